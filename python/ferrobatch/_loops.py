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
from time import perf_counter_ns
from typing import Any

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


class Pending:
    """A request awaiting its result. The ticket keeps its inputs alive."""

    __slots__ = ("future", "ticket", "timer", "batched", "started_ns")

    def __init__(
        self,
        future: asyncio.Future[dict[str, Any]],
        ticket: _core.Ticket,
        timer: asyncio.TimerHandle | None,
        batched: bool,
    ) -> None:
        self.future = future
        self.ticket = ticket
        self.timer = timer
        self.batched = batched
        self.started_ns = perf_counter_ns()


class LoopState:
    def __init__(self, loop: asyncio.AbstractEventLoop, loop_id: int, model_name: str) -> None:
        self.loop = loop
        self.loop_id = loop_id
        self.model_name = model_name
        self.pending: dict[int, Pending] = {}
        self.succeeded = 0
        self.failed: Counter[str] = Counter()
        self.request_ns = 0  # sum of submit-to-result times of succeeded requests

    # -- submit side (loop thread) -------------------------------------------------

    def submit(
        self, batcher: _core.Batcher, inputs: Any, timeout: float | None, batched: bool
    ) -> tuple[int, asyncio.Future[dict[str, Any]]]:
        try:
            ticket = batcher.submit(inputs, self.loop_id, timeout, batched)
        except FerrobatchError as exc:
            self.failed[failure_reason(exc)] += 1
            raise
        future = self.loop.create_future()
        rid = ticket.id
        timer = None
        if timeout is not None:
            timer = self.loop.call_later(timeout, self._expire, rid, timeout)
        self.pending[rid] = Pending(future, ticket, timer, batched)
        return rid, future

    def cancel(self, rid: int) -> None:
        """The awaiting task was cancelled: withdraw the request if not yet taken."""
        p = self.pending.get(rid)
        if p is None:
            return
        if p.timer is not None:
            p.timer.cancel()
        if p.ticket.withdraw("cancelled"):
            del self.pending[rid]  # never runs: its inputs may go
        self.failed["cancelled"] += 1

    def _expire(self, rid: int, timeout: float) -> None:
        p = self.pending.get(rid)
        if p is None or p.future.done():
            return
        if p.ticket.withdraw("expired"):
            del self.pending[rid]
        # else: a batch took it; keep the ticket (and inputs) until it resolves.
        p.future.set_exception(
            DeadlineExceededError(f"request to model '{self.model_name}' exceeded its {timeout}s timeout")
        )
        self.failed["deadline_exceeded"] += 1

    # -- fan-out (worker thread -> loop thread) --------------------------------------

    def deliver(
        self,
        routes: _core.Routes,
        outputs: dict[str, Any] | None,
        rows: dict[str, tuple[Any, ...]] | None,
        error: BaseException | None,
    ) -> None:
        """Called on a worker thread: one wake-up of this loop for the whole batch."""
        try:
            self.loop.call_soon_threadsafe(self._resolve, routes, outputs, rows, error)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to await these requests

    def _resolve(
        self,
        routes: _core.Routes,
        outputs: dict[str, Any] | None,
        rows: dict[str, tuple[Any, ...]] | None,
        error: BaseException | None,
    ) -> None:
        pending = self.pending
        now = perf_counter_ns()
        for rid, start, n in routes.entries():
            p = pending.pop(rid, None)
            if p is None:
                continue
            if p.timer is not None:
                p.timer.cancel()
            future = p.future
            if future.done():
                continue  # cancelled or past its deadline: already resolved
            if error is not None:
                future.set_exception(_model_error(self.model_name, error))
                self.failed["model_error"] += 1
                continue
            assert outputs is not None and rows is not None
            if p.batched:
                result = {name: out[start : start + n] for name, out in outputs.items()}
            else:
                result = {name: r[start] for name, r in rows.items()}
            future.set_result(result)
            self.succeeded += 1
            self.request_ns += now - p.started_ns

    def fail_all(self, message: str) -> None:
        """Fails every request still pending with ServerClosedError (loop thread)."""
        for rid, p in list(self.pending.items()):
            never_runs = p.ticket.withdraw("closed")
            if never_runs:
                del self.pending[rid]
            if p.future.done():
                continue
            if p.timer is not None:
                p.timer.cancel()
            p.future.set_exception(ServerClosedError(message))
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
