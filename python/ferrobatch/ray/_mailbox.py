"""The control channel of ``ferrobatch.torchrl.RayTransport``: one Ray actor
per transport that carries what does not ride shared memory (the requests
sent before the server shares itself, those of clients on other nodes or
past their process's shared cells, and the model's exceptions, pickled) and
each client's answers to them.

TorchRL's ``RayTransport`` starts a ``ray.util.queue.Queue`` actor for its
requests and another for each client's answers; here one asyncio actor
holds the request queue and every client's answer box, and each side
long-polls it (one call brings every message waiting).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import ray

__all__ = ["CLOSED", "Mailbox"]

#: What a client's poll brings once the server has closed the transport.
CLOSED = "ferrobatch.closed"


class _Mailbox:
    """Requests ``(client, message)`` in arrival order, bounded by
    ``max_requests`` (a sender waits for room); each client's answers in
    its own box. Closing answers every waiting and later poll with
    :data:`CLOSED` until the server opens it again (a restart).

    A sender finding the queue full is told so at once and sends again
    later (:class:`ferrobatch.torchrl`'s client backs off): a call waiting
    here for room would hold one of the actor's calls at a time, and a
    thousand of them would leave none for the server's ``take``, which
    makes the room."""

    def __init__(self, max_requests: int) -> None:
        self._requests: collections.deque[tuple[str, Any]] = collections.deque()
        self._max_requests = max(1, max_requests)
        self._boxes: dict[str, collections.deque[Any]] = {}
        self._arrived = asyncio.Condition()  # an answer, or the close
        self._queue = asyncio.Condition()  # a request, room for one, or the close
        self._closed = False

    async def put(self, client: str, message: Any) -> bool | None:
        """Queues one request: True; False (nothing queued) once closed;
        None (nothing queued) while the queue is full: send it again later."""
        async with self._queue:
            if self._closed:
                return False
            if len(self._requests) >= self._max_requests:
                return None
            self._requests.append((client, message))
            self._queue.notify_all()
            return True

    async def take(self, max_items: int, timeout: float) -> list[tuple[str, Any]]:
        """Up to ``max_items`` requests: waits up to ``timeout`` seconds for the first."""
        async with self._queue:
            if not self._requests and timeout > 0:
                try:
                    await asyncio.wait_for(self._queue.wait_for(lambda: bool(self._requests)), timeout)
                except TimeoutError:
                    return []
            return [self._requests.popleft() for _ in range(min(max_items, len(self._requests)))]

    async def answer(self, client: str, message: Any) -> None:
        async with self._arrived:
            self._boxes.setdefault(client, collections.deque()).append(message)
            self._arrived.notify_all()

    async def answers(self, client: str, timeout: float) -> list[Any]:
        """Every answer waiting for ``client`` (up to ``timeout`` seconds for
        the first); ``[CLOSED]`` once closed and none is left."""
        async with self._arrived:
            try:
                await asyncio.wait_for(
                    self._arrived.wait_for(lambda: bool(self._boxes.get(client)) or self._closed), timeout
                )
            except TimeoutError:
                return []
            box = self._boxes.pop(client, None)
            return list(box) if box else [CLOSED]

    async def close(self) -> list[tuple[str, Any]]:
        """Closes; returns the requests still queued (for the server to fail)."""
        async with self._queue:
            self._closed = True
            left = list(self._requests)
            self._requests.clear()
        async with self._arrived:
            self._arrived.notify_all()
        return left

    async def reopen(self) -> None:
        """Opens again (a restart). Answers not yet read stay: those the
        server sent as it closed are their clients' (their requests' ends)."""
        self._closed = False


#: The actor class (no CPU of Ray's count: it only waits).
Mailbox: Any = ray.remote(num_cpus=0)(_Mailbox)
