"""The v2 REST API as a Starlette (ASGI) application."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Iterable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from ..server import Server
from ._endpoint import HEADER_LENGTH, Endpoint, Reply
from ._lifecycle import serving
from .protocol import ModelRepository


def _response(reply: Reply) -> Response:
    return Response(reply.body, reply.status, reply.headers)


_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_HEADER_LENGTH = HEADER_LENGTH.encode()


class V2App(Starlette):
    """A Starlette app that answers ``POST .../infer`` in plain ASGI, ahead of
    the middleware stack, router and request/response objects: the one route
    on the per-request hot path. Every other request goes through Starlette."""

    endpoint: Endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):  # mounted under a prefix
                path = path[len(root) :]
            match = _INFER.fullmatch(path)
            if match is not None:
                return await self._infer(match, scope, receive, send)
        await super().__call__(scope, receive, send)

    async def _infer(self, match: re.Match[str], scope: Scope, receive: Receive, send: Send) -> None:
        header_length = encoding = None
        for key, value in scope["headers"]:
            if key == _HEADER_LENGTH:
                header_length = value.decode("latin-1")
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
        chunks: list[bytes] = []
        while True:
            message: Message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        reply = await self.endpoint.infer(
            match.group(1), match.group(2) or "", body, header_length, encoding
        )
        headers = [
            (b"content-type", reply.content_type.encode()),
            (b"content-length", str(len(reply.body)).encode()),
        ]
        if reply.header_length is not None:
            headers.append((_HEADER_LENGTH, str(reply.header_length).encode()))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})


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
        ]  # POST .../infer: V2App._infer
    if metrics:
        routes.append(Route("/metrics", prometheus))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with serving(endpoint.repository, manage_servers):
            yield

    app = V2App(routes=routes, lifespan=lifespan)
    app.endpoint = endpoint
    app.state.ferrobatch = endpoint
    return app
