"""Vertex AI's prediction endpoint (Triton's ``--allow-vertex-ai``): a port
of its own whose two routes, named by Vertex AI's ``AIP_PREDICT_ROUTE`` and
``AIP_HEALTH_ROUTE`` (regular expressions, matched whole), map onto the v2
API:

- the health route answers as ``/v2/health/ready``;
- the predict route infers the default model (a v2 inference request, JSON
  or binary; a binary body says its JSON part's length in its content type,
  ``application/vnd.vertex-ai-triton.binary+json;json-header-size=N``), or,
  with ``X-Vertex-Ai-Triton-Redirect: v2/...``, answers that v2 path
  instead (POST only: Vertex AI sends nothing else; a path that is read
  with GET is read so);
- any other path is a 400.

Every answer comes from the same :class:`Endpoint` handlers as the Python
front-end's, on the server's event loop (aiohttp's low-level server).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from aiohttp import web

from . import AIOHTTP_HANDLER_ARGS
from ._aiohttp import read_body, to_response
from ._endpoint import HEADER_LENGTH, Endpoint, Reply, _json
from .protocol import ProtocolError

if TYPE_CHECKING:
    from ..serve import VertexAI

#: A binary request's content type, followed by the length of its JSON part.
BINARY_TYPE = "application/vnd.vertex-ai-triton.binary+json;json-header-size="
#: The header naming another v2 path for the predict route to answer.
REDIRECT_HEADER = "X-Vertex-Ai-Triton-Redirect"


class VertexListener:
    """Vertex AI's endpoint on ``host:port``, answered by ``endpoint``."""

    def __init__(self, endpoint: Endpoint, vertex: VertexAI, *, max_body_size: int) -> None:
        self.endpoint = endpoint
        self.model = vertex.check([s.name for s in endpoint.repository.servers])
        self._predict = re.compile(vertex.predict_route)
        self._health = re.compile(vertex.health_route)
        self._max_body_size = max_body_size
        self._runner = web.ServerRunner(web.Server(self._handle, **AIOHTTP_HANDLER_ARGS))
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        """Listens (``OSError`` if it cannot)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        self.port = int(self._runner.addresses[0][1])  # the one picked, for port 0

    async def close(self) -> None:
        """Stops listening; requests being answered finish first."""
        await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        closing = self.endpoint.repository.closing
        return to_response(await self._answer(request), closing=closing)

    async def _answer(self, request: web.BaseRequest) -> Reply:
        path = request.path
        if self._health.fullmatch(path):
            return await self.endpoint.dispatch(request.method, "/v2/health/ready", {}, b"")
        if not self._predict.fullmatch(path):
            return _json(400, {"error": f"Vertex AI: {path!r} is neither the predict nor the health route"})
        redirect = request.headers.get(REDIRECT_HEADER)
        if request.method != "POST":
            allow = "POST"
            return Reply(405, _json(405, {"error": f"Vertex AI's predict route takes {allow}"}).body, allow=allow)
        body = await read_body(request, self._max_body_size)
        if isinstance(body, Reply):
            return body
        headers = dict(request.headers)
        try:
            _binary_header_length(headers)
        except ProtocolError as exc:
            return _json(exc.status, {"error": str(exc)})
        if redirect is None:
            return await self.endpoint.dispatch("POST", f"/v2/models/{self.model}/infer", headers, body)
        target = "/" + redirect.lstrip("/")
        reply = await self.endpoint.dispatch("POST", target, headers, body)
        if reply.status == 405 and reply.allow is not None and "GET" in reply.allow.split(", "):
            reply = await self.endpoint.dispatch("GET", target, headers, b"")  # a read: Vertex AI only POSTs
        return reply


def _binary_header_length(headers: dict[str, str]) -> None:
    """A binary body's JSON length, from its Vertex AI content type, becomes
    the v2 ``Inference-Header-Content-Length`` (in ``headers``)."""
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    at = content_type.find(BINARY_TYPE)
    if at < 0:
        return
    if at > 0:
        raise ProtocolError(400, f"a binary request's content type starts with {BINARY_TYPE!r}")
    given = content_type[len(BINARY_TYPE) :].strip()
    if not given.isdigit():
        raise ProtocolError(400, f"json-header-size must be a whole number, got {given[:40]!r}")
    for key in [k for k in headers if k.lower() == HEADER_LENGTH.lower()]:
        del headers[key]
    headers[HEADER_LENGTH] = given
