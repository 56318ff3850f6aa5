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
    tickets by id, counters, posted batches, doorbell) and failure counts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, loop_id: int, model_name: str) -> None:
        self.loop = loop
        self.loop_id = loop_id
        self.model_name = model_name
        self.mailbox = _core.LoopMailbox(loop_id, loop, self._fail_batch)
        self.pending: dict[int, _core.Ticket] = self.mailbox.pending
        self.counters = self.mailbox.counters  # successes, counted by the Rust fan-out
        self.failed: Counter[str] = Counter()
        self._watching = _watch_doorbell(loop, self.mailbox)

    # -- submit side (loop thread) -------------------------------------------------

    def count_failure(self, exc: FerrobatchError) -> None:
        self.failed[failure_reason(exc)] += 1

    def arm_timer(self, ticket: _core.Ticket, timeout: float) -> None:
        ticket.set_timer(self.loop.call_later(timeout, self.expire, ticket, timeout))

    def cancel(self, rid: int) -> None:
        """The awaiting task was cancelled: withdraw the request if not yet taken."""
        ticket = self.pending.get(rid)
        if ticket is None:
            return  # already resolved
        ticket.cancel_timer()
        if ticket.withdraw("cancelled"):
            del self.pending[rid]  # never runs: its inputs may go
        # else: a batch took it; the ticket (and inputs) stay until it resolves.
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
        for rid, _, _ in routes.entries():
            ticket = self.pending.pop(rid, None)
            if ticket is None:
                continue
            ticket.cancel_timer()
            future = ticket.future
            if not future.done():
                future.set_exception(_model_error(self.model_name, error))
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


def _model_error(model_name: str, error: BaseException) -> ModelError:
    if isinstance(error, ModelError):
        return ModelError(f"model '{model_name}': {error}")
    exc = ModelError(f"model '{model_name}' raised {type(error).__name__}: {error}")
    exc.__cause__ = error
    return exc


class LoopRegistry:
    """Every event loop that has submitted to one server, by loop id."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._by_loop: dict[asyncio.AbstractEventLoop, LoopState] = {}
        self.states: list[LoopState] = []
        self._lock = threading.Lock()

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
                    state = LoopState(loop, len(self.states), self._model_name)
                    self.states.append(state)
                    self._by_loop[loop] = state
        return state
