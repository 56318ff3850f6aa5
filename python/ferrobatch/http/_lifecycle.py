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
