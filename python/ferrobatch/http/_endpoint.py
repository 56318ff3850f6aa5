"""The v2 REST endpoints, independent of the web framework.

Each handler returns a :class:`Reply` (status, body bytes, headers, and
for a streamed answer the async generator of the rest of its body); the
Starlette and aiohttp adapters only move bytes in and out. :data:`ROUTES` is
the one routing table: :meth:`Endpoint.dispatch` answers any request from it
without a framework (the native front-end forwards what Rust does not answer
there), and the adapters register their routes from it. JSON versus the
binary tensor data extension is decided by ``Inference-Header-Content-Length``
(present: the body is a JSON header of that many bytes, then the binary
tensors), never by ``Content-Type``. Every JSON body, an inference request's
or another route's, is read by the v2 codec's rules (``load_json``): the same
syntax, and the same nesting limit (deeper is a 400, never a 500).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST

from .. import _core
from .._core import V2Request, clipped
from ..client import MAX_STREAM_BACKLOG, StreamBacklog
from ..errors import InvalidInputError
from ..metrics import exposition, registry
from ..server import Server
from . import _generate, _log_settings
from .protocol import (
    CLIENT_SHM_DISABLED,
    MAX_DECOMPRESSED_SIZE,
    ModelRepository,
    ProtocolError,
    ServedModel,
    error_message,
    error_status,
    load_json,
    request_inputs,
)

HEADER_LENGTH = "inference-header-content-length"
_JSON = "application/json"
_BINARY = "application/octet-stream"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str = _JSON
    header_length: int | None = None  # Inference-Header-Content-Length of a binary reply
    close: bool = False  # Connection: close (shutting down, or a body left unread)
    allow: str | None = None  # Allow: the methods a 405's path takes
    content_encoding: str | None = None  # gzip or deflate: the body is coded so
    #: The rest of the body, sent as it comes (``generate_stream``'s events)
    #: after ``body``; closing it early (the client left) ends the request.
    stream: AsyncGenerator[bytes, None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        headers = {"content-type": self.content_type}
        if self.header_length is not None:
            headers[HEADER_LENGTH] = str(self.header_length)
        if self.content_encoding is not None:
            headers["content-encoding"] = self.content_encoding
            headers["vary"] = "accept-encoding"
        if self.close:
            headers["connection"] = "close"
        if self.allow is not None:
            headers["allow"] = self.allow
        return headers


def _json(status: int, document: Any) -> Reply:
    return Reply(status, json.dumps(document, separators=(",", ":")).encode())


def error_reply(exc: BaseException, model: str = "", *, expose: bool = False) -> Reply:
    return _json(error_status(exc), {"error": error_message(exc, model, expose=expose)})


def too_large(size: int | None, limit: int, what: str = "request body") -> Reply:
    """413 for a body over ``limit``; the connection closes (the rest of the
    body is not read)."""
    told = f"of {size} bytes " if size is not None else ""
    message = f"{what} {told}is over the limit of {limit} bytes"
    return Reply(413, _json(413, {"error": message}).body, close=True)


_EMPTY_OK = Reply(200, b"", "text/plain")
NOT_FOUND = _json(404, {"error": "Not Found"})
#: Which of two Inference-Header-Content-Length values counts would be a
#: guess (Starlette's headers take the last, aiohttp's the first): refused.
REPEATED_HEADER_LENGTH = error_reply(ProtocolError(400, "Inference-Header-Content-Length is given more than once"))
#: Which of two codings the body has would be a guess too (each front-end read another).
REPEATED_CONTENT_ENCODING = error_reply(ProtocolError(400, "Content-Encoding is given more than once"))


# -- the routing table ----------------------------------------------------------------

_PARAM = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class Call:
    """What a route's handler gets: the path's parameters (percent-decoded),
    the headers (lower-case names) and the body."""

    params: Mapping[str, str]
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Route:
    """``method path`` (``{name}`` matches one path segment) answered by
    ``handler``; ``metrics`` marks ``/metrics``, left out with ``metrics=False``."""

    method: str
    path: str
    handler: Callable[[Endpoint, Call], Awaitable[Reply]]
    metrics: bool = False
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = _PARAM.split(self.path)  # literal, name, literal, name, ..., literal
        regex = "".join(f"(?P<{part}>[^/]+)" if i % 2 else re.escape(part) for i, part in enumerate(parts))
        object.__setattr__(self, "pattern", re.compile(regex))


async def _live(e: Endpoint, c: Call) -> Reply:
    return e.live()


async def _ready(e: Endpoint, c: Call) -> Reply:
    return e.ready()


async def _server_metadata(e: Endpoint, c: Call) -> Reply:
    return e.server_metadata()


async def _all_statistics(e: Endpoint, c: Call) -> Reply:
    return e.model_statistics()


def _inflated(e: Endpoint, c: Call) -> bytes:
    """``c``'s body, inflated as an infer body is (within the limit, or 400 / 413)."""
    coding = c.headers.get("content-encoding")
    if coding and coding != "identity":
        return _core.inflate(c.body, coding, e.max_decompressed_size)
    return c.body


async def _repository_index(e: Endpoint, c: Call) -> Reply:
    return e.repository_index(_inflated(e, c))


async def _load_model(e: Endpoint, c: Call) -> Reply:
    return await e.model_control("load", c.params["name"], c.body)


async def _unload_model(e: Endpoint, c: Call) -> Reply:
    return await e.model_control("unload", c.params["name"], c.body)


async def _read_log_settings(e: Endpoint, c: Call) -> Reply:
    return e.log_settings()


async def _update_log_settings(e: Endpoint, c: Call) -> Reply:
    return e.log_settings(c.body)


async def _shared_memory_status(e: Endpoint, c: Call) -> Reply:
    return e.shared_memory("status", c.params.get("region", ""))


async def _shared_memory_register(e: Endpoint, c: Call) -> Reply:
    return e.shared_memory("register", c.params.get("region", ""), c.body)


async def _shared_memory_unregister(e: Endpoint, c: Call) -> Reply:
    return e.shared_memory("unregister", c.params.get("region", ""))


async def _cuda_shared_memory_status(e: Endpoint, c: Call) -> Reply:
    return e.cuda_shared_memory("status", c.params.get("region", ""))


async def _cuda_shared_memory_register(e: Endpoint, c: Call) -> Reply:
    return e.cuda_shared_memory("register", c.params.get("region", ""))


async def _cuda_shared_memory_unregister(e: Endpoint, c: Call) -> Reply:
    return e.cuda_shared_memory("unregister", c.params.get("region", ""))


async def _metrics(e: Endpoint, c: Call) -> Reply:
    return e.metrics()


async def _model_metadata(e: Endpoint, c: Call) -> Reply:
    return e.model_metadata(c.params["name"], c.params.get("version", ""))


async def _model_ready(e: Endpoint, c: Call) -> Reply:
    return e.model_ready(c.params["name"], c.params.get("version", ""))


async def _model_config(e: Endpoint, c: Call) -> Reply:
    return e.model_config(c.params["name"], c.params.get("version", ""))


async def _model_statistics(e: Endpoint, c: Call) -> Reply:
    return e.model_statistics(c.params["name"], c.params.get("version", ""))


async def _generate_route(e: Endpoint, c: Call) -> Reply:
    return await e.generate(c.params["name"], c.params.get("version", ""), _inflated(e, c))


async def _generate_stream_route(e: Endpoint, c: Call) -> Reply:
    return await e.generate(c.params["name"], c.params.get("version", ""), _inflated(e, c), stream=True)


async def infer_route(e: Endpoint, c: Call) -> Reply:
    headers = c.headers
    return await e.infer(
        c.params["name"],
        c.params.get("version", ""),
        c.body,
        headers.get(HEADER_LENGTH),
        headers.get("content-encoding"),
        headers.get("accept-encoding"),
    )


#: The handler of ``POST .../infer`` (front-ends that read its body in
#: bounded steps themselves recognise it by this, and check its restriction
#: by ``INFER_PATH``).
INFER = infer_route
INFER_PATH = "/v2/models/{name}/infer"


def _model_routes(prefix: str) -> list[Route]:
    return [
        Route("GET", prefix, _model_metadata),
        Route("GET", prefix + "/ready", _model_ready),
        Route("GET", prefix + "/config", _model_config),
        Route("GET", prefix + "/stats", _model_statistics),
        Route("POST", prefix + "/infer", INFER),
        Route("POST", prefix + "/generate", _generate_route),
        Route("POST", prefix + "/generate_stream", _generate_stream_route),
    ]


#: Every v2 REST route, in matching order: ``/v2/models/stats`` (all
#: models' statistics) comes before ``/v2/models/{name}``, so no model's
#: metadata is served there. GET routes answer HEAD too.
ROUTES: tuple[Route, ...] = (
    Route("GET", "/v2/health/live", _live),
    Route("GET", "/v2/health/ready", _ready),
    Route("GET", "/v2", _server_metadata),
    Route("GET", "/v2/models/stats", _all_statistics),
    Route("POST", "/v2/repository/index", _repository_index),
    Route("POST", "/v2/repository/models/{name}/load", _load_model),
    Route("POST", "/v2/repository/models/{name}/unload", _unload_model),
    Route("GET", "/v2/logging", _read_log_settings),
    Route("POST", "/v2/logging", _update_log_settings),
    Route("GET", "/v2/systemsharedmemory/status", _shared_memory_status),
    Route("GET", "/v2/systemsharedmemory/region/{region}/status", _shared_memory_status),
    Route("POST", "/v2/systemsharedmemory/register", _shared_memory_register),
    Route("POST", "/v2/systemsharedmemory/region/{region}/register", _shared_memory_register),
    Route("POST", "/v2/systemsharedmemory/unregister", _shared_memory_unregister),
    Route("POST", "/v2/systemsharedmemory/region/{region}/unregister", _shared_memory_unregister),
    Route("GET", "/v2/cudasharedmemory/status", _cuda_shared_memory_status),
    Route("GET", "/v2/cudasharedmemory/region/{region}/status", _cuda_shared_memory_status),
    Route("POST", "/v2/cudasharedmemory/register", _cuda_shared_memory_register),
    Route("POST", "/v2/cudasharedmemory/region/{region}/register", _cuda_shared_memory_register),
    Route("POST", "/v2/cudasharedmemory/unregister", _cuda_shared_memory_unregister),
    Route("POST", "/v2/cudasharedmemory/region/{region}/unregister", _cuda_shared_memory_unregister),
    *_model_routes("/v2/models/{name}"),
    *_model_routes("/v2/models/{name}/versions/{version}"),
    Route("GET", "/metrics", _metrics, metrics=True),
)


class Endpoint:
    """Serves the v2 REST API for ``servers`` (see :mod:`ferrobatch.http`).

    ``expose_errors``: see :class:`ModelRepository` (``None``: the
    repository's setting). ``max_decompressed_size``: the most bytes a
    gzip or deflate body may expand to (413 beyond). ``metrics=False``
    leaves ``GET /metrics`` out of :attr:`routes`. ``http_restricted_api``:
    Triton's ``--http-restricted-api`` groups (``"<apis>:<header>=<value>"``,
    see ``ServeConfig``), checked by :meth:`refusal` (``ValueError`` for a
    malformed one). ``allow_client_shm``: see :class:`ModelRepository`
    (for ``servers`` given as servers). ``max_stream_backlog``: the most
    bytes of a decoupled model's responses one ``generate_stream`` holds
    before its client reads them (see :class:`~ferrobatch.client.StreamBacklog`).
    """

    def __init__(
        self,
        servers: Server | Iterable[Server] | ModelRepository,
        *,
        expose_errors: bool | None = None,
        max_decompressed_size: int = MAX_DECOMPRESSED_SIZE,
        metrics: bool = True,
        http_restricted_api: Sequence[str] = (),
        allow_client_shm: bool = False,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
    ) -> None:
        self.restrictions = _core.ApiRestrictions(list(http_restricted_api), [])
        if isinstance(servers, ModelRepository):
            self.repository = servers
        else:
            self.repository = ModelRepository(
                servers, expose_errors=bool(expose_errors), allow_client_shm=allow_client_shm
            )
        self.expose_errors = self.repository.expose_errors if expose_errors is None else expose_errors
        self.max_decompressed_size = max_decompressed_size
        self.max_stream_backlog = max_stream_backlog
        repository = self.repository
        self.registry = registry(  # asked at each scrape: models added while serving are reported
            lambda: repository.servers, cpu=repository.cpu_metrics, gpu=repository.gpu_metrics
        )
        self.routes = tuple(r for r in ROUTES if metrics or not r.metrics)

    async def dispatch(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """Answers one request from :attr:`routes` without a web framework;
        never raises. ``path`` may carry a query string (ignored); header
        names may be in any case. An unknown path is 404 ``{"error": "Not
        Found"}``; a known one with another method 405, with ``Allow``.
        HEAD is answered as GET (the transport leaves out the body)."""
        path = path.partition("?")[0]
        wanted = "GET" if method == "HEAD" else method
        allowed: list[str] = []
        for route in self.routes:
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            if route.method != wanted:
                allowed.append(route.method)
                continue
            params = {k: unquote(v) for k, v in match.groupdict().items()}
            return await self.answer(route, Call(params, {k.lower(): v for k, v in headers.items()}, body))
        if not allowed:
            return NOT_FOUND
        allow = ", ".join(sorted({*allowed, *(["HEAD"] if "GET" in allowed else [])}))
        return Reply(
            405,
            _json(405, {"error": f"Method Not Allowed: {clipped(method)} {clipped(path)} takes {allow}"}).body,
            allow=allow,
        )

    def refusal(self, path: str, headers: Mapping[str, str]) -> Reply | None:
        """403 for a request to a route (``path``, its template: one API
        group per route) of a restricted API group that lacks the header and
        value the group asks for; None when it may go on."""
        if not self.restrictions:
            return None
        message = self.restrictions.http_refusal(path, headers)
        return None if message is None else _json(403, {"error": message})

    async def answer(self, route: Route, call: Call) -> Reply:
        """``route``'s reply to ``call`` (403 when the route's API group is
        restricted and ``call`` lacks its header); never raises."""
        refused = self.refusal(route.path, call.headers)
        if refused is not None:
            return refused
        try:
            return await route.handler(self, call)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            return error_reply(exc, call.params.get("name", ""), expose=self.expose_errors)

    # -- health and metadata --------------------------------------------------------

    def live(self) -> Reply:
        return _EMPTY_OK

    def ready(self) -> Reply:
        return _EMPTY_OK if self.repository.ready else Reply(503, b"", "text/plain")

    def server_metadata(self) -> Reply:
        return _json(200, self.repository.server_metadata())

    def model_metadata(self, name: str, version: str = "") -> Reply:
        try:
            return _json(200, self.repository.model_metadata(name, version))
        except ProtocolError as exc:
            return error_reply(exc)

    def model_config(self, name: str, version: str = "") -> Reply:
        try:
            return _json(200, self.repository.model_config(name, version))
        except ProtocolError as exc:
            return error_reply(exc)

    def model_ready(self, name: str, version: str = "") -> Reply:
        try:
            ready = self.repository.model_ready(name, version)
        except ProtocolError as exc:
            return error_reply(exc)
        return _EMPTY_OK if ready else Reply(503, b"", "text/plain")

    def metrics(self) -> Reply:
        return Reply(200, exposition(self.registry), CONTENT_TYPE_LATEST)

    def model_statistics(self, name: str = "", version: str = "") -> Reply:
        """Triton's statistics of model ``name`` ("": every model)."""
        try:
            return _json(200, self.repository.model_statistics(name, version))
        except ProtocolError as exc:
            return error_reply(exc)

    def repository_index(self, body: bytes = b"") -> Reply:
        """Triton's repository index; a JSON body ``{"ready": true}`` lists
        only the ready models."""
        ready_only = False
        if body.strip():
            try:
                request = load_json(body)
            except ProtocolError as exc:
                return error_reply(exc)
            ready = request.get("ready", False) if isinstance(request, dict) else None
            if not isinstance(ready, bool):
                return error_reply(ProtocolError(400, 'a repository index request is a JSON object; "ready" a bool'))
            ready_only = ready
        return _json(200, self.repository.repository_index(ready_only))

    def log_settings(self, body: bytes = b"") -> Reply:
        """Triton's log settings (see :mod:`._log_settings`), first updated
        with those a JSON object ``body`` names."""
        try:
            if not body.strip():
                return _json(200, _log_settings.current())
            request = load_json(body)
            if not isinstance(request, dict):
                raise ProtocolError(400, "a log settings request is a JSON object of settings")
            return _json(200, _log_settings.update(request))
        except ProtocolError as exc:
            return error_reply(exc)

    async def model_control(self, action: str, name: str, body: bytes = b"") -> Reply:
        """Triton's model control: ``load`` or ``unload`` model ``name``
        (``body``: an optional JSON object, ``{"parameters": {...}}``); see
        :meth:`ModelRepository.load_model`."""
        try:
            request = load_json(body) if body.strip() else {}
            parameters = request.get("parameters", {}) if isinstance(request, dict) else None
            if not isinstance(parameters, dict):
                raise ProtocolError(400, f'a model {action} request is a JSON object; "parameters" an object')
            if action == "load":
                await self.repository.load_model(name, parameters)
            else:
                await self.repository.unload_model(name, parameters)
            return _EMPTY_OK
        except ProtocolError as exc:
            return error_reply(exc)

    def shared_memory(self, action: str, region: str, body: bytes = b"") -> Reply:
        """Triton's system shared-memory calls: ``status`` of ``region`` (""
        every one), ``register`` it (``body``: ``{"key": "/name", "offset":
        0, "byte_size": n}``), ``unregister`` it ("": every one)."""
        repository = self.repository
        try:
            if action == "status":
                return _json(200, repository.shared_memory_status(region))
            if action == "unregister":
                repository.unregister_shared_memory(region)
                return _EMPTY_OK
            if not repository.allows_client_shm:  # before the body, as Triton answers
                raise ProtocolError(501, CLIENT_SHM_DISABLED)
            repository.register_shared_memory(region, *_register_request(load_json(body) if body.strip() else {}))
            return _EMPTY_OK
        except ProtocolError as exc:
            return error_reply(exc)

    def cuda_shared_memory(self, action: str, region: str) -> Reply:
        """Triton's CUDA shared-memory calls, answered as Triton built
        without GPUs answers them (no region is ever registered)."""
        repository = self.repository
        try:
            if action == "status":
                return _json(200, repository.cuda_shared_memory_status(region))
            if action == "unregister":
                repository.unregister_cuda_shared_memory(region)
            else:
                repository.register_cuda_shared_memory(region)
            return _EMPTY_OK
        except ProtocolError as exc:
            return error_reply(exc)

    # -- inference --------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: str,
        body: bytes,
        header_length: str | None,
        content_encoding: str | None = None,
        accept_encoding: str | None = None,
    ) -> Reply:
        """``POST /v2/models/{name}[/versions/{version}]/infer``; never raises.

        The response is coded gzip when ``accept_encoding`` (the request's
        ``Accept-Encoding``) accepts it, else deflate if that is accepted,
        as Triton does (``Inference-Header-Content-Length`` stays the
        uncoded JSON header's length)."""
        try:
            model = self.repository.model(name, version)
            if content_encoding and content_encoding != "identity":
                # The native front-end's inflater (Rust, without the GIL). A
                # body this small inflates to about a MiB at most (deflate's
                # ratio is bounded near 1032:1): on the loop; larger, on a thread.
                limit = self.max_decompressed_size
                if len(body) <= _INLINE_INFLATE_INPUT:
                    body = _core.inflate(body, content_encoding, limit)
                else:
                    body = await anyio.to_thread.run_sync(_core.inflate, body, content_encoding, limit)
            # One call into the codec to decode, one to encode (see ServedModel).
            request = model.codec.decode(body, header_length)
            results = await self.repository.infer(
                model,
                request_inputs(request),
                request.timeout,
                request.priority,
                request.parameters,
                request.requested_outputs,
                uncached=request.shared_memory,
            )
            payload, length = self.repository.answer(model, lambda: model.codec.encode(request, results))
            coding = _core.response_coding(accept_encoding)
            if coding is not None:
                coded = (
                    await anyio.to_thread.run_sync(_core.compress, payload, coding)
                    if len(payload) > _INLINE_COMPRESS  # off the loop (the GIL is released)
                    else _core.compress(payload, coding)
                )
                if coded is None:
                    coding = None
                else:
                    payload = coded
            if length is None:
                return Reply(200, payload, content_encoding=coding)
            return Reply(200, payload, _BINARY, length, content_encoding=coding)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            return error_reply(exc, name, expose=self.expose_errors)

    async def generate(self, name: str, version: str, body: bytes, *, stream: bool = False) -> Reply:
        """Triton's generate extension (see :mod:`._generate`): ``POST
        .../generate``, or ``.../generate_stream`` with ``stream``; never
        raises. A failure before the first response is a JSON error with its
        status, as for ``infer``; a stream that fails later ends with an
        ``{"error": ...}`` event."""
        try:
            model = self.repository.model(name, version)
            request = model.codec.decode(_generate.infer_body(body, model.generate_inputs))
            tensors = request_inputs(request)
            if not model.server.decoupled:
                results = await self.repository.infer(
                    model, tensors, request.timeout, request.priority, request.parameters, request.requested_outputs
                )
                encode = functools.partial(_answered, model, request, results, stream)
                payload = self.repository.answer(model, encode)
                return Reply(200, payload, _generate.EVENT_STREAM if stream else _JSON)
            responses = self.repository.stream(
                model,
                tensors,
                request.timeout,
                request.priority,
                request.parameters,
                StreamBacklog(self.max_stream_backlog),
                requested_outputs=request.requested_outputs,
            )
            try:
                first = await self._next_answer(model, request, responses, stream)
                if stream:
                    events = self._events(model, request, responses, first)
                    return Reply(200, b"", _generate.EVENT_STREAM, stream=events)
                if first is None:
                    # Answered in full, with nothing: counted as its caller sees it.
                    model.server._answer_failed(InvalidInputError(_generate.ONE_RESPONSE))
                    raise InvalidInputError(_generate.ONE_RESPONSE)
                if await anext(responses, None) is not None:
                    await responses.athrow(InvalidInputError(_generate.ONE_RESPONSE))
                return Reply(200, first)
            except BaseException:
                await responses.aclose()
                raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            return error_reply(exc, name, expose=self.expose_errors)

    async def _next_answer(
        self,
        model: ServedModel,
        request: V2Request,
        responses: AsyncGenerator[dict[str, Any], None],
        as_event: bool,
    ) -> bytes | None:
        """The generate answer of the next of ``responses``; None at their end."""
        results = await anext(responses, None)
        if results is None:
            return None
        encode = functools.partial(_answered, model, request, results, as_event)
        return await self.repository.answer_streamed(responses, encode)

    async def _events(
        self,
        model: ServedModel,
        request: V2Request,
        responses: AsyncGenerator[dict[str, Any], None],
        first: bytes | None,
    ) -> AsyncGenerator[bytes, None]:
        """``generate_stream``'s events: ``first``, then one per response as
        it comes; an error ends the stream with an error event. Closed early
        (its client left), the request ends, counted as cancelled."""
        try:
            event = first
            while event is not None:
                yield event
                event = await self._next_answer(model, request, responses, True)
        except Exception as exc:  # noqa: BLE001 - the status is sent: the error is an event
            yield _generate.error_event(error_message(exc, model.server.name, expose=self.expose_errors))
        finally:
            with contextlib.suppress(Exception):
                await responses.aclose()


def _answered(model: ServedModel, request: V2Request, results: dict[str, Any], as_event: bool) -> bytes:
    """The generate answer for ``results`` of ``request`` to ``model``."""
    return model.codec.encode_generate(request, results, as_event=as_event)


def _register_request(request: Any) -> tuple[str, int, int]:
    """``(key, offset, byte_size)`` of a register request's JSON, or the
    400 saying what is wrong with it (Triton's words)."""
    if not isinstance(request, dict):
        raise ProtocolError(400, "a shared memory register request is a JSON object")
    if "key" not in request:
        raise ProtocolError(400, "Shared memory register request has no 'key' field")
    if "byte_size" not in request:
        raise ProtocolError(400, "Shared memory register request has no 'byte_size' field")
    key, offset, byte_size = request["key"], request.get("offset", 0), request["byte_size"]
    if not isinstance(key, str):
        raise ProtocolError(400, "Shared memory register request's 'key' must be a string")
    for field_name, value in (("offset", offset), ("byte_size", byte_size)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise ProtocolError(400, f"Shared memory register request's '{field_name}' must be an unsigned integer")
    return key, offset, byte_size


#: A coded request body at most this long is inflated on the event loop.
_INLINE_INFLATE_INPUT = 1 << 10
#: A response at most this long is coded on the event loop.
_INLINE_COMPRESS = 1 << 20
