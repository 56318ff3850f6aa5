"""The server: owns the batcher, the staging ring and one worker thread per
model instance, and runs the lifecycle (start, drain, stop)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from time import perf_counter_ns
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from . import _core
from ._loops import FAILURE_REASONS, LoopRegistry
from ._torch import Model, allocate_slot, make_coerce, make_executor, resolve_device
from .client import Client
from .errors import ServerClosedError
from .specs import TensorSpec

__all__ = ["Server"]

log = logging.getLogger("ferrobatch")


@dataclass
class _WorkerCounters:
    """Written by one worker thread only; summed by stats()."""

    compute_ns: int = 0
    failed_batches: int = 0


class Server:
    """Batches concurrent single-sample requests into model calls.

    Args:
        model: ``callable(dict[str, Tensor]) -> dict | Tensor | tuple``, called
            with a batch (leading dimension = rows) of every input; or a list
            of such callables, one per model instance (one worker thread each).
        inputs, outputs: the :class:`TensorSpec` of every input and output
            (per-sample shapes, without the batch dimension).
        max_batch_size: most rows per model call (default 64).
        max_delay: seconds a batch may wait to fill, counted from its oldest
            request (default 0.001). ``0`` is greedy: a free worker takes
            whatever is queued, up to ``max_batch_size``.
        min_batch_size: a batch with fewer rows waits for more, with no time
            limit (default 1: never waits). Callers bound it with ``timeout``;
            ``stop()`` dispatches what is left.
        preferred_batch_sizes: sizes dispatched before ``max_delay`` when no
            other request is waiting (default none).
        max_queue_size: requests allowed to wait; beyond it ``infer`` raises
            :class:`QueueFullError` at once (default 10000).
        device: where the model runs ("cpu", "cuda", "cuda:1", a
            ``torch.device``); ``None``: the device of the model's parameters,
            else CPU. A ``torch.nn.Module`` is moved there.
        name: the model's name in errors, stats and serving.
    """

    def __init__(
        self,
        model: Model | Sequence[Model],
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        max_batch_size: int = 64,
        max_delay: float = 0.001,
        min_batch_size: int = 1,
        preferred_batch_sizes: Sequence[int] = (),
        max_queue_size: int = 10_000,
        device: str | torch.device | None = None,
        name: str = "model",
    ) -> None:
        self._models: list[Model] = (
            list(model) if isinstance(model, (list, tuple)) else [model]  # type: ignore[list-item]
        )
        if not self._models or not all(callable(m) for m in self._models):
            raise TypeError("model must be a callable or a non-empty list of callables")
        self.inputs = tuple(_check_specs("inputs", inputs))
        self.outputs = tuple(_check_specs("outputs", outputs))
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if not (isinstance(max_delay, (int, float)) and math.isfinite(max_delay) and max_delay >= 0):
            raise ValueError(f"max_delay must be >= 0 seconds, got {max_delay!r}")
        if not isinstance(min_batch_size, int) or not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"min_batch_size must be in 1..{max_batch_size}, got {min_batch_size!r}")
        bad = [s for s in preferred_batch_sizes if not 1 <= s <= max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes must be in 1..{max_batch_size}, got {bad}")
        if not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"max_queue_size must be an int >= 1, got {max_queue_size!r}")
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_delay = float(max_delay)
        self.min_batch_size = min_batch_size
        self.preferred_batch_sizes = tuple(sorted(set(preferred_batch_sizes)))
        self.max_queue_size = max_queue_size
        self.devices = [resolve_device(m, device) for m in self._models]
        if device is not None:
            for m in self._models:
                if isinstance(m, torch.nn.Module):
                    m.to(self.devices[0])
        self._loops = LoopRegistry(name)
        self._batcher: _core.Batcher | None = None
        self._slots: list[dict[str, torch.Tensor]] = []
        self._threads: list[threading.Thread] = []
        self._counters: list[_WorkerCounters] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._phase = "created"  # created -> running -> stopping -> stopped

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Allocates the staging ring and starts one worker thread per instance."""
        if self._phase != "created":
            raise RuntimeError(f"server '{self.name}' was already started")
        pin = any(d.type == "cuda" for d in self.devices)
        # Two slots per instance: one being collated while another is in flight.
        slots = [
            allocate_slot(self.inputs, self.max_batch_size, pin)
            for _ in range(2 * len(self._models))
        ]
        self._slots = [{s.name: t for s, t in zip(self.inputs, slot)} for slot in slots]
        self._batcher = _core.Batcher(
            [(s.name, s.dtype, list(s.shape), s.torch_dtype) for s in self.inputs],
            slots,
            tensor_type=torch.Tensor,
            coerce=make_coerce(self.inputs),
            max_batch_size=self.max_batch_size,
            max_delay=self.max_delay,
            min_batch_size=self.min_batch_size,
            preferred_batch_sizes=list(self.preferred_batch_sizes),
            max_queue_size=self.max_queue_size,
            workers=len(self._models),
        )
        self._token = anyio.lowlevel.current_token()
        for i, (model, device) in enumerate(zip(self._models, self.devices)):
            counters = _WorkerCounters()
            self._counters.append(counters)
            thread = threading.Thread(
                target=self._work,
                args=(make_executor(model, device, self.outputs), _core.Worker(self._batcher), counters),
                name=f"ferrobatch-{self.name}-{i}",
                daemon=True,
            )
            self._threads.append(thread)
        self._phase = "running"
        for thread in self._threads:
            thread.start()

    async def stop(self, timeout: float | None = None) -> None:
        """Stops accepting requests, runs every accepted one, then stops the workers.

        If ``timeout`` seconds pass first, requests still waiting fail with
        :class:`ServerClosedError` (a model call in progress is left to finish
        on its thread). Idempotent.
        """
        if self._phase != "running":
            return
        self._phase = "stopping"
        assert self._batcher is not None
        self._batcher.close()
        threads = list(self._threads)

        def join_workers() -> None:
            for thread in threads:
                thread.join()

        with anyio.move_on_after(math.inf if timeout is None else timeout):
            await anyio.to_thread.run_sync(join_workers, abandon_on_cancel=True)
        message = f"server '{self.name}' stopped before the request could run"
        for state in list(self._loops.states):
            state.fail_all_threadsafe(message)
        self._phase = "stopped"

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def running(self) -> bool:
        return self._phase == "running"

    def client(self) -> Client:
        """A client for this server (cheap; share it or make many)."""
        return Client(self)

    def _running_batcher(self) -> _core.Batcher:
        if self._batcher is None or self._phase != "running":
            raise ServerClosedError(f"server '{self.name}' is not running ({self._phase})")
        return self._batcher

    def _loop_token(self) -> anyio.lowlevel.EventLoopToken:
        if self._token is None or self._phase != "running":
            raise ServerClosedError(f"server '{self.name}' is not running ({self._phase})")
        return self._token

    # -- the worker thread --------------------------------------------------------------

    def _work(self, executor: Any, worker: _core.Worker, counters: _WorkerCounters) -> None:
        batcher = self._batcher
        assert batcher is not None
        states = self._loops.states
        while True:
            batch = worker.next_batch()  # GIL released while it waits and collates
            if batch is None:
                return
            slot = self._slots[batch.slot]
            staged = {name: t[: batch.rows] for name, t in slot.items()}
            release: Callable[[], Any] = partial(batcher.release_slot, batch.slot)
            outputs: dict[str, torch.Tensor] | None = None
            rows: dict[str, tuple[torch.Tensor, ...]] | None = None
            error: BaseException | None = None
            started = perf_counter_ns()
            try:
                outputs = executor.run(staged, batch.rows, release)
                rows = {name: out.unbind(0) for name, out in outputs.items()}
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: the worker survives
                error, outputs, rows = exc, None, None
                counters.failed_batches += 1
                batcher.release_slot(batch.slot)  # no-op if the executor released it
            counters.compute_ns += perf_counter_ns() - started
            try:
                for loop_id, routes in batch.groups():
                    states[loop_id].deliver(routes, outputs, rows, error)
            except BaseException:  # noqa: BLE001
                log.exception("ferrobatch: fan-out of a batch of model '%s' failed", self.name)

    # -- introspection ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since start.

        ``requests_succeeded``; ``requests_failed`` by reason (invalid_input,
        queue_full, deadline_exceeded, cancelled, model_error, server_closed);
        ``batches``, ``rows`` and ``mean_batch_size`` (rows per batch);
        ``queue_depth`` (requests waiting now); ``queue_ns`` and ``compute_ns``
        (summed over requests and batches); ``request_ns`` (summed submit to
        result over succeeded requests).
        """
        failed = dict.fromkeys(FAILURE_REASONS, 0)
        succeeded = request_ns = 0
        for state in list(self._loops.states):
            succeeded += state.succeeded
            request_ns += state.request_ns
            for reason, n in state.failed.items():
                failed[reason] += n
        core = self._batcher.stats() if self._batcher is not None else {}
        batches = int(core.get("batches", 0))
        rows = int(core.get("rows", 0))
        return {
            "requests_succeeded": succeeded,
            "requests_failed": failed,
            "batches": batches,
            "rows": rows,
            "mean_batch_size": rows / batches if batches else 0.0,
            "queue_depth": int(core.get("queue_len", 0)),
            "queue_ns": int(core.get("queue_ns", 0)),
            "compute_ns": sum(c.compute_ns for c in self._counters),
            "request_ns": request_ns,
            "failed_batches": sum(c.failed_batches for c in self._counters),
        }

    def __repr__(self) -> str:
        return (
            f"Server(name={self.name!r}, instances={len(self._models)}, "
            f"max_batch_size={self.max_batch_size}, max_delay={self.max_delay}, {self._phase})"
        )


def _check_specs(kind: str, specs: Sequence[TensorSpec]) -> list[TensorSpec]:
    specs = list(specs)
    if not specs:
        raise ValueError(f"{kind} must declare at least one TensorSpec")
    for s in specs:
        if not isinstance(s, TensorSpec):
            raise TypeError(f"{kind} must be TensorSpec objects, got {type(s).__name__}")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{kind} names must be unique; repeated: {dupes}")
    return specs

