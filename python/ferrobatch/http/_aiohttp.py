"""The v2 REST API as an aiohttp application (usable as a sub-application)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from .._core import clipped
from ..client import MAX_STREAM_BACKLOG
from ..server import Server
from . import AIOHTTP_HANDLER_ARGS
from ._endpoint import (
    HEADER_LENGTH,
    INFER,
    INFER_PATH,
    NOT_FOUND,
    REPEATED_CONTENT_ENCODING,
    REPEATED_HEADER_LENGTH,
    Call,
    Endpoint,
    Reply,
    Route,
    _json,
    error_reply,
    too_large,
)
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
    http_restricted_api: Sequence[str] = (),
    allow_client_shm: bool = False,
    max_stream_backlog: int = MAX_STREAM_BACKLOG,
) -> web.Application:
    endpoint = Endpoint(
        servers,
        expose_errors=expose_errors,
        max_decompressed_size=max_decompressed_size,
        metrics=metrics,
        http_restricted_api=http_restricted_api,
        allow_client_shm=allow_client_shm,
        max_stream_backlog=max_stream_backlog,
    )
    repository = endpoint.repository

    def _response(reply: Reply) -> web.Response:
        return to_response(reply, closing=repository.closing)

    async def expect(request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: a declared body over the limit gets its
        413 instead of an invitation to send it."""
        length = request.content_length
        if length is not None and length > max_body_size:
            return _response(too_large(length, max_body_size))
        if request.version >= (1, 1) and request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def answering(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await read_body(request, max_body_size) if route.method == "POST" else b""
            if isinstance(body, Reply):
                return _response(body)
            call = Call(dict(request.match_info), request.headers, body)
            reply = await endpoint.answer(route, call)
            if reply.stream is not None:
                return await streamed(request, reply, closing=repository.closing)
            return _response(reply)

        return handle

    async def infer(request: web.Request) -> web.Response:
        refused = endpoint.refusal(INFER_PATH, request.headers)
        if refused is not None:
            return _response(refused)
        m = request.match_info
        body = await read_body(request, max_body_size)
        if isinstance(body, Reply):
            return _response(body)
        headers = request.headers
        lengths = headers.getall(HEADER_LENGTH, ())
        if len(lengths) > 1:  # which one counts would be a guess
            return _response(REPEATED_HEADER_LENGTH)
        if len(headers.getall("content-encoding", ())) > 1:
            return _response(REPEATED_CONTENT_ENCODING)
        reply = await endpoint.infer(
            m["name"],
            m.get("version", ""),
            body,
            lengths[0] if lengths else None,
            headers.get("content-encoding"),  # inflated (or refused) by the shared Rust code
            headers.get("accept-encoding"),
        )
        return _response(reply)

    @web.middleware
    async def json_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
        """404 and 405 as JSON errors, as the other front-ends answer them."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 404:
                reply = NOT_FOUND
            elif exc.status == 405:
                reply = _json(405, {"error": f"Method Not Allowed: {clipped(request.method)} {clipped(request.path)}"})
            else:
                raise
            response = _response(reply)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        async with serving(endpoint.repository, manage_servers):
            yield

    # The limit is checked above; aiohttp's own only backs it up. Bodies come
    # as sent (Content-Encoding is undone by Endpoint.infer, as on the other
    # front-ends), and a client that leaves cancels its handler, withdrawing
    # its request. As a sub-app, the parent's server settings count instead.
    app = web.Application(client_max_size=max_body_size, handler_args=AIOHTTP_HANDLER_ARGS)
    app[ENDPOINT_KEY] = endpoint
    # One aiohttp route per entry of the endpoint's table, in its order; GET
    # routes answer HEAD too. POST .../infer reads its body in bounded steps.
    for route in endpoint.routes:
        if route.handler is INFER:
            app.router.add_post(route.path, infer, expect_handler=expect)
        elif route.method == "GET":
            app.router.add_get(route.path, answering(route))
        else:
            app.router.add_route(route.method, route.path, answering(route), expect_handler=expect)
    app.middlewares.append(json_refusals)
    app.cleanup_ctx.append(lifespan)
    return app


def to_response(reply: Reply, *, closing: bool) -> web.Response:
    """``reply`` for aiohttp; the connection closes when it says so or the
    server is ``closing`` (draining: reconnect elsewhere)."""
    response = web.Response(body=reply.body, status=reply.status, headers=reply.headers)
    if reply.close or closing:
        response.force_close()
    return response


async def streamed(request: web.BaseRequest, reply: Reply, *, closing: bool) -> web.StreamResponse:
    """Sends ``reply`` whose body goes on in ``reply.stream``, chunk by chunk
    as it comes; a client that leaves ends the stream (and its request)."""
    assert reply.stream is not None
    response = web.StreamResponse(status=reply.status, headers=reply.headers)
    if reply.close or closing:
        response.force_close()
    try:
        await response.prepare(request)
        if reply.body:
            await response.write(reply.body)
        async for chunk in reply.stream:
            await response.write(chunk)
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left: nothing more to send it
    finally:
        await reply.stream.aclose()
    return response


async def read_body(request: web.BaseRequest, max_body_size: int) -> bytes | Reply:
    """The body as sent (aiohttp inflates nothing: ``auto_decompress`` is
    off), read in bounded steps, or the reply that refuses it."""
    length = request.content_length
    if length is not None and length > max_body_size:
        return too_large(length, max_body_size)  # at once, before reading the body
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.readany():
            size += len(chunk)
            if size > max_body_size:
                return too_large(None, max_body_size)
            chunks.append(chunk)
    except (RequestPayloadError, ConnectionResetError) as exc:  # a bad body, or the client left
        refused = error_reply(ProtocolError(400, f"unreadable request body: {exc}"))
        # The rest of the body cannot be read: the connection closes.
        return dataclasses.replace(refused, close=True)
    return b"".join(chunks)
