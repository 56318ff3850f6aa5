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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
import torch
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import metrics
from ..server import Server
from .protocol import (
    MAX_DECOMPRESSED_SIZE,
    MODEL_VERSION,
    ModelRepository,
    ProtocolError,
    ServedModel,
    check_tensor_header,
    decode_bytes,
    decode_list,
    encode_bytes,
    encode_list,
    error_message,
    error_status,
    timeout_from_parameters,
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
_decode_json = json.JSONDecoder().decode
_encode_json = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(slots=True)
class _Request:
    request_id: Any
    inputs: dict[str, Any]
    outputs: list[tuple[str, bool]] | None  # requested (name, binary), None: all
    binary_default: bool
    timeout: float | None


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
        self.registry = metrics.registry(self.repository.servers)
        self._prefixes = {s.name: _json_prefixes(self.repository.model(s.name)) for s in self.repository.servers}

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
        return Reply(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

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
            request = _decode_request(body, header_length, model)
            results = await self.repository.infer(model, request.inputs, request.timeout)
            return _encode_response(model, self._prefixes[name], request, results)
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


def _decode_request(body: bytes, header_length: str | None, model: ServedModel) -> _Request:
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            length = -1
        if not 0 <= length <= len(body):
            raise ProtocolError(
                400,
                f"Inference-Header-Content-Length must be 0..{len(body)} (the body's size), got {header_length!r}",
            )
        header, binary = body[:length], memoryview(body)[length:]
    try:
        document = _decode_json(header.decode())  # UTF-8, as RFC 8259 requires
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(400, f"malformed JSON in the request: {exc}") from None
    except RecursionError:
        raise ProtocolError(400, "malformed JSON in the request: nested too deep") from None
    if not isinstance(document, dict):
        raise ProtocolError(400, "the request must be a JSON object")
    request_id = document.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(400, "'id' must be a string")
    parameters = _parameters(document, "the request")
    timeout = timeout_from_parameters(parameters)
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise ProtocolError(400, "parameter 'binary_data_output' must be true or false")

    raw_inputs = document.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError(400, "the request needs a non-empty 'inputs' list")
    inputs: dict[str, Any] = {}
    offset = 0
    for raw in raw_inputs:
        if not isinstance(raw, dict):
            raise ProtocolError(400, "every entry of 'inputs' must be an object")
        name, datatype, shape = check_tensor_header(raw.get("name"), raw.get("datatype"), raw.get("shape"))
        if name in inputs:
            raise ProtocolError(400, f"input '{name}' is given twice")
        size = _parameters(raw, f"input '{name}'").get("binary_data_size")
        if size is not None:
            if "data" in raw:
                raise ProtocolError(400, f"input '{name}' has both 'data' and 'binary_data_size'")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ProtocolError(400, f"input '{name}': binary_data_size must be an int >= 0")
            if offset + size > len(binary):
                raise ProtocolError(
                    400,
                    f"input '{name}': binary_data_size {size} runs past the end of the body"
                    f" ({len(binary) - offset} binary bytes left)",
                )
            inputs[name] = decode_bytes(name, datatype, shape, binary[offset : offset + size])
            offset += size
        elif "data" in raw:
            if not isinstance(raw["data"], list):
                raise ProtocolError(400, f"input '{name}': 'data' must be a JSON array")
            inputs[name] = decode_list(name, datatype, shape, raw["data"])
        else:
            raise ProtocolError(400, f"input '{name}' has neither 'data' nor 'binary_data_size'")
    if offset != len(binary):
        raise ProtocolError(
            400,
            f"the inputs' binary_data_size add up to {offset} bytes, but {len(binary)} binary"
            " bytes follow the JSON header",
        )

    outputs: list[tuple[str, bool]] | None = None
    raw_outputs = document.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise ProtocolError(400, "'outputs' must be a list")
        known = model.output_types
        outputs = []
        for raw in raw_outputs:
            out_name = raw.get("name") if isinstance(raw, dict) else None
            if not isinstance(out_name, str):
                raise ProtocolError(400, "every entry of 'outputs' must be an object with a string 'name'")
            if out_name not in known:
                raise ProtocolError(
                    400,
                    f"unknown output {out_name[:80]!r} for model '{model.server.name}'; outputs: {', '.join(known)}",
                )
            name = out_name
            out_params = _parameters(raw, f"output '{name}'")
            if "classification" in out_params:
                raise ProtocolError(400, f"output '{name}': the classification extension is not supported")
            binary = out_params.get("binary_data", binary_default)
            if not isinstance(binary, bool):
                raise ProtocolError(400, f"output '{name}': binary_data must be true or false")
            outputs.append((name, binary))
    return _Request(request_id, inputs, outputs, binary_default, timeout)


def _parameters(document: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    parameters = document.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise ProtocolError(400, f"'parameters' of {what} must be an object")
    return parameters


def _encode_response(
    model: ServedModel,
    prefixes: dict[str, str],
    request: _Request,
    results: Mapping[str, torch.Tensor],
) -> Reply:
    # The JSON header is assembled from pre-encoded pieces: names and
    # datatypes are fixed per model, so only shapes, sizes and data vary.
    selected = request.outputs
    if selected is None:
        selected = [(name, request.binary_default) for name in model.output_types]
    entries: list[str] = []
    blobs: list[bytes] = []
    for name, binary in selected:
        tensor = results[name]
        shape = ",".join(map(str, tensor.shape))
        if binary:
            raw = encode_bytes(tensor)
            blobs.append(raw)
            entries.append(f'{prefixes[name]}{shape}],"parameters":{{"binary_data_size":{len(raw)}}}}}')
        else:
            entries.append(f'{prefixes[name]}{shape}],"data":{_encode_json(encode_list(tensor))}}}')
    request_id = "" if request.request_id is None else f',"id":{_encode_json(request.request_id)}'
    header = f'{prefixes[""]}{request_id},"outputs":[{",".join(entries)}]}}'.encode()
    if not blobs:
        return Reply(200, header)
    return Reply(200, b"".join([header, *blobs]), _BINARY, len(header))


def _json_prefixes(model: ServedModel) -> dict[str, str]:
    """JSON openings of a response ("") and of each of its output entries."""
    name = _encode_json(model.server.name)
    prefixes = {"": f'{{"model_name":{name},"model_version":"{MODEL_VERSION}"'}
    for output, datatype in model.output_types.items():
        prefixes[output] = f'{{"name":{_encode_json(output)},"datatype":"{datatype}","shape":['
    return prefixes
