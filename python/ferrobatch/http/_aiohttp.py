"""The v2 REST API as an aiohttp application (usable as a sub-application)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ..server import Server
from ._endpoint import HEADER_LENGTH, Endpoint, Reply, error_reply
from ._lifecycle import serving
from .protocol import ModelRepository, ProtocolError

#: Where the app keeps its :class:`Endpoint` (``app[ENDPOINT_KEY]``).
ENDPOINT_KEY = web.AppKey("ferrobatch_endpoint", Endpoint)


def _response(reply: Reply) -> web.Response:
    return web.Response(body=reply.body, status=reply.status, headers=reply.headers)


def aiohttp_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
    max_body_size: int = 64 * 1024 * 1024,
) -> web.Application:
    endpoint = Endpoint(servers)

    async def live(request: web.Request) -> web.Response:
        return _response(endpoint.live())

    async def ready(request: web.Request) -> web.Response:
        return _response(endpoint.ready())

    async def server_metadata(request: web.Request) -> web.Response:
        return _response(endpoint.server_metadata())

    async def model_metadata(request: web.Request) -> web.Response:
        m = request.match_info
        return _response(endpoint.model_metadata(m["name"], m.get("version", "")))

    async def model_ready(request: web.Request) -> web.Response:
        m = request.match_info
        return _response(endpoint.model_ready(m["name"], m.get("version", "")))

    async def model_config(request: web.Request) -> web.Response:
        m = request.match_info
        return _response(endpoint.model_config(m["name"], m.get("version", "")))

    async def infer(request: web.Request) -> web.Response:
        m = request.match_info
        try:
            # aiohttp has already undone a gzip or deflate Content-Encoding.
            body = await request.read()
        except RequestPayloadError as exc:
            return _response(error_reply(ProtocolError(400, f"unreadable request body: {exc}")))
        reply = await endpoint.infer(
            m["name"], m.get("version", ""), body, request.headers.get(HEADER_LENGTH)
        )
        return _response(reply)

    async def prometheus(request: web.Request) -> web.Response:
        return _response(endpoint.metrics())

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        async with serving(endpoint.repository, manage_servers):
            yield

    app = web.Application(client_max_size=max_body_size)
    app[ENDPOINT_KEY] = endpoint
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_metadata)
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.router.add_get(prefix, model_metadata)
        app.router.add_get(prefix + "/ready", model_ready)
        app.router.add_get(prefix + "/config", model_config)
        app.router.add_post(prefix + "/infer", infer)
    if metrics:
        app.router.add_get("/metrics", prometheus)
    app.cleanup_ctx.append(lifespan)
    return app
