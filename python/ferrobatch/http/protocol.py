"""The Open Inference Protocol v2 (KServe v2), independent of the transport.

What the HTTP apps and the gRPC service share: the registry of served models,
the v2 datatypes, metadata documents, tensor (de)serialisation, running a
request through a :class:`~ferrobatch.Client`, and the mapping of errors to
status codes. Nothing here imports a web framework.

Batching convention (Triton's, for models with ``max_batch_size > 0``): the
metadata shows every tensor as ``[-1, *shape]``; a request carries ``n >= 1``
rows (``[n, *shape]``), which join one batch together and are never split;
``n > max_batch_size`` is a bad request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import sys
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from .. import _core
from .._core import CodecError, V2Codec, V2Request, __version__, clipped
from ..client import Client, StreamBacklog
from ..errors import (
    DeadlineExceededError,
    FerrobatchError,
    InvalidInputError,
    ModelError,
    QueueFullError,
    ServerClosedError,
)
from ..server import Server
from ..specs import TensorSpec

__all__ = [
    "DATATYPES",
    "EXTENSIONS",
    "MAX_BODY_SIZE",
    "MAX_DECOMPRESSED_SIZE",
    "MAX_ELEMENTS",
    "MODEL_CONTROL_MODES",
    "MODEL_VERSION",
    "SERVER_ID",
    "ModelRepository",
    "ProtocolError",
    "ServedModel",
    "UnknownModelError",
    "datatype_of",
    "error_message",
    "error_status",
    "load_json",
    "model_inputs",
    "request_inputs",
]

log = logging.getLogger("ferrobatch.serve")
T = TypeVar("T")

#: Default limit on a request body as sent (HTTP) or a received message
#: (gRPC's ``max_receive_message_length``), in bytes.
MAX_BODY_SIZE = 64 * 1024 * 1024
#: Default limit on a request body after undoing its Content-Encoding (bytes).
MAX_DECOMPRESSED_SIZE = 64 * 1024 * 1024
#: Default limit on the elements all inputs of one request declare together:
#: a larger shape is refused (400) before anything is allocated for it.
MAX_ELEMENTS = 64 * 1024 * 1024

#: The one version every model is served as.
MODEL_VERSION = "1"
#: The name server metadata answers by default (Triton's ``--id``).
SERVER_ID = "ferrobatch"
#: Protocol extensions announced in the server metadata (both protocols,
#: both front-ends): binary tensors, Triton's statistics and model
#: configuration, request parameters, log settings, system shared memory
#: (served when the repository allows clients' shared memory), outputs
#: answered as their top classes.
EXTENSIONS = (
    "binary_tensor_data",
    "classification",
    "statistics",
    "model_configuration",
    "parameters",
    "logging",
    "system_shared_memory",
)
#: Why a shared-memory region cannot be registered (HTTP 501, gRPC
#: UNIMPLEMENTED, as Triton answers without ``--allow-client-shm``).
CLIENT_SHM_DISABLED = (
    "Client shared memory is disabled. Start the server with '--allow-client-shm' "
    "(ServeConfig(allow_client_shm=True), or allow_client_shm=True where the app is made) to enable."
)

#: Triton's model control modes (``--model-control-mode``): ``"none"`` serves
#: every model for good; ``"explicit"`` lets clients unload and load them.
MODEL_CONTROL_MODES = ("none", "explicit")
#: Why a model cannot be loaded or unloaded in mode "none" (Triton's words,
#: then how to allow it: HTTP 503, gRPC UNAVAILABLE).
MODEL_CONTROL_DISABLED = (
    "explicit model load / unload is not allowed if polling is enabled "
    "(start the server with '--model-control-mode=explicit', or ModelRepository(model_control_mode='explicit'))"
)


def no_available_versions(name: str) -> str:
    """Triton's words for a request to a model known but not loaded now
    (unloaded, warming up): HTTP 503, gRPC UNAVAILABLE (the native front-end's too)."""
    return f"Request for unknown model: '{clipped(name)}' has no available versions"


#: v2 datatype -> ferrobatch dtype name. BF16 travels as raw 2-byte words.
DATATYPES: dict[str, str] = {v2: name for name, v2, _ in _core.dtypes()}
_V2_OF = {dtype: v2 for v2, dtype in DATATYPES.items()}


def datatype_of(spec: TensorSpec) -> str:
    """The v2 datatype ("FP32") of a tensor spec."""
    return _V2_OF[spec.dtype]


class ProtocolError(Exception):
    """A request the protocol layer refuses; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def load_json(body: bytes) -> Any:
    """``body`` parsed as JSON by the v2 codec's rules: the syntax it accepts
    and its nesting limit, the same for every route as for an inference
    request. :class:`ProtocolError` 400 with the codec's message (``nested
    too deep``...) otherwise. The codec's own parser (iterative) reads the
    body first, so a document too deep for Python's recursive ``json``
    module never reaches it."""
    try:
        _core.check_json(body)
    except ValueError as exc:
        raise ProtocolError(400, f"{exc} in the request") from None
    try:
        return json.loads(body)
    except ValueError as exc:  # what the codec takes and Python does not (none known)
        raise ProtocolError(400, f"malformed JSON in the request: {exc}") from None


class UnknownModelError(ProtocolError):
    """No such model (or version): 400 over HTTP, NOT_FOUND over gRPC."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def error_status(exc: BaseException) -> int:
    """The HTTP status of an error raised while serving a request.

    400 bad request (including :class:`InvalidInputError` and the codec's
    ``CodecError``), 503 queue full or not running, 504 deadline passed, 500
    model failure or anything unexpected.
    """
    if isinstance(exc, (ProtocolError, CodecError)):
        return int(exc.status)
    if isinstance(exc, InvalidInputError):
        return 400
    if isinstance(exc, (QueueFullError, ServerClosedError)):
        return 503
    if isinstance(exc, DeadlineExceededError):
        return 504
    if isinstance(exc, ModelError):
        return 500
    return 500


def error_message(exc: BaseException, model: str, *, expose: bool = False) -> str:
    """What a remote client is told about ``exc``, raised serving a request to
    ``model``. Errors of the request itself (4xx, 503, 504) say what was wrong.
    Failures (500: the model raised, or something unexpected) are logged here
    with their traceback under a fresh request id; the client gets the
    exception's type and that id, and its message only with ``expose``: a
    model's exception text may carry paths or data the client must not see.
    """
    if error_status(exc) != 500 or isinstance(exc, (ProtocolError, CodecError)):
        return str(exc)
    request_id = secrets.token_hex(8)
    log.error("model '%s' failed (request id %s)", model, request_id, exc_info=exc)
    if expose:
        text = str(exc) if isinstance(exc, FerrobatchError) else f"{type(exc).__name__}: {exc}"
        return f"{text} (request id {request_id})"
    cause = exc.__cause__ if isinstance(exc, ModelError) and exc.__cause__ is not None else exc
    what = "failed" if isinstance(exc, ModelError) else "internal error"
    return f"model '{model}' {what}: {type(cause).__name__} (request id {request_id}; the server's log has the details)"


# -- the models served -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One served :class:`~ferrobatch.Server` and what every request to it
    needs, computed once: its client, its outputs' v2 datatypes, its v2
    codec (requests in, responses out; see ``ferrobatch._core.V2Codec``) and
    its inputs as a generate request fills them."""

    server: Server
    client: Client
    output_types: dict[str, str]  # output name -> v2 datatype, in spec order
    codec: V2Codec
    #: ``(name, datatype, shape)`` of each input, as its metadata says them.
    generate_inputs: list[tuple[str, str, list[int]]]

    @classmethod
    def of(
        cls, server: Server, *, max_elements: int = MAX_ELEMENTS, regions: _core.SharedMemoryRegions | None = None
    ) -> ServedModel:
        outputs = [(s.name, s.dtype, None if s.is_bytes else s.torch_dtype) for s in server.outputs]
        # Bodies are limited by the transports (max_body_size,
        # max_decompressed_size, gRPC's message size) before they get here.
        codec = V2Codec(
            server.name,
            outputs,
            max_body_size=sys.maxsize,
            max_elements=max_elements,
            batching=server.batching,
            decoupled=server.decoupled,
            regions=regions,
            # Outputs of a known size: a shared-memory region too small for
            # one is refused before the model runs, not after.
            output_row_bytes=[None if s.is_bytes or s.is_ragged else s.row_nbytes for s in server.outputs],
            output_labels=[None if s.labels is None else list(s.labels) for s in server.outputs],
        )
        inputs = [(t["name"], t["datatype"], t["shape"]) for t in tensor_metadata(server, server.inputs)]
        return cls(server, server.client(), {s.name: datatype_of(s) for s in server.outputs}, codec, inputs)


def tensor_metadata(server: Server, specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
    """The model metadata's ``{"name", "datatype", "shape"}`` of ``specs``:
    with a leading ``-1`` for the batch (a model without batching: one
    sample, as declared)."""
    batch = [-1] if server.batching else []
    return [{"name": s.name, "datatype": datatype_of(s), "shape": [*batch, *s.shape]} for s in specs]


#: What a load's configuration override may change (Triton's model
#: configuration fields, by their JSON names), besides naming the model.
CONFIG_FIELDS = (
    "max_batch_size",
    "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preferred_batch_size",
)


def batch_overrides(server: Server, config: object, current: Mapping[str, Any]) -> dict[str, Any]:
    """The :meth:`~ferrobatch.Server.reconfigure` arguments of a load's
    ``config`` parameter: Triton's model configuration as JSON text, whose
    :data:`CONFIG_FIELDS` change the model's batching (``max_batch_size``,
    ``dynamic_batching``'s ``max_queue_delay_microseconds`` and
    ``preferred_batch_size``; integers as numbers or as the strings of
    protobuf's JSON; camelCase names too). Its other fields must say what
    the model's configuration ``current`` says (a configuration read back,
    changed and sent whole is taken); a field left out stays as it is.
    :class:`ProtocolError` 400 ("failed to load ...") for text that is not
    a JSON object, another field or value, a value of the wrong kind, or
    settings the server refuses, before anything changes."""
    name = clipped(server.name)

    def refused(why: str) -> ProtocolError:
        return ProtocolError(400, f"failed to load '{name}': {why}")

    if not isinstance(config, str):
        raise refused("its 'config' parameter must be a string of JSON")
    try:
        document = json.loads(config)
    except ValueError as exc:
        raise refused(f"its configuration override is not valid JSON ({exc})") from None
    except RecursionError:
        raise refused("its configuration override is nested too deeply") from None
    if not isinstance(document, dict):
        raise refused("its configuration override must be a JSON object")

    def whole(field: str, value: object) -> int:
        # protobuf's JSON writes int64 as a string, int32 as a number: both are taken.
        value = _int_of_text(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise refused(f"'{field}' must be an integer, got {clipped(repr(value))}")
        return value

    fields = {_snake(k): v for k, v in document.items()}
    batching = fields.pop("dynamic_batching", None)
    if "name" in fields and fields.pop("name") != server.name:
        raise refused("a configuration override cannot rename the model")
    current = {_snake(k): v for k, v in current.items()}
    kept = {_snake(k): v for k, v in dict(current.get("dynamic_batching") or {}).items()}
    changes: dict[str, Any] = {}
    if "max_batch_size" in fields:
        size = whole("max_batch_size", fields.pop("max_batch_size"))
        if size != (server.max_batch_size if server.batching else 0):
            changes["max_batch_size"] = size
    if batching is not None:
        if not isinstance(batching, dict):
            raise refused("'dynamic_batching' must be an object")
        batching = {_snake(k): v for k, v in batching.items()}
        if "max_queue_delay_microseconds" in batching:
            delay = whole("max_queue_delay_microseconds", batching.pop("max_queue_delay_microseconds"))
            changes["max_delay"] = delay / 1e6
        if "preferred_batch_size" in batching:
            sizes = batching.pop("preferred_batch_size")
            if not isinstance(sizes, list):
                raise refused("'preferred_batch_size' must be a list of integers")
            changes["preferred_batch_sizes"] = [whole("preferred_batch_size", n) for n in sizes]
        fields.update({f"dynamic_batching.{k}": v for k, v in batching.items() if not _same(v, kept.get(k))})
    try:
        fields = {k: v for k, v in fields.items() if not _same(v, current.get(k))}
    except RecursionError:
        raise refused("its configuration override is nested too deeply") from None
    if fields:
        raise refused(
            f"ferrobatch cannot change {', '.join(map(clipped, sorted(fields)))} on a load; a configuration"
            f" override may set {', '.join(CONFIG_FIELDS)} (and the model's name)"
        )
    if changes.get("max_batch_size") == 0 or (not server.batching and changes):
        raise refused("batching cannot be turned on or off on a load (the tensors' shapes would change)")
    try:
        server.reconfigure(**changes, check_only=True)
    except ValueError as exc:
        raise refused(str(exc)) from None
    return changes


def _same(sent: object, kept: object) -> bool:
    """Whether a configuration's value as sent says what ``kept`` says:
    names compared as field names, protobuf JSON's int64 strings as ints."""

    def plain(value: object) -> object:
        if isinstance(value, dict):
            return {_snake(str(k)): plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return _int_of_text(value)

    return sent is not None and plain(sent) == plain(kept)


def _int_of_text(value: object) -> object:
    """An int64 as protobuf's JSON writes it (a string of at most 19
    digits) as the int; any other value as it is."""
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,19}", value):
        return int(value)
    return value


def _snake(key: str) -> str:
    """A protobuf JSON name as its field's name (``maxBatchSize`` -> ``max_batch_size``)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


class ModelRepository:
    """The named :class:`~ferrobatch.Server` objects one endpoint serves.

    Ready when every server is ready (started and warmed up) and :meth:`close`
    was not called.
    The servers' lifecycle belongs to whoever started them.

    ``expose_errors``: send the text of a model's exceptions to remote
    clients (see :func:`error_message`); off by default. ``max_elements``:
    the most elements the inputs of one request may declare together (400
    beyond, before anything is allocated). ``cpu_metrics`` and
    ``gpu_metrics``: the machine's metrics ``/metrics`` adds (see
    :func:`ferrobatch.metrics.registry`). ``allow_client_shm``: clients
    may register shared-memory regions and name them in requests (Triton's
    system shared-memory extension, off by default as in Triton: a client
    that may register any ``/dev/shm`` object may read or overwrite it).
    ``model_control_mode``: ``"explicit"`` lets clients unload a model and
    load it again (Triton's model repository extension; :meth:`load_model`);
    ``"none"``, the default as in Triton, refuses both. ``strict_readiness``
    (Triton's): ready only while every model is (an unloaded one aside, one
    that failed to start not); False: ready while not closing. ``server_id``
    (Triton's ``--id``): the name server metadata answers (``GET /v2``, gRPC
    ``ServerMetadata``); Triton's own is ``"triton"``, which some clients check.
    """

    def __init__(
        self,
        servers: Server | Iterable[Server],
        *,
        expose_errors: bool = False,
        max_elements: int = MAX_ELEMENTS,
        cpu_metrics: bool = True,
        gpu_metrics: bool = True,
        allow_client_shm: bool = False,
        model_control_mode: str = "none",
        strict_readiness: bool = True,
        server_id: str = SERVER_ID,
    ) -> None:
        listed = [servers] if isinstance(servers, Server) else list(servers)
        if not listed:
            raise ValueError("serve at least one Server")
        if model_control_mode not in MODEL_CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {MODEL_CONTROL_MODES}, got {model_control_mode!r}")
        if not isinstance(server_id, str) or not server_id:
            raise ValueError(f"server_id must be a non-empty string, got {server_id!r}")
        self.server_id = server_id
        self.model_control_mode = model_control_mode
        self.strict_readiness = strict_readiness
        #: The models not loaded now (unloaded, not loaded at start, or failed
        #: to start), each with why: known, not served.
        self._unloaded: dict[str, str] = {}
        #: Those of them that failed to start (``exit_on_error=False``): the
        #: server is not ready while one is (strict readiness), as in Triton.
        self._failed: set[str] = set()
        #: One load or unload of a model at a time.
        self._control_locks: dict[str, asyncio.Lock] = {}
        #: The stop of each model unloaded, while it runs (an unload returns before it ends, as Triton's).
        self._unloading: dict[str, asyncio.Task[None]] = {}
        #: The servers a load started: :meth:`stop_loaded` stops them.
        self._loaded_here: list[Server] = []
        #: Told ``(model, loaded)`` after each load and unload (a native front-end serves accordingly).
        self._control_hooks: list[Callable[[ServedModel, bool], object]] = []
        self._models: dict[str, ServedModel] = {}
        self._max_elements = max_elements
        #: Every model's codec reads and writes these (one registry per server).
        self._regions = _core.SharedMemoryRegions() if allow_client_shm else None
        for server in listed:
            self.add(server)
        self.expose_errors = expose_errors
        self.cpu_metrics = cpu_metrics
        self.gpu_metrics = gpu_metrics
        self._closing = False
        self._in_flight = 0
        self._idle: asyncio.Event | None = None

    def add(self, server: Server) -> ServedModel:
        """Serves ``server`` too, from now on (a model added while serving:
        see :meth:`ferrobatch.serve.Listening.add`); ``ValueError`` if a
        model of its name is served already."""
        if not isinstance(server, Server):
            raise TypeError(f"expected ferrobatch.Server objects, got {type(server).__name__}")
        if server.name in self._models:
            raise ValueError(f"two servers are named {server.name!r}; model names must be unique")
        model = ServedModel.of(server, max_elements=self._max_elements, regions=self._regions)
        self._models[server.name] = model
        return model

    @property
    def models(self) -> list[ServedModel]:
        return list(self._models.values())

    @property
    def servers(self) -> list[Server]:
        return [m.server for m in self._models.values()]

    def close(self) -> None:
        """Marks the endpoint as shutting down: not ready, new requests refused (503)."""
        self._closing = True

    def reopen(self) -> None:
        """Undoes :meth:`close`: an app's lifespan that runs again serves again."""
        self._closing = False

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def in_flight(self) -> int:
        """Requests inside :meth:`infer` now."""
        return self._in_flight

    async def wait_idle(self) -> None:
        """Returns once no request is inside :meth:`infer` (at once if none is)."""
        if self._in_flight:
            self._idle = self._idle or asyncio.Event()
            await self._idle.wait()

    @property
    def ready(self) -> bool:
        """Not closing, and with strict readiness every loaded model ready
        and none failed to start (an unloaded one does not count, as in Triton)."""
        if self._closing:
            return False
        return not self.strict_readiness or (not self._failed and all(m.server.ready for m in self.loaded_models))

    def model(self, name: str, version: str = "") -> ServedModel:
        """Model ``name`` (``version``: "" or "1"); :class:`UnknownModelError` if unknown."""
        model = self._models.get(name)
        if model is None:
            raise UnknownModelError(f"Request for unknown model: '{clipped(name)}' is not found")
        if version and version != MODEL_VERSION:
            raise UnknownModelError(
                f"Request for unknown model: '{clipped(name)}' version {clipped(version)} is not found"
            )
        return model

    def get(self, name: str, version: str = "") -> Server:
        """The server for ``name`` (and ``version``: "" or "1"); 400 if unknown."""
        return self.model(name, version).server

    def model_ready(self, name: str, version: str = "") -> bool:
        server = self.get(name, version)
        return not self._closing and name not in self._unloaded and server.ready

    # -- Triton's model control (model repository extension) ---------------------------

    @property
    def loaded_models(self) -> list[ServedModel]:
        """The models served now: all but those unloaded (or not loaded at start)."""
        return [m for m in self._models.values() if m.server.name not in self._unloaded]

    def leave_unloaded(self, names: Iterable[str], *, failed: str | None = None) -> None:
        """Models ``names`` are not loaded at start (``--load-model`` names the
        others; or their start ``failed``, saying why, with ``exit_on_error``
        off): known, refused as unloaded until :meth:`load_model`."""
        left = set(names)
        unknown = sorted(left - self._models.keys())
        if unknown:
            raise ValueError(f"no model named {', '.join(map(repr, unknown))} to leave unloaded")
        self._unloaded.update(dict.fromkeys(left, failed or "unloaded"))
        if failed is not None:
            self._failed |= left

    @property
    def failed_models(self) -> list[str]:
        """The models whose start failed, not loaded since."""
        return sorted(self._failed)

    def on_model_control(self, hook: Callable[[ServedModel, bool], object], *, add: bool = True) -> None:
        """Calls ``hook(model, loaded)`` after each load (``True``) and unload
        (``False``); ``add=False`` stops that."""
        if add:
            self._control_hooks.append(hook)
        else:
            with contextlib.suppress(ValueError):
                self._control_hooks.remove(hook)

    def _check_control(self, what: str, name: str, parameters: Mapping[str, Any] | None) -> ServedModel | None:
        if self.model_control_mode != "explicit":
            raise ProtocolError(503, MODEL_CONTROL_DISABLED)
        if self._closing:
            raise ProtocolError(503, f"failed to {what} '{clipped(name)}': the server is shutting down")
        # Triton's override of a model's files: ferrobatch's models are the
        # Server objects bound to it, not files it could reload. (A load's
        # new configuration: see load_model.)
        replaced = sorted(k for k in parameters or {} if (k == "config" and what != "load") or k.startswith("file:"))
        if replaced:
            raise ProtocolError(
                400,
                f"failed to {what} '{clipped(name)}': ferrobatch serves the models bound to it; a {what} "
                f"cannot replace their files ({', '.join(map(clipped, replaced))})",
            )
        return self._models.get(name)

    async def load_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Loads model ``name`` again after :meth:`unload_model` (starts its
        server: the warm-up, a new run whose statistics carry on), and
        returns once it serves; a model loaded already is left as it is
        (Triton reloads only what changed). With a ``config`` parameter
        (Triton's configuration override, JSON: see :func:`batch_overrides`)
        the model is loaded with that batching: stopped first if it runs
        (its accepted requests answered; new ones, meanwhile, as during an
        unload), reconfigured, started. 503 in mode ``"none"``; 400 for an
        unknown model, a ``file:`` parameter, a configuration it cannot take,
        or a failed warm-up (Triton's words)."""
        model = self._check_control("load", name, parameters)
        if model is None:
            raise ProtocolError(400, f"failed to load '{clipped(name)}', failed to poll from model repository")
        config = (parameters or {}).get("config")
        async with self._control_locks.setdefault(name, asyncio.Lock()):
            # Read against the configuration of now: another load's may have changed it.
            overrides = None if config is None else batch_overrides(model.server, config, self.model_config(name))
            unloading = self._unloading.pop(name, None)
            if unloading is not None:
                await unloading  # its stop ends first: a server starts from stopped
            server = model.server
            if overrides:
                await self._stop_for_new_config(model)
                server.reconfigure(**overrides)
                log.info("model '%s': reloading with %s", name, overrides)
            if name not in self._unloaded and server.running:
                return
            if not server.running:
                log.info("model '%s': loading (warm-up)", name)
                try:
                    await server.start()
                except (FerrobatchError, RuntimeError) as exc:  # a failed warm-up (Triton: 400)
                    why = error_message(exc, name, expose=self.expose_errors)  # the model's words only if exposed
                    raise ProtocolError(
                        400, f"load failed for model '{clipped(name)}': version 1 is at UNAVAILABLE state: {why}"
                    ) from None
                if self._closing:  # shutting down began during the warm-up: its owner may have passed it by
                    await server.stop(timeout=0)
                    raise ProtocolError(503, f"failed to load '{clipped(name)}': the server is shutting down")
                if server not in self._loaded_here:
                    self._loaded_here.append(server)
            self._unloaded.pop(name, None)
            self._failed.discard(name)
            for hook in list(self._control_hooks):
                hook(model, True)
            log.info("model '%s': loaded, serving", name)

    async def _stop_for_new_config(self, model: ServedModel) -> None:
        """Before a load's new configuration: the model is taken out of
        service (unless it is already) and its server stopped, its accepted
        requests answered. Under the model's control lock."""
        name = model.server.name
        if name not in self._unloaded:
            self._unloaded[name] = "loading a new configuration"
            for hook in list(self._control_hooks):
                hook(model, False)
        if model.server.running:
            await model.server.stop()

    async def unload_model(self, name: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Unloads model ``name``: from now on its requests are refused
        (503: "has no available versions"), it is not ready, and its server
        stops once the requests it accepted are answered. Returns at once,
        as Triton's unload does (:meth:`load_model` waits for the stop).
        Unloading an unknown or unloaded model does nothing, as in Triton;
        503 in mode ``"none"``."""
        model = self._check_control("unload", name, parameters)
        if model is None:
            return
        async with self._control_locks.setdefault(name, asyncio.Lock()):
            if name in self._failed:  # it never started: only its failure is forgotten, as Triton's unload does
                self._failed.discard(name)
                self._unloaded[name] = "unloaded"
                for hook in list(self._control_hooks):
                    hook(model, False)
                return
            if name in self._unloaded:
                return
            self._unloaded[name] = "unloaded"
            for hook in list(self._control_hooks):
                hook(model, False)
            self._unloading[name] = asyncio.ensure_future(self._stop_unloaded(model.server))

    @staticmethod
    async def _stop_unloaded(server: Server) -> None:
        try:
            await server.stop()
        except Exception:  # a failed stop must not go unseen; the next load() tries again
            log.exception("model '%s': stopping it after its unload failed", server.name)
        else:
            log.info("model '%s': unloaded", server.name)

    async def stop_loaded(self, timeout: float | None = None) -> None:
        """Model control's part of shutting down, for whoever serves the
        repository to await once it is closed, before stopping the servers it
        started (so that no server is stopped twice at once): waits up to
        ``timeout`` seconds for the unloads still stopping their servers
        (then stops those at once: their waiting requests fail with
        :class:`ServerClosedError`), and stops the servers a load started."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        unloading = dict(self._unloading)
        self._unloading.clear()
        if unloading:
            _, late = await asyncio.wait(unloading.values(), timeout=timeout)
            for task in late:
                task.cancel()  # a cancelled stop() leaves the rest to the next one
            await asyncio.gather(*late, return_exceptions=True)
            for name, task in unloading.items():
                if task in late:
                    await self._models[name].server.stop(timeout=0)
        while self._loaded_here:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            await self._loaded_here.pop().stop(timeout=left)

    def server_metadata(self) -> dict[str, Any]:
        return {"name": self.server_id, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        server = self.get(name, version)
        return {
            "name": server.name,
            "versions": [MODEL_VERSION],
            "platform": "pytorch",
            "inputs": tensor_metadata(server, server.inputs),
            "outputs": tensor_metadata(server, server.outputs),
        }

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """A Triton-style model configuration (what ``perf_analyzer`` reads)."""
        server = self.get(name, version)

        def tensors(specs: Sequence[TensorSpec]) -> list[dict[str, Any]]:
            return [
                {
                    "name": s.name,
                    "data_type": "TYPE_STRING" if s.is_bytes else "TYPE_" + datatype_of(s),
                    **({"format": "FORMAT_" + s.format} if s.format else {}),
                    "dims": list(s.shape),
                    **({"optional": True} if s.optional else {}),
                }
                for s in specs
            ]

        return {
            "name": server.name,
            "platform": "pytorch",
            "backend": "ferrobatch",
            "max_batch_size": server.max_batch_size if server.batching else 0,
            "input": tensors(server.inputs),
            "output": tensors(server.outputs),
            **(
                {
                    "dynamic_batching": {
                        "preferred_batch_size": list(server.preferred_batch_sizes),
                        "max_queue_delay_microseconds": round(server.max_delay * 1e6),
                    }
                }
                if server.batching
                else {}
            ),
            "instance_group": [{"count": len(server.devices), "kind": _instance_kind(server)}],
            **({"model_transaction_policy": {"decoupled": True}} if server.decoupled else {}),
        }

    # -- Triton's system shared memory ------------------------------------------------

    @property
    def allows_client_shm(self) -> bool:
        return self._regions is not None

    def shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        """The registered region ``name`` (empty: every one) as Triton lists
        it; 404 for a name not registered."""
        regions = []
        if self._regions is not None:
            try:
                regions = self._regions.status(name)
            except CodecError as exc:
                raise ProtocolError(exc.status, str(exc)) from None
        elif name:
            raise ProtocolError(404, f"Unable to find system shared memory region: '{clipped(name)}'")
        return [{"name": n, "key": k, "offset": o, "byte_size": b} for n, k, o, b in regions]

    def register_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Maps ``byte_size`` bytes of the shared-memory object ``key``
        (``/name``) from ``offset`` as region ``name``, which requests may
        then name; 400 if it cannot, 501 when clients' shared memory is off."""
        if self._regions is None:
            raise ProtocolError(501, CLIENT_SHM_DISABLED)
        if not name:
            raise ProtocolError(400, "'region name' is necessary to register system shared memory region")
        if offset < 0 or byte_size < 0:
            raise ProtocolError(400, "a shared memory region's offset and byte_size are integers >= 0")
        try:
            self._regions.register(name, key, offset, byte_size)
        except CodecError as exc:
            raise ProtocolError(exc.status, str(exc)) from None
        log.info("shared memory region %r registered: %r, offset %d, %d bytes", name, key, offset, byte_size)

    def unregister_shared_memory(self, name: str = "") -> None:
        """Unmaps region ``name`` (empty: every region) once the requests
        naming it are done with it; a name not registered is no error."""
        if self._regions is None:
            raise ProtocolError(501, CLIENT_SHM_DISABLED)
        self._regions.unregister(name)

    # -- Triton's CUDA shared memory, as Triton built without GPUs answers it ----------

    def cuda_shared_memory_status(self, name: str = "") -> list[dict[str, Any]]:
        """No CUDA region is ever registered: none listed; 404 for a name."""
        if name:
            raise ProtocolError(404, f"Unable to find cuda shared memory region: '{clipped(name)}'")
        return []

    def register_cuda_shared_memory(self, name: str) -> None:
        """Refused: 400 (501 when clients' shared memory is off)."""
        if self._regions is None:
            raise ProtocolError(501, CLIENT_SHM_DISABLED)
        if not name:
            raise ProtocolError(400, "'region name' is necessary to register cuda shared memory region")
        raise ProtocolError(
            400,
            f"failed to register CUDA shared memory region: '{clipped(name)}', CUDA shared memory is not supported",
        )

    def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """Nothing to unregister (501 when clients' shared memory is off)."""
        if self._regions is None:
            raise ProtocolError(501, CLIENT_SHM_DISABLED)

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's repository index: every model (``ready_only``: the ready
        ones), ``{"name", "version", "state": "READY" | "UNAVAILABLE", "reason"}``."""
        index = []
        for name, model in self._models.items():
            unloaded = self._unloaded.get(name)
            ready = not self._closing and unloaded is None and model.server.ready
            if ready or not ready_only:
                reason = "" if ready else "the server is shutting down" if self._closing else unloaded or "not running"
                state = "READY" if ready else "UNAVAILABLE"
                index.append({"name": name, "version": MODEL_VERSION, "state": state, "reason": reason})
        return index

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics document (``{"model_stats": [...]}``) for model
        ``name``, or every model when ``name`` is "", from ``Server.stats()``.

        ``inference_count`` is rows and ``execution_count`` batches;
        ``success`` counts succeeded requests with their submit-to-result
        time, ``fail`` failed ones (not timed), ``queue`` the time requests
        waited, ``compute_infer`` the model calls (a batch's time once per
        request; per batch in ``batch_stats``), each over the succeeded
        requests that ran; ``cache_hit`` and ``cache_miss`` count the
        requests answered from the response cache and those looked up there
        and run (as Triton, hits are in ``success`` and in no other).
        Collation, fan-out and cache lookups are not timed apart from the
        model call: ``compute_input``, ``compute_output`` and the cache's
        carry the counts with 0 ns.
        """
        models = [self.model(name, version)] if name else list(self._models.values())
        return {"model_stats": [_model_stats(m.server) for m in models]}

    async def infer(
        self,
        model: ServedModel,
        inputs: dict[str, Any],
        timeout: float | None,
        priority: int | None = None,
        parameters: str | None = None,
        requested_outputs: int = 0,
        uncached: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Runs ``n`` rows through ``model``; every output has leading dimension ``n``.
        ``priority``, ``parameters`` (a JSON object's text) and ``requested_outputs``
        (the outputs asked for, as bits of their indices) as the request gave them;
        the last two reach only a model built ``with_requests``. ``uncached``:
        past the response cache (a request naming shared-memory regions)."""
        with self._accepted(model):
            batched = model.server.batching  # without batching: one sample, no batch dimension
            told = model.server.with_requests
            if batched and priority is None and not told and not uncached:
                return await model.client.infer_batch(inputs, timeout=timeout)
            outputs: dict[str, torch.Tensor] = await model.client._infer_with(
                inputs,
                timeout,
                batched,
                priority,
                parameters if told else None,
                requested_outputs if told else 0,
                uncached=uncached,
            )
            return outputs

    async def stream(
        self,
        model: ServedModel,
        inputs: dict[str, Any],
        timeout: float | None,
        priority: int | None = None,
        parameters: str | None = None,
        backlog: StreamBacklog | None = None,
        requested_outputs: int = 0,
        uncached: bool = False,
    ) -> AsyncGenerator[dict[str, torch.Tensor], None]:
        """A decoupled model's responses to ``n`` rows, as :meth:`infer`
        takes them (``backlog``: the gRPC stream's, see
        :class:`~ferrobatch.client.StreamBacklog`)."""
        with self._accepted(model):
            told = model.server.with_requests
            keep, asked = (parameters, requested_outputs) if told else (None, 0)
            batching = model.server.batching
            responses = model.client._stream(inputs, timeout, batching, priority, keep, backlog, asked, uncached)
            try:
                async for out in responses:
                    try:
                        yield out
                    except FerrobatchError as exc:  # see answer_streamed
                        await responses.athrow(exc)
            finally:
                await responses.aclose()

    @staticmethod
    def answer(model: ServedModel, encode: Callable[[], T]) -> T:
        """``encode()``: the answer to a request ``model`` ran, written. If it
        cannot be (an output larger than its shared-memory region: the
        client's mistake, a 400; or the model's answer is not its outputs'),
        the request, counted as succeeded, is counted as its caller sees it,
        as the native front-end counts it; the error propagates."""
        try:
            return encode()
        except CodecError as exc:
            model.server._answer_failed(_seen(exc))
            raise

    @staticmethod
    async def answer_streamed(responses: AsyncGenerator[Any, None], encode: Callable[[], T]) -> T:
        """:meth:`answer` for one response of a :meth:`stream` (``responses``):
        if it cannot be written, the stream's request ends, counted as its
        caller sees it; the error propagates."""
        try:
            return encode()
        except CodecError as exc:
            with contextlib.suppress(FerrobatchError):
                await responses.athrow(_seen(exc))
            raise

    @contextlib.contextmanager
    def _accepted(self, model: ServedModel) -> Iterator[None]:
        """One request in flight (:meth:`close` waits for them), or
        :class:`ServerClosedError` once closing."""
        if self._closing:
            refusal = ServerClosedError(f"server is shutting down; model '{model.server.name}' takes no new requests")
            raise model.server._refused(refusal)
        if model.server.name in self._unloaded:  # not counted: it never reached the model, as natively
            raise ProtocolError(503, no_available_versions(model.server.name))
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()
                self._idle = None


def _seen(exc: CodecError) -> FerrobatchError:
    """What the caller of a request whose answer could not be written sees."""
    return InvalidInputError(str(exc)) if exc.status == 400 else ModelError(str(exc))


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


def _model_stats(server: Server) -> dict[str, Any]:
    stats = server.stats()
    succeeded = stats["requests_succeeded"]
    ran = max(0, succeeded - stats["cache_hits"])  # hits are answered, never queued for nor run
    batch_ns = stats["batch_compute_ns"]
    return {
        "name": server.name,
        "version": MODEL_VERSION,
        "last_inference": stats["last_inference_ms"],
        "inference_count": stats["rows"],
        "execution_count": stats["batches"],
        "inference_stats": {
            "success": _duration(succeeded, stats["request_ns"]),
            "fail": _duration(sum(stats["requests_failed"].values()), 0),
            "queue": _duration(ran, stats["succeeded_queue_ns"]),
            "compute_input": _duration(ran, 0),
            "compute_infer": _duration(ran, stats["request_compute_ns"]),
            "compute_output": _duration(ran, 0),
            "cache_hit": _duration(stats["cache_hits"], 0),
            "cache_miss": _duration(stats["cache_misses"], 0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(n, 0),
                "compute_infer": _duration(n, batch_ns.get(size, 0)),
                "compute_output": _duration(n, 0),
            }
            for size, n in stats["batch_sizes"].items()
        ],
    }


def _instance_kind(server: Server) -> str:
    return "KIND_GPU" if any(d.type == "cuda" for d in server.devices) else "KIND_CPU"


# -- tensors ---------------------------------------------------------------------------


def model_inputs(inputs: dict[str, Any], has_bf16: bool) -> dict[str, Any]:
    """What ``client.infer_batch`` takes from decoded inputs (``V2Tensor`` objects,
    read through the buffer protocol without a copy): as they are, but BF16
    ones, whose buffers are raw 16-bit words, as ``torch.bfloat16`` tensors."""
    if not has_bf16:
        return inputs
    return {
        name: torch.from_numpy(np.array(t, copy=True)).view(torch.bfloat16) if t.datatype == "BF16" else t
        for name, t in inputs.items()
    }


def request_inputs(request: V2Request) -> dict[str, Any]:
    """:func:`model_inputs` of a decoded request."""
    return model_inputs(request.inputs, request.has_bf16)
