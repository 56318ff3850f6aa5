"""Triton's machine metrics in /metrics: CPU from /proc, GPU from NVML."""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("prometheus_client", reason="the serve extra")
from prometheus_client.parser import text_string_to_metric_families

from ferrobatch._host_metrics import HostCollector
from ferrobatch.metrics import exposition, registry


def samples(text: str) -> dict[tuple[str, str], float]:
    """(name as exposed, its gpu_uuid label or "") -> value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = family.name if family.type == "counter" and s.name == family.name + "_total" else s.name
            found[(name, s.labels.get("gpu_uuid", ""))] = s.value
    return found


def scrape(collector: HostCollector) -> dict[tuple[str, str], float]:
    reg = registry([], cpu=False, gpu=False)
    reg.register(collector)
    return samples(exposition(reg).decode())


def write_proc(proc: Path, user: int, idle: int, iowait: int = 0) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    (proc / "stat").write_text(f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 7 7\ncpu0 1 2 3 4\n")
    (proc / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    250 kB\n")


def test_cpu_utilization_is_the_busy_share_since_the_previous_scrape(tmp_path: Path) -> None:
    write_proc(tmp_path, user=100, idle=800, iowait=100)
    collector = HostCollector(proc=tmp_path)
    write_proc(tmp_path, user=400, idle=1000, iowait=200)  # +300 busy of +600
    first = scrape(collector)
    assert first[("nv_cpu_utilization", "")] == 0.5
    assert first[("nv_cpu_memory_total_bytes", "")] == 1000 * 1024
    assert first[("nv_cpu_memory_used_bytes", "")] == 750 * 1024
    write_proc(tmp_path, user=400, idle=1300, iowait=200)  # idle since
    assert scrape(collector)[("nv_cpu_utilization", "")] == 0.0
    assert scrape(collector)[("nv_cpu_utilization", "")] == 0.0  # no time passed


def test_without_proc_there_are_no_cpu_metrics_and_the_scrape_still_answers(tmp_path: Path) -> None:
    found = scrape(HostCollector(proc=tmp_path / "absent"))
    assert not any(name.startswith("nv_cpu") for name, _ in found)


def test_a_busy_core_shows_in_the_machine_utilization() -> None:
    collector = HostCollector()
    scrape(collector)
    stop = time.monotonic() + 0.5
    while time.monotonic() < stop:
        pass
    utilization = scrape(collector)[("nv_cpu_utilization", "")]
    # One core of the machine's busy all along (this loop), whatever else ran.
    assert 0.8 / (os.cpu_count() or 1) < utilization <= 1.0


class FakeNvml(types.ModuleType):
    """pynvml's calls for two GPUs; the second reports no power."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.fail_init = fail_init
        self.energy_mj = {0: 5_000_000, 1: 9_000}

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> Any:
        return f"GPU-{handle}aaa" if handle == 0 else b"GPU-1bbb"

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=37 + handle, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, used=(handle + 1) * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 123_456  # mW

    def nvmlDeviceGetPowerManagementLimit(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self.energy_mj[handle]


def test_gpu_metrics_come_from_nvml_per_gpu_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    collector = HostCollector()
    nvml.energy_mj = {0: 5_250_000, 1: 10_500}
    found = scrape(collector)
    assert found[("nv_gpu_utilization", "GPU-0aaa")] == 0.37
    assert found[("nv_gpu_utilization", "GPU-1bbb")] == 0.38
    assert found[("nv_gpu_memory_total_bytes", "GPU-1bbb")] == 80 * 2**30
    assert found[("nv_gpu_memory_used_bytes", "GPU-1bbb")] == 2 * 2**30
    assert found[("nv_gpu_power_usage", "GPU-0aaa")] == 123.456
    assert found[("nv_gpu_power_limit", "GPU-0aaa")] == 700.0
    assert ("nv_gpu_power_usage", "GPU-1bbb") not in found  # not supported: left out
    assert found[("nv_energy_consumption", "GPU-0aaa")] == 250.0  # joules since the collector was made
    assert found[("nv_energy_consumption", "GPU-1bbb")] == 1.5


@pytest.mark.parametrize(("visible", "uuids"), [("1", {"GPU-1bbb"}), ("GPU-0", {"GPU-0aaa"}), ("", set())])
def test_gpu_metrics_keep_to_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, uuids: set[str]
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = scrape(HostCollector())
    assert {uuid for name, uuid in found if name == "nv_gpu_utilization"} == uuids


def test_without_a_driver_there_are_no_gpu_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(fail_init=True))
    found = scrape(HostCollector())
    assert not any(name.startswith(("nv_gpu", "nv_energy")) for name, _ in found)
    assert ("nv_cpu_utilization", "") in found


def test_the_real_nvml_without_a_driver_gives_no_gpu_metrics() -> None:
    import torch

    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: test_a_real_gpu_reports_its_memory_as_this_process_fills_it")
    found = scrape(HostCollector())
    assert not any(name.startswith(("nv_gpu", "nv_energy")) for name, _ in found)
    assert ("nv_cpu_utilization", "") in found


@pytest.mark.gpu
def test_a_real_gpu_reports_its_memory_as_this_process_fills_it() -> None:
    import torch

    pytest.importorskip("pynvml", reason="needs nvidia-ml-py (the gpu extra)")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    collector = HostCollector()
    before = scrape(collector)
    uuids = {uuid for name, uuid in before if name == "nv_gpu_memory_total_bytes"}
    assert uuids, before
    assert all(0.0 <= before[("nv_gpu_utilization", u)] <= 1.0 for u in uuids)
    used = sum(before[("nv_gpu_memory_used_bytes", u)] for u in uuids)
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    after = scrape(collector)
    assert sum(after[("nv_gpu_memory_used_bytes", u)] for u in uuids) >= used + 2**30
    del block
