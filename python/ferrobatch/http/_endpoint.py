"""The v2 REST endpoints, independent of the web framework.

Each handler returns a :class:`Reply` (status, body bytes, headers); the
Starlette and aiohttp adapters only move bytes in and out. JSON versus the
binary tensor data extension is decided by ``Inference-Header-Content-Length``
(present: the body is a JSON header of that many bytes, then the binary
tensors), never by ``Content-Type``.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST

from ..metrics import exposition, registry
from ..server import Server
from .protocol import (
    MAX_DECOMPRESSED_SIZE,
    ModelRepository,
    ProtocolError,
    error_message,
    error_status,
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

    @property
    def headers(self) -> dict[str, str]:
        headers = {"content-type": self.content_type}
        if self.header_length is not None:
            headers[HEADER_LENGTH] = str(self.header_length)
        if self.close:
            headers["connection"] = "close"
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


class Endpoint:
    """Serves the v2 REST API for ``servers`` (see :mod:`ferrobatch.http`).

    ``expose_errors``: see :class:`ModelRepository` (``None``: the
    repository's setting). ``max_decompressed_size``: the most bytes a
    gzip or deflate body may expand to (413 beyond).
    """

    def __init__(
        self,
        servers: Server | Iterable[Server] | ModelRepository,
        *,
        expose_errors: bool | None = None,
        max_decompressed_size: int = MAX_DECOMPRESSED_SIZE,
    ) -> None:
        if isinstance(servers, ModelRepository):
            self.repository = servers
        else:
            self.repository = ModelRepository(servers, expose_errors=bool(expose_errors))
        self.expose_errors = self.repository.expose_errors if expose_errors is None else expose_errors
        self.max_decompressed_size = max_decompressed_size
        self.registry = registry(self.repository.servers)

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

    # -- inference --------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: str,
        body: bytes,
        header_length: str | None,
        content_encoding: str | None = None,
    ) -> Reply:
        """``POST /v2/models/{name}[/versions/{version}]/infer``; never raises."""
        try:
            model = self.repository.model(name, version)
            if content_encoding and content_encoding != "identity":
                inflater = _Inflater(body, content_encoding, self.max_decompressed_size)
                # A small body is done in one bounded step on the loop; what
                # expands further continues on a thread (zlib drops the GIL).
                inflated = inflater.run(_INLINE_INFLATE)
                if inflated is None:
                    inflated = await anyio.to_thread.run_sync(inflater.run, None)
                assert inflated is not None
                body = inflated
            # One call into the codec to decode, one to encode (see ServedModel).
            request = model.codec.decode(body, header_length)
            results = await self.repository.infer(model, request_inputs(request), request.timeout)
            payload, length = model.codec.encode(request, results)
            if length is None:
                return Reply(200, payload)
            return Reply(200, payload, _BINARY, length)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            return error_reply(exc, name, expose=self.expose_errors)


#: Output bytes inflated on the event loop before the rest moves to a thread.
_INLINE_INFLATE = 1 << 20
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class _Inflater:
    """Undoes a gzip or deflate Content-Encoding in bounded steps, refusing
    (413) output beyond ``limit`` bytes before producing it."""

    def __init__(self, body: bytes, encoding: str, limit: int) -> None:
        wbits = _WBITS.get(encoding)
        if wbits is None:
            raise ProtocolError(400, f"unsupported Content-Encoding {encoding[:40]!r}; use gzip or deflate")
        self._encoding = encoding
        self._wbits = wbits
        self._limit = limit
        self._pending = body  # input not yet given to the decompressor
        self._inflate = zlib.decompressobj(wbits)
        self._out: list[bytes] = []
        self._size = 0

    def run(self, budget: int | None) -> bytes | None:
        """Inflates at most ``budget`` more bytes (``None``: up to the limit);
        the whole body when done, ``None`` when more remains."""
        stop = self._limit + 1 if budget is None else min(self._limit + 1, self._size + budget)
        try:
            while True:
                if self._size > self._limit:
                    raise ProtocolError(
                        413,
                        f"the {self._encoding} body expands past the limit of"
                        f" {self._limit} bytes (max_decompressed_size)",
                    )
                if self._inflate.eof:
                    rest = self._inflate.unused_data
                    if not rest:
                        return b"".join(self._out)
                    if self._encoding != "gzip":
                        raise ProtocolError(400, "the deflate body has data after its end")
                    self._inflate = zlib.decompressobj(self._wbits)  # the next gzip member
                    self._pending = rest
                if self._size >= stop:
                    return None
                data, self._pending = self._pending or self._inflate.unconsumed_tail, b""
                chunk = self._inflate.decompress(data, stop - self._size)
                if not chunk and not self._inflate.unconsumed_tail and not self._inflate.eof:
                    raise ProtocolError(400, f"the {self._encoding} body is truncated")
                self._out.append(chunk)
                self._size += len(chunk)
        except zlib.error as exc:
            raise ProtocolError(400, f"body is not valid {self._encoding}: {exc}") from None
