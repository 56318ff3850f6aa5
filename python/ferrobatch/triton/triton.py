"""PyTriton's ``Triton`` and ``TritonConfig`` (``pytriton.triton``), serving
bound inference callables with ferrobatch's own HTTP and gRPC front-end
instead of a Triton Inference Server process.

::

    with Triton(config=TritonConfig(http_port=8000, grpc_port=8001)) as triton:
        triton.bind("add", infer_func, inputs=[Tensor(name="x", dtype=np.float32, shape=(4,))],
                    outputs=[Tensor(name="y", dtype=np.float32, shape=(4,))],
                    config=ModelConfig(max_batch_size=64))
        triton.serve()          # blocks until SIGINT/SIGTERM, stop(), or an UnrecoverableError

Each bound model is one :class:`ferrobatch.Server` (each callable of a list
one instance, with a worker thread of its own); :func:`ferrobatch.serve.serve`
serves them all, on one event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook first: see _at_main_thread_exit
import dataclasses
import logging
import os
import queue
import re
import secrets
import socket
import threading
import time
import typing
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from .._cache import ResponseCache
from .._requests import RequestInfo
from .._variable import DEFAULT_ELEMENTS_PER_ROW, LENGTHS
from ..errors import ServerClosedError
from ..http.protocol import SERVER_ID
from ..serve import Listening, SageMaker, ServeConfig, VertexAI, serve
from ..server import Server
from ._binding import (
    RESERVED_PARAMETERS,
    BoundModel,
    InferFunc,
    TritonContext,
    inject_triton_context,
    model_config_of,
    numpy_dtype,
    tensor_spec,
)
from .constants import TRITON_ACCESS_HEADER
from .exceptions import (
    PyTritonInvalidOperationError,
    PyTritonModelConfigError,
    PyTritonValidationError,
    UnrecoverableError,
)
from .model_config import ModelConfig, QueuePolicy, Tensor, TimeoutAction
from .model_config.common import ModelWarmup, generate_warmup_data

__all__ = [
    "DEFAULT_PROTECTED_ENDPOINTS",
    "TRITON_ACCESS_HEADER",
    "VALID_TRITON_ENDPOINTS",
    "RemoteTriton",
    "Triton",
    "TritonConfig",
    "TritonLifecyclePolicy",
    "TritonSecurityConfig",
]

log = logging.getLogger("ferrobatch.triton")

#: Seconds :meth:`Triton.run` waits for the listeners and the models.
STARTUP_TIMEOUT_S = 120.0
#: Seconds readiness says 503, listeners open, before an UnrecoverableError's shutdown.
UNRECOVERABLE_DRAIN_S = 1.0
MONITORING_PERIOD_S = 10.0


@dataclasses.dataclass
class TritonLifecyclePolicy:
    """PyTriton's: when the Triton process starts and where its models are
    stored. ferrobatch starts none and stores nothing: accepted, unused."""

    launch_triton_on_startup: bool = True
    local_model_store: bool = False


#: Triton's API groups an access token may restrict (``--http-restricted-api``).
VALID_TRITON_ENDPOINTS = frozenset(
    {
        "health",
        "metadata",
        "inference",
        "shared-memory",
        "model-config",
        "model-repository",
        "statistics",
        "trace",
        "logging",
    }
)
#: What PyTriton restricts when told nothing (since PyTriton 0.7).
DEFAULT_PROTECTED_ENDPOINTS = ["shared-memory", "model-repository", "statistics", "trace", "logging"]


@dataclasses.dataclass
class TritonSecurityConfig:
    """PyTriton's token-based access restriction: the API groups in
    ``restricted_endpoints`` (None: :data:`DEFAULT_PROTECTED_ENDPOINTS`,
    ``[]``: none) answer only requests whose ``triton-access-token`` header
    (gRPC: ``triton-grpc-protocol-triton-access-token``) is
    ``access_token`` (None: a random one, :meth:`Triton.get_access_token`);
    others get 403 (gRPC UNAVAILABLE), as Triton's restricted APIs."""

    access_token: str | None = None
    restricted_endpoints: list[str] | None = None

    def __post_init__(self) -> None:
        if self.restricted_endpoints is None:
            self.restricted_endpoints = list(DEFAULT_PROTECTED_ENDPOINTS)
        self._validate_endpoint_names(self.restricted_endpoints)
        if self.access_token is None and self.restricted_endpoints:
            self.access_token = secrets.token_urlsafe(32)

    @staticmethod
    def _validate_endpoint_names(endpoints: Sequence[str]) -> None:
        invalid = set(endpoints) - VALID_TRITON_ENDPOINTS
        if invalid:
            raise PyTritonValidationError(
                f"Invalid endpoint names: {', '.join(sorted(invalid))}."
                f" Valid endpoints are: {', '.join(sorted(VALID_TRITON_ENDPOINTS))}"
            )

    def restriction(self) -> str | None:
        """Triton's ``<apis>:<header>=<token>`` for what this restricts (None: nothing)."""
        if not self.access_token or not self.restricted_endpoints:
            return None
        return f"{','.join(self.restricted_endpoints)}:{TRITON_ACCESS_HEADER}={self.access_token}"


@dataclasses.dataclass(kw_only=True)
class TritonConfig:
    """PyTriton's server configuration; every field is optional.

    Used: ``http_address`` / ``grpc_address`` (one address for both; default
    127.0.0.1 where Triton binds 0.0.0.0), ``http_port`` (8000),
    ``grpc_port`` (8001), ``allow_http`` / ``allow_grpc``,
    ``exit_timeout_secs`` (the graceful shutdown's limit, 30),
    ``log_verbose`` (>= 1: debug logs), ``log_file`` (the ``ferrobatch``
    logs of each run are appended there instead of going on to the root
    logger), ``id`` (the name server metadata answers: Triton's is
    ``"triton"``, ferrobatch's ``"ferrobatch"``), ``http_header_forward_pattern`` /
    ``grpc_header_forward_pattern`` (headers whose names match join each
    request's ``parameters``, by lowercase name; native front-end);
    ``metrics_port`` (8002, when free: see :func:`claim_metrics_port`),
    ``metrics_address`` (the one address), ``allow_metrics`` (False: no
    metrics port), ``allow_cpu_metrics`` / ``allow_gpu_metrics`` (the
    machine's ``nv_cpu_*`` / ``nv_gpu_*``), ``allow_client_shm`` (Triton's
    system shared-memory extension; off by default), ``strict_readiness``
    (False: ready whatever the models' state), ``grpc_use_ssl`` /
    ``grpc_use_ssl_mutual`` with ``grpc_server_cert``, ``grpc_server_key``
    and ``grpc_root_cert`` (gRPC over TLS, mutual: clients' certificates
    checked against the roots), ``grpc_keepalive_time`` /
    ``grpc_keepalive_timeout`` (milliseconds: HTTP/2 pings and how long one
    may go unanswered), ``grpc_infer_response_compression_level``
    (``"low"``: gzip, ``"medium"`` / ``"high"``: deflate, as Triton), ``exit_on_error`` (as in
    PyTriton, no effect: a model that fails to load raises in ``run()``). The other fields are Triton
    server options with no meaning here: setting one logs a warning.
    ``/metrics`` is served on the HTTP port too.
    """

    model_repository: str | None = None
    id: str | None = None
    log_verbose: int | None = None
    log_file: str | os.PathLike[str] | None = None
    exit_timeout_secs: int | None = None
    exit_on_error: bool | None = None
    strict_readiness: bool | None = None
    allow_http: bool | None = None
    http_address: str | None = None
    http_port: int | None = None
    http_header_forward_pattern: str | None = None
    http_thread_count: int | None = None
    http_restricted_api: str | None = None
    allow_grpc: bool | None = None
    grpc_address: str | None = None
    grpc_port: int | None = None
    grpc_header_forward_pattern: str | None = None
    grpc_infer_allocation_pool_size: int | None = None
    grpc_use_ssl: bool | None = None
    grpc_use_ssl_mutual: bool | None = None
    grpc_server_cert: str | os.PathLike[str] | None = None
    grpc_server_key: str | os.PathLike[str] | None = None
    grpc_root_cert: str | os.PathLike[str] | None = None
    grpc_infer_response_compression_level: str | None = None
    grpc_keepalive_time: int | None = None
    grpc_keepalive_timeout: int | None = None
    grpc_keepalive_permit_without_calls: bool | None = None
    grpc_http2_max_pings_without_data: int | None = None
    grpc_http2_min_recv_ping_interval_without_data: int | None = None
    grpc_http2_max_ping_strikes: int | None = None
    grpc_restricted_protocol: str | None = None
    allow_metrics: bool | None = None
    allow_gpu_metrics: bool | None = None
    allow_cpu_metrics: bool | None = None
    metrics_interval_ms: int | None = None
    metrics_port: int | None = None
    metrics_address: str | None = None
    allow_sagemaker: bool | None = None
    sagemaker_port: int | None = None
    sagemaker_safe_port_range: str | None = None
    sagemaker_thread_count: int | None = None
    allow_vertex_ai: bool | None = None
    vertex_ai_port: int | None = None
    vertex_ai_thread_count: int | None = None
    vertex_ai_default_model: str | None = None
    metrics_config: list[str] | None = None
    trace_config: list[str] | None = None
    cache_config: list[str] | None = None
    cache_directory: str | None = None
    buffer_manager_thread_count: int | None = None
    #: Triton's ``--allow-client-shm`` (newer than PyTriton's options).
    allow_client_shm: bool | None = None

    def __post_init__(self) -> None:
        if self.allow_http is False and self.allow_grpc is False:
            raise PyTritonValidationError("the HTTP or the gRPC endpoint has to be allowed")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> TritonConfig:
        """A config from ``{field: value}``, values cast to the fields' types
        (``"8000"`` → 8000, ``"true"`` → True, ``"a,b"`` → a list);
        unknown keys are logged and ignored."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for name, value in config.items():
            if name not in hints:
                log.warning("ignoring %s=%r: TritonConfig has no such field", name, value)
                continue
            values[name] = None if value is None else _cast(hints[name], value)
        return cls(**values)

    @classmethod
    def from_env(cls) -> TritonConfig:
        """A config from the ``PYTRITON_TRITON_CONFIG_<FIELD>`` environment
        variables (``PYTRITON_TRITON_CONFIG_GRPC_PORT=45436``; a list field
        from ``<FIELD>_0``, ``<FIELD>_1``...)."""
        prefix = "PYTRITON_TRITON_CONFIG_"
        found: dict[str, Any] = {}
        lists: dict[str, dict[int, str]] = {}
        for key, value in os.environ.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :].lower()
            indexed = re.fullmatch(r"(.+?)_(\d+)", name)
            if indexed is not None and indexed.group(1) in {f.name for f in dataclasses.fields(cls)}:
                lists.setdefault(indexed.group(1), {})[int(indexed.group(2))] = value
            else:
                found[name] = value
        for name, items in lists.items():
            found[name] = [items[i] for i in sorted(items)]
        return cls.from_dict(found)


def _cast(hint: Any, value: Any) -> Any:
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] or [hint]
    kind = typing.get_origin(kinds[0]) or kinds[0]
    if kind is list:
        return value.split(",") if isinstance(value, str) else list(value)
    if kind is bool and isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return kind(value)


#: The TritonConfig fields ferrobatch uses.
_USED = {
    "id",
    "log_file",
    "allow_http",
    "allow_grpc",
    "http_address",
    "grpc_address",
    "http_port",
    "grpc_port",
    "exit_timeout_secs",
    "log_verbose",
    "http_header_forward_pattern",
    "grpc_header_forward_pattern",
    "http_thread_count",
    "cache_config",
    "allow_metrics",
    "allow_cpu_metrics",
    "allow_gpu_metrics",
    "metrics_port",
    "metrics_address",
    "allow_vertex_ai",
    "vertex_ai_port",
    "vertex_ai_default_model",
    "allow_sagemaker",
    "sagemaker_port",
    "http_restricted_api",
    "grpc_restricted_protocol",
    "allow_client_shm",
    "strict_readiness",
    # Triton's own start loads no model in PyTriton (it binds them after, in
    # explicit mode): a model that fails raises in run() whatever it says, here too.
    "exit_on_error",
    "grpc_use_ssl",
    "grpc_use_ssl_mutual",
    "grpc_server_cert",
    "grpc_server_key",
    "grpc_root_cert",
    "grpc_keepalive_time",
    "grpc_keepalive_timeout",
    "grpc_infer_response_compression_level",
}

#: Elements of a ``(-1,)`` input one request may carry at least (the
#: batch's budget, ``Server(max_batch_elements=)``, is no smaller): 4 MiB
#: of float32, each staging slot holding as much.
REQUEST_ELEMENTS_AT_LEAST = 1 << 20

#: Triton's metrics port when ``metrics_port`` is not given.
DEFAULT_METRICS_PORT = 8002


def serve_config(
    config: TritonConfig, *, expose_errors: bool, frontend: str, security: TritonSecurityConfig | None = None
) -> ServeConfig:
    """The :class:`ServeConfig` a :class:`TritonConfig` asks for; a
    ``security`` config that restricts something replaces its
    ``http_restricted_api`` and ``grpc_restricted_protocol``, as PyTriton's."""
    ignored = sorted(f.name for f in dataclasses.fields(config) if f.name not in _USED and getattr(config, f.name))
    if ignored:
        log.warning("TritonConfig: %s not supported by ferrobatch; ignored", ", ".join(ignored))
    addresses = {a for a in (config.http_address, config.grpc_address, config.metrics_address) if a}
    if len(addresses) > 1:
        raise PyTritonValidationError(
            "ferrobatch listens on one address for HTTP, gRPC and metrics; got"
            f" http_address={config.http_address!r}, grpc_address={config.grpc_address!r}"
            f" and metrics_address={config.metrics_address!r}"
        )
    metrics = config.allow_metrics is not False
    restriction = security.restriction() if security is not None else None
    http_restricted = [restriction] if restriction else [config.http_restricted_api or ""]
    grpc_restricted = [restriction] if restriction else [config.grpc_restricted_protocol or ""]
    ssl = bool(config.grpc_use_ssl or config.grpc_use_ssl_mutual)
    return ServeConfig(
        host=addresses.pop() if addresses else "127.0.0.1",
        http_port=None if config.allow_http is False else (8000 if config.http_port is None else config.http_port),
        grpc_port=None if config.allow_grpc is False else (8001 if config.grpc_port is None else config.grpc_port),
        frontend=frontend,
        graceful_timeout=30.0 if config.exit_timeout_secs is None else float(config.exit_timeout_secs),
        log_level="debug" if config.log_verbose else "info",
        expose_errors=expose_errors,
        http_header_forward_pattern=config.http_header_forward_pattern,
        grpc_header_forward_pattern=config.grpc_header_forward_pattern,
        http_restricted_api=tuple(r for r in http_restricted if r),
        grpc_restricted_protocol=tuple(r for r in grpc_restricted if r),
        threads=config.http_thread_count,
        metrics_port=config.metrics_port if metrics else None,  # None: see claim_metrics_port
        cpu_metrics=metrics and config.allow_cpu_metrics is not False,
        gpu_metrics=metrics and config.allow_gpu_metrics is not False,
        allow_client_shm=bool(config.allow_client_shm),
        # PyTriton runs Triton in explicit mode: ModelClient.unload_model() and
        # load_model() unload a bound model and load it again.
        model_control_mode="explicit",
        strict_readiness=config.strict_readiness is not False,
        server_id=SERVER_ID if config.id is None else config.id,
        log_file=_path(config.log_file),
        # Triton's keepalive is in milliseconds; unset, ferrobatch's (a ping a minute) stands.
        keepalive_interval=60.0 if config.grpc_keepalive_time is None else config.grpc_keepalive_time / 1000,
        keepalive_timeout=None if config.grpc_keepalive_timeout is None else config.grpc_keepalive_timeout / 1000,
        grpc_infer_response_compression_level=config.grpc_infer_response_compression_level or "none",
        # As Triton: the files are read with SSL on only; mutual implies SSL.
        grpc_use_ssl=ssl,
        grpc_use_ssl_mutual=bool(config.grpc_use_ssl_mutual),
        grpc_server_cert=_path(config.grpc_server_cert) if ssl else None,
        grpc_server_key=_path(config.grpc_server_key) if ssl else None,
        grpc_root_cert=_path(config.grpc_root_cert) if config.grpc_use_ssl_mutual else None,
    )


def _path(path: str | os.PathLike[str] | None) -> str | None:
    """A file's path as ServeConfig takes it (PyTriton's fields are ``pathlib.Path``)."""
    return None if path is None else os.fspath(path)


def vertex_ai_of(config: TritonConfig) -> VertexAI | None:
    """Vertex AI's endpoint when ``allow_vertex_ai``: its routes from Vertex
    AI's ``AIP_PREDICT_ROUTE`` and ``AIP_HEALTH_ROUTE``, read when the server
    starts, as Triton reads them (``PyTritonValidationError`` if one is
    missing); its port ``vertex_ai_port``, else ``AIP_HTTP_PORT``, else 8080."""
    if not config.allow_vertex_ai:
        return None
    try:
        return VertexAI.from_env(config.vertex_ai_port, config.vertex_ai_default_model)
    except ValueError as exc:
        raise PyTritonValidationError(str(exc)) from None


def sagemaker_of(config: TritonConfig) -> SageMaker | None:
    """SageMaker's endpoint when ``allow_sagemaker``: its default model from
    ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``, read when the server starts; its
    port ``sagemaker_port``, else ``SAGEMAKER_BIND_TO_PORT``, else 8080."""
    if not config.allow_sagemaker:
        return None
    try:
        return SageMaker.from_env(config.sagemaker_port)
    except ValueError as exc:
        raise PyTritonValidationError(str(exc)) from None


def claim_metrics_port(serve: ServeConfig, config: TritonConfig) -> None:
    """Sets ``serve.metrics_port`` to Triton's (8002) when ``config`` names
    none and allows metrics, if that port is free now. When it is taken: a
    warning, and ``/metrics`` on the HTTP port only (a port the user did not
    ask for must not stop the server)."""
    if config.metrics_port is not None or config.allow_metrics is False:
        return
    with socket.socket(socket.AF_INET6 if ":" in serve.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listener binds
        try:
            probe.bind((serve.host, DEFAULT_METRICS_PORT))
        except OSError as exc:
            log.warning(
                "Triton's metrics port %d is not free (%s): /metrics is on the HTTP port only;"
                " TritonConfig(metrics_port=) names another",
                DEFAULT_METRICS_PORT,
                exc,
            )
            return
    serve.metrics_port = DEFAULT_METRICS_PORT


class Triton:
    """Binds inference callables as models and serves them over HTTP and
    gRPC (the Open Inference Protocol v2, as Triton does).

    ``config`` takes precedence over ``PYTRITON_TRITON_CONFIG_*`` variables,
    which take precedence over the defaults, as in PyTriton. ``workspace`` is
    accepted and unused (nothing is written to disk). ``expose_errors``
    (default True, as Triton): clients get the text of a callable's
    exception; False sends its type and a request id only. ``frontend``:
    ``"native"`` (Rust; the default) or ``"python"``.

    :meth:`bind` models, then :meth:`run` (in the background) or
    :meth:`serve` (blocking); :meth:`stop` (or leaving the ``with`` block)
    shuts down gracefully. A model bound while serving is served by the
    running listeners (as PyTriton loads it into its running Triton) once
    :meth:`bind` returns; it is stopped with the others.

    ``triton_lifecycle_policy`` (PyTriton's: when to launch the Triton
    process, where its model store lives) is accepted and has nothing to
    do: there is no separate process and nothing is written to disk.
    ``security_config`` (:class:`TritonSecurityConfig`; None: its
    defaults, PyTriton's) restricts API groups to requests carrying its
    access token (:meth:`get_access_token`), on HTTP and gRPC.
    """

    def __init__(
        self,
        *,
        config: TritonConfig | None = None,
        workspace: Any = None,
        expose_errors: bool = True,
        frontend: str = "native",
        triton_lifecycle_policy: Any = None,
        security_config: Any = None,
    ) -> None:
        del triton_lifecycle_policy  # no Triton process to launch, no model store to write
        self._security_config = security_config if security_config is not None else TritonSecurityConfig()

        def given(c: TritonConfig) -> dict[str, Any]:
            return {k: v for k, v in c.to_dict().items() if v is not None}

        merged = {**given(TritonConfig.from_env()), **(given(config) if config is not None else {})}
        self._config = TritonConfig(**merged)
        self._serve_config = serve_config(
            self._config, expose_errors=expose_errors, frontend=frontend, security=self._security_config
        )
        self._response_cache = _response_cache_of(self._config.cache_config)
        self._context = TritonContext()
        self._servers: list[Server] = []
        #: Each bound model's warm-ups: its instances, their ModelWarmup list, whether it batches.
        self._warmups: dict[str, tuple[list[BoundModel], list[ModelWarmup], bool]] = {}
        self._lock = threading.Lock()
        self._phase = "created"  # created -> running -> stopped (-> running again, models bound anew)
        self._exit_hook = False  # registered once, whatever the runs
        self._thread: threading.Thread | None = None  # run()'s
        self._serving_thread: threading.Thread | None = None  # run()'s, or the one in serve()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_asked = False
        self._ended = threading.Event()
        self._listening: Listening | None = None
        self.unrecoverable: UnrecoverableError | None = None

    # -- binding ---------------------------------------------------------------------------

    def bind(
        self,
        model_name: str,
        infer_func: InferFunc | Sequence[InferFunc],
        inputs: Sequence[Tensor],
        outputs: Sequence[Tensor],
        model_version: int = 1,
        config: ModelConfig | None = None,
        strict: bool = False,
        trace_config: list[str] | None = None,
    ) -> None:
        """Binds ``infer_func`` (or a list of callables: one model instance
        each) as the model ``model_name``.

        The callable gets a list of requests (each a mapping of input name
        to numpy array with its own leading batch dimension, and
        ``.parameters``) and returns one dict of numpy arrays per request;
        see :mod:`ferrobatch.triton.decorators` for the other shapes.
        ``strict``: the outputs must be declared, of their declared dtype and
        shape (else the requests of that call fail with a 500 saying what
        was wrong). Raises :class:`PyTritonModelConfigError` for what
        ferrobatch cannot serve.
        """
        with self._lock:
            self._unbind_stopped()
            running = self._phase == "running"
            listening = self._listening if running else None  # a stopped run's is closed
        if running and listening is None:
            listening = self._listening_once_started(model_name)
        if not model_name or not re.fullmatch(r"[a-zA-Z0-9._-]+", model_name):
            raise PyTritonValidationError(
                f"model name {model_name!r}: only letters, digits, dots, underscores and dashes"
            )
        if any(s.name == model_name for s in self._servers):  # PyTriton's error for a model loaded twice
            raise PyTritonInvalidOperationError(f"a model named {model_name!r} is already bound")
        if model_version != 1:
            raise PyTritonModelConfigError(f"model '{model_name}': only model_version=1 is served")
        if trace_config:
            log.warning("model '%s': trace_config is not supported; ignored", model_name)
        config = config or ModelConfig()
        funcs: list[InferFunc] = list(infer_func) if isinstance(infer_func, (list, tuple)) else [infer_func]  # type: ignore[list-item]
        if not funcs or not all(callable(f) for f in funcs):
            raise PyTritonValidationError("infer_func must be a callable or a non-empty list of callables")
        described = model_config_of(model_name, model_version, config, inputs, outputs, len(funcs))
        batcher = config.batcher
        _check_warmups(model_name, config)
        policy = batcher.default_queue_policy
        kwargs: dict[str, Any] = {}
        if policy is not None and policy.max_queue_size < 0:
            raise PyTritonModelConfigError(
                f"model '{model_name}': default_queue_policy.max_queue_size must be >= 0 (0: the default),"
                f" got {policy.max_queue_size}"
            )
        if policy is not None and policy.max_queue_size > 0:
            kwargs["max_queue_size"] = policy.max_queue_size
        if policy is not None and policy.default_timeout_microseconds < 0:
            raise PyTritonModelConfigError(
                f"model '{model_name}': default_queue_policy.default_timeout_microseconds must be >= 0"
                f" (0: none), got {policy.default_timeout_microseconds}"
            )
        if (
            policy is not None
            and policy.default_timeout_microseconds > 0
            and policy.timeout_action == TimeoutAction.REJECT
        ):
            kwargs["queue_timeout"] = policy.default_timeout_microseconds / 1e6
        if config.response_cache and self._response_cache is None:
            log.warning(
                "model '%s': response_cache=True needs a cache: TritonConfig(cache_config=['local,size=<bytes>']);"
                " served without one",
                model_name,
            )
        elif config.response_cache:
            kwargs["response_cache"] = self._response_cache  # one cache for every model, as Triton's
        if batcher.priority_levels > 1:  # one level is none, as in Triton
            kwargs["priority_levels"] = batcher.priority_levels
            kwargs["default_priority"] = batcher.default_priority_level or None
        if batcher.priority_queue_policy:
            log.warning("model '%s': priority_queue_policy is not supported; ignored", model_name)
        _warn_queue_policy(model_name, policy)
        models = [
            BoundModel(f, described, self._context, strict=strict, on_unrecoverable=self._on_unrecoverable)
            for f in funcs
        ]
        in_specs = [tensor_spec(t, str(t.name)) for t in described.inputs or []]
        out_specs = [tensor_spec(t, str(t.name)) for t in described.outputs or []]
        if any(s.is_ragged for s in in_specs):
            # Triton takes a (-1,) tensor as long as a request can carry:
            # a budget of max_batch_size * 1024 elements would refuse one
            # long request (16 s of 16 kHz audio) that PyTriton serves.
            kwargs["max_batch_elements"] = max(
                config.max_batch_size * DEFAULT_ELEMENTS_PER_ROW, REQUEST_ELEMENTS_AT_LEAST
            )
        try:
            server = Server(
                models,  # type: ignore[arg-type]  # with_requests: called as model(inputs, requests)
                inputs=in_specs,
                outputs=out_specs,
                max_batch_size=config.max_batch_size,
                max_delay=batcher.max_queue_delay_microseconds / 1e6,
                preferred_batch_sizes=list(batcher.preferred_batch_size or ()),
                name=model_name,
                isolate_failures=False,  # a failed call fails its requests, as in PyTriton
                warmup=False,
                with_requests=True,
                batching=config.batching,
                decoupled=config.decoupled,
                **kwargs,
            )
        except ValueError as exc:  # the batching settings
            raise PyTritonModelConfigError(f"model '{model_name}': {exc}") from exc
        # Its callables are shown neither a request's priority nor the protocol's parameters.
        server._cache_key_rules = (False, tuple(sorted(RESERVED_PARAMETERS)))
        for f in funcs:
            self._context.model_configs[f] = described
            inject_triton_context(self._context, f)
        if listening is not None:
            self._serve_while_running(listening, server, models, config)
        self._servers.append(server)
        if config.model_warmup and listening is None:
            self._warmups[model_name] = (models, list(config.model_warmup), config.batching)

    def _refuse_on_serving_thread(self, model_name: str) -> None:
        if threading.current_thread() is self._serving_thread:
            raise PyTritonInvalidOperationError(
                f"model '{model_name}': bind from another thread than the server's event loop (it would wait for"
                " itself)"
            )

    def _listening_once_started(self, model_name: str) -> Listening:
        """This run's listeners, once open and serving (a model bound while
        :meth:`run` starts is added once it has)."""
        self._refuse_on_serving_thread(model_name)
        ended = self._ended
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while (listening := self._listening) is None:
            if ended.wait(0.01):
                raise PyTritonInvalidOperationError(f"model '{model_name}' not bound: the server stopped meanwhile")
            if time.monotonic() > deadline:
                raise TimeoutError(f"model '{model_name}': the server did not start within {STARTUP_TIMEOUT_S} s")
        return listening

    def _serve_while_running(
        self, listening: Listening, server: Server, models: list[BoundModel], config: ModelConfig
    ) -> None:
        """A model bound while serving (as PyTriton loads it into the running
        Triton): warmed up, started and served before :meth:`bind` returns;
        until then its requests are answered as an unknown model's."""
        self._refuse_on_serving_thread(server.name)
        if config.model_warmup:
            _warm_up(server.name, models, list(config.model_warmup), config.batching)
        try:
            listening.add_blocking(server, timeout=STARTUP_TIMEOUT_S)
        except ServerClosedError:
            raise PyTritonInvalidOperationError(
                f"model '{server.name}' not bound: the server stopped meanwhile"
            ) from None
        except ValueError as exc:
            if server.name not in listening.models:
                raise  # not the name: what the start raised
            # Bound twice at once, from two threads.
            raise PyTritonInvalidOperationError(f"a model named {server.name!r} is already bound") from exc

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        """Starts serving in the background; returns once every model is
        ready (the listeners open first). Stopped by :meth:`stop`, or, if
        still running when the main thread ends, at interpreter exit, as
        :meth:`stop` does."""
        started: queue.SimpleQueue[Listening | BaseException] = queue.SimpleQueue()
        self._start()
        thread = threading.Thread(target=self._serve_here, args=(started.put,), name="ferrobatch-triton", daemon=True)
        self._thread = thread
        thread.start()
        if not self._exit_hook:
            self._exit_hook = True
            _at_main_thread_exit(weakref.WeakMethod(self.stop))
        try:
            first = started.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"the models were not ready within {STARTUP_TIMEOUT_S} s") from None
        if isinstance(first, BaseException):
            thread.join()
            raise first

    def serve(self, monitoring_period_s: float = MONITORING_PERIOD_S) -> None:
        """Serves until SIGINT/SIGTERM (on the main thread), :meth:`stop`
        or an :class:`UnrecoverableError`; then shuts down gracefully and
        returns. After :meth:`run`, waits for the background server instead."""
        if self._thread is not None and self._phase == "running":
            try:
                while not self._ended.wait(monitoring_period_s):
                    pass
            except KeyboardInterrupt:
                log.info("SIGINT received, exiting")
            self.stop()
            return
        self._start()
        self._serve_here(lambda _: None)

    def stop(self) -> bool:
        """Shuts down gracefully (readiness 503, requests already accepted
        answered, listeners closed) and waits for it; False if not running.
        Not from an inference callable (it would wait for its own call to
        end): raise :class:`UnrecoverableError` there."""
        with self._lock:
            if self._phase != "running":
                return False
            self._phase = "stopped"
        self._ask_stop()
        if threading.current_thread() is not self._serving_thread:
            # Not from an inference callable: it would wait for itself (raise
            # UnrecoverableError there instead).
            self._ended.wait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        return True

    def get_access_token(self) -> str:
        """The token the restricted API groups ask for (the one given, or
        the one made; see :class:`TritonSecurityConfig`)."""
        return self._security_config.access_token or ""

    def is_alive(self) -> bool:
        """True while serving (from :meth:`run` or :meth:`serve` until it ends)."""
        return self._phase == "running" and self._listening is not None and not self._ended.is_set()

    @property
    def _triton_server(self) -> _ServingHandle:
        """What PyTriton's ``Triton`` calls its server process, whose
        ``is_alive()`` its own tests poll after an unrecoverable error:
        here, whether this run still serves (its listeners and workers)."""
        ended = self._ended  # this run's
        return _ServingHandle(lambda: self._phase == "running" and not ended.is_set())

    def is_connected(self) -> bool:
        return self.is_alive()

    def connect(self) -> None:
        """PyTriton's ``connect``: here, the same as :meth:`run`."""
        self.run()

    def __enter__(self) -> Triton:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- ferrobatch's own -------------------------------------------------------------------

    @property
    def servers(self) -> list[Server]:
        """The :class:`ferrobatch.Server` of each bound model (``stats()``...)."""
        return list(self._servers)

    @property
    def http_port(self) -> int | None:
        """The HTTP port listened on (the one picked for port 0), once running."""
        return self._listening.http_port if self._listening is not None else None

    @property
    def grpc_port(self) -> int | None:
        """The gRPC port listened on, once running."""
        return self._listening.grpc_port if self._listening is not None else None

    @property
    def vertex_ai_port(self) -> int | None:
        """Vertex AI's endpoint's port (``allow_vertex_ai``), once running."""
        return self._listening.vertex_ai_port if self._listening is not None else None

    @property
    def sagemaker_port(self) -> int | None:
        """SageMaker's endpoint's port (``allow_sagemaker``), once running."""
        return self._listening.sagemaker_port if self._listening is not None else None

    # -- internals --------------------------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            if self._phase == "running":
                raise PyTritonInvalidOperationError("already running")
            self._unbind_stopped()
            if not self._servers:
                raise PyTritonInvalidOperationError(
                    "bind at least one model before run() or serve() (stop() unbinds the models, as PyTriton's)"
                )
            self._serve_config.vertex_ai = vertex_ai_of(self._config)
            self._serve_config.sagemaker = sagemaker_of(self._config)
            # Before it listens: a model warmed up is ready when it says so (a failure: run() raises).
            for name, (models, warmups, batching) in self._warmups.items():
                _warm_up(name, models, warmups, batching)
            # A run of its own: what the last one left is not this one's.
            self._thread = self._serving_thread = None
            self._loop, self._stop_event, self._stop_asked = None, None, False
            self._ended = threading.Event()
            self._listening, self.unrecoverable = None, None
            self._phase = "running"
        if self._config.log_verbose:
            # As PyTriton warns (its tests look for these words): debug logs cost time per request.
            log.warning(
                "Triton Inference Server is running with enabled verbose logs (log_verbose=%s: ferrobatch's"
                " debug logs). It may affect inference performance.",
                self._config.log_verbose,
            )

    def _unbind_stopped(self) -> None:
        """After a stop, the models it served are unbound (as PyTriton's
        ``stop()`` unloads them): the next run serves the models bound
        since. Kept until then, for their ``stats()``. Under ``_lock``."""
        if self._phase == "stopped":
            self._servers = []  # a new list: the stopped run's serve() may still hold its own
            self._warmups = {}
            self._phase = "created"

    def _serve_here(self, report: Callable[[Listening | BaseException], None]) -> None:
        """Runs the server on this thread, on a new event loop, until it stops."""

        self._serving_thread = threading.current_thread()
        ended = self._ended  # this run's: a later run has its own

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            if self._stop_asked:
                self._stop_event.set()

            def ready(listening: Listening) -> None:
                self._listening = listening
                log.info("models %s: HTTP port %s, gRPC port %s", listening.models, *_ports(listening))
                report(listening)

            claim_metrics_port(self._serve_config, self._config)
            await serve(self._servers, self._serve_config, on_ready=ready, stop=self._stop_event)

        try:
            asyncio.run(main())
        except BaseException as exc:
            if threading.current_thread() is not self._thread:
                raise  # serve(): the caller's
            if self._listening is None:
                report(exc)  # run() raises it
            else:
                log.exception("serving stopped on an error")
        finally:
            ended.set()
            with self._lock:
                if self._ended is ended:  # not a later run's
                    self._phase = "stopped"

    def _ask_stop(self) -> None:
        """Sets the server's stop event from any thread (never blocks)."""
        self._stop_asked = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass  # the loop has closed: the server has ended already

    def _on_unrecoverable(self, exc: UnrecoverableError) -> None:
        """From a worker thread: shut down as :meth:`stop` does, without
        waiting (the worker's own batch must end first), after readiness has
        said 503 for :data:`UNRECOVERABLE_DRAIN_S` with the listeners still
        open, so probes and load balancers see the server go, as in PyTriton."""
        self.unrecoverable = self.unrecoverable or exc
        # Read by serve() once the stop event is set, which _ask_stop does after this.
        self._serve_config.drain_delay = max(self._serve_config.drain_delay, UNRECOVERABLE_DRAIN_S)
        self._ask_stop()


@dataclasses.dataclass(frozen=True)
class _ServingHandle:
    """A run of a :class:`Triton`, as PyTriton's tests see its server process."""

    serving: Callable[[], bool]

    def is_alive(self) -> bool:
        return self.serving()


class RemoteTriton:
    """PyTriton's binding of this process's callables to a Triton server
    started by another process. Refused: a ferrobatch server runs the models
    of the process that serves them. Bind them with :class:`Triton` in the
    serving process; to run a model's Python outside that process (past its
    GIL), give its ``Server`` ``instance_kind="process"``."""

    def __init__(self, url: str, *args: Any, **kwargs: Any) -> None:
        raise PyTritonValidationError(
            f"RemoteTriton({url!r}) is not supported by ferrobatch: a ferrobatch server runs the models of the"
            " process that serves them; bind them with Triton in that process (for a model's Python outside it,"
            " past its GIL: Server(instance_kind='process'))"
        )


def _at_main_thread_exit(stop: weakref.WeakMethod[Callable[[], bool]]) -> None:
    """Calls ``stop`` (if its object lives) when the interpreter exits, while
    it still can shut a server down: when the main thread ends, before
    :mod:`concurrent.futures` stops its thread pools (``asyncio.to_thread``
    refuses work after that, and ``atexit`` functions run later still).
    Python's exit hooks run last registered first; this module imports
    ``concurrent.futures.thread``, so its hook was registered before."""

    def at_exit() -> None:
        method = stop()
        if method is not None:
            method()

    register = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
    if register is not None:
        register(at_exit)
    else:
        atexit.register(at_exit)


def _ports(listening: Listening) -> tuple[int | None, int | None]:
    return listening.http_port, listening.grpc_port


def _warn_queue_policy(name: str, policy: QueuePolicy | None) -> None:
    """Warns of the queue policy's setting ferrobatch cannot keep: Triton
    moves a request past its queue timeout behind the others (``DELAY``);
    ferrobatch never reorders its queue, so it applies no queue timeout then."""
    if policy is None:
        return
    if policy.timeout_action == TimeoutAction.DELAY and policy.default_timeout_microseconds > 0:
        log.warning(
            "model '%s': default_queue_policy.timeout_action=DELAY is not supported (requests are never"
            " reordered): its default_timeout_microseconds is not applied; a request's own 'timeout'"
            " still bounds it (504)",
            name,
        )


def _response_cache_of(entries: Sequence[str] | None) -> ResponseCache | None:
    """The cache ``TritonConfig.cache_config`` describes (Triton's
    ``--cache-config``: ``"local,size=<bytes>"``, or its parts as separate
    entries, as the environment gives them), shared by the models that
    enable ``response_cache``; None without one."""
    if not entries:
        return None
    size: int | None = None
    for token in (t.strip() for entry in entries for t in str(entry).split(",")):
        key, is_setting, value = token.partition("=")
        if not is_setting:
            if token != "local":
                raise PyTritonValidationError(
                    f"cache_config {list(entries)!r}: only Triton's 'local' cache is served (\"local,size=<bytes>\")"
                )
        elif key.strip() != "size":
            log.warning("cache_config %r: only the local cache's size is applied; %r ignored", list(entries), token)
        else:
            try:
                size = int(value.strip())
            except ValueError:
                raise PyTritonValidationError(f"cache_config: size must be a number of bytes, got {value!r}") from None
            if size <= 0:
                raise PyTritonValidationError(f"cache_config: size must be > 0 bytes, got {size}")
    if size is None:
        raise PyTritonValidationError(f"cache_config {list(entries)!r}: the local cache needs size=<bytes>")
    return ResponseCache(size)


def _check_warmups(name: str, config: ModelConfig) -> None:
    for warmup in config.model_warmup or []:
        if not isinstance(warmup, ModelWarmup):
            raise PyTritonModelConfigError(f"model '{name}': model_warmup takes ModelWarmup entries, got {warmup!r}")
        if warmup.batch_size < 1 or warmup.count < 1:
            raise PyTritonModelConfigError(
                f"model '{name}': warm-up '{warmup.name}' needs batch_size and count >= 1"
                f" (got {warmup.batch_size}, {warmup.count})"
            )
        if warmup.batch_size > max(config.max_batch_size, 1):
            raise PyTritonModelConfigError(
                f"model '{name}': warm-up '{warmup.name}' has batch_size {warmup.batch_size}, over the"
                f" model's max_batch_size {config.max_batch_size}"
            )


def _warm_up(name: str, models: Sequence[BoundModel], warmups: Sequence[ModelWarmup], batching: bool) -> None:
    """Runs ``warmups`` on each instance (``models``), as Triton warms a
    model up before it is ready: each call one request of ``batch_size``
    rows of made-up data, its outputs checked and dropped (a decoupled
    model's every response read)."""
    declared = {str(t.name): t for t in models[0].config.inputs or []}
    for warmup in warmups:
        unknown = set(warmup.inputs) - set(declared)
        if unknown:
            raise PyTritonModelConfigError(f"model '{name}': warm-up '{warmup.name}' has undeclared inputs {unknown}")
        inputs: dict[str, Any] = {}
        for input_name, tensor in declared.items():
            shape = tuple(tensor.shape)
            spec = warmup.inputs.get(input_name)
            if spec is not None:
                data = generate_warmup_data(spec, warmup.batch_size)
            else:  # left out of the warm-up: absent from its request, as an optional input left out
                data = np.zeros((warmup.batch_size, *(max(d, 0) for d in shape)), dtype=numpy_dtype(tensor))
            inputs[input_name] = data
            if -1 in shape:  # as the core hands a variable input: its lengths too
                dims = [i for i, d in enumerate(shape) if d == -1]
                lengths = np.array([[data.shape[1 + i] for i in dims]] * warmup.batch_size, dtype=np.int64)
                inputs[input_name + LENGTHS] = lengths
        absent = frozenset(declared) - frozenset(warmup.inputs)
        # Its outputs are dropped: none is required of a response (PyTriton's warm-up keeps what it gets).
        request = RequestInfo(rows=warmup.batch_size if batching else 1, absent=absent, requested_outputs=frozenset())
        for model in models:
            for _ in range(warmup.count):
                try:
                    produced = model(inputs, [request])
                    if not isinstance(produced, dict):
                        for _response in produced:  # a decoupled model's responses
                            pass
                except Exception as exc:
                    raise PyTritonModelConfigError(
                        f"model '{name}': warm-up '{warmup.name}' failed: {type(exc).__name__}: {exc}"
                    ) from exc
