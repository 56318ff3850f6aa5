"""The caller's side: batch this process's requests before the Ray hop, one
handle call per batch."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio.from_thread
import anyio.to_thread
import numpy as np
import torch

from .._executor import RequestsFailed, retryable
from .._requests import Parameter, RequestInfo
from .._variable import LENGTHS, OFFSETS
from ..client import Client
from ..errors import DeadlineExceededError, FerrobatchError, ModelError, ServerClosedError
from ..server import Server
from ..specs import TensorSpec
from ._wire import to_wire

#: Seconds a client waits for its deployment to describe itself when it has
#: no ``call_timeout`` (a deployment that is gone fails its first request then).
START_TIMEOUT_S = 60.0

__all__ = ["RayClient", "client"]


class _Forward:
    """The local server's "model": sends its batch as one handle call, each
    request of it an item of its own (its rows at its own lengths, its
    priority and parameters) that the replica submits as a request of its
    own, then lays the replies out as the local batch's outputs. It runs on
    a worker thread of the local server, which waits for the reply: each
    instance is one batch in flight."""

    def __init__(self, call: Any, call_timeout: float | None, description: Mapping[str, Any]) -> None:
        self._call = call
        self._timeout = call_timeout
        self._inputs: list[TensorSpec] = list(description["inputs"])
        self._outputs: list[TensorSpec] = list(description["outputs"])
        self._with_priority = int(description.get("priority_levels", 0)) >= 2
        # Rows of fixed shapes stack: neighbours with no parameters and the
        # same priority cross as one item (one request in the replica),
        # which halves the cost per request of the hop on both sides.
        self._stackable = not any(s.is_ragged for s in (*self._inputs, *self._outputs))

    def __call__(self, batch: Mapping[str, Any], requests: Sequence[RequestInfo]) -> dict[str, Any]:
        spans: list[_Span] = []
        start = 0
        for index, request in enumerate(requests):
            priority = request.priority if self._with_priority else None
            parameters = dict(request.parameters) or None
            last = spans[-1] if spans else None
            if (
                self._stackable
                and parameters is None
                and last is not None
                and (last.priority, last.parameters, last.absent) == (priority, None, request.absent)
            ):
                last.rows += request.rows
                last.requests.append(index)
            else:
                spans.append(_Span(start, request.rows, priority, parameters, request.absent, [index]))
            start += request.rows
        items = [
            (
                to_wire(
                    {
                        s.name: _rows_of(s, batch, span.first, span.rows)
                        for s in self._inputs
                        if s.name not in span.absent
                    }
                ),
                span.priority,
                span.parameters,
            )
            for span in spans
        ]
        replies = self._send(items)
        for (ok, reply), span in zip(replies, spans):
            if not ok and len(span.requests) > 1 and retryable(reply):
                raise reply  # several requests' failure: with isolate_failures, the halves find whose it is
        rows = [span.rows for span in spans]
        laid_out: dict[str, Any] = {}
        for spec in self._outputs:
            parts = [reply[spec.name] if ok else _unread(spec, span.rows) for (ok, reply), span in zip(replies, spans)]
            laid_out.update(_batch_of(spec, parts, rows))
        errors = {i: reply for (ok, reply), span in zip(replies, spans) if not ok for i in span.requests}
        if errors:
            # Each request fails with the replica's error for it (overload
            # stays a QueueFullError), the others get their rows: nothing is sent again.
            raise RequestsFailed(laid_out, errors)
        return laid_out

    def _send(self, items: list[tuple[dict[str, Any], int | None, dict[str, Any] | None]]) -> list[tuple[bool, Any]]:
        """One handle call carrying ``items``; the replica's answer to each."""
        # The items view the local staging slot: it is not reused before this
        # returns, after Ray has sent them.
        response = self._call.remote(items)
        try:
            replies: list[tuple[bool, Any]] = response.result(timeout_s=self._timeout)
        except BaseException:
            response.cancel()
            raise
        return replies


@dataclass
class _Span:
    """Neighbouring requests of a batch that cross as one item: their first
    row, rows, priority, parameters and the optional inputs they left out,
    and their indices in the batch's requests."""

    first: int
    rows: int
    priority: int | None
    parameters: dict[str, Any] | None
    absent: frozenset[str]
    requests: list[int]


def _unread(spec: TensorSpec, rows: int) -> Any:
    """Output ``spec``'s rows for an item the replica failed: zeros (variable
    dimensions empty), which nobody reads."""
    shape = (rows, *(max(d, 0) for d in spec.shape))
    return np.full(shape, b"", dtype=object) if spec.is_bytes else torch.zeros(shape, dtype=spec.torch_dtype)


def _rows_of(spec: TensorSpec, batch: Mapping[str, Any], start: int, rows: int) -> Any:
    """A request's rows of input ``spec``, cut from the collated batch at the
    request's own lengths (the rows of one request share them)."""
    value = batch[spec.name]
    if not spec.is_ragged:
        return value[start : start + rows]
    if spec.ragged == "jagged":
        offsets = batch[spec.name + OFFSETS]
        first, end = int(offsets[start]), int(offsets[start + rows])
        return value[first:end].reshape(rows, int(offsets[start + 1]) - first, *value.shape[1:])
    own = [int(n) for n in batch[spec.name + LENGTHS].reshape(len(value), -1)[start]]
    box = [slice(None)] * (value.ndim - 1)
    for d, n in zip(_variable_dims(spec), own):
        box[d] = slice(0, n)
    return value[(slice(start, start + rows), *box)]


def _batch_of(spec: TensorSpec, parts: Sequence[Any], rows: Sequence[int]) -> dict[str, Any]:
    """Output ``spec`` of the whole batch from each request's part
    (``[rows, *its own shape]``, as the replica answered it), laid out as
    the local server takes a model's outputs: stacked, padded with
    ``_lengths`` or jagged with ``_offsets``."""
    # numpy where it can (Ray's arrays are read-only: numpy copies them
    # without a warning); torch for dtypes numpy lacks.
    as_torch = any(isinstance(p, torch.Tensor) for p in parts)
    arrays: list[Any] = [torch.as_tensor(p) for p in parts] if as_torch else [np.asarray(p) for p in parts]
    concat: Any = torch.cat if as_torch else np.concatenate
    if not spec.is_ragged:
        return {spec.name: concat(arrays)}
    if spec.ragged == "jagged":
        row_lengths = [a.shape[1] for a, n in zip(arrays, rows) for _ in range(n)]
        flat = concat([a.reshape(-1, *a.shape[2:]) for a in arrays])
        return {spec.name: flat, spec.name + OFFSETS: np.cumsum([0, *row_lengths], dtype=np.int64)}
    dims = _variable_dims(spec)
    shape = list(arrays[0].shape[1:])
    for d in dims:
        shape[d] = max(a.shape[1 + d] for a in arrays)
    total = sum(rows)
    values: Any
    if spec.is_bytes:
        values = np.full((total, *shape), b"", dtype=object)
    elif as_torch:
        values = torch.full((total, *shape), spec.pad_value, dtype=arrays[0].dtype)
    else:
        values = np.full((total, *shape), spec.pad_value, dtype=arrays[0].dtype)
    lengths: list[list[int]] = []
    at = 0
    for a, n in zip(arrays, rows):
        values[(slice(at, at + n), *(slice(0, m) for m in a.shape[1:]))] = a
        lengths += [[a.shape[1 + d] for d in dims]] * n
        at += n
    index = np.asarray(lengths, dtype=np.int64)
    return {spec.name: values, spec.name + LENGTHS: index if len(dims) > 1 else index[:, 0]}


def _from_wire(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """A response as it crossed the hop (numpy arrays; see ``_wire``) as
    ``Client`` answers: torch tensors (copied: Ray's arrays are read-only),
    BYTES as numpy object arrays."""
    return {
        name: torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) and value.dtype != object else value
        for name, value in outputs.items()
    }


def _variable_dims(spec: TensorSpec) -> tuple[int, ...]:
    """Where a padded tensor's lengths apply in one row's shape."""
    return spec.variable_dims if spec.is_padded_nd else (0,)


class RayClient:
    """ferrobatch's client API for a Ray Serve deployment made by
    :func:`~ferrobatch.ray.deployment`; get one with :func:`client`.

    Requests from any task, event loop or thread of this process queue in a
    local :class:`~ferrobatch.Server` whose model forwards each batch as one
    handle call (Ray picks the replica), each request in it with its own
    rows (BYTES and variable-length ones at their own lengths), priority and
    parameters; the replica submits each as a request of its own, and each
    caller gets its own rows back. So Ray's cost per call is paid once per
    batch, not once per sample, and nothing a caller gives is lost on the
    way.

    The local server starts on first use (it asks a replica for the model's
    specs first), on an event loop thread of its own, or with ``start()`` /
    ``async with`` / ``with``; ``close()`` / ``aclose()`` runs every request
    already accepted, then stops it. Errors are ferrobatch's: a request the
    replica answered with an error gets that error, alone and at once (its
    ``QueueFullError`` stays one, counted ``queue_full``; nothing is sent
    again); a failed handle call (a dead replica, a ``call_timeout``) is a
    :class:`ModelError` whose ``__cause__`` is Ray's exception, and with
    ``isolate_failures`` the batch's requests are retried in halves first.
    """

    def __init__(
        self,
        handle: Any,
        *,
        max_batch_size: int | None = None,
        max_delay: float = 0.001,
        max_queue_size: int = 10_000,
        batches_in_flight: int = 4,
        call_timeout: float | None = None,
        isolate_failures: bool = True,
    ) -> None:
        if not isinstance(batches_in_flight, int) or batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be an int >= 1, got {batches_in_flight!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self._handle = handle
        self._max_batch_size = max_batch_size
        self._max_delay = max_delay
        self._max_queue_size = max_queue_size
        self._batches_in_flight = batches_in_flight
        self._call_timeout = call_timeout
        self._isolate_failures = isolate_failures
        self._lock = threading.Lock()
        #: One start at a time (held across the deployment's describe(), which close() does not wait for).
        self._start_lock = threading.Lock()
        self._server: Server | None = None
        self._client: Client | None = None
        # The local server's event loop thread, and how to end it.
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_cm: contextlib.AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._closed = False
        #: What the deployment said about itself (``describe()``), once started.
        self.description: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the local batcher now (blocking: from a thread that runs no
        event loop; ``await client.astart()`` on one). Idempotent."""
        self._started()

    async def astart(self) -> None:
        """:meth:`start` from an event loop (the wait runs on a worker thread)."""
        if self._client is None:
            await anyio.to_thread.run_sync(self._started, abandon_on_cancel=True)

    async def _local(self, timeout: float | None) -> Client:
        """The local batcher's client, started first within ``timeout``
        (a request's own: :class:`DeadlineExceededError` past it)."""
        local = self._client
        if local is not None:
            return local
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            await self.astart()
        if scope.cancelled_caught:
            raise DeadlineExceededError(
                f"the deployment did not answer describe() within the request's {timeout}s timeout"
            )
        assert self._client is not None
        return self._client

    def _started(self) -> Client:
        with self._start_lock:
            if self._client is not None:
                return self._client
            if self._closed:
                raise ServerClosedError("this ferrobatch.ray client was closed")
            try:  # bounded: a deployment that is gone must not leave its caller (or close()) waiting
                description: dict[str, Any] = self._handle.describe.remote().result(
                    timeout_s=self._call_timeout or START_TIMEOUT_S
                )
            except Exception as exc:  # Ray's errors of a handle call, whichever
                raise ServerClosedError(f"the deployment did not describe itself: {type(exc).__name__}: {exc}") from exc
            remote_max = int(description["max_batch_size"])
            max_batch_size = min(self._max_batch_size or remote_max, remote_max)
            call = self._handle.infer_requests
            # The replica's priority levels and token budget apply here first:
            # the local queue orders and refuses as the replica's would.
            forwards: list[Any] = [  # with_requests: each called as model(inputs, requests)
                _Forward(call, self._call_timeout, description) for _ in range(self._batches_in_flight)
            ]
            server = Server(
                forwards,
                inputs=description["inputs"],
                outputs=description["outputs"],
                max_batch_size=max_batch_size,
                max_delay=self._max_delay,
                max_queue_size=self._max_queue_size,
                max_batch_elements=description.get("max_batch_elements"),
                priority_levels=int(description.get("priority_levels", 0)),
                default_priority=description.get("default_priority"),
                device="cpu",
                name=str(description["name"]),
                isolate_failures=self._isolate_failures,
                warmup=False,
                with_requests=True,
                batching=bool(description.get("batching", True)),
            )
            portal_cm = anyio.from_thread.start_blocking_portal()
            portal = portal_cm.__enter__()
            try:
                portal.call(server.start)
            except BaseException as exc:
                portal_cm.__exit__(type(exc), exc, exc.__traceback__)
                raise
            client = server.client()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._portal, self._portal_cm = portal, portal_cm
                    self._server, self.description = server, description
                    self._client = client
            if closed:  # close() came while it started: nothing is left running
                try:
                    portal.call(server.stop)
                finally:
                    portal_cm.__exit__(None, None, None)
                raise ServerClosedError("this ferrobatch.ray client was closed")
            return client

    def close(self, timeout: float | None = None) -> None:
        """Stops the local batcher: every accepted request still runs (within
        ``timeout`` seconds; then those waiting fail with
        :class:`ServerClosedError`); later calls raise it. Idempotent."""
        with self._lock:
            self._closed = True
            portal, portal_cm, server = self._portal, self._portal_cm, self._server
            self._portal = self._portal_cm = None
        if portal is None or portal_cm is None or server is None:
            return
        try:
            portal.call(server.stop, timeout)
        finally:
            portal_cm.__exit__(None, None, None)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from an event loop (the wait runs on a worker thread)."""
        await anyio.to_thread.run_sync(self.close, timeout)

    def __enter__(self) -> RayClient:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> RayClient:
        await self.astart()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- requests -------------------------------------------------------------------------

    async def infer(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """One sample, as :meth:`ferrobatch.Client.infer`: batched with this
        process's other requests, sent with them in one handle call.
        ``timeout``, cancellation and errors behave as there; ``priority``
        orders the local queue and the replica's, ``parameters`` reach the
        replica's model (``with_requests``) as if given there."""
        local = await self._local(timeout)
        return await local.infer(inputs, timeout, priority=priority, parameters=parameters)

    async def infer_batch(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> dict[str, Any]:
        """``n`` rows that travel together, as :meth:`ferrobatch.Client.infer_batch`."""
        local = await self._local(timeout)
        return await local.infer_batch(inputs, timeout, priority=priority, parameters=parameters)

    async def stream(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A decoupled deployment's responses to one sample, as
        :meth:`ferrobatch.Client.stream`: one streaming handle call (the
        replica batches it with its other requests; nothing is batched here),
        each response as its replica's model makes it. Leaving the loop early
        cancels the call, and so the request."""
        async for out in self._stream(inputs, timeout, False, priority, parameters):
            yield out

    async def stream_batch(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """``n`` rows' responses, as :meth:`ferrobatch.Client.stream_batch`."""
        async for out in self._stream(inputs, timeout, True, priority, parameters):
            yield out

    async def _stream(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None,
        batched: bool,
        priority: int | None,
        parameters: Mapping[str, Parameter] | None,
    ) -> AsyncIterator[dict[str, Any]]:
        if self._closed:
            raise ServerClosedError("this ferrobatch.ray client was closed")
        from ray.exceptions import RayError

        call = self._handle.options(stream=True).stream
        responses = call.remote(
            to_wire(dict(inputs)), timeout, batched=batched, priority=priority, parameters=parameters
        )
        # The request's deadline bounds its whole stream here too: Ray may hold the call before the replica has it.
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while True:
                with anyio.move_on_after(deadline - time.monotonic()) as scope:
                    try:
                        out = await responses.__anext__()
                    except StopAsyncIteration:
                        break
                    except RayError as exc:
                        if isinstance(exc, FerrobatchError):  # the replica's own error, as Ray wraps it
                            raise
                        raise ModelError(f"the stream's replica failed: {type(exc).__name__}: {exc}") from exc
                if scope.cancelled_caught:
                    raise DeadlineExceededError(f"request exceeded its {timeout}s timeout")
                yield _from_wire(out)
            finished = True
        finally:
            if not finished:  # left early, failed or timed out: the replica's request goes
                responses.cancel()

    def infer_sync(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """Blocking :meth:`infer`, for threads that run no event loop."""
        local = self._client or self._started()
        return local.infer_sync(inputs, timeout, priority=priority, parameters=parameters)

    @property
    def server(self) -> Server | None:
        """The local batcher (None before it starts)."""
        return self._server

    def stats(self) -> dict[str, Any]:
        """The local batcher's ``stats()``: its ``batches`` are handle calls,
        its ``mean_batch_size`` the rows per call. Empty before it starts."""
        return self._server.stats() if self._server is not None else {}


def client(
    handle: Any,
    *,
    max_batch_size: int | None = None,
    max_delay: float = 0.001,
    max_queue_size: int = 10_000,
    batches_in_flight: int = 4,
    call_timeout: float | None = None,
    isolate_failures: bool = True,
) -> RayClient:
    """A client with ferrobatch's API that batches this process's requests
    before they cross to ``handle``'s deployment (one made by
    :func:`~ferrobatch.ray.deployment`)::

        client = ferrobatch.ray.client(serve.get_deployment_handle("mlp", app_name="mlp"))
        out = await client.infer({"x": x})           # or client.infer_sync(...) from a thread

    ``max_batch_size``: rows per handle call (default and at most the
    deployment's ``max_batch_size``); ``max_delay``: seconds a batch may wait
    to fill; ``batches_in_flight``: handle calls outstanding at once (each a
    worker thread of the local batcher); ``call_timeout``: seconds one handle
    call may take (None: no limit); ``isolate_failures``: see
    :class:`~ferrobatch.Server`. See :class:`RayClient`.
    """
    return RayClient(
        handle,
        max_batch_size=max_batch_size,
        max_delay=max_delay,
        max_queue_size=max_queue_size,
        batches_in_flight=batches_in_flight,
        call_timeout=call_timeout,
        isolate_failures=isolate_failures,
    )
