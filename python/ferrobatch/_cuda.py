"""The CUDA executor: one stream per model instance, pinned staging in, pinned
outputs out, completion through CUDA events, and optionally one CUDA graph per
batch bucket.

A batch goes through two threads of its instance. The *launch* thread collates
it into a staging slot (in Rust), then enqueues on the instance's stream: the
host-to-device copy from the pinned slot (``non_blocking``), an event
(``staged``), the model (or the replay of its graph), the device-to-host copy
into freshly allocated pinned output buffers, and a second event (``done``). It
then goes on to collate the next batch while the GPU computes this one. The
*complete* thread waits on ``staged`` (GIL released) before the slot is given
back to the ring — so a slot is never rewritten while a copy may still read
it — then on ``done``, and fans the outputs out.

Pinned output buffers come from torch's caching host allocator: a caller's
result is a row of one, and the block is reused only once every row of it is
dropped and the copy into it has completed.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import Any

import torch

from . import _core
from ._executor import Executor, Retried, WorkerCounters
from ._requests import RequestInfo
from ._torch import Model, WarmupBatch, fill_slot, merge_rows, normalize_outputs
from .specs import TensorSpec

__all__ = ["IN_FLIGHT", "CudaExecutor", "InFlight", "cuda_graph_fallback_warning"]

# Batches one CUDA instance holds at once (each holds a staging slot until its
# host-to-device copy has completed): two enqueued on its stream, so the GPU
# always has the next one ready, and one being collated.
IN_FLIGHT = 3

log = logging.getLogger("ferrobatch")


class InFlight:
    """A batch enqueued on an instance's stream. ``wait_staged`` and ``wait``
    block on CUDA events with the GIL released; call them from one thread."""

    __slots__ = ("rows", "started_ns", "staged", "done", "outputs", "error", "retried")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.started_ns = perf_counter_ns()
        self.staged: torch.cuda.Event | None = None
        self.done: torch.cuda.Event | None = None
        self.outputs: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        # After failure isolation: what it found (counted on completion).
        self.retried: Retried | None = None

    def wait_staged(self) -> None:
        """Returns once the staging slot's bytes have been copied to the device:
        from then on the slot may be rewritten."""
        if self.staged is not None:
            self.staged.synchronize()

    def wait(self) -> dict[str, torch.Tensor]:
        """The outputs in (pinned) host memory, once computed and copied; raises
        what the model raised, or the CUDA error that the stream ran into."""
        if self.done is not None:
            self.done.synchronize()
        if self.error is not None:
            raise self.error
        return self.outputs


# Launched batches, in order, from an instance's launch thread to its complete thread.
Handoff = queue.SimpleQueue[tuple[_core.Batch, InFlight] | None]


class CudaExecutor(Executor):
    """Runs one model instance on its own CUDA stream.

    ``pad_to`` (a table ``rows -> bucket``, given with ``cuda_graphs`` or
    ``compile``) pads every batch to its bucket: the rows go into a persistent
    device buffer whose padding rows hold earlier inputs (never garbage), and
    the outputs of the padding rows are dropped. With ``cuda_graphs``, one
    graph per bucket is captured by :meth:`warm_up`.

    Each batch is enqueued under the weight gate (:meth:`Executor.gated`); a
    weight update takes the gate, then waits for the device before copying
    the weights in place (so the graphs stay valid). Instead of
    :meth:`Executor.serve`, two threads serve the instance:
    :meth:`serve_launch` and :meth:`serve_complete`.
    """

    def __init__(
        self,
        model: Model,
        device: torch.device,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        max_batch_size: int,
        pad_to: Sequence[int] | None = None,
        cuda_graphs: bool = False,
    ) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.model = model
        self.device = device
        self.inputs = inputs
        self.outputs = outputs
        self.pad_to = pad_to
        self.cuda_graphs = cuda_graphs
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        # Padded mode: one device buffer per input; bucket b runs on its first b rows.
        self._padded: dict[str, torch.Tensor] = {}
        if pad_to is not None:
            with torch.cuda.device(device):
                self._padded = {
                    s.name: torch.zeros((max_batch_size, *s.shape), dtype=s.torch_dtype, device=device) for s in inputs
                }
        # bucket -> (graph, its static outputs), filled by warm_up.
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    @property
    def graphed_buckets(self) -> tuple[int, ...]:
        """The bucket sizes that replay a captured CUDA graph."""
        return tuple(sorted(self._graphs))

    def bind_thread(self) -> None:
        """Makes this instance's device and stream current on the calling
        thread (both are per-thread in torch); :meth:`launch` relies on it."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    # -- warm-up --------------------------------------------------------------------

    def warm_up(self, batch_for: WarmupBatch, buckets: Sequence[int], slot: Mapping[str, torch.Tensor]) -> str | None:
        """Runs each bucket size through :meth:`launch` from ``slot`` (a pinned
        staging slot the caller owns), just as requests will — compiling the
        model if it is compiled — then captures one CUDA graph per bucket if
        asked.

        Raises what the model raised. Returns why the capture failed (the
        instance then runs eagerly), else None.
        """
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            # Twice when capturing: lazy initialisations (cuBLAS workspaces,
            # autotuning, allocator pools) must not happen inside a capture.
            for _ in range(2 if self.cuda_graphs else 1):
                for rows in buckets:
                    fill_slot(slot, batch_for(rows))
                    flight = self.launch(slot, rows)
                    flight.wait()
            if not self.cuda_graphs:
                return None
            try:
                self._capture(buckets)
            except Exception as exc:  # noqa: BLE001 - any failure means "run eagerly"
                self._graphs.clear()
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001 - best effort: the error is reported below
                    pass
                return f"{type(exc).__name__}: {exc}"
        return None

    def _run_eager(
        self, on_device: dict[str, torch.Tensor], rows: int, requests: list[RequestInfo] | None
    ) -> dict[str, torch.Tensor]:
        if requests is not None:
            return normalize_outputs(self.model(on_device, requests), self.outputs, rows)  # type: ignore[call-arg]
        return normalize_outputs(self.model(on_device), self.outputs, rows)

    def run_alone(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The model on one row, eagerly on the device, outside the weight
        gate: the invariance sampler's re-run (on the sampler's thread)."""
        with torch.inference_mode(), torch.cuda.device(self.device):
            on_device = {name: t.to(self.device) for name, t in inputs.items()}
            requests = [RequestInfo(1)] if self.with_requests else None
            return {name: t.cpu() for name, t in self._run_eager(on_device, 1, requests).items()}

    def _capture(self, buckets: Sequence[int]) -> None:
        # One memory pool for every bucket of this instance: its graphs replay
        # one at a time on one stream, so their intermediates may share memory.
        # Largest first, so the smaller captures fit in what it reserved.
        pool = torch.cuda.graph_pool_handle()
        for rows in sorted(buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            static_in = {name: buf[:rows] for name, buf in self._padded.items()}
            with (
                torch.inference_mode(),
                torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"),
            ):
                static_out = self._run_eager(static_in, rows, self.requests_of(0, rows))
            self._graphs[rows] = (graph, static_out)

    # -- serving ----------------------------------------------------------------------

    def launch(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> InFlight:
        """Enqueues the batch in ``rows`` rows of the (pinned) staging slot,
        from ``start``, on this instance's stream and returns at once. Never
        raises: an error is kept in the returned :class:`InFlight` and raised
        by ``wait``. Call it from a thread after :meth:`bind_thread`."""
        flight = InFlight(rows)
        if start:
            slot = {name: t[start : start + rows] for name, t in slot.items()}
        stream = self.stream
        try:
            with torch.no_grad():
                bucket = self.pad_to[rows] if self.pad_to is not None else rows
                if self._padded:
                    for name, buf in self._padded.items():
                        buf[:rows].copy_(slot[name][:rows], non_blocking=True)
                    on_device = {name: buf[:bucket] for name, buf in self._padded.items()}
                else:
                    on_device = {name: t[:rows].to(self.device, non_blocking=True) for name, t in slot.items()}
                flight.staged = _record(stream)
                graph = self._graphs.get(bucket)
                if graph is not None:
                    graph[0].replay()
                    outputs = graph[1]
                else:
                    outputs = self._run_eager(on_device, bucket, self.requests_of(start, rows))
                # Copied out right behind the model (or the replay) on the same
                # stream: the next replay of that graph cannot overwrite them first.
                for name, out in outputs.items():
                    if bucket != rows:
                        out = out[:rows]
                    host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    host.copy_(out, non_blocking=True)
                    flight.outputs[name] = host
                flight.done = _record(stream)
        except BaseException as exc:  # noqa: BLE001 - delivered to the batch's callers
            flight.error = exc
            flight.outputs = {}
            # Whatever was enqueued still reads the slot: wait for all of it.
            try:
                flight.staged = flight.done = _record(stream)
            except BaseException:  # noqa: BLE001 - a broken context: nothing to wait on
                flight.staged = flight.done = None
        return flight

    @torch.no_grad()  # once per thread (see _torch.model_mode): entering it per batch costs microseconds
    def serve_launch(
        self,
        worker: _core.Worker,
        slots: Sequence[Mapping[str, torch.Tensor]],
        handoff: Handoff,
        tokens: threading.Semaphore,
    ) -> None:
        """The instance's first thread: collates a batch and enqueues it on the
        instance's stream, then collates the next while the GPU computes.
        ``tokens`` bounds the batches it holds (and so the slots) to IN_FLIGHT."""
        try:
            self.bind_thread()
            while True:
                tokens.acquire()  # GIL released while it waits
                batch = worker.next_batch()
                if batch is None:
                    return
                try:
                    self.begin(batch)  # its failure fails the batch's callers, as on CPU
                    with self.gated() as version:  # no weight update while enqueuing it
                        flight = self._launch_batch(slots[batch.slot], batch)
                    if flight.error is None:
                        self.stamp(flight.outputs, version, batch.rows)
                except BaseException as exc:  # noqa: BLE001 - launch keeps model errors; not this
                    flight = InFlight(batch.rows)
                    flight.error = exc
                    try:
                        self.stream.synchronize()  # nothing enqueued may still read the slot
                    except BaseException:  # noqa: BLE001 - a broken context: nothing to wait on
                        pass
                handoff.put((batch, flight))
        except BaseException:
            log.exception("ferrobatch: instance on %s stopped", self.device)
        finally:
            handoff.put(None)

    def _launch_batch(self, slot: Mapping[str, torch.Tensor], batch: _core.Batch) -> InFlight:
        """Launches ``batch``; if its model call raised (eagerly, at launch),
        retries it in halves (:meth:`Executor.retry`), each part launched and
        waited for on this thread, so only the requests whose own call still
        fails get the error."""
        flight = self.launch(slot, batch.rows)
        if flight.error is None:
            return flight
        retried = self.retry(batch, flight.error, lambda start, rows: self.launch(slot, rows, start).wait())
        if retried is None:
            return flight
        self.stream.synchronize()  # every part's reads of the slot are done
        merged = InFlight(batch.rows)
        merged.started_ns = flight.started_ns
        merged.outputs = retried.outputs if retried.outputs is not None else {}
        merged.error = retried.error
        merged.retried = retried
        return merged

    def merge(self, done: list[tuple[int, int, Any]], rows: int) -> dict[str, torch.Tensor]:
        return merge_rows(done, rows, self.outputs, self.version_output)

    @torch.no_grad()  # once per thread (see _torch.model_mode): entering it per batch costs microseconds
    def serve_complete(
        self,
        worker: _core.Worker,
        slots: Sequence[Mapping[str, torch.Tensor]],
        handoff: Handoff,
        tokens: threading.Semaphore,
        counters: WorkerCounters,
    ) -> None:
        """The instance's second thread: for each launched batch, in order,
        waits (GIL released) for its host-to-device copy and only then gives
        the slot back, waits for its outputs, and finishes the batch. With
        invariance sampling, the slot is given back once the outputs are in:
        a sampled row is copied from it."""
        while (item := handoff.get()) is not None:
            batch, flight = item
            outputs: dict[str, torch.Tensor] | None = None
            error: BaseException | None = None
            try:
                flight.wait_staged()
            except BaseException as exc:  # noqa: BLE001 - the CUDA context is broken
                error = exc
            if self.sampler is None:
                batch.release_slot()
            if error is None:
                try:
                    outputs = flight.wait()
                except BaseException as exc:  # noqa: BLE001 - delivered to the callers
                    error, outputs = exc, None
            if self.sampler is not None:
                if outputs is not None and flight.retried is None:
                    self.offer(slots[batch.slot], outputs, batch.rows)
                batch.release_slot()
            self.complete(worker, batch, counters, flight.started_ns, outputs, error, flight.retried, ring_now=True)
            tokens.release()


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


def cuda_graph_fallback_warning(model_name: str, failures: Mapping[int, str]) -> None:
    """The one warning for a server whose model could not be captured."""
    which = ", ".join(f"instance {i}: {why}" for i, why in sorted(failures.items()))
    warnings.warn(
        f"model '{model_name}' cannot be captured in a CUDA graph, so it runs eagerly ({which})."
        " Host synchronisation inside the model (.item(), .cpu(), printing a tensor,"
        " data-dependent shapes) is the usual cause.",
        RuntimeWarning,
        stacklevel=3,
    )
