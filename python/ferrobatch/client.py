"""The caller's side: ``await client.infer(...)`` and ``client.infer_sync(...)``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import sys
import threading
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import anyio.lowlevel
import torch

from . import _core
from ._requests import Parameter
from .errors import FerrobatchError, InvalidInputError, ServerClosedError, StreamBacklogError
from .specs import flatten_into, nested_key

if TYPE_CHECKING:
    from .server import Server

__all__ = ["Client", "StreamBacklog", "flatten_inputs"]

Inputs = Mapping[str, Any]
Outputs = dict[str, torch.Tensor]

#: ``Server(max_stream_backlog=)``'s and ``ServeConfig``'s default: bytes.
MAX_STREAM_BACKLOG = 64 << 20


class StreamBacklog:
    """The bytes of a stream's responses made but not yet read, bounded by
    ``limit``: one per ``client.stream`` call, or one shared by the requests
    of a gRPC stream (counting its messages not yet sent as well). Counted
    on the loop thread, let go there or by the thread that reads
    (``stream_sync``), hence the lock."""

    __slots__ = ("_lock", "limit", "unread")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.unread = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Counts a new response's ``nbytes``; past ``limit``, counts nothing
        and raises :class:`StreamBacklogError` (its request then fails)."""
        with self._lock:
            unread = self.unread
            if unread + nbytes <= self.limit:
                self.unread = unread + nbytes
                return
        raise StreamBacklogError(
            f"the stream's reader is too slow: {unread} bytes of responses are unread and the next "
            f"({nbytes} bytes) would pass max_stream_backlog ({self.limit}); the request is cancelled"
        )

    def add(self, nbytes: int) -> None:
        """Counts bytes already made (a response on its way to its reader): never refused."""
        with self._lock:
            self.unread += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.unread = max(0, self.unread - nbytes)


def flatten_inputs(inputs: Mapping[Any, Any], names: Collection[str] | None = None) -> dict[str, Any]:
    """``{name: value}`` from a TensorDict or any Mapping: a nested key
    (``("a", "b")``, or a Mapping inside the Mapping) is named ``"a.b"``. A
    TensorDict's keys not in ``names`` are left out (it may carry more than the
    model reads); another Mapping's are kept (submit refuses them)."""
    if not isinstance(inputs, Mapping):
        raise InvalidInputError(f"inputs must be a dict, a TensorDict or a Mapping, got {type(inputs).__name__}")
    flat: dict[str, Any] = {}
    is_td = _is_tensordict(inputs)
    if is_td:
        for key, value in inputs.items(include_nested=True, leaves_only=True):  # type: ignore[call-arg]
            name = key if isinstance(key, str) else ".".join(key)
            if names is None or name in names:
                flat[name] = value
        return flat
    flatten_into(flat, inputs, "")
    return flat


def submit_from_thread(
    loop: asyncio.AbstractEventLoop, submit: Callable[[], asyncio.Future[Any]]
) -> concurrent.futures.Future[Any]:
    """Runs ``submit`` (which queues a request and returns its future) by a
    callback on ``loop``, from any other thread: a Future of the request's
    outputs or of the error ``infer`` would raise. No task per request."""
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()
    result.set_running_or_notify_cancel()

    def settle(future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            result.set_exception(ServerClosedError("the request was cancelled"))
            return
        error = future.exception()
        if error is None:
            result.set_result(future.result())
        else:
            result.set_exception(error)

    def on_loop() -> None:
        try:
            future = submit()
        except BaseException as exc:  # noqa: BLE001 - the caller's to see
            result.set_exception(exc)
            return
        future.add_done_callback(settle)

    loop.call_soon_threadsafe(on_loop)
    return result


def response_bytes(response: object) -> int:
    """The bytes one streamed response holds: its tensors' and arrays'
    elements, a BYTES output's elements by their lengths, through a dict or
    a TensorDict of them."""
    if isinstance(response, torch.Tensor):
        return response.nbytes
    if isinstance(response, (bytes, str)):
        return len(response)
    if getattr(getattr(response, "dtype", None), "kind", None) == "O":  # a numpy array of BYTES elements
        return sum(len(v) for v in getattr(response, "flat", ()) if isinstance(v, (bytes, str)))
    values = getattr(response, "values", None)
    if callable(values):  # a dict or a TensorDict
        return sum(response_bytes(v) for v in values())
    return int(getattr(response, "nbytes", 0))


def _is_tensordict(value: object) -> bool:
    if "tensordict" not in sys.modules:
        return False
    from tensordict import TensorDictBase

    return isinstance(value, TensorDictBase)


def _to_tensordict(outputs: Outputs, rows: int | None = None) -> Any:
    """A request's outputs as a TensorDict: of one sample, or (``rows``) of
    that many."""
    from tensordict import TensorDict

    return TensorDict({nested_key(k): v for k, v in outputs.items()}, batch_size=[] if rows is None else [rows])


def _rows_of(inputs: Any) -> int | None:
    """A batched TensorDict's rows: its first batch dimension (None if it has none)."""
    batch_size = tuple(inputs.batch_size)
    return int(batch_size[0]) if batch_size else None


# A forked child must not reuse the parent's cached event loops (see _core.Submitter).
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_core.after_fork_in_child)


class Client:
    """Submits requests to a :class:`~ferrobatch.Server`; get one with ``server.client()``.

    A client may be shared by any number of tasks, event loops and threads.
    """

    __slots__ = ("_input_names", "_loop_token", "_server", "_submitter")

    def __init__(
        self,
        server: Server,
        submitter: _core.Submitter,
        loop_token: Callable[[], anyio.lowlevel.EventLoopToken],
    ) -> None:
        # What a client needs of its server: the way in for requests, and the
        # server's event loop for blocking callers. (``server`` is for users.)
        self._server = server
        self._submitter = submitter
        self._loop_token = loop_token
        self._input_names = frozenset(s.name for s in server.inputs)

    @property
    def server(self) -> Server:
        return self._server

    async def infer(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """Runs one sample through the model, batched with other callers'.

        ``inputs`` maps every input name to one sample of its declared dtype and
        shape (a torch CPU tensor, a numpy array, or any buffer-protocol or
        DLPack object). Returns ``{output name: tensor of the output's shape}``.

        ``inputs`` may also be a ``TensorDict`` (batch size ``[]``) or any
        other Mapping: a nested key ``("a", "b")`` (or a Mapping within the
        Mapping) is the input named ``"a.b"`` (in a plain dict, write
        ``"a.b"``). A TensorDict's keys that are no input are ignored, and the
        result is then a ``TensorDict`` of the outputs (``"a.b"`` nested as
        ``("a", "b")``). A plain dict costs nothing extra; the others are
        flattened in Python first (microseconds).

        Raises at once :class:`InvalidInputError` (bad input; never queued),
        :class:`QueueFullError` or :class:`ServerClosedError`; later
        :class:`DeadlineExceededError` once ``timeout`` seconds pass,
        :class:`ModelError` if the batch's model call failed, or
        :class:`ServerClosedError` if the server stopped first. Cancelling the
        awaiting task withdraws the request if no batch has taken it yet.
        Each input is copied when the request is queued, before ``infer`` first
        yields: the caller may modify, resize or reuse its objects at once,
        and the result never shares memory with them.

        ``timeout`` is in seconds; ``None``, ``math.inf`` or one too long to
        represent means no deadline; a negative or NaN timeout is an
        :class:`InvalidInputError`. ``stats()`` counts the request once, as
        this call ended: a result, the error it raised, or ``cancelled`` if
        the awaiting task was cancelled (even in the loop iteration its
        result arrived).

        ``priority``: the request's level with ``Server(priority_levels=n)``,
        1 (most urgent) to ``n``; ``None`` or 0: the server's
        ``default_priority``. Ignored by a server without levels.
        ``parameters``: ``{name: bool | int | float | str}`` handed to a
        model built with ``Server(..., with_requests=True)`` (see
        :class:`~ferrobatch.RequestInfo`).
        """
        if priority is not None or parameters is not None:
            return await self._infer_with(inputs, timeout, False, priority, parameters)
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            return await self._infer_mapping(inputs, timeout)
        # One call into Rust per request (it finds this loop's mailbox, queues
        # the request and arms the deadline). The caller keeps the future and
        # id, never the mailbox's entry: a failed future's traceback holds the
        # caller's frame, and the entry (which the cycle collector does not
        # see) holds the future.
        future, rid = self._submitter.submit(inputs, timeout, False)
        try:
            return await future
        except asyncio.CancelledError:
            self._withdraw(rid, future)
            raise
        finally:
            # A raised error's traceback holds this frame: without this, the
            # frame -> future -> error -> traceback cycle would keep the
            # inputs alive until the cycle collector runs.
            del future, inputs

    async def _infer_with(
        self,
        inputs: Inputs,
        timeout: float | None,
        batched: bool,
        priority: int | None,
        parameters: Mapping[str, Parameter] | str | None,
        requested_outputs: int = 0,
        *,
        uncached: bool = False,
    ) -> Any:
        """``infer`` / ``infer_batch`` with a priority or parameters (a JSON
        object's text: the v2 front-ends pass on what a request carried, and
        the outputs it asked for as bits of their indices, 0: not said;
        ``uncached``: past the response cache, a request whose answer is not
        its inputs' alone)."""
        tensordict = _is_tensordict(inputs)
        rows = _rows_of(inputs) if tensordict and batched else None
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            inputs = flatten_inputs(inputs, self._input_names if tensordict else None)
        future, rid = self._submitter.submit(
            inputs, timeout, batched, priority, parameters, requested_outputs=requested_outputs, uncached=uncached
        )
        try:
            outputs = await future
        except asyncio.CancelledError:
            self._withdraw(rid, future)
            raise
        finally:
            del future, inputs  # as in infer
        return _to_tensordict(outputs, rows) if tensordict else outputs

    async def _infer_mapping(self, inputs: Inputs, timeout: float | None) -> Any:
        if _is_tensordict(inputs):
            outputs = await self.infer(flatten_inputs(inputs, self._input_names), timeout)
            return _to_tensordict(outputs)
        return await self.infer(flatten_inputs(inputs), timeout)

    def _submit_threadsafe(self, inputs: dict[str, Any]) -> concurrent.futures.Future[Outputs]:
        """Submits from any thread but the event loop's: the request is queued
        by a callback on the server's loop (no task), and the returned future
        resolves with the outputs or the error ``infer`` would raise."""
        loop = self._loop_token().native_token
        assert isinstance(loop, asyncio.AbstractEventLoop), "the server runs on asyncio"
        submitter = self._submitter

        def submit() -> asyncio.Future[Outputs]:
            future, _ = submitter.submit(inputs, None, False)
            return future

        return submit_from_thread(loop, submit)

    async def infer_batch(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Outputs:
        """Like :meth:`infer` for ``n >= 1`` samples at once: every input has a
        leading dimension ``n`` (at most ``max_batch_size``), and so does every
        output. The rows join a batch together and are never split."""
        if priority is not None or parameters is not None or type(inputs) is not dict:
            outputs: Outputs = await self._infer_with(inputs, timeout, True, priority, parameters)
            return outputs
        future, rid = self._submitter.submit(inputs, timeout, True)
        try:
            return await future
        except asyncio.CancelledError:
            self._withdraw(rid, future)
            raise
        finally:
            del future, inputs  # as in infer

    async def stream(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> AsyncIterator[Any]:
        """A decoupled model's responses to one sample (``Server(decoupled=True)``),
        each as its batch's model yields it::

            async for out in client.stream({"x": x}):   # {output name: tensor} per response
                ...

        The request is queued at the first iteration, batched with other
        callers' as :meth:`infer` is (same inputs, errors, ``timeout``,
        ``priority`` and ``parameters``); the iteration ends with the model's
        generator. An error raised after some responses (the model failed,
        the deadline passed, the server stopped) ends it with that error.
        Leaving the loop early (``break``, or the task cancelled) cancels the
        request: once no request of its batch is awaited, the model's
        generator is closed. ``stats()`` counts the request once, as the
        iteration ended.
        """
        async for out in self._stream(inputs, timeout, False, priority, parameters):
            yield out

    async def stream_batch(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> AsyncIterator[Outputs]:
        """Like :meth:`stream` for ``n >= 1`` samples at once (as
        :meth:`infer_batch`): each response has a leading dimension ``n``."""
        async for out in self._stream(inputs, timeout, True, priority, parameters):
            yield out

    async def _stream(
        self,
        inputs: Inputs,
        timeout: float | None,
        batched: bool,
        priority: int | None,
        parameters: Mapping[str, Parameter] | str | None,
        backlog: StreamBacklog | None = None,
        requested_outputs: int = 0,
        uncached: bool = False,
    ) -> AsyncGenerator[Any, None]:
        """``stream`` / ``stream_batch`` (``parameters``: a JSON object's
        text: the v2 front-ends pass on what a request carried, as they do
        ``requested_outputs`` and ``uncached``, see :meth:`_infer_with`;
        ``backlog``: the gRPC stream's the request answers on, else its own)."""
        tensordict = _is_tensordict(inputs)
        rows = _rows_of(inputs) if tensordict and batched else None
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            inputs = flatten_inputs(inputs, self._input_names if tensordict else None)
        responses = _Responses(StreamBacklog(self._server.max_stream_backlog) if backlog is None else backlog)
        future, rid = self._submitter.submit(
            inputs, timeout, batched, priority, parameters, responses, requested_outputs, uncached
        )
        del inputs
        future.add_done_callback(responses.wake)
        # A front-end that cannot write a response throws in what its caller
        # saw instead (see `ModelRepository.answer_streamed`): counted so.
        undelivered: FerrobatchError | None = None
        seen_to_the_end = False
        try:
            while True:
                while responses.items:
                    out = responses.popleft()
                    try:
                        yield _to_tensordict(out, rows) if tensordict else out
                    except FerrobatchError as exc:
                        undelivered = exc
                        raise
                if future.done():
                    seen_to_the_end = True
                    future.result()  # the end of the stream, or the error that ended it
                    return
                await responses.wait()
        finally:
            if not seen_to_the_end:
                # Left early, cancelled or undelivered: the request goes, and
                # counts as cancelled (or as `undelivered`), even if it ended
                # meanwhile: its caller did not see it end.
                self._withdraw(rid, future, undelivered)
            del future

    def _withdraw(self, rid: int, future: asyncio.Future[Outputs], error: FerrobatchError | None = None) -> None:
        """The awaiting task was cancelled (on the loop that submitted
        ``rid``); or, given ``error``, its caller saw that instead."""
        self._submitter.cancel(rid, future, error)

    def infer_sync(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """Blocking :meth:`infer`, for threads other than an event loop's.

        The calling thread queues the request itself and waits for its batch
        with the GIL released: no hop through the server's event loop. Ctrl-C
        withdraws a request no batch has taken yet. Calling it on a thread
        that runs an event loop raises ``RuntimeError`` (it would block that
        loop, and deadlock if it is the server's). ``priority`` and
        ``parameters`` as in :meth:`infer`.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "infer_sync() blocks and was called from a thread running an event loop; "
                "use `await client.infer(...)` there"
            )
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            if _is_tensordict(inputs):
                flat = flatten_inputs(inputs, self._input_names)
                return _to_tensordict(self._submitter.infer_blocking(flat, timeout, False, priority, parameters))
            inputs = flatten_inputs(inputs)
        return self._submitter.infer_blocking(inputs, timeout, False, priority, parameters)

    def stream_sync(
        self,
        inputs: Inputs,
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Iterator[Any]:
        """Blocking :meth:`stream`, for threads other than an event loop's:
        iterates a decoupled model's responses to one sample. The request is
        made on the server's event loop (``run_in_background`` or the loop
        ``start()`` ran on), and each response handed to this thread as it
        comes; leaving the loop early cancels the request, as in :meth:`stream`.
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "stream_sync() blocks and was called from a thread running an event loop; "
                "use `async for out in client.stream(...)` there"
            )
        loop = self._loop_token().native_token
        assert isinstance(loop, asyncio.AbstractEventLoop), "the server runs on asyncio"
        handed: queue.SimpleQueue[tuple[Any, int] | _Ended] = queue.SimpleQueue()
        # What is handed and not yet read counts too: this thread is the reader.
        backlog = StreamBacklog(self._server.max_stream_backlog)

        async def pump() -> None:
            try:
                async for out in self._stream(inputs, timeout, False, priority, parameters, backlog):
                    nbytes = response_bytes(out)
                    backlog.add(nbytes)
                    handed.put((out, nbytes))
            except BaseException as exc:  # this thread's to raise
                handed.put(_Ended(exc))
                raise
            handed.put(_Ended(None))

        pumping = asyncio.run_coroutine_threadsafe(pump(), loop)
        try:
            while not isinstance(item := handed.get(), _Ended):
                out, nbytes = item
                backlog.release(nbytes)
                yield out
            if item.error is not None:
                raise item.error
        finally:
            pumping.cancel()  # left early: the request is cancelled on its loop


class _Ended:
    """The end of a :meth:`Client.stream_sync` stream: ``error``, or None."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _Responses:
    """A streamed request's responses as its mailbox hands them over
    (``put_nowait``, on the loop thread), and a wait for the next one or the
    end (the request's future, whose callback is :meth:`wake`)."""

    __slots__ = ("_backlog", "_waiter", "items")

    def __init__(self, backlog: StreamBacklog) -> None:
        self.items: deque[tuple[Any, int]] = deque()
        self._backlog = backlog
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        """Raises :class:`StreamBacklogError` past the backlog's bound (the
        mailbox then fails the request, counted under ``queue_full``)."""
        nbytes = response_bytes(item)
        self._backlog.take(nbytes)
        self.items.append((item, nbytes))
        self.wake()

    def popleft(self) -> Any:
        item, nbytes = self.items.popleft()
        self._backlog.release(nbytes)
        return item

    def wake(self, _: object = None) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
