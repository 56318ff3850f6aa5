"""Starting and stopping the served servers with an app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

from ..server import Server
from .protocol import ModelRepository

# The start in progress of each server: apps sharing a server (two mounted
# apps, two lifespans) wait for the one start instead of racing it.
_starts: weakref.WeakKeyDictionary[Server, asyncio.Task[None]] = weakref.WeakKeyDictionary()


async def start_once(server: Server) -> bool:
    """Starts ``server`` unless it runs or another caller is starting it (then
    waits for that start, and its error). True if this call started it."""
    task = _starts.get(server)
    if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
        await asyncio.shield(task)
        return False
    if server.running:
        return False
    task = asyncio.get_running_loop().create_task(server.start())
    _starts[server] = task
    await asyncio.shield(task)  # a cancelled waiter leaves the start to finish
    return True


@contextlib.asynccontextmanager
async def serving(repository: ModelRepository, manage_servers: bool) -> AsyncIterator[None]:
    """While inside: the servers run. With ``manage_servers``, servers not yet
    running are started on entry and stopped (draining accepted requests) on
    exit; either way the endpoint reports not-ready once exit begins, and
    serves again if the lifespan runs again (a second TestClient session, a
    second AppRunner over the same app)."""
    started: list[Server] = []
    repository.reopen()
    try:
        if manage_servers:
            for server in repository.servers:
                if await start_once(server):
                    started.append(server)
        yield
    finally:
        repository.close()
        await repository.stop_loaded()  # those a client's load started, or an unload is stopping
        for server in reversed(started):
            await server.stop()


async def stop_at_loop_shutdown(repository: ModelRepository, started: list[Server]) -> AsyncIterator[None]:
    """Once advanced to its ``yield``, waits there until the event loop closes
    its async generators (``loop.shutdown_asyncgens()``, which ``asyncio.run``
    calls on the way out), then stops the servers in ``started``: the only
    end-of-loop hook an app without a lifespan has. Keep a reference to it:
    the loop holds async generators weakly."""
    try:
        yield
    finally:
        repository.close()
        await repository.stop_loaded()  # those a client's load started, or an unload is stopping
        for server in reversed(started):
            await server.stop()
