"""The v2 REST API as a Starlette (ASGI) application."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..server import Server
from ._endpoint import HEADER_LENGTH, Endpoint, Reply
from ._lifecycle import serving
from .protocol import ModelRepository


def _response(reply: Reply) -> Response:
    return Response(reply.body, reply.status, reply.headers)


def starlette_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
) -> Starlette:
    endpoint = Endpoint(servers)

    async def live(request: Request) -> Response:
        return _response(endpoint.live())

    async def ready(request: Request) -> Response:
        return _response(endpoint.ready())

    async def server_metadata(request: Request) -> Response:
        return _response(endpoint.server_metadata())

    async def model_metadata(request: Request) -> Response:
        p = request.path_params
        return _response(endpoint.model_metadata(p["name"], p.get("version", "")))

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        return _response(endpoint.model_ready(p["name"], p.get("version", "")))

    async def model_config(request: Request) -> Response:
        p = request.path_params
        return _response(endpoint.model_config(p["name"], p.get("version", "")))

    async def infer(request: Request) -> Response:
        p = request.path_params
        headers = request.headers
        reply = await endpoint.infer(
            p["name"],
            p.get("version", ""),
            await request.body(),
            headers.get(HEADER_LENGTH),
            headers.get("content-encoding"),
        )
        return _response(reply)

    async def prometheus(request: Request) -> Response:
        return _response(endpoint.metrics())

    routes = [
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route("/v2", server_metadata),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, model_metadata),
            Route(prefix + "/ready", model_ready),
            Route(prefix + "/config", model_config),
            Route(prefix + "/infer", infer, methods=["POST"]),
        ]
    if metrics:
        routes.append(Route("/metrics", prometheus))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with serving(endpoint.repository, manage_servers):
            yield

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.ferrobatch = endpoint
    return app
