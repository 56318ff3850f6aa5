"""Starting and stopping the served servers with an app's lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ..server import Server
from .protocol import ModelRepository


@contextlib.asynccontextmanager
async def serving(repository: ModelRepository, manage_servers: bool) -> AsyncIterator[None]:
    """While inside: the servers run. With ``manage_servers``, servers not yet
    running are started on entry and stopped (draining accepted requests) on
    exit; either way the endpoint reports not-ready once exit begins."""
    started: list[Server] = []
    try:
        if manage_servers:
            for server in repository.servers:
                if not server.running:
                    await server.start()
                    started.append(server)
        yield
    finally:
        repository.close()
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
        for server in reversed(started):
            await server.stop()
