"""What every model instance's executor shares, whatever runs its model.

An executor serves one instance: it takes collated batches from its worker,
runs the model on them and finishes each batch with one call into Rust.
:class:`Executor` owns what must behave the same on every kind of instance:

* the weight gate: every model call runs under it, and the version output
  carries the version it ran with (:meth:`Executor.gated`);
* the requests handed to a model built ``with_requests`` (each part of a
  batch gets its own, :meth:`Executor.requests_of`);
* failure isolation: a batch whose model call raised is retried in halves
  and the parts that ran merged (:func:`isolate`, :meth:`Executor.retry`);
* invariance sampling: a row of a batch re-run alone, off the worker thread;
* counting (:class:`WorkerCounters`) and the finish call
  (:meth:`Executor.complete`).

The kinds plug in by how a batch is staged for the model (``stage``), how
rows of it run (``run``), how the parts of a retried batch merge
(``merge``) and how a sampled row is copied out (``offer``):
``CpuExecutor`` runs the model on the staging slot itself, ``ProcessExecutor``
in a child process reading the same slot, ``VariableExecutor`` on BYTES and
variable-length inputs built from it. They share :meth:`Executor.serve`.
``CudaExecutor`` launches each batch on its stream from one thread and
completes it on a second; both threads use the same gate, requests,
isolation, sampling and completion.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns, time_ns
from typing import Any

import torch

from . import _core
from ._invariance import InvarianceSampler
from ._requests import RequestInfo, request_infos
from ._weights import Gate
from .errors import DeadlineExceededError, ModelError, QueueFullError, ServerClosedError
from .specs import TensorSpec

log = logging.getLogger("ferrobatch")

_UNGATED: contextlib.AbstractContextManager[None] = contextlib.nullcontext()  # stateless: shared


@dataclass
class WorkerCounters:
    """One instance's counters: written by its worker thread only, once per
    batch, and summed by ``Server.stats()`` (which copies the dicts: a copy
    of a dict of ints is one step that a worker's update cannot interleave)."""

    compute_ns: int = 0  # per batch
    # per request the model call did not fail: a batch's compute time counts once for each (Triton's)
    request_compute_ns: int = 0
    failed_batches: int = 0
    isolated_failures: int = 0  # requests failed alone: their own model call raised too
    retry_calls: int = 0  # model calls made to isolate failures
    batch_sizes: dict[int, int] = field(default_factory=dict)  # rows -> batches of that many rows
    batch_compute_ns: dict[int, int] = field(default_factory=dict)  # rows -> their compute_ns
    last_inference_ns: int = 0  # wall clock (time.time_ns) when the latest batch finished

    def add(self, elapsed_ns: int, n_requests: int, failed: bool, rows: int, succeeded: int | None = None) -> None:
        """Counts a batch of ``n_requests`` requests (``succeeded`` of them not
        failed by it: all unless given)."""
        self.compute_ns += elapsed_ns
        self.request_compute_ns += elapsed_ns * (n_requests if succeeded is None else succeeded)
        self.failed_batches += failed
        self.batch_sizes[rows] = self.batch_sizes.get(rows, 0) + 1
        self.batch_compute_ns[rows] = self.batch_compute_ns.get(rows, 0) + elapsed_ns
        self.last_inference_ns = time_ns()


def finish(worker: _core.Worker, batch: _core.Batch, outputs: Any, error: BaseException | None,
           ring_now: bool = False, failed: list[tuple[int, BaseException]] | None = None) -> None:  # fmt: skip
    """Hands a batch's outcome to its callers (one call into Rust). Never
    raises: a failure here is a bug, logged, and the worker goes on."""
    try:
        worker.finish(batch, outputs, error, ring_now, failed)
    except BaseException:
        log.exception("ferrobatch: finishing a batch failed")


def yield_to_front_end() -> None:
    """Makes the calling thread (and the threads it starts) SCHED_BATCH (Linux): a
    woken SCHED_BATCH thread never preempts the running one. The model's
    workers run so while a native front-end runs in the process (see
    ``Server``'s ``_worker_thread``)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:  # a seccomp profile may forbid it: the worker runs as it is
        log.warning("ferrobatch: a worker could not yield to the front-end (stays SCHED_OTHER): %s", exc)


class InstanceDownError(ModelError):
    """The instance cannot run a batch now: its process could not be
    started. Retrying there would fail the same way, so failure isolation
    does not."""


class RequestsFailed(Exception):
    """What a model called with its requests (``with_requests``) on a CPU
    instance raises when some of them failed on their own: ``outputs`` as
    it would return them for every row of the call (a failed request's rows
    hold anything of the declared shapes: nobody reads them) and
    ``errors``, each failed request's error by its index in the call's
    requests. Each of those requests gets its error, the others their rows,
    and nothing is retried. Another of ferrobatch's errors (a downstream
    server's ``QueueFullError``, ...) reaches its caller as it is, counted
    under its outcome. ``ferrobatch.ray``'s forwarding model raises it."""

    def __init__(self, outputs: Any, errors: Mapping[int, BaseException]) -> None:
        super().__init__(f"{len(errors)} of the call's requests failed")
        self.outputs = outputs
        self.errors = dict(errors)

    def answered(self, outputs: Any, start: int, requests: Sequence[RequestInfo] | None) -> PartlyAnswered:
        """What the executor raises on: ``outputs`` (the model's, checked),
        each failed request by its first row in the batch (the call ran
        rows ``start..``). A :class:`ModelError`, the call's failure, when
        the model names requests it was not given."""
        if requests is None:
            raise ModelError("only a model called with its requests may fail some of them")
        firsts = list(itertools.accumulate((r.rows for r in requests), initial=start))
        unknown = [i for i in self.errors if not 0 <= i < len(requests)]
        if unknown:
            raise ModelError(f"the model failed requests {unknown} of {len(requests)}")
        return PartlyAnswered(outputs, sorted((firsts[i], e) for i, e in self.errors.items()))


class PartlyAnswered(Exception):
    """A model call whose model raised :class:`RequestsFailed`, its outputs
    checked as a call's are: the call's ``outputs`` and the requests that
    failed, by first row (``failed``)."""

    def __init__(self, outputs: Any, failed: list[tuple[int, BaseException]]) -> None:
        super().__init__("some of the call's requests failed")
        self.outputs = outputs
        self.failed = failed


def retryable(error: BaseException) -> bool:
    """Whether failure isolation may retry after ``error``: any ``Exception``
    but :class:`InstanceDownError` and the errors a retry would only repeat
    or make worse (a downstream's ``QueueFullError``, ``ServerClosedError``
    or ``DeadlineExceededError``, which its callers get as they are), never
    a ``BaseException`` that means the process is going down
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) or a
    cancellation."""
    final = (InstanceDownError, QueueFullError, ServerClosedError, DeadlineExceededError)
    return isinstance(error, Exception) and not isinstance(error, final)


@dataclass
class Isolated:
    """What retrying a failed batch in halves found: ``done`` holds
    ``(start_row, rows, outputs)`` of the parts that ran, ``failed``
    ``(start_row, error)`` of each request that did not get a result,
    ``calls`` the model calls made and ``alone`` how many of the failed
    requests failed in a call of their own."""

    done: list[tuple[int, int, Any]]
    failed: list[tuple[int, BaseException]]
    calls: int
    alone: int


def isolate(request_rows: Sequence[tuple[int, int]], error: BaseException, call: Callable[[int, int], Any]) -> Isolated:
    """Retries a batch whose model call raised ``error``, in halves, so that
    only the requests whose own call still fails are failed.

    ``request_rows`` is each request's ``(start_row, rows)`` in batch order;
    ``call(start_row, rows)`` runs the model on those rows of the batch.
    A failed part of more than one request is split in two (by requests),
    each half a model call, breadth first: a batch of ``n`` requests with
    one bad request takes ``2 * ceil(log2(n))`` calls, always allowed (so
    one bad request fails alone), and however many fail, at most that or
    ``n`` calls are made, the larger: once the next split would exceed it,
    the parts still failed fail with the error they raised. An error
    :func:`retryable` refuses is never retried.
    """
    result = Isolated([], [], 0, 0)
    n = len(request_rows)
    # 2 * ceil(log2(n)): a lone bad request's path; more than n for n = 3 or 5.
    budget = max(n, 2 * (n - 1).bit_length())
    todo: deque[tuple[int, int, BaseException, bool]] = deque([(0, len(request_rows), error, False)])
    while todo:
        first, count, err, retried = todo.popleft()
        if count == 1 or result.calls + 2 > budget or not retryable(err):
            result.failed += [(request_rows[i][0], err) for i in range(first, first + count)]
            result.alone += count == 1 and retried
            continue
        half = count // 2
        for lo, n in ((first, half), (first + half, count - half)):
            start = request_rows[lo][0]
            last_start, last_rows = request_rows[lo + n - 1]
            result.calls += 1
            try:
                result.done.append((start, last_start + last_rows - start, call(start, last_start + last_rows - start)))
            except PartlyAnswered as part:  # the model said whose failure it is
                result.done.append((start, last_start + last_rows - start, part.outputs))
                result.failed += part.failed
            except BaseException as exc:  # noqa: BLE001 - split further, or failed as it is
                todo.append((lo, n, exc, True))
    return result


@dataclass
class Retried:
    """A failed batch after failure isolation: the merged ``outputs`` of the
    parts that ran and each failed request's ``(start_row, error)``; or, when
    the parts could not be merged, no outputs and the ``error`` every request
    gets. ``calls`` and ``alone`` as in :class:`Isolated`."""

    outputs: Any
    error: BaseException | None
    failed: list[tuple[int, BaseException]] | None
    calls: int
    alone: int


def batch_requests(
    batch: _core.Batch, input_names: Sequence[str], output_names: Sequence[str] = ()
) -> list[tuple[int, RequestInfo]]:
    """The batch's requests as ``(start row, RequestInfo)``, in row order
    (``input_names`` / ``output_names``: the server's inputs and outputs, to
    name those a request left out or asked for)."""
    infos = request_infos(batch.request_parameters(), input_names, output_names)
    starts = itertools.accumulate((r.rows for r in infos), initial=0)
    return list(zip(starts, infos))


def version_rows(version: int, rows: int) -> torch.Tensor:
    """The ``version_output`` of a batch: its weights' version, one int64 per row."""
    return torch.full((rows,), version, dtype=torch.int64)


class Executor:
    """One model instance's executor (see the module docstring). Subclasses
    implement ``run`` (and, as they need, ``stage``, ``merge``, ``offer``,
    ``run_alone`` and ``serve_stream``); the server sets the attributes
    below once, before the first batch."""

    gate: Gate | None = None
    version_output: str | None = None
    isolate_failures: bool = False
    decoupled: bool = False  # the model yields its outputs (VariableExecutor streams them)
    sampler: InvarianceSampler | None = None  # re-runs sampled rows alone (invariance_sample_rate)
    with_requests: bool = False  # the model takes (inputs, requests)
    input_names: tuple[str, ...] = ()  # the model's inputs, in order (RequestInfo.absent names them)
    output_names: tuple[str, ...] = ()  # the server's outputs, in order (RequestInfo.requested_outputs names them)
    outputs: Sequence[TensorSpec] = ()
    # With ``with_requests``: the batch being served, as (start row, request) in row order.
    _requests: Sequence[tuple[int, RequestInfo]] = ()
    # Whether finishing the batch being served copies every answer out of its
    # outputs (``Batch.copies_outputs``): outputs may then view the staging
    # slot, which is given back only after the finish.
    _answers_copied: bool = False

    def bind_weights(self, gate: Gate, version_output: str | None) -> None:
        """Runs every model call under ``gate``; with ``version_output``,
        adds that output: the version each row ran with."""
        self.gate = gate
        self.version_output = version_output

    # -- what every kind shares --------------------------------------------------------

    def gated(self) -> contextlib.AbstractContextManager[int | None]:
        """``with`` it holds the weight gate (no weight update meanwhile) and
        gives the version the model runs with; None without a gate. The gate
        itself, not a generator around it: this runs once per batch."""
        return self.gate if self.gate is not None else _UNGATED

    def stamp(self, outputs: dict[str, Any], version: int | None, rows: int) -> None:
        """Adds the version output to a batch's ``outputs`` (if asked for)."""
        if self.version_output is not None and version is not None:
            outputs[self.version_output] = version_rows(version, rows)

    def begin(self, batch: _core.Batch) -> None:
        """Reads what the batch about to be served tells its model calls: its
        requests (``with_requests``) and whether its answers are copied."""
        self._requests = batch_requests(batch, self.input_names, self.output_names) if self.with_requests else ()
        self._answers_copied = batch.copies_outputs

    def requests_of(self, start: int, rows: int) -> list[RequestInfo] | None:
        """For a model built ``with_requests``: the requests of rows
        ``start..start + rows`` of the batch being served; outside a batch
        (warm-up), one per row without parameters. None for other models."""
        if not self.with_requests:
            return None
        chosen = [r for first, r in self._requests if start <= first < start + rows]
        return chosen if chosen else [RequestInfo(1)] * rows

    def attempt(self, staged: Any, start: int, rows: int) -> Any:
        """One model call on ``rows`` rows of a staged batch from ``start``,
        under the weight gate, with the version output if asked for."""
        with self.gated() as version:
            try:
                outputs = self.run(staged, rows, start)
            except PartlyAnswered as part:
                self.stamp(part.outputs, version, rows)
                raise
        self.stamp(outputs, version, rows)
        return outputs

    def retry(self, batch: _core.Batch, error: BaseException, call: Callable[[int, int], Any]) -> Retried | None:
        """With ``isolate_failures``, a batch whose model call raised
        ``error`` retried in halves (``call(start, rows)`` runs a part, see
        :func:`isolate`) and the parts that ran merged; None when it is not
        retried (one request, an error that is not :func:`retryable`). A
        call whose model said which of its requests failed
        (:class:`RequestsFailed`) is not retried: each gets what it said."""
        if isinstance(error, PartlyAnswered):
            return Retried(error.outputs, None, error.failed, 0, 0)
        if not self.isolate_failures or not retryable(error) or batch.n_requests < 2:
            return None
        isolated = isolate(batch.request_rows(), error, call)
        try:
            merged = self.merge(isolated.done, batch.rows)
        except BaseException as exc:  # noqa: BLE001 - parts that cannot be merged: all fail
            return Retried(None, exc, None, isolated.calls, isolated.alone)
        return Retried(merged, None, isolated.failed, isolated.calls, isolated.alone)

    def complete(
        self,
        worker: _core.Worker,
        batch: _core.Batch,
        counters: WorkerCounters,
        started_ns: int,
        outputs: Any,
        error: BaseException | None,
        retried: Retried | None = None,
        ring_now: bool = False,
    ) -> None:
        """Counts a batch whose slot is given back, and finishes it: each
        caller gets its rows of ``outputs``, the ``error``, or (after
        isolation) its own error."""
        if retried is not None:
            counters.retry_calls += retried.calls
            counters.isolated_failures += retried.alone
        failed_batch = error is not None or retried is not None
        failed = retried.failed if retried is not None else None
        succeeded = 0 if error is not None else batch.n_requests - len(failed or ())
        counters.add(perf_counter_ns() - started_ns, batch.n_requests, failed_batch, batch.rows, succeeded)
        # Without ring_now, its callers' doorbells ring at the next next_batch, GIL released.
        finish(worker, batch, outputs, error, ring_now=ring_now or self.may_wait, failed=failed)

    @torch.no_grad()  # once per thread (see _torch.model_mode): entering it per batch costs microseconds
    def serve(
        self, worker: _core.Worker, slots: Sequence[Mapping[str, torch.Tensor]], counters: WorkerCounters
    ) -> None:
        """The instance's worker loop, until the batcher closes: takes a
        collated batch (the GIL released while it waits and collates), runs
        it, gives its slot back and finishes it."""
        while self.ready_for_batch() and (batch := worker.next_batch()) is not None:
            started = perf_counter_ns()
            slot = slots[batch.slot]
            try:
                self.begin(batch)
            except BaseException as exc:  # noqa: BLE001 - its callers fail; the worker survives
                batch.release_slot()
                self.complete(worker, batch, counters, started, None, exc)
                continue
            if self.decoupled:
                self.serve_stream(worker, batch, slot, counters, started)
                continue
            outputs: Any = None
            error: BaseException | None = None
            retried: Retried | None = None
            staged: Any = None
            try:
                staged = self.stage(slot, batch)
                outputs = self.attempt(staged, 0, batch.rows)
            except BaseException as exc:  # noqa: BLE001 - even SystemExit: the worker survives
                error = exc
            if error is not None and staged is not None:
                retried = self.retry(batch, error, functools.partial(self.attempt, staged))
                if retried is not None:
                    outputs, error = retried.outputs, retried.error
            elif self.sampler is not None and outputs is not None:
                self.offer(staged, outputs, batch.rows)  # copies a row before the slot goes
            if self._answers_copied:  # outputs may view the slot: it goes once they are copied
                self.complete(worker, batch, counters, started, outputs, error, retried)
                batch.release_slot()
            else:  # outputs never alias the slot here (see CpuExecutor.run)
                batch.release_slot()
                self.complete(worker, batch, counters, started, outputs, error, retried)

    # -- what each kind supplies --------------------------------------------------------

    def ready_for_batch(self) -> bool:
        """Called before the worker takes each batch; an instance that cannot
        run one yet may wait here, leaving the batches to the others. True."""
        return True

    @property
    def may_wait(self) -> bool:
        """Whether :meth:`ready_for_batch` may wait before the next batch: the
        finished batch's callers are then woken at once, not at the
        ``next_batch`` that would ring them."""
        return False

    def stage(self, slot: Mapping[str, torch.Tensor], batch: _core.Batch) -> Any:
        """What the model runs on, from a batch's staging slot: the slot itself."""
        return slot

    def run(self, staged: Any, rows: int, start: int = 0) -> Any:
        """The model's outputs for ``rows`` rows of ``staged`` from ``start``
        (outside the gate: :meth:`attempt` holds it)."""
        raise NotImplementedError

    def merge(self, done: list[tuple[int, int, Any]], rows: int) -> Any:
        """One batch of ``rows`` rows from the parts of a retried batch."""
        raise NotImplementedError

    def offer(self, staged: Any, outputs: Any, rows: int) -> None:
        """Offers the invariance sampler a row of a finished batch."""
        if self.sampler is not None:
            self.sampler.offer(staged, outputs, rows)

    def run_alone(self, inputs: Mapping[str, Any]) -> Any:
        """The model on one row, outside the weight gate: the invariance
        sampler's re-run (see ``_invariance``)."""
        raise ModelError("invariance sampling does not run on this kind of instance")

    def serve_stream(
        self, worker: _core.Worker, batch: _core.Batch, slot: Mapping[str, torch.Tensor], counters: WorkerCounters,
        started: int,
    ) -> None:  # fmt: skip
        """One batch of a decoupled model (``VariableExecutor`` streams)."""
        batch.release_slot()
        error = ModelError("this kind of instance does not stream")
        self.complete(worker, batch, counters, started, None, error)
