"""The server: owns the batcher, the staging ring and one worker thread per
model instance, and runs the lifecycle (start, drain, stop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import operator
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from . import _core
from ._cache import CachedRows, ResponseCache
from ._cache import response_cache as response_cache_of
from ._cuda import IN_FLIGHT, CudaExecutor, Handoff, cuda_graph_fallback_warning
from ._executor import Executor, WorkerCounters, yield_to_front_end
from ._invariance import InvarianceSampler, summed
from ._process import ProcessExecutor, share_slots
from ._torch import (
    CpuExecutor,
    Model,
    adapt_model,
    allocate_slot,
    batch_buckets,
    compile_model,
    make_coerce,
    padding_table,
    resolve_device,
    resolve_instances,
    warmup_batches,
)
from ._variable import (
    DEFAULT_ELEMENTS_PER_ROW,
    VariableExecutor,
    core_shape,
    is_variable,
    layouts,
    padded_dims,
    sample_rows,
)
from ._variable import allocate_slot as variable_slot
from ._weights import WeightUpdate, WeightUpdates, Withdrawable
from .client import MAX_STREAM_BACKLOG, Client, flatten_inputs
from .errors import FerrobatchError, ModelError, ServerClosedError
from .specs import TensorSpec, dtype_name, example_specs

if TYPE_CHECKING:
    from .shared import Shared

__all__ = ["Server"]

log = logging.getLogger("ferrobatch")


class Server:
    """Batches concurrent single-sample requests into model calls.

    Args:
        model: ``callable(dict[str, Tensor]) -> dict | Tensor | tuple``, called
            with a batch (leading dimension = rows) of every input; or a list
            of such callables, one per model instance. Each instance has its
            own worker (and CUDA stream); a batch goes to whichever instance is
            free. The same module listed twice is two instances sharing weights.
            A ``torch.nn.Module`` with a single input is called with that
            tensor (unless its ``forward`` annotates its parameter as a dict
            or Mapping); a ``tensordict.nn.TensorDictModule`` (any
            ``TensorDictModuleBase``) with a ``TensorDict`` of batch size
            ``[rows]``, a spec ``"a.b"`` being its nested key ``("a", "b")``.
            It may return a ``TensorDict``; outputs are read from it by key.
        inputs, outputs: the :class:`TensorSpec` of every input and output
            (per-sample shapes, without the batch dimension).
        max_batch_size: most rows per model call (default 64).
        max_delay: seconds a batch may wait to fill, counted from its oldest
            request (default 0.001). ``0`` is greedy: a free worker takes
            whatever is queued, up to ``max_batch_size``. ``"auto"``: an
            adaptive window — a batch goes as soon as it has as many rows as
            the batch before it (at once for a lone caller, full under heavy
            load), and at the latest when its oldest request is
            ``max_delay_cap`` old (a fall in load costs one batch that wait).
        max_delay_cap: the adaptive window's cap in seconds (default 0.005;
            only with ``max_delay="auto"``).
        delay_from: where ``max_delay`` counts from: ``"request"`` (default,
            the oldest request's arrival) or ``"free_worker"``: from when a
            free worker starts gathering, if later, as TorchRL's ``timeout``
            (a worker back from a batch waits that long for its callers' next
            requests instead of sending at once what queued meanwhile; with
            thread callers the batch still goes as soon as all are in it).
        min_batch_size: a batch with fewer rows waits for more, with no time
            limit (default 1: never waits). Callers bound it with ``timeout``;
            ``stop()`` dispatches what is left.
        preferred_batch_sizes: sizes dispatched before ``max_delay`` when no
            other request is waiting (default none).
        max_queue_size: requests allowed to wait; beyond it ``infer`` raises
            :class:`QueueFullError` at once (default 10000).
        default_timeout: seconds a request that gives no ``timeout`` may
            take, on every way in (in process, threads, shared memory, HTTP
            and gRPC): it then fails with :class:`DeadlineExceededError`, as
            with its own ``timeout``, which bounds the whole call (a running
            batch, a decoupled request's whole stream), not only its time in
            the queue as Triton's queue-policy timeout does. Through
            ``ferrobatch.ray`` it bounds each batch the client forwards.
            ``None`` (default): no limit.
        queue_timeout: seconds a request may wait to be taken into a batch
            (Triton's queue-policy timeout): one that waited longer fails
            with :class:`DeadlineExceededError` and is never run; once in a
            batch, only its own ``timeout`` bounds it. Every way in. Answered
            when its time is up while an instance gathers (a batch still
            filling included); while every instance is busy, as soon as one
            is free.
            ``None`` (default): no limit.
        response_cache: keep results by their request's inputs (Triton's
            response cache): a request whose inputs (bytes, shapes, rows,
            optional inputs left out, requested outputs, and its parameters
            with ``with_requests``) match a kept result's is answered with
            it as its batch is released (as it comes, never queued, while
            every instance runs a batch of 10 ms or more), never run. A
            size in bytes (a cache of this server's), or a
            :class:`ferrobatch.ResponseCache` shared by several servers
            (one bound for all); the least recently used results go first.
            Every way in; a weight update drops this server's results. Only
            successes are kept, each a copy of its rows; not with
            ``decoupled=True``. ``stats()``
            counts ``cache_hits`` (not in ``batches`` nor ``rows``) and
            ``cache_misses``. ``None`` (default): no cache.
        device: where the model runs ("cpu", "cuda", "cuda:1", a
            ``torch.device``); ``None``: the device of the model's parameters,
            else CPU. A ``torch.nn.Module`` is moved there. A list gives one
            device per instance (``["cuda:0", "cuda:1", "cpu"]``); with a single
            model, a module is then copied once per distinct device.
        name: the model's name in errors, stats and serving.
        cuda_graphs: capture one CUDA graph per batch bucket (the preferred
            batch sizes, or the powers of two, and ``max_batch_size``) and
            replay it, each batch padded to its bucket. Only for CUDA
            instances; a model that cannot be captured runs eagerly, with one
            ``RuntimeWarning``.
        compile: ``torch.compile`` the model (a dict gives its keyword
            arguments). Batches are padded to the buckets, and every bucket is
            compiled during warm-up, so no request pays for compilation.
        warmup: ``None`` (default): warm up with zeros where it pays — CUDA
            instances, ``cuda_graphs``, ``compile`` — and not for plain CPU
            models. ``True``: always with zeros (BYTES and variable-length
            inputs: every row at its minimum shape, each ``-1`` one element,
            BYTES empty). A dict ``{input: sample}`` (one sample, or ``n``
            stacked; for a BYTES or variable-length model one row, or a list
            of rows, each at its own length, collated as requests are):
            with those samples. ``False``:
            never (not allowed with ``cuda_graphs`` or ``compile``). Warm-up
            runs every bucket size once in ``start()``, which returns once it
            is done; a model error there fails ``start()`` with
            :class:`ModelError`.
        version_output: the name of an extra int64 output (shape ``()``): the
            version of the weights (see :meth:`update_weights`) that computed
            the row's batch. ``None`` (default): no such output.
        isolate_failures: when a batch's model call raises an ``Exception``,
            retry its requests in halves (each half a model call of its own,
            recursively) so that only the requests whose own call still
            raises get :class:`ModelError`; everyone else gets a result
            (default True). A batch of ``n`` requests costs at most ``n``
            extra calls however many fail, or ``2 * ceil(log2(n))`` if that
            is more (what one bad request takes, so it always fails alone).
            ``KeyboardInterrupt``, ``SystemExit`` and the other
            non-``Exception`` errors are never retried. ``stats()`` counts
            ``retry_calls`` and ``isolated_failures``. On a CUDA instance
            the retries run when the model call raises as it is enqueued
            (errors of Python code, shapes, dtypes), each part waited for;
            an error the device reports later fails the whole batch.
        invariance_sample_rate: the fraction ``r`` of live requests re-run
            alone, off the hot path, to check that their result does not
            depend on the rest of their batch (see
            :func:`ferrobatch.testing.check_batch_invariance` for the same
            check offline): a batch of ``n`` rows has one row copied out
            with probability ``n * r`` and a thread of its own runs the model
            on it alone and compares, with the output dtype's tolerance.
            ``stats()`` counts ``invariance_checks`` and
            ``invariance_mismatches``. 0 (default): off. CPU and CUDA
            instances, without ``compile``; not process instances.
        priority_levels: ``n >= 2`` priority levels, as Triton's: a request's
            ``priority`` (``client.infer(..., priority=p)``, or the v2
            request parameter ``priority`` over HTTP and gRPC) is 1, the most
            urgent, to ``n``; 0 or none is ``default_priority``. Workers take
            the most urgent level first, first come first served within a
            level, except that a request passed over for ``max_priority_wait``
            seconds goes first (the longest waiting first), so no level starves.
            Admission is per level: level ``p`` admits while the queue has room
            (``max_queue_size``) and fewer than ``ceil(max_queue_size *
            (n - p + 1) / n)`` requests of level ``p`` wait, so the most urgent
            level can fill the queue and a full less urgent level never
            refuses a more urgent request. 0 (default): one level, and a
            request's priority is ignored (as Triton without levels).
        default_priority: the level of requests that name none (default:
            ``priority_levels``, the least urgent).
        max_priority_wait: seconds a waiting request may be passed over by
            more urgent ones (default 1.0); ``None``: strict priority.
        with_requests: call the model as ``model(inputs, requests)``, where
            ``requests`` is the batch's :class:`~ferrobatch.RequestInfo` list in
            row order (each request's rows and parameters); warm-up and
            invariance re-runs pass one request per row, without parameters.
            Not with ``cuda_graphs`` (a replayed graph calls no Python).
        torch_threads: torch intra-op threads of each instance's worker
            thread. ``None`` (default): a budget that never oversubscribes
            the cores the process may use: those cores less one (for the
            event loop and the native front-end), shared among the CPU
            instances, at least 1, at most ``torch.get_num_threads()``.
            ``stats()["torch_threads"]`` and the start-up log (``ferrobatch``
            logger, INFO) say what was picked. At most 1024.
        cpu_affinity: one set of core numbers per instance (``[{0, 1},
            {2, 3}]``): each instance's worker thread(s), and the torch
            intra-op threads they start, run on its set only, and its
            default ``torch_threads`` is the set's size. ``None`` (default):
            wherever the OS puts them. Linux only (``os.sched_setaffinity``).
        batching: False serves a model that takes one sample per call
            (Triton's ``max_batch_size: 0``): each request runs alone
            (``max_batch_size`` 1, no wait), and over HTTP and gRPC its
            tensors have no batch dimension, shaped as declared. In process,
            ``infer`` is unchanged (one sample).
        decoupled: the model streams its responses (Triton's decoupled
            mode): called on a batch as usual, it returns an iterable (a
            generator) whose every item is a batch's outputs, each handed to
            the batch's callers at once. Served over gRPC
            ``ModelStreamInfer`` (``ferrobatch serve``, ``ferrobatch.triton``,
            either front-end), where each request gets one
            response per item, then an empty final response when it asks
            (``triton_enable_empty_final_response``). A client that goes
            away stops the model once no request of its batch listens. Its
            batch's failure (the generator raising) fails its requests
            (responses sent stay sent): no failure isolation, no invariance
            sampling, no CUDA graphs or compile. In process, on an event
            loop, ``client().stream(...)`` iterates a request's responses;
            ``infer``, ``infer_sync`` and ``share()`` refuse it (one result
            cannot carry a stream).
        max_stream_backlog: the most bytes of a decoupled model's
            responses one ``client().stream(...)`` holds before its caller
            reads them (default 64 MiB): a response past them ends the stream
            with :class:`StreamBacklogError` and cancels the request, so a
            reader that stops costs at most that much. The network
            front-ends bound each gRPC stream the same way
            (``ServeConfig.max_stream_backlog``).
        instance_kind: ``"thread"`` (default): each instance is a worker
            thread of this process. ``"process"``: each instance's model runs
            in a child process of its own (``spawn``; the model must be
            picklable), past the GIL, fed through shared memory (the staging
            slots and its output buffers; a batch crosses as a slot index on
            a pipe). A child that dies is started again; the batch it held
            fails (with ``isolate_failures``, it runs once more on the new
            process first), and one found dead between batches is replaced
            before the next. An instance whose process cannot be started
            leaves the batches to the others, trying again after 1, 2, 4, ...
            30 s; with no other instance running, the batches it takes fail at
            once. CPU, fixed-shape tensors only;
            no warm-up, invariance sampling or weight updates (the weights
            live in the children). ``cpu_affinity`` and ``torch_threads``
            apply to each child.
    """

    def __init__(
        self,
        model: Model | Sequence[Model],
        *,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        max_batch_size: int = 64,
        max_delay: float | Literal["auto"] = 0.001,
        max_delay_cap: float = 0.005,
        delay_from: Literal["request", "free_worker"] = "request",
        min_batch_size: int = 1,
        preferred_batch_sizes: Sequence[int] = (),
        max_queue_size: int = 10_000,
        default_timeout: float | None = None,
        queue_timeout: float | None = None,
        response_cache: int | ResponseCache | None = None,
        device: str | torch.device | None | Sequence[str | torch.device | None] = None,
        name: str = "model",
        cuda_graphs: bool = False,
        compile: bool | Mapping[str, Any] = False,
        warmup: bool | Mapping[str, Any] | None = None,
        version_output: str | None = None,
        isolate_failures: bool = True,
        invariance_sample_rate: float = 0.0,
        max_batch_elements: int | None = None,
        priority_levels: int = 0,
        default_priority: int | None = None,
        max_priority_wait: float | None = 1.0,
        with_requests: bool = False,
        torch_threads: int | None = None,
        batching: bool = True,
        cpu_affinity: Sequence[Iterable[int]] | None = None,
        decoupled: bool = False,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
        instance_kind: Literal["thread", "process"] = "thread",
    ) -> None:
        self._models: list[Model] = (
            list(model) if isinstance(model, (list, tuple)) else [model]  # type: ignore[list-item]
        )
        if not self._models or not all(callable(m) for m in self._models):
            raise TypeError("model must be a callable or a non-empty list of callables")
        self.inputs = tuple(_check_specs("inputs", inputs))
        self.outputs = tuple(_check_specs("outputs", outputs))
        optional_outputs = [s.name for s in self.outputs if s.optional]
        if optional_outputs:
            raise ValueError(f"outputs cannot be optional (only inputs): {', '.join(optional_outputs)}")
        labelled_inputs = [s.name for s in self.inputs if s.labels is not None]
        if labelled_inputs:
            raise ValueError(f"inputs have no class labels (only outputs): {', '.join(labelled_inputs)}")
        formatted_outputs = [s.name for s in self.outputs if s.format is not None]
        if formatted_outputs:
            raise ValueError(f"outputs have no image format (only inputs): {', '.join(formatted_outputs)}")
        late = [s.name for s in self.inputs[64:] if s.optional]
        if late:
            raise ValueError(f"optional inputs must be among the first 64 inputs: {', '.join(late)}")
        # What the model returns; ``outputs`` adds the version output, if any.
        self._model_outputs = self.outputs
        if version_output is not None:
            if not isinstance(version_output, str) or not version_output:
                raise ValueError(f"version_output must be a non-empty output name, got {version_output!r}")
            if version_output in {s.name for s in self.outputs}:
                raise ValueError(f"version_output {version_output!r} is already one of the model's outputs")
            self.outputs += (TensorSpec(version_output, "int64", ()),)
        self.version_output = version_output
        self.decoupled = bool(decoupled)
        #: Where results are kept by their inputs (None: nowhere).
        self.response_cache = response_cache_of(response_cache)
        if self.response_cache is not None and self.decoupled:
            raise ValueError("response_cache keeps one result per request: not with decoupled=True")
        # This server's entries there; new for each weight version.
        self._cache_namespace = 0 if self.response_cache is None else self.response_cache.namespace()
        if not isinstance(max_stream_backlog, int) or max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be an int >= 1 (bytes), got {max_stream_backlog!r}")
        self.max_stream_backlog = max_stream_backlog
        # A stream's responses are sent as they come: a failed batch cannot be retried.
        self.isolate_failures = bool(isolate_failures) and not self.decoupled
        rate = float(invariance_sample_rate)
        if self.decoupled and rate > 0:
            raise ValueError("invariance_sample_rate needs one result per request: not with decoupled=True")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"invariance_sample_rate must be between 0 and 1, got {invariance_sample_rate!r}")
        self.invariance_sample_rate = rate
        self._samplers: list[InvarianceSampler] = []
        if not isinstance(priority_levels, int) or not 0 <= priority_levels <= 255 or priority_levels == 1:
            raise ValueError(f"priority_levels must be 0 (none) or 2..255, got {priority_levels!r}")
        if default_priority is not None and (
            not isinstance(default_priority, int) or not 1 <= default_priority <= max(priority_levels, 1)
        ):
            raise ValueError(f"default_priority must be in 1..{max(priority_levels, 1)}, got {default_priority!r}")
        if max_priority_wait is not None and not (
            isinstance(max_priority_wait, (int, float)) and max_priority_wait >= 0
        ):
            raise ValueError(f"max_priority_wait must be >= 0 seconds or None, got {max_priority_wait!r}")
        self.priority_levels = priority_levels
        self.default_priority = default_priority
        self.max_priority_wait = max_priority_wait
        self.with_requests = bool(with_requests)
        # What the model is told of a request besides its inputs, so what a
        # cache key holds: its priority, and the parameters it is never shown
        # (ferrobatch.triton's callables see neither the priority nor the
        # protocol's own parameters).
        self._cache_key_rules: tuple[bool, tuple[str, ...]] = (self.with_requests, ())
        if torch_threads is not None and not whole_in(torch_threads, 1, MAX_TORCH_THREADS):
            raise ValueError(
                f"torch_threads must be an int from 1 to {MAX_TORCH_THREADS} or None, got {torch_threads!r}"
            )
        self._torch_threads_given = torch_threads
        self.cpu_affinity = _check_affinity(cpu_affinity, len(self._models))
        #: torch intra-op threads of each instance's worker, as picked at start (0 before).
        self.torch_threads = 0
        #: Whether the CPU instances' workers are started as SCHED_BATCH threads (picked at
        #: start: while a native front-end runs; a refusal by the OS is logged as a warning).
        self.workers_yield = False
        if self.with_requests and cuda_graphs:
            raise ValueError("with_requests needs the model called from Python: not with cuda_graphs")
        self.batching = bool(batching)
        if not self.batching:  # one request per model call, at once
            max_batch_size, max_delay, min_batch_size, preferred_batch_sizes = 1, 0.0, 1, ()
        if delay_from not in ("request", "free_worker"):
            raise ValueError(f"delay_from must be 'request' or 'free_worker', got {delay_from!r}")
        self.delay_from = delay_from
        self.adaptive_delay = max_delay == "auto"
        if self.adaptive_delay:
            max_delay = max_delay_cap
        _check_batching(max_batch_size, max_delay, min_batch_size, preferred_batch_sizes, self.adaptive_delay)
        if not whole_in(max_queue_size, 1, MAX_QUEUE_SIZE):
            raise ValueError(f"max_queue_size must be an int from 1 to {MAX_QUEUE_SIZE}, got {max_queue_size!r}")
        #: The timeout of a request that gives none (seconds; None: no limit).
        self.default_timeout = _seconds_or_none("default_timeout", default_timeout)
        #: How long a request may wait to be taken into a batch (seconds; None: no limit).
        self.queue_timeout = _seconds_or_none("queue_timeout", queue_timeout)
        self.name = name
        self.max_batch_size = max_batch_size
        if max_batch_elements is not None and not whole_in(max_batch_elements, 1, MAX_BATCH_ELEMENTS):
            raise ValueError(
                f"max_batch_elements must be an int from 1 to {MAX_BATCH_ELEMENTS} or None, got {max_batch_elements!r}"
            )
        # BYTES or variable-length tensors: collated by layout, run on CPU;
        # a decoupled model runs on the same executor, which streams.
        self._variable = is_variable(self.inputs) or is_variable(self.outputs) or self.decoupled
        #: The most elements of each variable-length input one batch holds
        #: (padded ones counted padded); None without such inputs.
        self.max_batch_elements: int | None = None
        #: Whether max_batch_elements was given (else it follows max_batch_size).
        self._batch_elements_given = max_batch_elements is not None
        if any(s.is_ragged for s in self.inputs):
            self.max_batch_elements = max_batch_elements or max_batch_size * DEFAULT_ELEMENTS_PER_ROW
        elif max_batch_elements is not None:
            raise ValueError("max_batch_elements applies to variable-length inputs (a shape starting with -1)")
        # The fixed window, or the adaptive window's cap.
        self.max_delay = float(max_delay)
        self.min_batch_size = min_batch_size
        self.preferred_batch_sizes = tuple(sorted(set(preferred_batch_sizes)))
        self.max_queue_size = max_queue_size
        if instance_kind not in ("thread", "process"):
            raise ValueError(f"instance_kind must be 'thread' or 'process', got {instance_kind!r}")
        self.instance_kind = instance_kind
        self._init_instances(device, cuda_graphs, compile, warmup)
        if instance_kind == "process":
            self._check_process_instances(warmup)
        self._weights = WeightUpdates(len(self._models))
        # Every event loop that submits: its pending requests, what its
        # callers saw, and the mailbox its batches are delivered to.
        self._loops = _core.LoopRegistry(name)
        # Held apart from the server: its finalizer must not reference it.
        self._native = _NativeParts()
        # A server freed while running: its workers drain and end, and event
        # loops stop watching its doorbells.
        weakref.finalize(self, _release_native, self._native, self._loops)
        # Client.infer's way in: holds the batcher while the server runs.
        self._submitter = _core.Submitter(self._loops, self._not_running, decoupled=self.decoupled)
        self._slots: list[dict[str, torch.Tensor]] = []
        self._threads: list[threading.Thread] = []
        self._counters: list[WorkerCounters] = []  # every run's: stats() carry on across restarts
        #: What the runs before this one counted, besides their workers' counters.
        self._earlier = _EarlierRuns()
        self._first_id = 1  # the id of the first request of the next run's batcher
        # Held while a restart moves the last run's totals into _earlier (and by stats()).
        self._runs_lock = threading.Lock()
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._shared: list[Shared] = []
        self._phase = "created"  # created -> starting (warm-up) -> running -> stopping -> stopped
        # A stop() during start(): start() sees it after each of its awaits and never runs the workers.
        self._stop_requested = False
        self._start_ended: anyio.Event | None = None
        # Serializes the last steps of concurrent stop() calls (they run on worker threads).
        self._finish_lock = threading.Lock()

    @property
    def _batcher(self) -> _core.Batcher | None:
        return self._native.batcher

    @_batcher.setter
    def _batcher(self, batcher: _core.Batcher | None) -> None:
        self._native.batcher = batcher

    @property
    def _executors(self) -> list[Executor]:
        return self._native.executors

    @_executors.setter
    def _executors(self, executors: list[Executor]) -> None:
        self._native.executors = executors

    @classmethod
    def from_example(cls, model: Model | Sequence[Model], example_inputs: Mapping[str, Any], **kwargs: Any) -> Server:
        """A server whose input and output specs come from one model call.

        ``example_inputs`` is one sample (no batch dimension): a dict of input
        name to tensor, or a ``TensorDict`` / any Mapping, nested keys named
        ``"a.b"``. For a ``TensorDictModule``, only its ``in_keys`` are inputs.
        The model runs once on a batch of that one sample (on its device,
        under ``torch.inference_mode``) and its outputs give the output specs:
        a dict's keys (or a TensorDict's keys other than the inputs, ``"a.b"``
        when nested), ``"output"`` for a single tensor, ``"output_0"``,
        ``"output_1"``... for a tuple. Every other keyword goes to
        :class:`Server`.
        """
        if "inputs" in kwargs or "outputs" in kwargs:
            raise TypeError("from_example infers inputs and outputs; pass them to Server() instead")
        first: Model = model[0] if isinstance(model, (list, tuple)) else model  # type: ignore[assignment]
        in_keys = getattr(first, "in_keys", None)
        names = None if in_keys is None else {k if isinstance(k, str) else ".".join(k) for k in in_keys}
        flat = flatten_inputs(example_inputs, names)
        if not flat:
            raise ValueError("example_inputs has no tensors")
        device = kwargs.get("device")
        run_on = resolve_device(first, None if isinstance(device, (list, tuple)) else device)
        if isinstance(first, torch.nn.Module) and device is not None and not isinstance(device, (list, tuple)):
            first.to(run_on)
        inputs = [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in flat.items()]
        batch = {name: t.unsqueeze(0).to(run_on) for name, t in flat.items()}
        with torch.inference_mode():
            raw = adapt_model(first, inputs, ())(batch)
        outputs = example_specs(raw, exclude=set(flat))
        return cls(model, inputs=inputs, outputs=outputs, **kwargs)

    def _init_instances(
        self,
        device: str | torch.device | None | Sequence[str | torch.device | None],
        cuda_graphs: bool,
        compile: bool | Mapping[str, Any],
        warmup: bool | Mapping[str, Any] | None,
    ) -> None:
        """Resolves the instances and their devices, and checks the
        ``cuda_graphs`` / ``compile`` / ``warmup`` options."""
        self._models, self.devices = resolve_instances(self._models, device)
        if self.decoupled and (cuda_graphs or compile is not False or isinstance(warmup, Mapping)):
            raise ValueError(
                f"model '{self.name}': a decoupled model runs without cuda_graphs, compile or warm-up samples"
            )
        if self._variable and (cuda_graphs or compile is not False):
            raise ValueError(
                f"model '{self.name}': BYTES and variable-length tensors run without cuda_graphs or compile"
            )
        if warmup is False and (cuda_graphs or compile is not False):
            raise ValueError("cuda_graphs and compile need warm-up: warmup=False is not allowed with them")
        if cuda_graphs and not any(d.type == "cuda" for d in self.devices):
            warnings.warn(
                f"model '{self.name}': cuda_graphs=True has no effect without a CUDA device"
                f" (instances on {', '.join(map(str, self.devices))}); it runs eagerly",
                RuntimeWarning,
                stacklevel=3,
            )
        self.cuda_graphs = bool(cuda_graphs)
        self._compile = compile
        self._warmup = warmup
        samples = warmup if isinstance(warmup, Mapping) else None
        # A variable-length model's samples are rows of their own lengths, collated at warm-up.
        self._warmup_rows = sample_rows(self.inputs, samples) if self._variable and samples is not None else None
        self._warmup_batch = warmup_batches(self.inputs, None if self._variable else samples)
        self.buckets = batch_buckets(self.max_batch_size, self.preferred_batch_sizes)

    def reconfigure(
        self,
        *,
        max_batch_size: int | None = None,
        max_delay: float | None = None,
        preferred_batch_sizes: Sequence[int] | None = None,
        check_only: bool = False,
    ) -> None:
        """Changes how a server not running batches (None: as it is): its
        next :meth:`start` runs with them (staging, warm-up and buckets made
        for them); what it counted carries on. ``max_delay`` sets a fixed
        window (an adaptive one, ``"auto"``, ends). Triton's model control
        reloads a model with a new configuration this way.
        ``RuntimeError`` while it runs; ``ValueError`` for settings
        ``Server()`` would refuse, with nothing changed. ``check_only``:
        only refuses what it would refuse (running or not), changes nothing."""
        if self._phase not in ("created", "stopped") and not check_only:
            raise RuntimeError(f"server '{self.name}' is {self._phase}: stop it before reconfiguring it")
        if not self.batching and (max_batch_size, preferred_batch_sizes) != (None, None):
            raise ValueError(f"model '{self.name}' is served without batching: its batch settings cannot change")
        size = self.max_batch_size if max_batch_size is None else max_batch_size
        delay = self.max_delay if max_delay is None else max_delay
        adaptive = self.adaptive_delay and max_delay is None
        preferred = self.preferred_batch_sizes if preferred_batch_sizes is None else tuple(preferred_batch_sizes)
        _check_batching(size, delay, self.min_batch_size, preferred, adaptive)
        if check_only:
            return
        self.max_batch_size = size
        self.max_delay = float(delay)
        self.adaptive_delay = adaptive
        self.preferred_batch_sizes = tuple(sorted(set(preferred)))
        if any(s.is_ragged for s in self.inputs) and not self._batch_elements_given:
            self.max_batch_elements = size * DEFAULT_ELEMENTS_PER_ROW
        self.buckets = batch_buckets(self.max_batch_size, self.preferred_batch_sizes)

    def _check_process_instances(self, warmup: bool | Mapping[str, Any] | None) -> None:
        refused = [
            ("a CUDA device", any(d.type != "cpu" for d in self.devices)),
            ("BYTES or variable-length tensors", self._variable and not self.decoupled),
            ("decoupled=True", self.decoupled),
            ("cuda_graphs", self.cuda_graphs),
            ("compile", self._compile is not False),
            ("warm-up", warmup is True or isinstance(warmup, Mapping)),
            ("invariance_sample_rate", self.invariance_sample_rate > 0),
        ]
        what = [name for name, given in refused if given]
        if what:
            raise ValueError(f"model '{self.name}': instance_kind='process' runs without {', '.join(what)}")

    def _make_executor(self, i: int) -> Executor:
        """Instance ``i``'s executor, set up as every kind is: requests for a
        model that takes them, failure isolation, decoupled streaming and
        invariance sampling (not for compiled models, whose re-run of one
        row would compile anew, nor for process instances)."""
        executor = self._executor_of_kind(i)
        executor.with_requests = self.with_requests
        executor.input_names = tuple(s.name for s in self.inputs)
        executor.output_names = tuple(s.name for s in self.outputs)
        executor.isolate_failures = self.isolate_failures
        executor.decoupled = self.decoupled
        if self.invariance_sample_rate > 0 and self._compile is False and self.instance_kind != "process":
            weights = self._weights
            sampler = InvarianceSampler(self.invariance_sample_rate, executor.run_alone, lambda: weights.version)
            executor.sampler = sampler
            self._samplers.append(sampler)
        return executor

    def _executor_of_kind(self, i: int) -> Executor:
        if self.instance_kind == "process":
            return ProcessExecutor(self._models[i], i, self.name, self.inputs, self._model_outputs, self.max_batch_size)
        if self._variable:  # called with a dict: it needs the lengths/offsets beside each input
            return VariableExecutor(self._models[i], self.devices[i], self.inputs, self._model_outputs)
        model = compile_model(self._models[i], self._compile)
        if not self.with_requests:  # a model given its requests takes the dict of inputs as it is
            model = adapt_model(model, self.inputs, self._model_outputs)
        device = self.devices[i]
        padded = padding_table(self.buckets)
        if device.type == "cuda":
            pad = self.cuda_graphs or self._compile is not False
            return CudaExecutor(
                model, device, self.inputs, self._model_outputs, self.max_batch_size,
                pad_to=padded if pad else None, cuda_graphs=self.cuda_graphs,
            )  # fmt: skip
        return CpuExecutor(model, device, self._model_outputs, pad_to=padded if self._compile is not False else None)

    def _prepare_instances(self) -> tuple[list[Executor], dict[int, str]]:
        """Builds every instance's executor and warms it up (on a worker thread).
        Returns the executors and, by instance, why a CUDA graph capture failed."""
        executors: list[Executor] = []
        capture_failures: dict[int, str] = {}
        self._samplers = []
        pin = any(d.type == "cuda" for d in self.devices)
        # Warm-up goes through a staging slot of its own, as requests will.
        slot: dict[str, torch.Tensor] | None = None
        for i, device in enumerate(self.devices):
            executor = self._make_executor(i)
            gate = self._weights.gates[i]
            executor.bind_weights(gate, self.version_output)
            executors.append(executor)
            warm = self._warmup is True or isinstance(self._warmup, Mapping)
            if self._warmup is None:
                warm = device.type == "cuda" or self._compile is not False
            if not warm:
                continue
            if slot is None and not isinstance(executor, VariableExecutor):
                slot = dict(zip((s.name for s in self.inputs), allocate_slot(self.inputs, self.max_batch_size, pin)))
            try:
                with gate:  # weight updates wait for warm-up
                    if isinstance(executor, VariableExecutor):  # no staging: the rows as they are
                        executor.warm_up_minimum(self.buckets, self._warmup_rows)
                        why = None
                    else:
                        assert slot is not None and isinstance(executor, (CpuExecutor, CudaExecutor))
                        why = executor.warm_up(self._warmup_batch, self.buckets, slot)
            except Exception as exc:
                raise ModelError(
                    f"model '{self.name}' (instance {i} on {device}) failed during warm-up:"
                    f" {type(exc).__name__}: {exc}. Pass warmup={{input: sample}} with"
                    " representative inputs, or warmup=False to skip warm-up."
                ) from exc
            if why is not None:
                capture_failures[i] = why
        return executors, capture_failures

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Warms every instance up (see ``warmup``), allocates the staging ring
        and starts the workers. Returns once the server is :attr:`ready`.

        Raises :class:`ModelError` if the model fails during warm-up; the
        server is then left as it was before ``start()``. Raises
        :class:`ServerClosedError` if ``stop()`` is called meanwhile: the
        workers never start, and the server is stopped.

        A stopped server may start again: a new run, with instances, staging
        and workers of its own (warmed up again), whose ``stats()`` carry on
        from the last run's. Its shares ended with the last run (``share()``
        again). Raises ``RuntimeError`` while a model call that ``stop(timeout)``
        left running has not returned yet.
        """
        if self._phase == "stopped":
            self._leave_stopped_run()
        elif self._phase != "created":
            raise RuntimeError(f"server '{self.name}' was already started")
        self._check_staging_fits()
        self._phase = "starting"
        self._stop_requested = False
        self._start_ended = anyio.Event()
        try:
            await self._start_workers()
        except BaseException:
            # No batch ran: the invariance samplers' threads have nothing to check.
            for sampler in self._samplers:
                sampler.stop()
            self._samplers = []
            if self._stop_requested:
                self._phase = "stopped"
            raise
        finally:
            self._start_ended.set()

    def _leave_stopped_run(self) -> None:
        """Before a stopped server starts again: what its last run counted is
        kept for ``stats()``, and what that run held is let go."""
        if any(thread.is_alive() for thread in self._threads) or any(s.running for s in self._samplers):
            raise RuntimeError(
                f"server '{self.name}' is still finishing a model call that stop() left running;"
                " start it again once that call returns"
            )
        with self._runs_lock:  # stats() sees the totals before or after, never both
            if self._batcher is not None:
                self._earlier.add_batcher(self._batcher.stats())
                self._first_id = self._batcher.next_id
            processes = [e for e in self._executors if isinstance(e, ProcessExecutor)]
            self._earlier.retry_calls += sum(e.reruns for e in processes)
            self._earlier.process_restarts += sum(max(0, e.starts - 1) for e in processes)
            checks, mismatches = summed(self._samplers)
            self._earlier.invariance_checks += checks
            self._earlier.invariance_mismatches += mismatches
            self._batcher, self._executors, self._slots, self._threads, self._samplers = None, [], [], [], []
        self._shared = []  # closed by the stop
        self._phase = "created"

    def _raise_if_stop_requested(self) -> None:
        if self._stop_requested:
            raise ServerClosedError(f"server '{self.name}' was stopped during start()")

    async def _start_workers(self) -> None:
        """``start()`` past its checks. Every failure leaves the phase 'created'
        and frees what it allocated."""
        try:
            # Off the event loop: warm-up may compile and capture for seconds.
            executors, capture_failures = await anyio.to_thread.run_sync(self._prepare_instances)
            self._raise_if_stop_requested()
        except BaseException:
            self._phase = "created"
            raise
        if capture_failures:
            log.warning("ferrobatch: model '%s' runs eagerly: %s", self.name, capture_failures)
            cuda_graph_fallback_warning(self.name, capture_failures)
        self._executors = executors
        for executor in executors:
            if isinstance(executor, ProcessExecutor):
                executor.on_health_change = self._native.instances_changed
        try:
            pin = any(d.type == "cuda" for d in self.devices)
            per_instance = [_staging_slots(isinstance(e, CudaExecutor)) for e in executors]
            if self._variable:
                elements = self.max_batch_elements or 0
                self._slots = [
                    variable_slot(self.inputs, self.max_batch_size, elements) for _ in range(sum(per_instance))
                ]
                slots = [list(slot.values()) for slot in self._slots]
            else:
                slots = [allocate_slot(self.inputs, self.max_batch_size, pin) for _ in range(sum(per_instance))]
                self._slots = [{s.name: t for s, t in zip(self.inputs, slot)} for slot in slots]
            if self.instance_kind == "process":
                share_slots(self._slots)  # before the batcher takes their addresses
            self._batcher = _core.Batcher(
                [(s.name, s.dtype, core_shape(s), None if s.is_bytes else s.torch_dtype) for s in self.inputs],
                slots,
                layouts=layouts(self.inputs),
                max_batch_elements=self.max_batch_elements,
                padded_dims=padded_dims(self.inputs),
                tensor_type=torch.Tensor,
                coerce=make_coerce(self.inputs),
                max_batch_size=self.max_batch_size,
                max_delay=self.max_delay,
                min_batch_size=self.min_batch_size,
                preferred_batch_sizes=list(self.preferred_batch_sizes),
                max_queue_size=self.max_queue_size,
                workers=len(self._models),
                adaptive=self.adaptive_delay,
                delay_from_free_worker=self.delay_from == "free_worker",
                priority_levels=self.priority_levels,
                default_priority=self.default_priority,
                max_priority_wait=self.max_priority_wait,
                keep_parameters=self.with_requests,  # others never carry a request's parameters
                optional=[s.optional for s in self.inputs],
                default_timeout=self.default_timeout,
                queue_timeout=self.queue_timeout,
                response_cache=None
                if self.response_cache is None
                else (
                    self.response_cache,
                    self._cache_namespace,
                    CachedRows(self.outputs, self.version_output),
                    self._cache_key_rules[0],
                    list(self._cache_key_rules[1]),
                ),
                # Numbered on from the last run's: the callers' tables outlive a run.
                first_id=self._first_id,
            )
        except BaseException:
            self._executors, self._slots, self._phase = [], [], "created"
            raise
        if self.response_cache is not None:
            with self._runs_lock:  # a weight update made meanwhile renewed the namespace
                self._batcher.set_cache_namespace(self._cache_namespace)
        self._token = anyio.lowlevel.current_token()
        # torch's intra-op thread count is per OpenMP thread once set: each
        # worker is pinned to the budget, whatever ran before on its thread.
        cpu_instances = sum(not isinstance(e, CudaExecutor) for e in executors)
        torch_threads = self._torch_threads_given or thread_budget(cpu_instances)
        if self.cpu_affinity is not None and self._torch_threads_given is None:
            torch_threads = min(len(cores) for cores in self.cpu_affinity)  # each instance its own cores
        self.torch_threads = torch_threads
        self.workers_yield = _front_end_cores > 0 and cpu_instances > 0 and hasattr(os, "SCHED_BATCH")
        log.info(
            "server '%s': %d instance(s), %d torch intra-op thread(s) each%s%s",
            self.name,
            len(executors),
            torch_threads,
            ""
            if self._torch_threads_given
            else f" (picked: {usable_cores()} usable cores, one kept for the event loop)"
            if self.cpu_affinity is None
            else f" (picked: the smallest of the instances' core sets {[sorted(c) for c in self.cpu_affinity]})",
            "; CPU workers yield to the native front-end (SCHED_BATCH)" if self.workers_yield else "",
        )
        try:
            for i, executor in enumerate(executors):
                if isinstance(executor, ProcessExecutor):
                    cores = None if self.cpu_affinity is None else self.cpu_affinity[i]
                    await anyio.to_thread.run_sync(
                        executor.launch, self._slots, torch_threads, cores, self.workers_yield
                    )
            # Nothing awaits from here to 'running': a stop() seen by neither check comes after.
            self._raise_if_stop_requested()
        except BaseException:
            await anyio.to_thread.run_sync(self._stop_processes, False)
            self._batcher.close()
            self._batcher, self._phase = None, "created"
            raise
        in_processes = [e for e in executors if isinstance(e, ProcessExecutor)]
        for executor in in_processes:
            executor.peers = in_processes
        for i, executor in enumerate(executors):
            counters = WorkerCounters()
            self._counters.append(counters)
            worker = _core.Worker(self._batcher, self._loops)
            thread_name = f"ferrobatch-{self.name}-{i}"
            # Per CPU instance one thread; per CUDA instance two, one launching
            # batches and one completing them (IN_FLIGHT at most in between).
            loops: list[tuple[str, Callable[..., None], tuple[Any, ...]]]
            if isinstance(executor, CudaExecutor):
                handoff: Handoff = queue.SimpleQueue()
                tokens = threading.Semaphore(IN_FLIGHT)
                ring = self._slots
                loops = [
                    (f"{thread_name}-launch", executor.serve_launch, (worker, ring, handoff, tokens)),
                    (f"{thread_name}-complete", executor.serve_complete, (worker, ring, handoff, tokens, counters)),
                ]
            else:
                loops = [(thread_name, executor.serve, (worker, self._slots, counters))]
            cores = None if self.cpu_affinity is None else self.cpu_affinity[i]
            # A CUDA instance's threads launch and complete: their wake-ups stay prompt.
            yields = self.workers_yield and not isinstance(executor, CudaExecutor)
            self._threads += [
                threading.Thread(
                    target=_worker_thread,
                    args=(torch_threads, cores, yields, target, *args),
                    name=name,
                    daemon=True,
                )
                for name, target, args in loops
            ]
        if self.response_cache is not None:
            # Hits found as they are submitted are answered here, beside the
            # instances: never behind a batch that is running (as Triton's).
            found = _core.Worker(self._batcher, self._loops)
            self._threads.append(
                threading.Thread(target=_answer_found, args=(found,), name=f"ferrobatch-{self.name}-cache", daemon=True)
            )
        self._phase = "running"
        self._submitter.accept(self._batcher)
        for thread in self._threads:
            thread.start()
        self._native.serving = True
        for hook in list(self._native.on_run):
            hook()
        self._native.instances_changed()

    async def stop(self, timeout: float | None = None) -> None:
        """Stops accepting requests, runs every accepted one, then stops the workers.

        If ``timeout`` seconds pass first, requests still waiting fail with
        :class:`ServerClosedError` (a model call in progress is left to finish
        on its thread). Idempotent. Called during ``start()``, it waits for
        the warm-up in progress (up to ``timeout``): ``start()`` then raises
        :class:`ServerClosedError` and no worker ever runs. A ``stop()`` that
        is cancelled or fails part way leaves the rest to the next one.
        """
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout)
        ):
            raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        if self._phase == "starting":
            self._stop_requested = True
            assert self._start_ended is not None
            with anyio.CancelScope(deadline=deadline):
                await self._start_ended.wait()
        if self._phase == "running":
            self._phase = "stopping"
            self._native.serving = False
            self._native.instances_changed()  # readiness says not ready from here on
        if self._phase != "stopping":
            return  # never started, stopped, or a start() that will stop itself
        # Every step is idempotent, so a stop() cancelled or failed part way is finished by the next.
        await anyio.to_thread.run_sync(self._stop_accepting_shared)
        self._submitter.accept(None)
        assert self._batcher is not None
        self._batcher.close()
        for executor in self._executors:
            if isinstance(executor, ProcessExecutor):
                executor.closing()
        with anyio.CancelScope(deadline=deadline):
            await _joined(self._threads)
        joined = not any(thread.is_alive() for thread in self._threads)
        # True of a request still queued and of one whose batch (or stream) was still running alike.
        message = f"server '{self.name}' stopped before the request was answered"
        # This run's requests only: a loop's share of this call may come round after a restart.
        self._loops.fail_all(message, self._batcher.next_id)
        # One call on a worker thread: a cancellation waits for it, so it is never left half done.
        await anyio.to_thread.run_sync(self._finish_stop, message, joined)

    def _stop_accepting_shared(self) -> None:
        """Other processes' clients refuse new requests too."""
        for shared in self._shared:
            shared._stop_accepting()

    def _finish_stop(self, message: str, joined: bool) -> None:
        """The last steps of ``stop()`` (a worker thread): each runs even if one before fails."""
        with self._finish_lock:
            if self._phase != "stopping":
                return  # a concurrent stop() finished first
            try:
                for shared in self._shared:
                    shared._close(message)
            finally:
                try:
                    # Last: the callers of a batch still in an instance process when the
                    # wait ran out have their ServerClosedError, not the process's end.
                    self._stop_processes(joined)
                finally:
                    try:
                        for sampler in self._samplers:
                            sampler.stop()
                    finally:
                        self._phase = "stopped"

    @contextlib.contextmanager
    def run_in_background(self, stop_timeout: float | None = None) -> Iterator[Server]:
        """Runs the server on an event loop of its own, in a background
        thread, for programs that have no event loop (threads calling
        ``client.infer_sync``)::

            with server.run_in_background():
                out = server.client().infer_sync({"x": x})

        Returns once the server is :attr:`ready` (warm-up done); on exit it
        stops the server (``stop(stop_timeout)``) and ends the thread.
        """
        with anyio.from_thread.start_blocking_portal() as portal:
            portal.call(self.start)
            try:
                yield self
            finally:
                portal.call(self.stop, stop_timeout)

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

    @property
    def ready(self) -> bool:
        """True once ``start()`` has warmed every instance up and the workers
        run; False before, during warm-up, from ``stop()`` on, and while every
        instance is down (process instances whose processes died and could
        not be started again: each tries again, later and later)."""
        return self._phase == "running" and self._native.instances_up()

    def _watch_readiness(self, watcher: Callable[[bool], object]) -> None:
        """Calls ``watcher(instances up)`` now and whenever that changes (a
        native front-end's readiness follows it; a worker thread may call it)."""
        self._native.watchers.append(watcher)
        watcher(self._native.instances_up())

    def _unwatch_readiness(self, watcher: Callable[[bool], object]) -> None:
        """Stops calling ``watcher`` (its front-end stopped)."""
        with contextlib.suppress(ValueError):
            self._native.watchers.remove(watcher)

    def _on_each_run(self, hook: Callable[[], object], *, add: bool = True) -> None:
        """Calls ``hook()`` once each later run serves (a native front-end
        then serves its new batcher); ``add=False`` stops that."""
        if add:
            self._native.on_run.append(hook)
        else:
            with contextlib.suppress(ValueError):
                self._native.on_run.remove(hook)

    def client(self) -> Client:
        """A client for this server (cheap; share it or make many)."""
        return Client(self, self._submitter, self._loop_token)

    def share(
        self,
        name: str,
        *,
        max_clients: int = 32,
        rows_per_client: int = 1024,
        ring_size: int = 4096,
        mode: int = 0o600,
        cell_bytes: int = 1024,
        metadata: Mapping[str, Any] | None = None,
    ) -> Shared:
        """Exposes this running server to other processes of the same user as
        ``name``: ``ferrobatch.connect(name)`` there returns a client with the
        API of :meth:`client`, whose requests join the same batches.

        Sizes are fixed for the share: ``max_clients`` processes connected at
        once, ``rows_per_client`` rows each may have in flight (beyond,
        :class:`QueueFullError` at once), ``ring_size`` requests waiting to be
        taken (a power of two). The segment is a file in ``/dev/shm`` of
        permissions ``mode`` (default 0o600: this user only), made once and
        removed when the server stops; one left by a server that died is
        replaced (with a log line), one of a running server is a
        ``ValueError``, and so is sharing one server twice. Raises
        :class:`ServerClosedError` unless running.

        A model with BYTES or variable-length tensors is shared too: each
        request takes as many cells as its bytes need, ``cell_bytes`` each
        (for its inputs, and as many for its outputs; a request whose
        outputs outgrow them fails with :class:`ModelError` naming the
        size). ``rows_per_client * cell_bytes`` bounds what one client has
        in flight.

        ``metadata`` (JSON-serializable) travels with the share: clients read
        it as ``client.metadata``.
        """
        from .shared import share

        if self._shared:
            raise ValueError(f"server '{self.name}' is already shared as '{self._shared[0].name}'")
        if self.decoupled:
            raise ValueError(
                f"server '{self.name}' is decoupled: its responses stream in process, over gRPC ModelStreamInfer"
                " and HTTP generate_stream, not through shared memory"
            )
        shared = share(
            self,
            name,
            max_clients=max_clients,
            rows_per_client=rows_per_client,
            ring_size=ring_size,
            mode=mode,
            cell_bytes=cell_bytes,
            metadata=metadata,
        )
        self._shared.append(shared)
        return shared

    def _check_staging_fits(self) -> None:
        """Refuses, before anything is allocated, staging slots larger than
        the machine's memory (``max_batch_size`` rows of each input, or
        ``max_batch_elements`` of a variable-length one, per slot)."""
        per_slot = 0
        for spec in self.inputs:
            if spec.is_bytes:
                continue  # held by the requests, not staged
            itemsize = spec.torch_dtype.itemsize
            if spec.is_ragged or spec.is_padded_nd:
                per_slot += (self.max_batch_elements or 0) * itemsize + 8 * (self.max_batch_size + 1) * len(spec.shape)
            else:
                per_slot += self.max_batch_size * math.prod(spec.shape) * itemsize
        slots = sum(_staging_slots(d.type == "cuda") for d in self.devices)
        memory = _physical_memory()
        if memory is not None and per_slot * slots > memory:
            raise ValueError(
                f"model '{self.name}': {slots} staging slots of {per_slot} bytes (max_batch_size {self.max_batch_size}"
                f", max_batch_elements {self.max_batch_elements}) would take more than this machine's memory"
                f" ({memory} bytes)"
            )

    def _stop_processes(self, wait: bool = True) -> None:
        """Stops the instance processes; without ``wait``, at once."""
        for executor in self._executors:
            if isinstance(executor, ProcessExecutor):
                executor.stop(wait)

    def _native_parts(self) -> tuple[_core.Batcher, _core.LoopRegistry]:
        """The batcher and the loop registry (the owner of this server's
        sinks), for the native front-end to submit to and deliver through."""
        if self._batcher is None or self._phase != "running":
            raise ServerClosedError(f"server '{self.name}' is not running ({self._phase})")
        return self._batcher, self._loops

    def _refused(self, error: FerrobatchError) -> FerrobatchError:
        """``error``, counted in ``stats()``: a front-end refused a request
        of this server before submitting it (it closes)."""
        self._loops.count_refusal(error)
        return error

    def _answer_failed(self, error: FerrobatchError) -> None:
        """A request answered (counted as succeeded) whose answer a front-end
        could not write: counted in ``stats()`` as its caller sees it, ``error``."""
        self._loops.recount_success(error)

    def _not_running(self) -> ServerClosedError:
        return ServerClosedError(f"server '{self.name}' is not running ({self._phase})")

    def _loop_token(self) -> anyio.lowlevel.EventLoopToken:
        if self._token is None or self._phase != "running":
            raise ServerClosedError(f"server '{self.name}' is not running ({self._phase})")
        return self._token

    # -- weights ------------------------------------------------------------------------

    async def update_weights(self, update: WeightUpdate) -> int:
        """Applies a weight update between batches on every instance and
        returns the new version (versions start at 0 and go up by one per
        update).

        ``update`` is a state dict, copied in place into every model
        (``load_state_dict``: parameters keep their storage, so CUDA graphs and
        compiled models stay valid; keys and shapes are checked against every
        model first, and a mismatch changes nothing), or a callable run on
        each distinct model (a module shared by instances runs it once); a
        callable that replaces parameters instead of updating them in place
        invalidates captured CUDA graphs.

        It never runs during a forward pass, and never leaves a batch to run
        while only some instances have it: it waits for the batches in
        progress on every instance (on CUDA, for those already enqueued),
        applies the update to all, then lets batches run again. Returns once
        every instance has it: every batch that starts afterwards uses it.
        The wait and the update run on a worker thread, not the event loop.
        Works before ``start()`` and after ``stop()`` too.

        Cancelled (or timed out) while it waits for the batches in progress,
        it is withdrawn: it changes nothing, ever. Cancelled once it has
        begun updating, it finishes first (the await returns when it is done
        and the version is bumped), then the cancellation is raised: when
        the caller sees it, the weights are as the cancellation says.
        """
        withdrawable = Withdrawable()
        applying = asyncio.get_running_loop().run_in_executor(None, self._update_unless_withdrawn, update, withdrawable)
        applying.add_done_callback(_retrieve)  # a withdrawn update's outcome is nobody's
        try:
            return await asyncio.shield(applying)
        except asyncio.CancelledError:
            if not withdrawable.withdraw():
                await _finish_despite_cancellation(applying)
            raise

    def _update_unless_withdrawn(self, update: WeightUpdate, withdrawable: Withdrawable) -> int:
        if self.instance_kind == "process":
            raise ValueError(f"server '{self.name}': the weights of process instances live in their processes")
        version, _ = self._weights.apply(update, self._models, self.devices, withdrawable=withdrawable)
        self._forget_cached()
        return version

    def update_weights_sync(self, update: WeightUpdate) -> int:
        """Blocking :meth:`update_weights`, for threads other than the event
        loop's (it would block that loop: ``RuntimeError`` there)."""
        _refuse_on_event_loop("update_weights_sync()", "await server.update_weights(...)")
        if self.instance_kind == "process":
            raise ValueError(f"server '{self.name}': the weights of process instances live in their processes")
        version, _ = self._weights.apply(update, self._models, self.devices)
        self._forget_cached()
        return version

    def _forget_cached(self) -> None:
        """Drops the results kept under the old weights: requests are looked
        up under a fresh namespace from now on (a batch of the old weights
        that finishes later keeps its results under the old one, never
        found again), and the old one's entries go."""
        if self.response_cache is None:
            return
        with self._runs_lock:
            old, self._cache_namespace = self._cache_namespace, self.response_cache.namespace()
            if self._batcher is not None:
                self._batcher.set_cache_namespace(self._cache_namespace)
        self.response_cache.forget(old)

    @property
    def model_version(self) -> int:
        """The version of the weights: 0, then one more per weight update."""
        return self._weights.version

    # -- introspection ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters since the first ``start()`` (a server started again
        after ``stop()`` carries them on).

        ``requests_succeeded``; ``requests_failed`` by reason (invalid_input,
        queue_full, deadline_exceeded, cancelled, model_error, server_closed);
        ``batches``, ``rows`` and ``mean_batch_size`` (rows per batch);
        ``queue_depth`` (requests waiting now, those in a batch that is still
        filling included: they are not taken until it goes) and, with priority levels,
        ``queue_depth_by_priority`` (``{level: requests}``); ``queue_ns`` (time queued,
        summed over requests) and ``succeeded_queue_ns`` (the same over the
        requests their batch's model call did not fail, as Triton counts
        it); ``dispatch_reasons`` (batches by why they were
        released: full, next_does_not_fit, preferred_size, delay_expired,
        greedy, adaptive, callers_waiting, shutdown; they sum to ``batches``) and ``release_age_ns``
        (the oldest request's age when its batch was released, summed over
        batches); ``weight_updates`` and ``model_version``
        (see :meth:`update_weights`); ``compute_ns`` (model time, summed over
        batches) and ``request_compute_ns`` (the same counted once per request
        of each batch the model call did not fail, as Triton counts it); ``request_ns`` (submit to result,
        summed over succeeded requests) and ``request_durations_us`` (the
        succeeded requests by that time, ``{upper bound in µs: requests}``
        over the bounds of ``ferrobatch._core.REQUEST_BOUNDS_US``, 50 µs to
        20 s, then ``math.inf``; both count a success when its batch answers
        it, so an event-loop caller cancelled in that same instant is in
        them and counted cancelled); ``failed_batches`` (batches whose
        model call raised); with ``isolate_failures``, ``retry_calls`` (model
        calls made to isolate failures, and batches run again on an instance
        process started after theirs died) and ``isolated_failures`` (requests
        that failed in a call of their own); ``batch_sizes`` (batches by
        their number of rows, ``{rows: batches}``, summing to ``batches``
        once they have finished) and ``batch_compute_ns`` (``compute_ns`` by
        the same batch sizes); with ``response_cache``, ``cache_hits``
        (requests answered from it, never run) and ``cache_misses``
        (requests looked up there and run); ``last_inference_ms`` (when the latest batch
        finished, in milliseconds since the epoch; 0 before the first);
        ``instance_kind`` and, for process instances, ``process_restarts``;
        with ``invariance_sample_rate``, ``invariance_checks`` (requests
        re-run alone) and ``invariance_mismatches`` (of those, the ones whose
        result alone differed from their batch's).
        """
        outcomes = self._loops.stats()
        batch_sizes: dict[int, int] = {}
        batch_compute_ns: dict[int, int] = {}
        for c in self._counters:
            for size, n in dict(c.batch_sizes).items():  # copied first: workers add sizes
                batch_sizes[size] = batch_sizes.get(size, 0) + n
            for size, ns in dict(c.batch_compute_ns).items():
                batch_compute_ns[size] = batch_compute_ns.get(size, 0) + ns
        succeeded = outcomes.pop("succeeded")
        request_ns = outcomes.pop("request_ns")
        request_buckets = self._loops.request_buckets()
        with self._runs_lock:  # this run's and the earlier runs' totals, at one time
            batcher, earlier = self._batcher, self._earlier
            core = earlier.with_batcher({} if batcher is None else batcher.stats())
            processes = [e for e in self._executors if isinstance(e, ProcessExecutor)]
            reruns = sum(e.reruns for e in processes) + earlier.retry_calls
            restarts = sum(max(0, e.starts - 1) for e in processes) + earlier.process_restarts
            checks, mismatches = summed(self._samplers)
            checks, mismatches = checks + earlier.invariance_checks, mismatches + earlier.invariance_mismatches
        batches = int(core.get("batches", 0))
        rows = int(core.get("rows", 0))
        return {
            "requests_succeeded": succeeded,
            "requests_failed": outcomes,
            "batches": batches,
            "rows": rows,
            "mean_batch_size": rows / batches if batches else 0.0,
            "queue_depth": int(core.get("queue_len", 0)),
            "queue_depth_by_priority": self._depth_by_priority(core),
            "queue_ns": int(core.get("queue_ns", 0)),
            "succeeded_queue_ns": int(core.get("succeeded_queue_ns", 0)),
            "dispatch_reasons": dict(core.get("dispatch_reasons", {})),
            "release_age_ns": int(core.get("release_age_ns", 0)),
            "cache_hits": int(core.get("cache_hits", 0)),
            "cache_misses": int(core.get("cache_misses", 0)),
            "compute_ns": sum(c.compute_ns for c in self._counters),
            "request_compute_ns": sum(c.request_compute_ns for c in self._counters),
            "request_ns": request_ns,
            "request_durations_us": dict(zip([*_core.REQUEST_BOUNDS_US, math.inf], request_buckets, strict=True)),
            "failed_batches": sum(c.failed_batches for c in self._counters),
            "isolated_failures": sum(c.isolated_failures for c in self._counters),
            "retry_calls": sum(c.retry_calls for c in self._counters) + reruns,
            "invariance_checks": checks,
            "invariance_mismatches": mismatches,
            "torch_threads": self.torch_threads,
            "workers_yield": self.workers_yield,
            "cpu_affinity": None if self.cpu_affinity is None else [sorted(c) for c in self.cpu_affinity],
            "instance_kind": self.instance_kind,
            # Instance processes started again after one died.
            "process_restarts": restarts,
            "batch_sizes": dict(sorted(batch_sizes.items())),
            "batch_compute_ns": dict(sorted(batch_compute_ns.items())),
            "last_inference_ms": max((c.last_inference_ns for c in self._counters), default=0) // 1_000_000,
            "weight_updates": self._weights.count,
            "model_version": self._weights.version,
        }

    def _depth_by_priority(self, core: Mapping[str, Any]) -> dict[int, int]:
        """Requests waiting now by priority level (1: most urgent); empty without levels."""
        if self.priority_levels == 0:
            return {}
        lens = list(core.get("queue_lens", ())) or [0] * self.priority_levels
        return {level: int(n) for level, n in enumerate(lens, start=1)}

    def __repr__(self) -> str:
        return (
            f"Server(name={self.name!r}, instances={len(self._models)}, "
            f"max_batch_size={self.max_batch_size}, max_delay={self.max_delay}, {self._phase})"
        )


def _check_batching(
    max_batch_size: object,
    max_delay: object,
    min_batch_size: object,
    preferred_batch_sizes: Sequence[object],
    adaptive: bool,
) -> None:
    """Refuses batch settings no server runs with (``ValueError`` naming the
    setting), for :class:`Server` and :meth:`Server.reconfigure`."""
    if not (isinstance(max_batch_size, int) and whole_in(max_batch_size, 1, MAX_BATCH_SIZE)):
        raise ValueError(f"max_batch_size must be an int from 1 to {MAX_BATCH_SIZE}, got {max_batch_size!r}")
    if not (
        isinstance(max_delay, (int, float))
        and not isinstance(max_delay, bool)
        and math.isfinite(max_delay)
        and max_delay >= 0
    ):
        what = "max_delay_cap" if adaptive else "max_delay"
        raise ValueError(f"{what} must be >= 0 seconds (or max_delay='auto'), got {max_delay!r}")
    if not whole_in(min_batch_size, 1, max_batch_size):
        raise ValueError(f"min_batch_size must be in 1..{max_batch_size}, got {min_batch_size!r}")
    bad = [s for s in preferred_batch_sizes if not whole_in(s, 1, max_batch_size)]
    if bad:
        raise ValueError(f"preferred_batch_sizes must be in 1..{max_batch_size}, got {bad}")


class _EarlierRuns:
    """What the stopped runs of a server started again counted, besides
    their workers' counters (which ``stats()`` keeps): their batchers'
    totals, their instance processes' and their invariance samplers'."""

    #: The batcher's totals (its queue lengths are of now: not carried).
    TOTALS = ("batches", "rows", "queue_ns", "succeeded_queue_ns", "release_age_ns", "cache_hits", "cache_misses")

    def __init__(self) -> None:
        self.batcher: dict[str, int] = dict.fromkeys(self.TOTALS, 0)
        self.dispatch_reasons: dict[str, int] = {}
        self.retry_calls = self.process_restarts = 0
        self.invariance_checks = self.invariance_mismatches = 0

    def add_batcher(self, stats: Mapping[str, Any]) -> None:
        for key in self.TOTALS:
            self.batcher[key] += int(stats.get(key, 0))
        for reason, n in dict(stats.get("dispatch_reasons", {})).items():
            self.dispatch_reasons[reason] = self.dispatch_reasons.get(reason, 0) + int(n)

    def with_batcher(self, stats: Mapping[str, Any]) -> dict[str, Any]:
        """The running batcher's ``stats`` with the earlier runs' totals added."""
        merged = dict(stats)
        for key in self.TOTALS:
            merged[key] = int(stats.get(key, 0)) + self.batcher[key]
        reasons = dict(stats.get("dispatch_reasons", {}))
        for reason, n in self.dispatch_reasons.items():
            reasons[reason] = int(reasons.get(reason, 0)) + n
        merged["dispatch_reasons"] = reasons
        return merged


class _NativeParts:
    """What a server's finalizer closes, held apart from the server: a
    finalizer that referenced the server would keep it alive for good."""

    __slots__ = ("batcher", "executors", "watchers", "serving", "on_run")

    def __init__(self) -> None:
        # Set while started; the worker threads hold it too, so it outlives the server.
        self.batcher: _core.Batcher | None = None
        self.executors: list[Executor] = []
        #: Told whether any instance can run batches, when that changes.
        self.watchers: list[Callable[[bool], object]] = []
        #: From a run's start until its stop begins.
        self.serving = False
        #: Called once each run (after the first) serves: a native front-end takes its new batcher.
        self.on_run: list[Callable[[], object]] = []

    def instances_up(self) -> bool:
        """Whether an instance can run batches: the server serves, and not
        every instance is down."""
        if not self.serving:
            return False
        return not self.executors or not all(isinstance(e, ProcessExecutor) and e.down for e in self.executors)

    def instances_changed(self) -> None:
        """An instance went down or came back (on its worker's thread)."""
        up = self.instances_up()
        for watcher in list(self.watchers):
            watcher(up)


def _release_native(parts: _NativeParts, loops: _core.LoopRegistry) -> None:
    """A server was freed without ``stop()``: no client is left (each holds
    the server), so its workers find nothing queued and end, freeing the
    model and the staging slots they hold; its instance processes are
    killed (nothing is left for them to run)."""
    if parts.batcher is not None:
        parts.batcher.close()
    loops.close()
    for executor in parts.executors:
        if isinstance(executor, ProcessExecutor):
            executor.stop(wait=False)


async def _joined(threads: Sequence[threading.Thread]) -> None:
    """Waits until every thread has ended. The join runs on a daemon thread
    of its own: a model call that never returns must not keep the
    interpreter from exiting once ``stop(timeout=...)`` gave up on it (a
    worker thread of anyio's would be joined at exit)."""
    done = anyio.Event()
    token = anyio.lowlevel.current_token()

    def join() -> None:
        for thread in threads:
            thread.join()
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except (RuntimeError, anyio.RunFinishedError):
            pass  # the event loop is gone: nobody waits any more

    threading.Thread(target=join, name="ferrobatch-join", daemon=True).start()
    await done.wait()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Marks a future's exception retrieved (asyncio logs those that are not)."""
    if not future.cancelled():
        future.exception()


async def _finish_despite_cancellation(applying: asyncio.Future[int]) -> None:
    """Waits until a weight update that has begun is done, whatever cancels
    the waiting meanwhile (its caller is cancelled already)."""
    while not applying.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((applying,))


def _refuse_on_event_loop(what: str, instead: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what} blocks and was called from a thread running an event loop; use `{instead}` there")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS, Windows)
        return os.cpu_count() or 1


#: Bounds of the batching sizes, checked before anything is allocated (the
#: staging slots hold max_batch_size rows; the queue's room, max_queue_size).
MAX_BATCH_SIZE = 1 << 20
MAX_QUEUE_SIZE = _core.MAX_QUEUE_SIZE
MAX_BATCH_ELEMENTS = 1 << 32


def _physical_memory() -> int | None:
    """The machine's memory in bytes, where the OS says (None elsewhere)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _staging_slots(cuda: bool) -> int:
    """Staging slots of one instance: on CPU two, one being collated while
    another runs; on CUDA one for each batch it may hold (IN_FLIGHT)."""
    return IN_FLIGHT if cuda else 2


def whole_in(value: object, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool) from ``low`` to ``high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


#: The most torch intra-op threads an instance may be given: past it, a
#: typo (or 10**9) would have OpenMP start threads until the process fails.
MAX_TORCH_THREADS = 1024

#: Cores the native front-end's runtime threads hold in this process (its
#: listeners add theirs while they run): the models' thread budget leaves them.
_front_end_cores = 0
_front_end_lock = threading.Lock()


def front_end_threads() -> int:
    """The native front-end's runtime threads when the user set none: half
    the usable cores (at least one), the other half left to the models'
    workers and the event loop. One on a 2-core machine, as before."""
    return max(1, usable_cores() // 2)


def hold_front_end_cores(threads: int) -> None:
    """The native front-end runs ``threads`` more runtime threads (a negative
    count: fewer); servers started from now on budget around them."""
    global _front_end_cores
    with _front_end_lock:
        _front_end_cores = max(0, _front_end_cores + threads)


def thread_budget(cpu_instances: int) -> int:
    """Each CPU instance's torch intra-op threads when the user set none: the
    usable cores less one for the event loop and those the native
    front-end's threads hold, shared among the CPU instances, at least 1,
    and never more than torch's own setting (``torch.set_num_threads`` or
    ``OMP_NUM_THREADS``). torch's default is every core: its threads would
    fight the event loop's for them, and each model call waits for its
    slowest thread."""
    spare = max(1, usable_cores() - 1 - _front_end_cores)
    return max(1, min(torch.get_num_threads(), spare // max(1, cpu_instances)))


def _seconds_or_none(name: str, value: object) -> float | None:
    """A timeout setting: ``None``, or a number of seconds > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")
    return float(value)


def _answer_found(worker: _core.Worker) -> None:
    """Answers the requests the response cache held as they came, until the batcher closes."""
    while worker.answer_found():
        pass


def _worker_thread(
    threads: int, cores: frozenset[int] | None, yields: bool, target: Callable[..., None], *args: Any
) -> None:
    """Runs a worker loop (``target``) with its torch threads, cores and,
    with ``yields``, as a SCHED_BATCH thread: this thread and the OpenMP
    threads it starts. A woken SCHED_BATCH thread never preempts the running
    one. Where a CPU worker shares a core with the native front-end's
    runtime thread, each batch would otherwise interrupt the front-end in
    the middle of its sockets twice (its first row, then the full batch),
    each interruption two context switches; the worker now runs when the
    front-end waits, or at the next scheduler tick. Its share of the core is
    unchanged, and on a core of its own it runs at once."""
    try:
        if cores is not None:
            os.sched_setaffinity(0, cores)  # this thread (Linux), and the OpenMP threads it starts
        if yields:
            yield_to_front_end()
        torch.set_num_threads(threads)
    except Exception:  # a worker that did not start would leave its requests waiting
        log.exception("ferrobatch: worker %s runs without its cores or threads", threading.current_thread().name)
    target(*args)


def _check_affinity(cpu_affinity: Sequence[Iterable[int]] | None, instances: int) -> list[frozenset[int]] | None:
    """One non-empty set of usable core numbers per instance, or None."""
    if cpu_affinity is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpu_affinity needs os.sched_setaffinity (Linux)")
    try:  # core numbers, not anything int() takes (0.5, "01")
        sets = [frozenset(operator.index(c) for c in cores) for cores in cpu_affinity]
    except TypeError as exc:
        raise ValueError(f"cpu_affinity must be sets of core numbers (ints), got {cpu_affinity!r}") from exc
    if len(sets) != instances:
        raise ValueError(f"cpu_affinity gives {len(sets)} core sets for {instances} instance(s); give one each")
    usable = os.sched_getaffinity(0)
    for i, cores in enumerate(sets):
        if not cores or not cores <= usable:
            raise ValueError(
                f"cpu_affinity[{i}] = {sorted(cores)}: a non-empty set of the usable cores {sorted(usable)}"
            )
    return sets


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
