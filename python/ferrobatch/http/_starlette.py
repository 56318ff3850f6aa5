"""The v2 REST API as a Starlette (ASGI) application."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from ..client import MAX_STREAM_BACKLOG
from ..server import Server
from ._endpoint import (
    HEADER_LENGTH,
    INFER_PATH,
    NOT_FOUND,
    REPEATED_CONTENT_ENCODING,
    REPEATED_HEADER_LENGTH,
    Call,
    Endpoint,
    Reply,
    _json,
    too_large,
)
from ._endpoint import Route as EndpointRoute
from ._lifecycle import serving, start_once, stop_at_loop_shutdown
from .protocol import MAX_BODY_SIZE, MAX_DECOMPRESSED_SIZE, ModelRepository

log = logging.getLogger("ferrobatch.http")


def _response(reply: Reply, closing: bool) -> Response:
    headers = reply.headers
    if closing:  # draining: the client should reconnect elsewhere
        headers["connection"] = "close"
    if reply.stream is not None:
        return _Streamed(reply, headers)
    return Response(reply.body, reply.status, headers)


class _Streamed(StreamingResponse):
    """A reply whose body goes on in ``reply.stream``, sent as it comes;
    closed however the response ends (a client that leaves ends the stream
    and its request)."""

    def __init__(self, reply: Reply, headers: dict[str, str]) -> None:
        assert reply.stream is not None
        self._stream = reply.stream
        chunks = self._chunks(reply.body, reply.stream) if reply.body else reply.stream
        super().__init__(chunks, reply.status, headers)

    @staticmethod
    async def _chunks(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        if first:
            yield first
        async for chunk in rest:
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.aclose()


_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_HEADER_LENGTH = HEADER_LENGTH.encode()


async def _cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any], gone: list[bool]) -> None:
    # The body is read: the next message is http.disconnect, if the client leaves.
    if (await receive())["type"] == "http.disconnect":
        gone.append(True)
        task.cancel()


class _V2Router(Router):
    """Starlette's router that answers ``POST .../infer`` itself in plain ASGI:
    inside the middleware stack (user middleware guards it as every route),
    but ahead of route matching and request/response objects, as it is the
    one route on the per-request hot path.

    With ``manage_servers`` and no lifespan (a mounted app gets none; nor
    does an ASGI server run with lifespan off), the first request starts the
    servers and they stop when the event loop shuts down (the end of
    ``asyncio.run``, as uvicorn runs); requests wait for that start, while
    the readiness routes answer 503 until it is done.
    """

    endpoint: Endpoint
    body_limit: int  # not max_body_size: Starlette's own limit takes that name
    manage_servers: bool
    lifespan_ran: bool = False
    _startup: asyncio.Task[None] | None = None
    _stopper: AsyncIterator[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.manage_servers and not self.lifespan_ran:
                self._start_lazily()
            if scope["method"] == "POST":
                path: str = scope["path"]
                root: str = scope.get("root_path", "")
                if root and path.startswith(root):  # mounted under a prefix
                    path = path[len(root) :]
                match = _INFER.fullmatch(path)
                if match is not None:
                    return await self._infer(match, scope, receive, send)
        await super().__call__(scope, receive, send)

    def _start_lazily(self) -> None:
        if self._startup is None:
            self._startup = asyncio.get_running_loop().create_task(self._start_servers())

    async def _start_servers(self) -> None:
        started: list[Server] = []
        # Held here: the loop tracks async generators only weakly.
        self._stopper = stop_at_loop_shutdown(self.endpoint.repository, started)
        await anext(self._stopper)
        log.info("ferrobatch: no lifespan ran (a mounted app?): starting the servers on first use")
        for server in self.endpoint.repository.servers:
            try:
                if await start_once(server):  # another app may be starting it: waits
                    started.append(server)
            except Exception:  # requests get 503 (not running)
                log.exception("ferrobatch: model '%s' failed to start", server.name)

    async def _infer(self, match: re.Match[str], scope: Scope, receive: Receive, send: Send) -> None:
        if self.endpoint.restrictions:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            refused = self.endpoint.refusal(INFER_PATH, headers)
            if refused is not None:
                return await self._send(refused, send)
        header_length = encoding = content_length = accept = None
        repeated: Reply | None = None
        for key, value in scope["headers"]:
            if key == _HEADER_LENGTH:
                if header_length is not None:
                    repeated = REPEATED_HEADER_LENGTH
                header_length = value.decode("latin-1")
            elif key == b"content-encoding":
                if encoding is not None:
                    repeated = repeated or REPEATED_CONTENT_ENCODING
                encoding = value.decode("latin-1")
            elif key == b"accept-encoding":
                accept = value.decode("latin-1")
            elif key == b"content-length":
                content_length = value
        limit = self.body_limit
        reply: Reply | None = None
        if content_length is not None and content_length.isdigit() and int(content_length) > limit:
            reply = too_large(int(content_length), limit)  # at once, before reading the body
        else:
            chunks: list[bytes] = []
            size = 0
            while True:
                message: Message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left: nobody to answer
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    reply = too_large(None, limit)
                    break
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if reply is None and repeated is not None:
            reply = repeated
        if reply is None:
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            # A client that leaves withdraws its request (counted cancelled), as
            # on the native front-end: nobody is left to take the answer.
            task = asyncio.current_task()
            assert task is not None
            gone: list[bool] = []
            watch = asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, task, gone))
            try:
                if self._startup is not None and not self._startup.done():
                    await asyncio.shield(self._startup)
                name, version = match.group(1), match.group(2) or ""
                reply = await self.endpoint.infer(name, version, body, header_length, encoding, accept)
            except asyncio.CancelledError:
                if not gone or task.uncancel():  # cancelled from elsewhere too
                    raise
                return
            finally:
                watch.cancel()
        await self._send(reply, send)

    async def _send(self, reply: Reply, send: Send) -> None:
        headers = [
            (b"content-type", reply.content_type.encode()),
            (b"content-length", str(len(reply.body)).encode()),
        ]
        if reply.header_length is not None:
            headers.append((_HEADER_LENGTH, str(reply.header_length).encode()))
        if reply.content_encoding is not None:
            headers += [(b"content-encoding", reply.content_encoding.encode()), (b"vary", b"accept-encoding")]
        if reply.close or self.endpoint.repository.closing:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})
        await send({"type": "http.response.body", "body": reply.body})


def starlette_app(
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
) -> Starlette:
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

    def handler(route: EndpointRoute) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            body = b""
            if route.method == "POST":  # POST .../infer does not come here: _V2Router._infer
                declared = request.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_body_size:
                    return _response(too_large(int(declared), max_body_size), True)
                chunks: list[bytes] = []
                size = 0
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > max_body_size:
                        return _response(too_large(None, max_body_size), True)
                    chunks.append(chunk)
                body = b"".join(chunks)
            call = Call(request.path_params, request.headers, body)
            return _response(await endpoint.answer(route, call), repository.closing)

        return handle

    # One Starlette route per entry of the endpoint's table, in its order.
    routes = [Route(r.path, handler(r), methods=[r.method]) for r in endpoint.routes]

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            reply = NOT_FOUND
        else:
            reply = _json(exc.status_code, {"error": f"{exc.detail}: {request.method} {request.url.path}"})
        return Response(reply.body, exc.status_code, {**reply.headers, **(exc.headers or {})})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        router.lifespan_ran = True
        async with serving(repository, manage_servers):
            yield

    # No trailing-slash redirects: .../infer/ is 404, as on the other front-ends.
    router = _V2Router(routes, redirect_slashes=False, lifespan=lifespan)
    router.endpoint = endpoint
    router.body_limit = max_body_size
    router.manage_servers = manage_servers
    app = Starlette(exception_handlers={404: refused, 405: refused})
    app.router = router
    app.state.ferrobatch = endpoint
    return app
