"""Per-event-loop request bookkeeping and the fan-out into it.

Each event loop that submits gets a ``LoopState``: its pending requests, its
counters, and the callback a worker schedules (once per batch, with one
``call_soon_threadsafe``) to resolve every request of that batch from that
loop. All of a ``LoopState`` except ``deliver`` runs on its loop's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
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


# A pending request: (future, ticket, deadline timer or None, batched).
# A plain tuple, because the Rust fan-out (Routes.resolve) reads it directly;
# the ticket keeps the request's inputs alive until it is resolved or withdrawn.
Pending = tuple[asyncio.Future[dict[str, Any]], _core.Ticket, asyncio.TimerHandle | None, bool]


class LoopState:
    def __init__(self, loop: asyncio.AbstractEventLoop, loop_id: int, model_name: str) -> None:
        self.loop = loop
        self.loop_id = loop_id
        self.model_name = model_name
        self.pending: dict[int, Pending] = {}
        self.counters = _core.LoopCounters()  # successes, counted by the Rust fan-out
        self.failed: Counter[str] = Counter()

    # -- submit side (loop thread) -------------------------------------------------

    def count_failure(self, exc: FerrobatchError) -> None:
        self.failed[failure_reason(exc)] += 1

    def cancel(self, rid: int) -> None:
        """The awaiting task was cancelled: withdraw the request if not yet taken."""
        p = self.pending.get(rid)
        if p is None:
            return
        future, ticket, timer, _ = p
        if timer is not None:
            timer.cancel()
        if ticket.withdraw("cancelled"):
            del self.pending[rid]  # never runs: its inputs may go
        self.failed["cancelled"] += 1

    def expire(self, rid: int, timeout: float) -> None:
        """The request's deadline passed (its timer fired)."""
        p = self.pending.get(rid)
        if p is None or p[0].done():
            return
        future, ticket, _, _ = p
        if ticket.withdraw("expired"):
            del self.pending[rid]
        # else: a batch took it; keep the ticket (and inputs) until it resolves.
        future.set_exception(
            DeadlineExceededError(f"request to model '{self.model_name}' exceeded its {timeout}s timeout")
        )
        self.failed["deadline_exceeded"] += 1

    # -- fan-out (worker thread -> loop thread) --------------------------------------

    def deliver(
        self,
        routes: _core.Routes,
        outputs: dict[str, torch.Tensor] | None,
        rows: dict[str, tuple[torch.Tensor, ...]] | None,
        error: BaseException | None,
    ) -> None:
        """Called on a worker thread: one wake-up of this loop for the whole batch."""
        try:
            if error is None:
                assert rows is not None and outputs is not None
                self.loop.call_soon_threadsafe(routes.resolve, self.pending, rows, outputs, self.counters)
            else:
                self.loop.call_soon_threadsafe(self._fail_batch, routes, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to await these requests

    def _fail_batch(self, routes: _core.Routes, error: BaseException) -> None:
        for rid, _, _ in routes.entries():
            p = self.pending.pop(rid, None)
            if p is None:
                continue
            future, _, timer, _ = p
            if timer is not None:
                timer.cancel()
            if not future.done():
                future.set_exception(_model_error(self.model_name, error))
                self.failed["model_error"] += 1

    def fail_all(self, message: str) -> None:
        """Fails every request still pending with ServerClosedError (loop thread)."""
        for rid, (future, ticket, timer, _) in list(self.pending.items()):
            if ticket.withdraw("closed"):
                del self.pending[rid]
            if future.done():
                continue
            if timer is not None:
                timer.cancel()
            future.set_exception(ServerClosedError(message))
            self.failed["server_closed"] += 1

    def fail_all_threadsafe(self, message: str) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.fail_all(message)
            return
        try:
            self.loop.call_soon_threadsafe(self.fail_all, message)
        except RuntimeError:
            pass  # closed loop: nothing awaits there any more


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
