"""Per-event-loop request bookkeeping and the fan-out into it.

Each event loop that submits gets a ``LoopState``: its pending requests, its
counters, and a mailbox with a doorbell (an eventfd the loop watches with
``add_reader``). A worker posts each batch's outcome into the mailbox of every
loop it has requests from and rings once the GIL is released; the loop drains
all posted batches in one callback, resolving the futures in Rust. All of a
``LoopState`` except ``deliver`` and the ``*_threadsafe``/``close`` methods
runs on its loop's thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from . import _core
from .errors import (
    DeadlineExceededError,
    FerrobatchError,
    InvalidInputError,
    ModelError,
    QueueFullError,
    ServerClosedError,
)

# Failure reasons, as counted in Server.stats()["requests_failed"].
FAILURE_REASONS = (
    "invalid_input",
    "queue_full",
    "deadline_exceeded",
    "cancelled",
    "model_error",
    "server_closed",
)


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, InvalidInputError):
        return "invalid_input"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    if isinstance(exc, DeadlineExceededError):
        return "deadline_exceeded"
    if isinstance(exc, ServerClosedError):
        return "server_closed"
    return "model_error"


class LoopState:
    """One event loop's requests to one server: the Rust mailbox (pending
    tickets by id, counters, posted batches, doorbell) and failure counts.

    Counting rule: a request counts once, as what its caller saw. The
    outcome that resolves its future counts (a success in the Rust fan-out,
    a failure here); if the awaiting task is cancelled instead of seeing that
    outcome, ``cancel`` moves the count to ``cancelled``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_id: int, model_name: str) -> None:
        self.loop = loop
        self.loop_id = loop_id
        self.model_name = model_name
        # The mailbox must not hold this state (a cycle the collector cannot
        # see through the mailbox would keep both, and the doorbell's fds).
        this = weakref.ref(self)

        def on_error(routes: _core.Routes, error: BaseException) -> None:
            state = this()
            if state is not None:
                state._fail_batch(routes, error)

        self.mailbox = _core.LoopMailbox(loop_id, loop, on_error)
        self.pending: dict[int, _core.Ticket] = self.mailbox.pending
        self.counters = self.mailbox.counters  # successes, counted by the Rust fan-out
        self.failed: Counter[str] = Counter()
        # Successes the fan-out counted whose caller was cancelled before seeing them.
        self.successes_recounted = 0
        self._watching = _watch_doorbell(loop, self.mailbox)

    @property
    def succeeded(self) -> int:
        return self.counters.succeeded - self.successes_recounted

    # -- submit side (loop thread) -------------------------------------------------

    def count_failure(self, exc: FerrobatchError) -> None:
        self.failed[failure_reason(exc)] += 1

    def arm_timer(self, ticket: _core.Ticket, timeout: float) -> None:
        ticket.set_timer(self.loop.call_later(timeout, self.expire, ticket, timeout))

    def cancel(self, rid: int, future: asyncio.Future[Any]) -> None:
        """The task awaiting ``future`` (request ``rid``) was cancelled:
        withdraw the request if no batch took it, and count it as cancelled,
        whatever else may have resolved the future meanwhile."""
        ticket = self.pending.get(rid)
        if ticket is not None:
            ticket.cancel_timer()
            if ticket.withdraw("cancelled"):
                del self.pending[rid]  # never runs: its inputs may go
            # else: a batch took it; the ticket (and inputs) stay until it resolves.
        if not future.done():
            future.cancel()  # a late result is then dropped, uncounted
        elif not future.cancelled():
            # Resolved (and counted) in the same loop iteration the task was
            # cancelled: the caller saw the cancellation, not that outcome.
            error = future.exception()
            if error is None:
                self.successes_recounted += 1
            else:
                self.failed[failure_reason(error)] -= 1
        self.failed["cancelled"] += 1

    def expire(self, ticket: _core.Ticket, timeout: float) -> None:
        """The request's deadline passed (its timer fired)."""
        ticket.cancel_timer()  # already fired: only lets go of the handle
        future = ticket.future
        if future.done() or ticket.id not in self.pending:
            return
        if ticket.withdraw("expired"):
            del self.pending[ticket.id]
        future.set_exception(
            DeadlineExceededError(f"request to model '{self.model_name}' exceeded its {timeout}s timeout")
        )
        self.failed["deadline_exceeded"] += 1

    # -- fan-out (worker thread -> loop thread) --------------------------------------

    def deliver(
        self,
        worker: _core.Worker | None,
        routes: _core.Routes,
        outputs: dict[str, torch.Tensor] | None,
        error: BaseException | None,
    ) -> None:
        """Called on a worker thread: posts the batch's outcome for this loop.

        With ``worker``, the doorbell rings at its next ``next_batch`` (GIL
        released); without, at once. A loop without a doorbell is woken with
        ``call_soon_threadsafe``. Either way once per drain, not per batch.
        """
        if worker is not None:
            wake_here = worker.deliver(self.mailbox, routes, outputs, error)
        else:
            wake_here = self.mailbox.post(routes, outputs, error) and not self.mailbox.ring()
        if wake_here:
            try:
                self.loop.call_soon_threadsafe(self.mailbox.drain)
            except RuntimeError:
                pass  # the loop is closed: nobody is left to await these requests

    def _fail_batch(self, routes: _core.Routes, error: BaseException) -> None:
        """Fails this loop's requests of a batch whose model call (or fan-out)
        raised ``error``. Nothing here may leave a request unresolved: the
        message is made before any ticket is taken, and cannot raise."""
        message = _model_error_message(self.model_name, error)
        for rid, _, _ in routes.entries():
            ticket = self.pending.pop(rid, None)
            if ticket is None:
                continue
            ticket.cancel_timer()
            future = ticket.future
            if not future.done():
                exc = ModelError(message)
                exc.__cause__ = None if isinstance(error, ModelError) else error
                future.set_exception(exc)
                self.failed["model_error"] += 1

    def fail_all(self, message: str) -> None:
        """Fails every request still pending with ServerClosedError (loop thread)."""
        for rid, ticket in list(self.pending.items()):
            if ticket.withdraw("closed"):
                del self.pending[rid]
            future = ticket.future
            if future.done():
                continue
            ticket.cancel_timer()
            future.set_exception(ServerClosedError(message))
            self.failed["server_closed"] += 1

    def fail_all_threadsafe(self, message: str) -> None:
        self._on_loop(self.fail_all, message)

    def close(self) -> None:
        """Stops watching the doorbell (any thread); the mailbox closes its fds when freed."""
        if self._watching:
            self._watching = False
            fd = self.mailbox.doorbell_fd
            self._on_loop(self.loop.remove_reader, fd)

    def _on_loop(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            fn(*args)
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # closed loop: nothing awaits there any more


def _watch_doorbell(loop: asyncio.AbstractEventLoop, mailbox: _core.LoopMailbox) -> bool:
    """Gives ``mailbox`` a doorbell ``loop`` watches (on the loop's thread).
    False where the loop cannot watch file descriptors: the mailbox then has
    no doorbell, and ``call_soon_threadsafe`` wakes the loop instead."""
    if hasattr(os, "eventfd"):
        read_fd = write_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    else:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
    try:
        loop.add_reader(read_fd, mailbox.drain)
    except (NotImplementedError, OSError, RuntimeError):
        for fd in {read_fd, write_fd}:
            os.close(fd)
        return False
    # Nothing rings before this: the mailbox owns the fds from here.
    mailbox.set_doorbell(read_fd, write_fd, read_fd == write_fd)
    return True


def describe(error: BaseException) -> str:
    """``str(error)`` for a message, even when the exception's ``__str__`` raises."""
    try:
        return str(error)
    except BaseException:  # noqa: BLE001 - a message must never fail a request
        return f"<{type(error).__name__} whose str() raised>"


def _model_error_message(model_name: str, error: BaseException) -> str:
    if isinstance(error, ModelError):
        return f"model '{model_name}': {describe(error)}"
    return f"model '{model_name}' raised {type(error).__name__}: {describe(error)}"


class LoopRegistry:
    """Every event loop that submits to one server, by loop id.

    A loop's state (and its doorbell's fds) is dropped once the loop is
    closed and none of its requests is left in flight: each new loop sweeps
    the closed ones, so a program that runs ``asyncio.run`` again and again
    keeps one state at a time, not one per loop ever seen. The counts of the
    dropped states are kept in ``retired``.
    """

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._by_loop: dict[asyncio.AbstractEventLoop, LoopState] = {}
        self.by_id: dict[int, LoopState] = {}
        self._next_id = 0
        self.retired_succeeded = 0
        self.retired_request_ns = 0
        self.retired_failed: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def states(self) -> list[LoopState]:
        """The states of the loops not yet dropped."""
        return list(self.by_id.values())

    def close(self) -> None:
        """Stops every loop watching its doorbell (the server is going away)."""
        for state in self.states:
            state.close()

    def state_for(self, loop: asyncio.AbstractEventLoop) -> LoopState:
        state = self._by_loop.get(loop)
        if state is None:
            with self._lock:
                state = self._by_loop.get(loop)
                if state is None:
                    self._sweep_closed_loops()
                    if self._next_id > 0xFFFF_FFFF:
                        raise RuntimeError("too many event loops for one server")
                    state = LoopState(loop, self._next_id, self._model_name)
                    self._next_id += 1
                    self.by_id[state.loop_id] = state
                    self._by_loop[loop] = state
        return state

    def _sweep_closed_loops(self) -> None:
        """Drops the states of closed loops with nothing in flight (lock held)."""
        for state in list(self.by_id.values()):
            if not state.loop.is_closed():
                continue
            # Nobody can await these any more: withdraw what is still queued,
            # and settle batches delivered after the loop closed.
            for rid, ticket in list(state.pending.items()):
                if ticket.withdraw("closed"):
                    del state.pending[rid]
            if state.pending:
                try:
                    state.mailbox.drain()
                except Exception:  # noqa: BLE001 - futures of a closed loop refuse callbacks
                    pass
            if state.pending:
                continue  # a batch still holds some of its inputs: next sweep
            self.retired_succeeded += state.succeeded
            self.retired_request_ns += state.counters.request_ns
            self.retired_failed.update(state.failed)
            self.retired_failed["model_error"] += state.counters.failed_in_fan_out
            del self.by_id[state.loop_id]
            del self._by_loop[state.loop]
