"""The caller's side: ``await client.infer(...)`` and ``client.infer_sync(...)``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import torch

from ._loops import LoopState
from .errors import FerrobatchError, ServerClosedError

if TYPE_CHECKING:
    from .server import Server

__all__ = ["Client"]

_get_running_loop = asyncio.get_running_loop

Inputs = dict[str, Any]
Outputs = dict[str, torch.Tensor]


class Client:
    """Submits requests to a :class:`~ferrobatch.Server`; get one with ``server.client()``.

    A client may be shared by any number of tasks, event loops and threads.
    """

    __slots__ = ("_server", "_cached")

    def __init__(self, server: Server) -> None:
        self._server = server
        # (loop, state) of the last loop seen: one tuple, so threads never see a torn pair.
        self._cached: tuple[asyncio.AbstractEventLoop | None, LoopState | None] = (None, None)

    @property
    def server(self) -> Server:
        return self._server

    def _state_for(self, loop: asyncio.AbstractEventLoop) -> LoopState:
        state = self._server._loops.state_for(loop)
        self._cached = (loop, state)
        return state

    async def infer(self, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """Runs one sample through the model, batched with other callers'.

        ``inputs`` maps every input name to one sample of its declared dtype and
        shape (a torch CPU tensor, a numpy array, or any buffer-protocol or
        DLPack object). Returns ``{output name: tensor of the output's shape}``.

        Raises at once :class:`InvalidInputError` (bad input; never queued),
        :class:`QueueFullError` or :class:`ServerClosedError`; later
        :class:`DeadlineExceededError` once ``timeout`` seconds pass,
        :class:`ModelError` if the batch's model call failed, or
        :class:`ServerClosedError` if the server stopped first. Cancelling the
        awaiting task withdraws the request if no batch has taken it yet.
        The inputs must not be modified until this returns.
        """
        state, future, rid = self._submit(inputs, timeout, False)
        try:
            return await future
        except asyncio.CancelledError:
            state.cancel(rid)
            raise

    async def infer_batch(self, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """Like :meth:`infer` for ``n >= 1`` samples at once: every input has a
        leading dimension ``n`` (at most ``max_batch_size``), and so does every
        output. The rows join a batch together and are never split."""
        state, future, rid = self._submit(inputs, timeout, True)
        try:
            return await future
        except asyncio.CancelledError:
            state.cancel(rid)
            raise

    def _submit(
        self, inputs: Inputs, timeout: float | None, batched: bool
    ) -> tuple[LoopState, asyncio.Future[Outputs], int]:
        # The per-request path: one call into Rust, which queues the request,
        # makes its future and registers its ticket with this loop's mailbox.
        # The caller keeps the future and id, never the ticket: a failed
        # future's traceback holds the caller's frame, and the ticket (which
        # the cycle collector does not see) holds the future.
        loop = _get_running_loop()
        cached_loop, state = self._cached
        if cached_loop is not loop or state is None:
            state = self._state_for(loop)
        batcher = self._server._accepting
        if batcher is None:
            raise self._server._not_running()
        try:
            ticket = batcher.submit(inputs, state.mailbox, timeout, batched)
        except FerrobatchError as exc:
            state.count_failure(exc)
            raise
        if timeout is not None:
            state.arm_timer(ticket, timeout)
        return state, ticket.future, ticket.id

    def infer_sync(self, inputs: Inputs, timeout: float | None = None) -> Outputs:
        """Blocking :meth:`infer`, for threads other than the event loop's.

        Calling it on a thread that runs an event loop raises ``RuntimeError``
        (it would block that loop, and deadlock if it is the server's).
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
        token = self._server._loop_token()
        try:
            return anyio.from_thread.run(self.infer, inputs, timeout, token=token)
        except anyio.RunFinishedError:
            raise ServerClosedError(f"server '{self._server.name}' is not running") from None
