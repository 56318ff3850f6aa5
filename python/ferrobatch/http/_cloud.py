"""Cloud platforms' prediction endpoints, as Triton serves them: each on a
port of its own, mapping the platform's routes onto the v2 API.

Vertex AI (Triton's ``--allow-vertex-ai``): two routes, named by Vertex AI's
``AIP_PREDICT_ROUTE`` and ``AIP_HEALTH_ROUTE`` (regular expressions, matched
whole).

- The health route answers as ``/v2/health/ready``.
- The predict route infers the default model: a v2 inference request, JSON
  or binary (a binary body says its JSON part's length in its content type,
  ``application/vnd.vertex-ai-triton.binary+json;json-header-size=N``). With
  ``X-Vertex-Ai-Triton-Redirect: v2/...`` it answers that v2 path instead
  (POST only: Vertex AI sends nothing else; a path that is read with GET is
  read so).

SageMaker (Triton's ``--allow-sagemaker``, one model): ``GET /ping``
answers as ``/v2/health/ready``; ``POST /invocations`` infers the default
model, a binary body's (and a binary answer's) JSON length in the content
type ``application/vnd.sagemaker-triton.binary+json;json-header-size=N``;
or, with ``SAGEMAKER_TRITON_INFERENCE_TYPE`` ``generate`` or
``generate_stream``, answers as that route of Triton's generate extension
(a stream's events sent as they come). Multi-model endpoints (``/models``:
loading archives from a URL) are not served.

Any other path is a 400. Every answer comes from the same :class:`Endpoint`
handlers as the Python front-end's, on the server's event loop (aiohttp's
low-level server): these ports carry a platform's traffic, not the fast path.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from aiohttp import web

from . import AIOHTTP_HANDLER_ARGS
from ._aiohttp import read_body, streamed, to_response
from ._endpoint import HEADER_LENGTH, Endpoint, Reply, _json
from .protocol import ProtocolError

if TYPE_CHECKING:
    from ..serve import SageMaker, VertexAI

#: A binary request's content type on Vertex AI, followed by its JSON part's length.
VERTEX_BINARY = "application/vnd.vertex-ai-triton.binary+json;json-header-size="
#: The header naming another v2 path for Vertex AI's predict route to answer.
REDIRECT_HEADER = "X-Vertex-Ai-Triton-Redirect"
#: A binary request's (and answer's) content type on SageMaker.
SAGEMAKER_BINARY = "application/vnd.sagemaker-triton.binary+json;json-header-size="


class PredictionListener:
    """``platform``'s endpoint (a :class:`~ferrobatch.serve.VertexAI` or a
    :class:`~ferrobatch.serve.SageMaker`), answered by ``endpoint``;
    ``ValueError`` when ``platform`` names no served model or a bad route."""

    def __init__(self, endpoint: Endpoint, platform: VertexAI | SageMaker, *, max_body_size: int) -> None:
        from ..serve import VertexAI

        self.endpoint = endpoint
        self.model = platform.check([s.name for s in endpoint.repository.servers])
        self.vertex = isinstance(platform, VertexAI)
        if isinstance(platform, VertexAI):
            self.platform = "Vertex AI"
            self._predict, self._health = re.compile(platform.predict_route), re.compile(platform.health_route)
            self._binary = VERTEX_BINARY
            self._asks = "infer"
        else:
            self.platform = "SageMaker"
            self._predict, self._health = re.compile("/invocations"), re.compile("/ping")
            self._binary = SAGEMAKER_BINARY
            self._asks = platform.inference_type
        #: What its routes are, for the log.
        self.routes = f"predict {self._predict.pattern!r}: model '{self.model}'; health {self._health.pattern!r}"
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
        reply = await self._answer(request)
        closing = self.endpoint.repository.closing
        if reply.stream is not None:
            return await streamed(request, reply, closing=closing)
        return to_response(reply, closing=closing)

    async def _answer(self, request: web.BaseRequest) -> Reply:
        path = request.path
        if self._health.fullmatch(path):
            return await self.endpoint.dispatch(request.method, "/v2/health/ready", dict(request.headers), b"")
        if not self._predict.fullmatch(path):
            return _json(400, {"error": f"{self.platform}: {path!r} is neither the predict nor the health route"})
        if request.method != "POST":
            return Reply(405, _json(405, {"error": "the predict route takes POST"}).body, allow="POST")
        body = await read_body(request, self._max_body_size)
        if isinstance(body, Reply):
            return body
        headers = dict(request.headers)
        try:
            _binary_header_length(headers, self._binary)
        except ProtocolError as exc:
            return _json(exc.status, {"error": str(exc)})
        redirect = request.headers.get(REDIRECT_HEADER) if self.vertex else None
        if redirect is None:
            reply = await self.endpoint.dispatch("POST", f"/v2/models/{self.model}/{self._asks}", headers, body)
            if not self.vertex and reply.header_length is not None:
                # SageMaker says a binary answer's JSON length in its content type.
                reply = dataclasses.replace(
                    reply, content_type=f"{self._binary}{reply.header_length}", header_length=None
                )
            return reply
        target = "/" + redirect.lstrip("/")
        reply = await self.endpoint.dispatch("POST", target, headers, body)
        if reply.status == 405 and reply.allow is not None and "GET" in reply.allow.split(", "):
            reply = await self.endpoint.dispatch("GET", target, headers, b"")  # a read: Vertex AI only POSTs
        return reply


def _binary_header_length(headers: dict[str, str], binary_type: str) -> None:
    """A binary body's JSON length, from the platform's content type, becomes
    the v2 ``Inference-Header-Content-Length`` (in ``headers``)."""
    content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
    at = content_type.find(binary_type)
    if at < 0:
        return
    if at > 0:
        raise ProtocolError(400, f"a binary request's content type starts with {binary_type!r}")
    given = content_type[len(binary_type) :].strip()
    if not given.isdigit():
        raise ProtocolError(400, f"json-header-size must be a whole number, got {given[:40]!r}")
    for key in [k for k in headers if k.lower() == HEADER_LENGTH]:
        del headers[key]
    headers[HEADER_LENGTH] = given
