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
    :data:`CLOSED` until the server opens it again (a restart)."""

    def __init__(self, max_requests: int) -> None:
        self._requests: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=max(1, max_requests))
        self._boxes: dict[str, collections.deque[Any]] = {}
        self._arrived = asyncio.Condition()
        self._closed = False

    async def put(self, client: str, message: Any) -> bool:
        """Queues one request; False (and nothing queued) once closed."""
        if self._closed:
            return False
        await self._requests.put((client, message))
        return True

    async def take(self, max_items: int, timeout: float) -> list[tuple[str, Any]]:
        """Up to ``max_items`` requests: waits up to ``timeout`` seconds for the first."""
        taken: list[tuple[str, Any]] = []
        if self._requests.empty():
            if timeout <= 0:
                return taken
            try:
                taken.append(await asyncio.wait_for(self._requests.get(), timeout))
            except TimeoutError:
                return taken
        while len(taken) < max_items and not self._requests.empty():
            taken.append(self._requests.get_nowait())
        return taken

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
        self._closed = True
        left = []
        while not self._requests.empty():
            left.append(self._requests.get_nowait())
        async with self._arrived:
            self._arrived.notify_all()
        return left

    async def reopen(self) -> None:
        self._closed = False
        self._boxes.clear()


#: The actor class (no CPU of Ray's count: it only waits).
Mailbox: Any = ray.remote(num_cpus=0)(_Mailbox)
