"""The v2 REST API as an aiohttp application (usable as a sub-application)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ..server import Server
from ._endpoint import HEADER_LENGTH, Endpoint, Reply, error_reply, too_large
from ._lifecycle import serving
from .protocol import MAX_BODY_SIZE, MAX_DECOMPRESSED_SIZE, ModelRepository, ProtocolError

#: Where the app keeps its :class:`Endpoint` (``app[ENDPOINT_KEY]``).
ENDPOINT_KEY = web.AppKey("ferrobatch_endpoint", Endpoint)


def aiohttp_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
    expose_errors: bool | None = None,
    max_body_size: int = MAX_BODY_SIZE,
    max_decompressed_size: int = MAX_DECOMPRESSED_SIZE,
) -> web.Application:
    endpoint = Endpoint(servers, expose_errors=expose_errors, max_decompressed_size=max_decompressed_size)
    repository = endpoint.repository

    def _response(reply: Reply) -> web.Response:
        response = web.Response(body=reply.body, status=reply.status, headers=reply.headers)
        if reply.close or repository.closing:  # draining: reconnect elsewhere
            response.force_close()
        return response

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
        length = request.content_length
        if length is not None and length > max_body_size:
            return _response(too_large(length, max_body_size))  # at once, before reading the body
        # aiohttp undoes a gzip or deflate Content-Encoding as it reads, in
        # bounded steps: what arrives here is decompressed.
        encoded = request.headers.get("content-encoding", "identity").lower() != "identity"
        limit = max_decompressed_size if encoded else max_body_size
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    what = "decompressed request body" if encoded else "request body"
                    return _response(too_large(None, limit, what))
                chunks.append(chunk)
        except RequestPayloadError as exc:
            refused = error_reply(ProtocolError(400, f"unreadable request body: {exc}"))
            # The rest of the body cannot be read: the connection closes.
            return _response(dataclasses.replace(refused, close=True))
        reply = await endpoint.infer(
            m["name"], m.get("version", ""), b"".join(chunks), request.headers.get(HEADER_LENGTH)
        )
        return _response(reply)

    async def prometheus(request: web.Request) -> web.Response:
        return _response(endpoint.metrics())

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        async with serving(endpoint.repository, manage_servers):
            yield

    # The limits are checked above; aiohttp's own (on what it decompressed)
    # only backs them up.
    app = web.Application(client_max_size=max(max_body_size, max_decompressed_size))
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
