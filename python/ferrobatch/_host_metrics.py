"""Triton's machine metrics, read when Prometheus scrapes.

- ``nv_cpu_utilization`` (0.0-1.0, every core of the machine, since the
  previous scrape; the first scrape covers the time since the collector was
  made), ``nv_cpu_memory_total_bytes`` and ``nv_cpu_memory_used_bytes``
  (total less available): from ``/proc/stat`` and ``/proc/meminfo``, as
  Triton reads them; absent where there is no ``/proc``.
- ``nv_gpu_utilization`` (0.0-1.0), ``nv_gpu_memory_total_bytes``,
  ``nv_gpu_memory_used_bytes``, ``nv_gpu_power_usage`` and
  ``nv_gpu_power_limit`` (watts) and ``nv_energy_consumption`` (joules since
  the collector was made), labelled ``gpu_uuid``: from NVML through
  ``pynvml`` (the ``nvidia-ml-py`` package, ``pip install ferrobatch[gpu]``),
  which asks the driver without making a CUDA context. Absent without it or
  without a GPU; a value a GPU does not report (power on some boards) is left
  out for that GPU. ``CUDA_VISIBLE_DEVICES`` limits them to the GPUs it
  names (by UUID prefix, or by index: NVML's, which is CUDA's under
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``).

A scrape reads these where it is answered (the HTTP port's event loop, or the
metrics port's thread): two reads of ``/proc`` and, per GPU, five NVML calls.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics import CounterFamily

__all__ = ["HostCollector"]


def cpu_times(proc: Path) -> tuple[int, int] | None:
    """(busy, total) clock ticks of every core since boot, from ``/proc/stat``'s
    ``cpu`` line: total is user through steal (guest time is inside user),
    idle is idle and iowait. None without it."""
    try:
        with (proc / "stat").open() as f:
            fields = f.readline().split()
        ticks = [int(v) for v in fields[1:9]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 4 or fields[0] != "cpu":
        return None
    idle = sum(ticks[3:5])
    return sum(ticks) - idle, sum(ticks)


def memory_bytes(proc: Path) -> tuple[int, int] | None:
    """(total, used) bytes of memory from ``/proc/meminfo``: used is total less
    available. None without it."""
    values = {}
    try:
        with (proc / "meminfo").open() as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    values[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(values) < 2:
        return None
    return values["MemTotal"], values["MemTotal"] - values["MemAvailable"]


@dataclass
class _Gpu:
    handle: Any
    uuid: str
    energy_at_start_mj: int | None


def _visible(index: int, uuid: str, names: str | None) -> bool:
    if names is None:
        return True
    for name in filter(None, (n.strip() for n in names.split(","))):
        if (name.isdigit() and int(name) == index) or (not name.isdigit() and uuid.startswith(name)):
            return True
    return False


class _Nvml:
    """The GPUs NVML sees, or nothing where it cannot be used."""

    def __init__(self) -> None:
        self.gpus: list[_Gpu] = []
        try:
            self.nvml: Any = importlib.import_module("pynvml")
            self.nvml.nvmlInit()
            count = self.nvml.nvmlDeviceGetCount()
        except Exception:  # noqa: BLE001 - no package, no driver, no GPU: no GPU metrics
            return
        names = os.environ.get("CUDA_VISIBLE_DEVICES")
        for index in range(count):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = self.nvml.nvmlDeviceGetUUID(handle)
            except Exception:  # noqa: BLE001 - a GPU NVML cannot name is left out
                continue
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if _visible(index, uuid, names):
                self.gpus.append(_Gpu(handle, uuid, self.read(self.nvml.nvmlDeviceGetTotalEnergyConsumption, handle)))

    @staticmethod
    def read(call: Callable[[Any], Any], handle: Any) -> Any:
        """``call(handle)``, or None where the GPU does not report it."""
        try:
            return call(handle)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and its kin
            return None


class HostCollector(Collector):
    """Yields Triton's CPU and GPU metrics of the machine (see the module)."""

    def __init__(self, proc: Path = Path("/proc"), *, cpu: bool = True, gpu: bool = True) -> None:
        self._proc = proc
        self._lock = threading.Lock()
        self._cpu_on = cpu
        self._last_cpu = cpu_times(proc) if cpu else None
        self._nvml = _Nvml() if gpu else None

    def collect(self) -> Iterator[Metric]:
        if self._cpu_on:
            yield from self._cpu()
        yield from self._gpu()

    def _cpu(self) -> Iterator[Metric]:
        with self._lock:  # concurrent scrapes each take their own interval
            now = cpu_times(self._proc)
            last, self._last_cpu = self._last_cpu, now
        if now is not None:
            busy, total = (now[0] - last[0], now[1] - last[1]) if last is not None else now
            family = GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]")
            family.add_metric([], min(max(busy / total, 0.0), 1.0) if total > 0 else 0.0)
            yield family
        memory = memory_bytes(self._proc)
        if memory is not None:
            yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=memory[0])
            yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=memory[1])

    def _gpu(self) -> Iterator[Metric]:
        if self._nvml is None or not self._nvml.gpus:
            return
        nvml, read = self._nvml.nvml, self._nvml.read
        labels = ["gpu_uuid"]
        utilization = GaugeMetricFamily("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=labels)
        total = GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=labels)
        used = GaugeMetricFamily("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=labels)
        power = GaugeMetricFamily("nv_gpu_power_usage", "GPU power usage in watts", labels=labels)
        limit = GaugeMetricFamily("nv_gpu_power_limit", "GPU power management limit in watts", labels=labels)
        energy = CounterFamily(
            "nv_energy_consumption", "GPU energy consumption in joules since the server started", labels=labels
        )
        for gpu in self._nvml.gpus:
            uuid = [gpu.uuid]
            rates = read(nvml.nvmlDeviceGetUtilizationRates, gpu.handle)
            if rates is not None:
                utilization.add_metric(uuid, rates.gpu / 100)
            memory = read(nvml.nvmlDeviceGetMemoryInfo, gpu.handle)
            if memory is not None:
                total.add_metric(uuid, memory.total)
                used.add_metric(uuid, memory.used)
            milliwatts = read(nvml.nvmlDeviceGetPowerUsage, gpu.handle)
            if milliwatts is not None:
                power.add_metric(uuid, milliwatts / 1000)
            milliwatts = read(nvml.nvmlDeviceGetPowerManagementLimit, gpu.handle)
            if milliwatts is not None:
                limit.add_metric(uuid, milliwatts / 1000)
            millijoules = read(nvml.nvmlDeviceGetTotalEnergyConsumption, gpu.handle)
            if millijoules is not None and gpu.energy_at_start_mj is not None:
                energy.add_metric(uuid, (millijoules - gpu.energy_at_start_mj) / 1000)
        yield from (f for f in (utilization, total, used, power, limit, energy) if f.samples)
