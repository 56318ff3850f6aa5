"""``ferrobatch serve``: run servers behind HTTP and gRPC in one process.

    ferrobatch serve myapp.models:server --http-port 8000 --grpc-port 8001
    ferrobatch serve path/to/models.py:make_servers
    ferrobatch serve --demo

The target ``module:attr`` (or ``file.py:attr``) names a :class:`~ferrobatch.Server`,
a list of them, or a zero-argument function returning either; ``module`` is
imported from the current directory first, as ``python -m`` does.

The native front-end (the default) answers both in Rust, inside the
extension; ``--frontend python`` serves them with uvicorn and grpcio on the
servers' event loop instead.

The ports open before the models start: while they warm up, readiness
(``/v2/health/ready``, gRPC ServerReady) says not ready and inference answers
503 / UNAVAILABLE; the log shows each model's warm-up start and end.

SIGINT or SIGTERM shuts down gracefully. With ``--drain-delay SECONDS``,
readiness says 503 first while requests are still served for that long (a
load balancer sees not-ready and stops sending; a second signal ends the
delay). Then new requests are refused (HTTP 503 with ``Connection: close`` / gRPC
UNAVAILABLE), the listeners close, and every request already accepted is
answered. A further signal, or ``--graceful-timeout`` seconds, cuts the wait
short: requests still waiting then (a model call that never returns
included) are answered 503 / UNAVAILABLE, and the process exits.

The native front-end bounds what a client can hold: ``--max-connections``
open at once (more are closed on accept; a few beyond answer health checks
only), ``--header-timeout`` for a request's headers (and a new connection's
first bytes and first request, HTTP/2 included: slowloris clients are cut
off), ``--body-timeout`` for its body (408), ``--idle-timeout`` for a
connection with no request in flight; HTTP/2 connections are pinged every
``--keepalive-interval`` seconds. It inflates gzip and deflate
request bodies up to ``--max-decompressed-size`` bytes (413 beyond) and codes
responses as the request's ``Accept-Encoding`` asks (gzip, else deflate).

A model's exception text is not sent to clients unless ``--expose-errors``:
they get its type and a request id, and the log has the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import inspect
import ipaddress
import logging
import math
import os
import queue
import re
import signal
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _core
from .client import MAX_STREAM_BACKLOG
from .errors import FerrobatchError, ModelError, ServerClosedError
from .grpc import COMPRESSION_LEVELS
from .http import _log_settings
from .http.protocol import (
    MAX_BODY_SIZE,
    MAX_DECOMPRESSED_SIZE,
    MODEL_CONTROL_MODES,
    SERVER_ID,
    ModelRepository,
    ServedModel,
    error_message,
)
from .server import Server, usable_cores, whole_in

if TYPE_CHECKING:
    import grpc.aio
    import uvicorn

    from .http._cloud import PredictionListener
    from .http._native import NativeListeners
    from .metrics import MetricsListener

__all__ = [
    "Listening",
    "SageMaker",
    "ServeConfig",
    "StartupError",
    "TargetError",
    "VertexAI",
    "load_servers",
    "serve",
    "serve_in_thread",
]

log = logging.getLogger("ferrobatch.serve")


class TargetError(RuntimeError):
    """The target's own code failed: importing its module, or calling its
    factory. The message names the target and the error; ``__cause__`` is
    the error itself, with its traceback."""

    def __init__(self, target: str, error: Exception) -> None:
        super().__init__(f"cannot load target {target}: {type(error).__name__}: {error}")
        self.target = target


def load_servers(target: str) -> list[Server]:
    """The servers named by ``module:attr`` or ``path/to/file.py:attr``.

    ``attr`` may be a Server, a list or tuple of them, or a zero-argument
    function returning either (a model, or any other callable object, is not
    called). Raises ``ValueError`` saying what was wrong with the target
    itself, and :class:`TargetError` when the module or the factory raises.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:attr' or 'file.py:attr', got {target!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"no such file: {module_name}")
        # First on sys.path, as `python file.py` does: its sibling modules
        # import, and so does the module itself in spawned process instances.
        directory = str(path.resolve().parent)
        if sys.path[:1] != [directory]:
            sys.path.insert(0, directory)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {module_name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        with _target_code(target):
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_name != missing and not module_name.startswith(missing + "."):
                raise TargetError(target, exc) from exc  # one that the target imports
            raise ValueError(f"no module named {missing!r}") from None
        except Exception as exc:
            raise TargetError(target, exc) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name} has no attribute {attr!r}") from None
    # Only a function is a factory: a model (an nn.Module) is callable too,
    # and calling it with no inputs would fail with a confusing error.
    if inspect.isroutine(obj) or isinstance(obj, partial):
        with _target_code(target):
            obj = obj()
    servers = [obj] if isinstance(obj, Server) else obj
    if not isinstance(servers, (list, tuple)) or not servers or not all(isinstance(s, Server) for s in servers):
        hint = ""
        if _is_module(obj):
            hint = (
                "; wrap the model in one: ferrobatch.Server(model, inputs=[...], outputs=[...])"
                " or ferrobatch.Server.from_example(model, example_inputs)"
            )
        raise ValueError(
            f"{target} must be a ferrobatch.Server, a list of them, or a zero-argument function"
            f" returning either; got {type(obj).__name__}{hint}"
        )
    return list(servers)


@contextlib.contextmanager
def _target_code(target: str) -> Iterator[None]:
    """Runs the target's own code (its module, its factory): what it raises
    is a bug or a missing file of the user's, a :class:`TargetError`."""
    try:
        yield
    except Exception as exc:
        raise TargetError(target, exc) from exc


def _is_module(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


class StartupError(RuntimeError):
    """An endpoint could not start listening (the reason is in the message)."""


@dataclass(frozen=True)
class VertexAI:
    """Vertex AI's prediction endpoint (Triton's ``--allow-vertex-ai``):
    its port, and its two routes, regular expressions matched whole: the
    health route answers as ``/v2/health/ready``; the predict route infers
    the default model (without ``default_model``, the server must serve
    exactly one), or answers the v2 path an ``X-Vertex-Ai-Triton-Redirect``
    header names (see :mod:`ferrobatch.http._cloud`)."""

    predict_route: str
    health_route: str
    port: int = 8080
    default_model: str | None = None

    @classmethod
    def from_env(cls, port: int | None = None, default_model: str | None = None) -> VertexAI:
        """Vertex AI's container variables: ``AIP_PREDICT_ROUTE`` and
        ``AIP_HEALTH_ROUTE`` (required: ``ValueError`` naming the one
        missing), and ``AIP_HTTP_PORT`` when ``port`` is None (else 8080)."""
        routes = {name: os.environ.get(name, "") for name in ("AIP_PREDICT_ROUTE", "AIP_HEALTH_ROUTE")}
        for name, route in routes.items():
            if not route:
                raise ValueError(f"{name} is not defined for the Vertex AI endpoint")
        if port is None:
            given = os.environ.get("AIP_HTTP_PORT", "")
            port = int(given) if given.isdigit() else 8080
        return cls(routes["AIP_PREDICT_ROUTE"], routes["AIP_HEALTH_ROUTE"], port, default_model)

    def check(self, models: list[str]) -> str:
        """The model the predict route infers; ``ValueError`` if the routes
        are not regular expressions or there is no such model."""
        for what, route in (("predict route", self.predict_route), ("health route", self.health_route)):
            try:
                re.compile(route)
            except re.error as exc:
                raise ValueError(f"Vertex AI {what} {route!r} is not a regular expression: {exc}") from None
        return _default_model("Vertex AI", self.default_model, models, "vertex_ai_default_model")


#: What SageMaker's ``POST /invocations`` may ask (``SAGEMAKER_TRITON_INFERENCE_TYPE``).
SAGEMAKER_INFERENCE_TYPES = ("infer", "generate", "generate_stream")


@dataclass(frozen=True)
class SageMaker:
    """SageMaker's inference endpoint (Triton's ``--allow-sagemaker``): its
    port; ``GET /ping`` answers as ``/v2/health/ready`` and ``POST
    /invocations`` asks the default model (without ``default_model``, the
    server must serve exactly one; see :mod:`ferrobatch.http._cloud`) what
    ``inference_type`` says: ``infer`` (a v2 inference request), or Triton's
    ``generate`` or ``generate_stream`` (its generate extension)."""

    port: int = 8080
    default_model: str | None = None
    inference_type: str = "infer"

    def __post_init__(self) -> None:
        if self.inference_type not in SAGEMAKER_INFERENCE_TYPES:
            raise ValueError(
                f"SageMaker's inference type must be one of {', '.join(SAGEMAKER_INFERENCE_TYPES)}, "
                f"got {self.inference_type!r}"
            )

    @classmethod
    def from_env(cls, port: int | None = None) -> SageMaker:
        """SageMaker's container variables: ``SAGEMAKER_TRITON_DEFAULT_MODEL_NAME``,
        ``SAGEMAKER_TRITON_INFERENCE_TYPE`` (``infer``, ``generate`` or
        ``generate_stream``; another is a ``ValueError``), and
        ``SAGEMAKER_BIND_TO_PORT`` when ``port`` is None (else 8080)."""
        kind = os.environ.get("SAGEMAKER_TRITON_INFERENCE_TYPE", "") or "infer"
        if port is None:
            given = os.environ.get("SAGEMAKER_BIND_TO_PORT", "")
            port = int(given) if given.isdigit() else 8080
        return cls(port, os.environ.get("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME") or None, kind)

    def check(self, models: list[str]) -> str:
        """The model ``/invocations`` infers; ``ValueError`` if there is no such model."""
        return _default_model("SageMaker", self.default_model, models, "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME")


def _default_model(platform: str, named: str | None, models: list[str], how: str) -> str:
    if named is None:
        if len(models) != 1:
            raise ValueError(f"{platform}: {len(models)} models are served; name the default one ({how})")
        return models[0]
    if named not in models:
        raise ValueError(f"{platform}: the default model {named!r} is not served")
    return named


@dataclass
class ServeConfig:
    """Where and how :func:`serve` listens. A port of ``None`` disables that
    endpoint; ``0`` picks a free one (see the ``on_ready`` callback)."""

    host: str = "127.0.0.1"
    http_port: int | None = 8000
    #: Who answers HTTP and gRPC: "native" (Rust in the extension: tokio +
    #: hyper, and tonic for gRPC; inference never becomes a Python object) or
    #: "python" (uvicorn and the Starlette app, grpcio and its servicer, as
    #: embedded apps use).
    frontend: str = "native"
    grpc_port: int | None = 8001
    graceful_timeout: float = 30.0
    log_level: str = "info"
    #: Triton's ``--log-file``: while :func:`serve` runs, the ``ferrobatch``
    #: logger writes to this file (appended), and only there. None: as
    #: logging is set up (:func:`run`: standard error).
    log_file: str | None = None
    access_log: bool = False
    #: ``sys.setswitchinterval`` for the process, set by :func:`run` only (None:
    #: leave it). A model's worker thread takes the GIL back after every torch
    #: op; under load the event-loop thread holds it for up to this long each
    #: time, so Python's 5 ms default stretches a small model's call to tens
    #: of milliseconds.
    switch_interval: float | None = 0.001
    #: Send the text of a model's exceptions to clients (off: its type and a
    #: request id only; the log has the traceback either way).
    expose_errors: bool = False
    #: The largest request body (HTTP) or message (gRPC) accepted, in bytes
    #: (413 / RESOURCE_EXHAUSTED beyond).
    max_body_size: int = MAX_BODY_SIZE
    #: The most bytes a gzip or deflate HTTP body may expand to (413 beyond);
    #: gRPC holds a decompressed message to ``max_body_size``.
    max_decompressed_size: int = MAX_DECOMPRESSED_SIZE
    #: Seconds between the first SIGINT/SIGTERM and closing the listeners:
    #: readiness says 503 meanwhile, and requests are still served (so a load
    #: balancer sees not-ready and stops sending first). A second signal
    #: ends it early.
    drain_delay: float = 0.0
    #: Native front-end: its runtime's threads, across which connections
    #: spread. None: half the cores the process may run on
    #: (``os.sched_getaffinity``), the rest left to the models' workers,
    #: whose default torch threads leave these out.
    threads: int | None = None
    #: Native front-end: connections open at once; a new one beyond is closed
    #: on accept.
    max_connections: int = 10_000
    #: Native front-end: HTTP/2 (h2c and gRPC) streams in flight per connection.
    max_streams: int = 1024
    #: Native front-end: seconds for a request's headers (and a new
    #: connection's first bytes) to arrive; the connection is closed after.
    header_timeout: float = 30.0
    #: Native front-end: seconds for a request's body to arrive (408 after).
    body_timeout: float = 60.0
    #: Native front-end: seconds a connection may stay open with no request
    #: in flight (HTTP/2: GOAWAY, then closed).
    idle_timeout: float = 300.0
    #: HTTP/2 connections are pinged this often (seconds) and
    #: closed when a ping is not answered within ``keepalive_timeout``, so a
    #: client that vanished without closing (a dead host, a dropped route)
    #: has its calls cancelled; 0: no pings. The native front-end's h2c and
    #: gRPC connections, the Python front-end's gRPC ones (grpcio's
    #: keepalive: Triton's ``--grpc-keepalive-time``).
    keepalive_interval: float = 60.0
    #: Seconds a ping may go unanswered (Triton's ``--grpc-keepalive-timeout``);
    #: None: ``keepalive_interval``.
    keepalive_timeout: float | None = None
    #: Triton's ``--grpc-infer-response-compression-level``, either front-end:
    #: "none" (the default) sends gRPC responses as they are; "low" compresses
    #: them with gzip, "medium" and "high" with deflate (each the other when the
    #: call accepts only that one; none when it accepts neither), as gRPC's
    #: own servers rank them.
    grpc_infer_response_compression_level: str = "none"
    #: Native front-end: a regular expression; HTTP request headers whose
    #: names it matches (anywhere, ignoring case) join the request's parameters,
    #: by lowercase name, for models built ``with_requests`` (Triton's
    #: ``--http-header-forward-pattern``). None: no header is forwarded.
    http_header_forward_pattern: str | None = None
    #: The same for gRPC metadata (``--grpc-header-forward-pattern``).
    grpc_header_forward_pattern: str | None = None
    #: Triton's ``--http-restricted-api``, either front-end: each
    #: ``"<apis>:<header>=<value>"`` (``apis``: comma-separated among
    #: health, metadata, inference, shared-memory, model-config,
    #: model-repository, statistics, trace, logging; each in one group at
    #: most) answers those API groups' HTTP requests only when they carry
    #: ``header`` with ``value``; others get 403.
    http_restricted_api: tuple[str, ...] = ()
    #: Triton's ``--grpc-restricted-protocol``: the same for gRPC, whose
    #: calls must carry ``triton-grpc-protocol-<header>``; others end UNAVAILABLE.
    grpc_restricted_protocol: tuple[str, ...] = ()
    #: Triton's ``--allow-client-shm``: clients may register regions of
    #: POSIX shared memory (``/dev/shm`` objects) over HTTP or gRPC and name
    #: them in infer requests, for inputs and outputs (the system
    #: shared-memory extension). Off by default, as in Triton: a client that
    #: may register regions may read or overwrite any ``/dev/shm`` object
    #: this process may open (restrict the ``shared-memory`` API group, or
    #: keep the ports to trusted clients).
    allow_client_shm: bool = False
    #: Triton's ``--model-control-mode``: ``"explicit"`` lets clients unload
    #: a model and load it again (``POST /v2/repository/models/{name}/load``
    #: and ``/unload``, gRPC ``RepositoryModelLoad`` / ``Unload``, tritonclient's
    #: ``load_model`` / ``unload_model``); ``"none"`` (as in Triton) refuses both.
    model_control_mode: str = "none"
    #: Triton's ``--load-model`` (with ``model_control_mode="explicit"``): the
    #: models started with the server; the others wait, unloaded, for a load.
    #: None (or ``["*"]``): every model.
    load_models: Sequence[str] | None = None
    #: Triton's ``--exit-on-error``: a model whose start (warm-up) fails stops
    #: the server from starting (True, the default). False: the others serve;
    #: it is left unloaded (UNAVAILABLE in the repository index, with why; a
    #: load tries it again with ``model_control_mode="explicit"``) and, with
    #: ``strict_readiness``, the server is not ready meanwhile, as in Triton.
    exit_on_error: bool = True
    #: Triton's ``--strict-readiness``: ``/v2/health/ready`` (gRPC
    #: ``ServerReady``) says ready only while every model is (True, the
    #: default); False: while the server serves, whatever its models' state.
    strict_readiness: bool = True
    #: Triton's ``--grpc-use-ssl``: gRPC over TLS, with ``grpc_server_cert``
    #: (the certificate chain, PEM) and ``grpc_server_key`` (its key, PEM),
    #: on either front-end (HTTP stays plaintext, as Triton's; put a proxy
    #: in front for HTTPS). The files are read and checked at start.
    grpc_use_ssl: bool = False
    #: Triton's ``--grpc-use-ssl-mutual`` (implies ``grpc_use_ssl``): clients
    #: must also present a certificate that ``grpc_root_cert`` signs.
    grpc_use_ssl_mutual: bool = False
    grpc_server_cert: str | None = None
    grpc_server_key: str | None = None
    #: The certificates that sign clients' (PEM), for ``grpc_use_ssl_mutual``.
    grpc_root_cert: str | None = None
    #: Triton's ``--id``: the name server metadata answers (``GET /v2``, gRPC
    #: ``ServerMetadata``). Triton's is ``"triton"``, which some of its clients check.
    server_id: str = SERVER_ID
    #: The most bytes of a decoupled model's responses one stream holds
    #: before its client reads them (either front-end): a gRPC
    #: ``ModelStreamInfer`` stream, or one HTTP ``generate_stream``. A
    #: response past them fails its request (an ``error_message`` on the gRPC
    #: stream, an error event ending the HTTP one; counted ``queue_full``)
    #: instead of being held, so a client that stops reading costs at most that much.
    max_stream_backlog: int = MAX_STREAM_BACKLOG
    #: Also share the models with other processes of this user (see
    #: :meth:`Server.share`) under this name (one model), or
    #: ``"{share}.{model}"`` each (several); ``ferrobatch.connect`` there.
    share: str | None = None
    #: A port of its own for ``GET /metrics`` (Triton's ``--metrics-port``;
    #: 8002 there), on ``host``; ``0`` picks a free one. None: none (the
    #: HTTP port serves ``/metrics`` either way).
    metrics_port: int | None = None
    #: The machine's CPU and memory (``nv_cpu_*``) and this process's
    #: (``process_*``) in ``/metrics`` (Triton's ``--allow-cpu-metrics``).
    cpu_metrics: bool = True
    #: The GPUs' (``nv_gpu_*``, through NVML: the ``gpu`` extra) in
    #: ``/metrics`` (Triton's ``--allow-gpu-metrics``).
    gpu_metrics: bool = True
    #: Vertex AI's prediction endpoint on a port of its own, on ``host``
    #: (Triton's ``--allow-vertex-ai``; see :mod:`ferrobatch.http._cloud`,
    #: ``VertexAI.from_env()`` reads Vertex AI's ``AIP_*`` variables). Opens
    #: once the models have started. None: none.
    vertex_ai: VertexAI | None = None
    #: SageMaker's inference endpoint on a port of its own, on ``host``
    #: (Triton's ``--allow-sagemaker``; ``SageMaker.from_env()`` reads
    #: SageMaker's ``SAGEMAKER_*`` variables). Opens once the models have
    #: started. None: none.
    sagemaker: SageMaker | None = None


#: Bounds of ServeConfig's numbers: each is checked before anything is
#: started or allocated (a thread count of 10**9 would be attempted).
MAX_FRONT_END_THREADS = _core.MAX_FRONT_END_THREADS
MAX_CONNECTIONS = _core.MAX_CONNECTIONS
MAX_STREAMS = 1 << 20
MAX_BYTES_LIMIT = 1 << 40
MAX_SECONDS = 1e9


def check_config(config: ServeConfig) -> None:
    """Refuses a config :func:`serve` cannot honour, naming the field, what
    it must be and what it was (``ValueError``)."""

    def whole(name: str, low: int, high: int, *, optional: bool = False, what: str = "") -> None:
        value = getattr(config, name)
        if optional and value is None:
            return
        if not whole_in(value, low, high):
            none = " or None" if optional else ""
            raise ValueError(f"{name} must be an int from {low} to {high}{what}{none}, got {value!r}")

    def seconds(name: str, *, zero: bool = True, optional: bool = False) -> None:
        value = getattr(config, name)
        if optional and value is None:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not (value >= 0 if zero else value > 0) or value > MAX_SECONDS:
            low = ">= 0" if zero else "> 0"
            raise ValueError(f"{name} must be {low} and at most {MAX_SECONDS:.0e} seconds, got {value!r}")

    if config.http_port is None and config.grpc_port is None:
        raise ValueError("nothing to serve: both the HTTP and the gRPC endpoint are disabled")
    if config.frontend not in ("native", "python"):
        raise ValueError(f"frontend must be 'native' or 'python', got {config.frontend!r}")
    # A real bool only: "false" (from an environment variable, say) is truthy,
    # and would send models' error texts to clients.
    for flag in ("access_log", "expose_errors", "cpu_metrics", "gpu_metrics"):
        if not isinstance(getattr(config, flag), bool):
            raise ValueError(f"{flag} must be True or False, got {getattr(config, flag)!r}")
    _check_grpc_tls(config)
    if config.log_file is not None and (not isinstance(config.log_file, str) or not config.log_file):
        raise ValueError(f"log_file must be a file's path or None, got {config.log_file!r}")
    if config.log_level not in LOG_LEVELS:
        raise ValueError(f"log_level must be one of {', '.join(map(repr, LOG_LEVELS))}, got {config.log_level!r}")
    _check_host(config.host, native=config.frontend == "native")
    if config.share is not None:
        _check_share_name("share", config.share)
    if not isinstance(config.server_id, str) or not config.server_id:
        raise ValueError(f"server_id must be a non-empty string, got {config.server_id!r}")
    if config.model_control_mode not in MODEL_CONTROL_MODES:
        raise ValueError(f"model_control_mode must be one of {MODEL_CONTROL_MODES}, got {config.model_control_mode!r}")
    if config.load_models is not None:
        if isinstance(config.load_models, str) or not all(isinstance(n, str) for n in config.load_models):
            raise ValueError(f"load_models must be a sequence of model names or None, got {config.load_models!r}")
        if config.model_control_mode != "explicit":  # Triton's rule
            raise ValueError("load_models (--load-model) requires model_control_mode='explicit' as well")
        if "*" in config.load_models and len(config.load_models) > 1:
            raise ValueError("load_models: '*' (every model) must be the only name")
    for name in ("http_header_forward_pattern", "grpc_header_forward_pattern"):
        pattern = getattr(config, name)
        if pattern is not None and not isinstance(pattern, str):
            raise ValueError(f"{name} must be a regular expression (a str) or None, got {pattern!r}")
    for name in ("http_restricted_api", "grpc_restricted_protocol"):
        groups = getattr(config, name)
        if isinstance(groups, str) or not all(isinstance(g, str) for g in groups):
            raise ValueError(f"{name} must be a sequence of '<apis>:<header>=<value>' strings, got {groups!r}")
    _core.ApiRestrictions(list(config.http_restricted_api), list(config.grpc_restricted_protocol))  # ValueError
    forwarding = config.http_header_forward_pattern is not None or config.grpc_header_forward_pattern is not None
    if forwarding and config.frontend != "native":
        raise ValueError("header forwarding (http/grpc_header_forward_pattern) needs frontend='native'")
    for port in ("http_port", "grpc_port", "metrics_port"):
        whole(port, 0, 65535, optional=True, what=" (a port; 0 picks a free one)")
    for name, kind in (("vertex_ai", VertexAI), ("sagemaker", SageMaker)):
        platform = getattr(config, name)
        if platform is None:
            continue
        if not isinstance(platform, kind):
            raise ValueError(f"{name} must be a {kind.__name__} or None, got {platform!r}")
        if not whole_in(platform.port, 0, 65535):
            raise ValueError(f"{name}.port must be an int from 0 to 65535 (0 picks a free one), got {platform.port!r}")
    whole("threads", 1, MAX_FRONT_END_THREADS, optional=True)
    whole("max_connections", 1, MAX_CONNECTIONS)
    whole("max_streams", 1, MAX_STREAMS)
    for size in ("max_body_size", "max_decompressed_size", "max_stream_backlog"):
        whole(size, 1, MAX_BYTES_LIMIT, what=" (bytes)")
    for name in ("header_timeout", "body_timeout", "idle_timeout"):
        seconds(name, zero=False)
    seconds("keepalive_interval")  # 0: no pings
    seconds("keepalive_timeout", zero=False, optional=True)
    if config.grpc_infer_response_compression_level not in COMPRESSION_LEVELS:
        raise ValueError(
            f"grpc_infer_response_compression_level must be one of {', '.join(map(repr, COMPRESSION_LEVELS))},"
            f" got {config.grpc_infer_response_compression_level!r}"
        )
    seconds("graceful_timeout")
    seconds("drain_delay")
    if config.switch_interval is not None and not (
        isinstance(config.switch_interval, (int, float))
        and not isinstance(config.switch_interval, bool)
        and 0 < config.switch_interval <= 1
    ):
        raise ValueError(f"switch_interval must be > 0 and at most 1 second, or None, got {config.switch_interval!r}")


def _check_grpc_tls(config: ServeConfig) -> None:
    """Refuses TLS settings that do not make a TLS listener: a flag that is
    not a bool, TLS without its certificate and key (or mutual TLS without
    roots), or files given with TLS off, which would serve plaintext to
    clients that expect TLS; then reads the files as a TLS server would
    (:func:`grpc_tls`), so a bad file fails the start on either front-end."""
    for flag in ("grpc_use_ssl", "grpc_use_ssl_mutual"):
        if not isinstance(getattr(config, flag), bool):
            raise ValueError(f"{flag} must be True or False, got {getattr(config, flag)!r}")
    files = ("grpc_server_cert", "grpc_server_key", "grpc_root_cert")
    for name in files:
        path = getattr(config, name)
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"{name} must be a file's path or None, got {path!r}")
    if not (config.grpc_use_ssl or config.grpc_use_ssl_mutual):
        given = [name for name in files if getattr(config, name) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} given without grpc_use_ssl: gRPC would be served without TLS")
        return
    if config.grpc_server_cert is None or config.grpc_server_key is None:
        raise ValueError("grpc_use_ssl needs grpc_server_cert and grpc_server_key (PEM files)")
    if config.grpc_use_ssl_mutual and config.grpc_root_cert is None:
        raise ValueError("grpc_use_ssl_mutual needs grpc_root_cert: the certificates that sign clients' certificates")
    grpc_tls(config)


@dataclass(frozen=True)
class GrpcTls:
    """The PEM bytes of a TLS gRPC listener (:func:`grpc_tls`)."""

    cert: bytes
    key: bytes
    #: Clients must present a certificate these sign; None: no client certificates.
    root: bytes | None


#: The most bytes a certificate or key file may hold (as the native front-end's).
MAX_PEM_FILE = 1 << 20


def grpc_tls(config: ServeConfig) -> GrpcTls | None:
    """The config's TLS files, read (each bounded before it is read) and
    checked with :mod:`ssl` (the key is the certificate's; the roots are
    certificates); ``ValueError`` names the file. None: plaintext gRPC."""
    if not (config.grpc_use_ssl or config.grpc_use_ssl_mutual):
        return None
    assert config.grpc_server_cert is not None and config.grpc_server_key is not None  # _check_grpc_tls

    def read(name: str, path: str) -> bytes:
        try:
            size = os.stat(path).st_size
            if size > MAX_PEM_FILE:
                raise ValueError(f"{name} {path}: {size} bytes, more than a PEM file holds ({MAX_PEM_FILE})")
            with open(path, "rb") as file:
                return file.read(MAX_PEM_FILE)
        except OSError as exc:
            raise ValueError(f"{name} {path}: {exc.strerror or exc}") from None

    cert = read("grpc_server_cert", config.grpc_server_cert)
    key = read("grpc_server_key", config.grpc_server_key)
    root = (
        read("grpc_root_cert", config.grpc_root_cert) if config.grpc_use_ssl_mutual and config.grpc_root_cert else None
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.grpc_server_cert, config.grpc_server_key)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(
            f"grpc_server_cert {config.grpc_server_cert} and grpc_server_key {config.grpc_server_key}: {exc}"
        ) from None
    if root is not None:
        try:
            context.load_verify_locations(cadata=root.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise ValueError(f"grpc_root_cert {config.grpc_root_cert}: {exc}") from None
    return GrpcTls(cert, key, root)


def _native_tls(config: ServeConfig) -> dict[str, Any]:
    """The native front-end's TLS arguments (it reads the files itself)."""
    if not (config.grpc_use_ssl or config.grpc_use_ssl_mutual):
        return {}
    return {
        "grpc_server_cert": config.grpc_server_cert,
        "grpc_server_key": config.grpc_server_key,
        "grpc_root_cert": config.grpc_root_cert if config.grpc_use_ssl_mutual else None,
        "grpc_use_ssl_mutual": config.grpc_use_ssl_mutual,
    }


#: What ``log_level`` may be: the names both logging and uvicorn know.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _check_host(host: object, *, native: bool) -> None:
    if not isinstance(host, str) or not host:
        raise ValueError(f"host must be a non-empty str, got {host!r}")
    if not native or host == "localhost":
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host must be an IP address (or 'localhost') with frontend='native', got {host!r}") from None


def _check_share_name(what: str, name: object) -> None:
    """Refuses a name shared memory cannot use (``ValueError`` naming ``what``)."""
    ok = (
        isinstance(name, str)
        and 0 < len(name) <= MAX_SHARE_NAME
        and not name.startswith(".")
        and all(c.isascii() and (c.isalnum() or c in "._-") for c in name)
    )
    if not ok:
        raise ValueError(
            f"{what} must be 1 to {MAX_SHARE_NAME} letters, digits, '.', '_' or '-' (not starting with '.'),"
            f" got {name!r}"
        )


#: The longest name shared memory takes (its file is /dev/shm/ferrobatch.NAME).
MAX_SHARE_NAME = 200


class _Repository(ModelRepository):
    """A repository whose readiness can be turned off while requests are
    still served (the drain delay), or held off until the native front-end
    serves the started models (it takes them all at once, after the last
    warm-up: a model started before then would say ready yet answer 503)."""

    unready = False
    awaiting_native = False

    @property
    def ready(self) -> bool:
        return self._held_back_because() is None and super().ready

    def model_ready(self, name: str, version: str = "") -> bool:
        return super().model_ready(name, version) and self._held_back_because() is None

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        reason = self._held_back_because()
        index = super().repository_index(ready_only)
        if reason is None:
            return index
        if ready_only:
            return []  # every entry was a ready one
        return [{**e, "state": "UNAVAILABLE", "reason": reason} if e["state"] == "READY" else e for e in index]

    def _held_back_because(self) -> str | None:
        """Why a started model must not say ready now, or None."""
        if self.unready:
            return "draining"
        if self.awaiting_native:
            return "waiting for the other models to start"
        return None


@dataclass(frozen=True)
class Listening:
    """What :func:`serve` reports once it accepts requests, and how to serve
    one more model while it runs (:meth:`add`)."""

    http_port: int | None
    grpc_port: int | None
    #: The models served; grows with :meth:`add`.
    models: list[str]
    metrics_port: int | None = None
    #: Vertex AI's endpoint's port (``ServeConfig.vertex_ai``), or None.
    vertex_ai_port: int | None = None
    #: SageMaker's endpoint's port (``ServeConfig.sagemaker``), or None.
    sagemaker_port: int | None = None
    _adder: Callable[[Server], Coroutine[Any, Any, None]] | None = field(default=None, repr=False, compare=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False, compare=False)

    async def add(self, server: Server) -> None:
        """Serves ``server`` too, from any event loop: starts it here (its
        warm-up) if it is not running, then serves it over every listener
        (HTTP, gRPC, metrics, ``--share``'s shared memory as ``SHARE.MODEL``).
        Until it returns, requests to the model are answered as to an unknown
        one. ``ValueError`` if a model of its name is served;
        :class:`~ferrobatch.ServerClosedError` once :func:`serve` is stopping;
        what its start raised if it failed (nothing else is affected)."""
        adder, loop = self._adding()
        if asyncio.get_running_loop() is loop:
            await adder(server)
        else:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(adder(server), loop))

    def add_blocking(self, server: Server, timeout: float | None = None) -> None:
        """:meth:`add` from a thread that runs no event loop of its own (or
        another one's): waits for it, at most ``timeout`` seconds
        (``TimeoutError``; the model is still added once started)."""
        adder, loop = self._adding()
        if _running_loop() is loop:
            raise RuntimeError("add_blocking() on serve()'s own event loop would wait for itself: await add()")
        future = asyncio.run_coroutine_threadsafe(adder(server), loop)
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"model '{server.name}' was not served within {timeout} s") from None

    def _adding(self) -> tuple[Callable[[Server], Coroutine[Any, Any, None]], asyncio.AbstractEventLoop]:
        """serve()'s adder and its loop."""
        if self._adder is None or self._loop is None:
            raise ServerClosedError("this Listening was not made by serve(): it cannot add a model")
        return self._adder, self._loop


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def serve(
    servers: Sequence[Server],
    config: ServeConfig | None = None,
    *,
    on_ready: Callable[[Listening], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serves ``servers`` over HTTP and gRPC until SIGINT/SIGTERM (when on the
    main thread) or until ``stop`` is set, then shuts down gracefully.

    The listeners open first; servers that are not running are then started
    here (warm-up: not ready meanwhile) and stopped on the way out.
    ``on_ready`` is called once every server is ready, with the
    :class:`Listening` whose :meth:`~Listening.add` serves one more. With
    ``config.log_file``, ferrobatch's log goes to that file meanwhile.
    """
    config = config or ServeConfig()
    check_config(config)
    with _log_settings.to_file(config.log_file, getattr(logging, config.log_level.upper())):
        await _serve(servers, config, on_ready=on_ready, stop=stop)


async def _serve(
    servers: Sequence[Server],
    config: ServeConfig,
    *,
    on_ready: Callable[[Listening], None] | None,
    stop: asyncio.Event | None,
) -> None:
    """:func:`serve` past its checks."""
    repository = _Repository(
        servers,
        expose_errors=config.expose_errors,
        cpu_metrics=config.cpu_metrics,
        gpu_metrics=config.gpu_metrics,
        allow_client_shm=config.allow_client_shm,
        model_control_mode=config.model_control_mode,
        strict_readiness=config.strict_readiness,
        server_id=config.server_id,
    )
    if config.load_models is not None and list(config.load_models) != ["*"]:
        unknown = sorted(set(config.load_models) - {s.name for s in repository.servers})
        if unknown:
            raise StartupError(f"--load-model: no model named {', '.join(map(repr, unknown))}")
        repository.leave_unloaded(s.name for s in repository.servers if s.name not in config.load_models)
    if config.share is not None:  # refused now, not after the warm-ups
        for server in repository.servers:
            _check_share_name("share name", _shared_name(repository.servers, server, config.share))
    stop = stop or asyncio.Event()
    delayed = asyncio.Event()  # the drain delay is over (or skipped)
    forced = asyncio.Event()
    started: list[Server] = []
    http: uvicorn.Server | None = None
    http_task: asyncio.Task[None] | None = None
    rpc: grpc.aio.Server | None = None
    native: NativeListeners | None = None
    metrics: MetricsListener | None = None
    platforms: list[PredictionListener] = []  # Vertex AI's, SageMaker's
    with _signals(stop, delayed, forced):
        try:
            grpc_port = None
            http_port = None
            if config.frontend == "native":
                from .http._native import NativeListeners

                repository.awaiting_native = True  # until attach(), below
                try:
                    native = NativeListeners(
                        repository,
                        config.host,
                        config.http_port,
                        config.grpc_port,
                        max_body_size=config.max_body_size,
                        max_decompressed_size=config.max_decompressed_size,
                        threads=config.threads,
                        max_connections=config.max_connections,
                        max_streams=config.max_streams,
                        header_timeout=config.header_timeout,
                        body_timeout=config.body_timeout,
                        idle_timeout=config.idle_timeout,
                        keepalive_interval=config.keepalive_interval,
                        keepalive_timeout=config.keepalive_timeout,
                        grpc_response_compression=config.grpc_infer_response_compression_level,
                        http_header_forward_pattern=config.http_header_forward_pattern,
                        grpc_header_forward_pattern=config.grpc_header_forward_pattern,
                        max_stream_backlog=config.max_stream_backlog,
                        http_restricted_api=config.http_restricted_api,
                        grpc_restricted_protocol=config.grpc_restricted_protocol,
                        strict_readiness=config.strict_readiness,
                        **_native_tls(config),
                    )
                except OSError as exc:
                    raise StartupError(str(exc)) from None
                http_port, grpc_port = native.http_port, native.grpc_port
                log.info(
                    "native front-end: %d runtime thread(s)%s",
                    native.threads,
                    "" if config.threads is not None else f" (picked: half of {usable_cores()} usable cores)",
                )
            elif config.grpc_port is not None:
                # The Python front-end's packages (grpcio, uvicorn, Starlette) are
                # imported only when it runs: the native one needs none of them.
                import grpc

                from .grpc import grpc_server

                rpc = grpc_server(
                    repository,
                    None,
                    max_message_size=config.max_body_size,
                    max_stream_backlog=config.max_stream_backlog,
                    grpc_restricted_protocol=config.grpc_restricted_protocol,
                    keepalive_interval=config.keepalive_interval,
                    keepalive_timeout=config.keepalive_timeout,
                    response_compression=config.grpc_infer_response_compression_level,
                )
                address = f"{_bracket(config.host)}:{config.grpc_port}"
                tls = grpc_tls(config)
                try:
                    if tls is None:
                        grpc_port = rpc.add_insecure_port(address)
                    else:
                        credentials = grpc.ssl_server_credentials(
                            [(tls.key, tls.cert)], root_certificates=tls.root, require_client_auth=tls.root is not None
                        )
                        grpc_port = rpc.add_secure_port(address, credentials)
                except RuntimeError as exc:
                    raise StartupError(f"gRPC: cannot listen on {address}: {exc}") from None
                await rpc.start()
            if config.http_port is not None and config.frontend == "python":
                import uvicorn

                from .http import starlette_app

                app = starlette_app(
                    repository,
                    manage_servers=False,
                    max_body_size=config.max_body_size,
                    max_decompressed_size=config.max_decompressed_size,
                    http_restricted_api=config.http_restricted_api,
                    max_stream_backlog=config.max_stream_backlog,
                )
                http = _uvicorn_server(
                    uvicorn.Config(
                        app,
                        host=config.host,
                        port=config.http_port,
                        lifespan="off",
                        log_level=config.log_level,
                        access_log=config.access_log,
                        proxy_headers=False,  # bound to a known host; no X-Forwarded-* rewriting
                        server_header=False,  # no "server: uvicorn" for clients to fingerprint
                        # A backstop only: _shutdown answers every request in time.
                        timeout_graceful_shutdown=math.ceil(config.graceful_timeout) + _BACKSTOP,
                        http="httptools" if _has("httptools") else "h11",
                    )
                )
                http_task = asyncio.create_task(_serve_http(http))
                http_port = await _bound_port(http, http_task)
            if config.metrics_port is not None:
                metrics = _metrics_listener(repository, config.host, config.metrics_port)
            metrics_port = metrics.port if metrics is not None else None
            adding = asyncio.Lock()  # one model added at a time: its name is checked, then it starts

            async def add(server: Server) -> None:
                async with adding:
                    if stop.is_set() or repository.closing:
                        raise ServerClosedError(f"model '{server.name}' not added: the server is shutting down")
                    if not isinstance(server, Server):
                        raise TypeError(f"expected a ferrobatch.Server, got {type(server).__name__}")
                    if any(s.name == server.name for s in repository.servers):
                        raise ValueError(f"a model named {server.name!r} is served already")
                    shared_as = f"{config.share}.{server.name}" if config.share is not None else None
                    if shared_as is not None:
                        _check_share_name("share name", shared_as)
                    started_in_time = await _start_servers([server], started, stop, http_task)
                    if not started_in_time or stop.is_set() or repository.closing:
                        # Stopping began during its warm-up: the shutdown may have passed it by.
                        await server.stop(timeout=config.graceful_timeout)
                        raise ServerClosedError(f"model '{server.name}' not added: the server is shutting down")
                    model = repository.add(server)
                    if native is not None:
                        native.add(model)
                    if shared_as is not None:
                        _share_as(server, shared_as)
                    listening.models.append(server.name)
                    log.info("model '%s': added, serving", server.name)

            listening = Listening(
                http_port,
                grpc_port,
                [s.name for s in repository.servers],
                metrics_port,
                _adder=add,
                _loop=asyncio.get_running_loop(),
            )
            where = (
                f"HTTP on {config.host}:{http_port}" if http_port is not None else "HTTP off",
                f"gRPC on {config.host}:{grpc_port}" if grpc_port is not None else "gRPC off",
                f"; metrics on {config.host}:{metrics_port}" if metrics_port is not None else "",
            )
            log.info("listening (%s, %s%s); not ready until the models have started", *where)

            def failed(server: Server, exc: BaseException) -> None:
                why = error_message(exc, server.name, expose=config.expose_errors)
                log.error("model '%s': failed to start; serving the others (exit_on_error off): %s", server.name, why)
                repository.leave_unloaded([server.name], failed=f"failed to start: {why}")

            loading = [m.server for m in repository.loaded_models]
            on_failure = None if config.exit_on_error else failed
            if not await _start_servers(loading, started, stop, http_task, on_failure):
                return
            if native is not None:
                native.attach()
                repository.awaiting_native = False
            if config.share is not None:
                _share(repository.servers, config.share, loaded=[m.server for m in repository.loaded_models])
                everyone = repository.servers

                def share_again(model: ServedModel, loaded: bool) -> None:
                    # A run's shares end with it: a model loaded again is shared again.
                    if loaded:
                        _share_as(model.server, _shared_name(everyone, model.server, config.share or ""))

                repository.on_model_control(share_again)
            if config.vertex_ai is not None:
                platforms.append(await _prediction_listener(repository, config, config.vertex_ai))
                listening = dataclasses.replace(listening, vertex_ai_port=platforms[-1].port)
            if config.sagemaker is not None:
                platforms.append(await _prediction_listener(repository, config, config.sagemaker))
                listening = dataclasses.replace(listening, sagemaker_port=platforms[-1].port)
            # What start-up left on the heap (torch, the model, the imports:
            # some 200k objects) is kept for good: moved out of the collector's
            # reach, a full collection no longer walks it every few hundred ms
            # (measured: 28 % of the server's CPU and its p99, binary HTTP).
            gc.collect()
            gc.freeze()
            log.info("start-up heap frozen: %d objects kept out of full collections", gc.get_freeze_count())
            log.info(
                "serving %s: HTTP %s, gRPC %s",
                ", ".join(listening.models),
                f"http://{config.host}:{http_port}" if http_port is not None else "off",
                f"{config.host}:{grpc_port}" if grpc_port is not None else "off",
            )
            if on_ready is not None:
                on_ready(listening)
            await _any(stop.wait(), *_watch(http_task))
            if stop.is_set() and config.drain_delay > 0:
                await _drain_delay(config.drain_delay, repository, native, delayed)
        finally:
            delayed.set()
            log.info("shutting down: refusing new requests, draining accepted ones")
            repository.close()
            if native is not None:
                native.drain()
            await _shutdown(http, http_task, rpc, native, repository, started, forced, config.graceful_timeout)
            for platform in platforms:
                await platform.close()
            if metrics is not None:
                await asyncio.to_thread(metrics.close)
            log.info("stopped")


async def _prediction_listener(
    repository: ModelRepository, config: ServeConfig, platform: VertexAI | SageMaker
) -> PredictionListener:
    """Vertex AI's or SageMaker's endpoint, listening (``StartupError`` when it cannot)."""
    from .http._cloud import PredictionListener
    from .http._endpoint import Endpoint

    # Triton's Vertex AI and SageMaker endpoints keep its HTTP restrictions: the same handlers answer.
    endpoint = Endpoint(
        repository,
        max_decompressed_size=config.max_decompressed_size,
        http_restricted_api=config.http_restricted_api,
        max_stream_backlog=config.max_stream_backlog,
    )
    try:
        listener = PredictionListener(endpoint, platform, max_body_size=config.max_body_size)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:
        await listener.start(config.host, platform.port)
    except OSError as exc:
        raise StartupError(
            f"{listener.platform}: cannot listen on {_bracket(config.host)}:{platform.port}: {exc}"
        ) from None
    log.info("%s endpoint on %s:%s (%s)", listener.platform, config.host, listener.port, listener.routes)
    return listener


def _metrics_listener(repository: ModelRepository, host: str, port: int) -> MetricsListener:
    """``GET /metrics`` on a port of its own (``StartupError`` when it cannot listen)."""
    from .metrics import MetricsListener, registry

    collectors = registry(lambda: repository.servers, cpu=repository.cpu_metrics, gpu=repository.gpu_metrics)
    try:
        return MetricsListener(collectors, host, port)
    except OSError as exc:
        raise StartupError(f"metrics: cannot listen on {_bracket(host)}:{port}: {exc}") from None


async def _drain_delay(
    seconds: float, repository: _Repository, native: NativeListeners | None, delayed: asyncio.Event
) -> None:
    """Readiness says not ready for ``seconds`` (or until ``delayed`` is set)
    while requests are still served."""
    log.info("draining: not ready, still serving for %g s (drain delay)", seconds)
    repository.unready = True
    if native is not None:
        native.set_ready(False)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await delayed.wait()


#: Seconds the listeners' own graceful limits run past ``graceful_timeout``:
#: by then every accepted request has been answered (see _shutdown).
_BACKSTOP = 5


async def _any(*waits: Awaitable[Any]) -> None:
    """Returns once any of ``waits`` is done, and cancels the others (shield
    a task that must go on)."""
    futures = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            if future.done() and not future.cancelled():
                future.exception()  # seen here; raised, if at all, by its owner
            future.cancel()


def _watch(task: asyncio.Task[None] | None) -> list[Awaitable[Any]]:
    """``task`` (uvicorn's, which ends if it fails) shielded, for :func:`_any`."""
    return [] if task is None else [asyncio.shield(task)]


def _share(servers: Sequence[Server], name: str, loaded: Sequence[Server]) -> None:
    """Shares the ``loaded`` servers of ``servers`` through shared memory (``--share``)."""
    for server in loaded:
        _share_as(server, _shared_name(servers, server, name))


def _share_as(server: Server, shared_as: str) -> None:
    try:
        server.share(shared_as)
    except (ValueError, OSError) as exc:
        raise StartupError(f"--share: {exc}") from None
    log.info("model '%s': shared as '%s' (ferrobatch.connect(%r))", server.name, shared_as, shared_as)


def _shared_name(servers: Sequence[Server], server: Server, share: str) -> str:
    """What ``--share`` shares ``server`` as: ``share`` (one model), else ``share.MODEL``."""
    return share if len(servers) == 1 else f"{share}.{server.name}"


async def _start_servers(
    servers: Sequence[Server],
    started: list[Server],
    stop: asyncio.Event,
    http_task: asyncio.Task[None] | None,
    on_failure: Callable[[Server, BaseException], None] | None = None,
) -> bool:
    """Starts the servers that are not running, one by one, logging each
    warm-up; False if ``stop`` was set (or HTTP ended) first. Raises what a
    failed start raised, or with ``on_failure`` tells it and goes on."""

    async def start_all() -> None:
        for server in servers:
            if server.running:
                continue
            log.info("model '%s': starting (warm-up)", server.name)
            began = time.perf_counter()
            try:
                await server.start()
            except (FerrobatchError, RuntimeError) as exc:
                if on_failure is None or isinstance(exc, ServerClosedError):  # stopping: not the model's failure
                    raise
                on_failure(server, exc)
                continue
            started.append(server)
            log.info("model '%s': ready (%.2f s)", server.name, time.perf_counter() - began)

    starting = asyncio.ensure_future(start_all())
    try:
        await _any(asyncio.shield(starting), stop.wait(), *_watch(http_task))
    finally:
        if not starting.done():
            log.info("stopping before the models have started (a warm-up in progress ends first)")
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
    if starting.cancelled():
        return False
    starting.result()
    return True


async def _shutdown(
    http: uvicorn.Server | None,
    http_task: asyncio.Task[None] | None,
    rpc: grpc.aio.Server | None,
    native: NativeListeners | None,
    repository: ModelRepository,
    started: Sequence[Server],
    forced: asyncio.Event,
    timeout: float,
) -> None:
    """Closes the listeners, lets the requests in flight finish for at most
    ``timeout`` seconds (or until ``forced``), then stops the servers, which
    answers those still waiting (ServerClosedError: HTTP 503, gRPC
    UNAVAILABLE) before the listeners' own limits would cut them off."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    listeners: list[asyncio.Future[Any]] = []
    if rpc is not None:
        listeners.append(asyncio.ensure_future(rpc.stop(grace=timeout + _BACKSTOP)))
    if http is not None and http_task is not None:
        http.should_exit = True
        listeners.append(http_task)

    async def force() -> None:
        await forced.wait()
        if http is not None:
            http.force_exit = True
        if rpc is not None:
            await rpc.stop(grace=0)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await _any(repository.wait_idle(), forced.wait())
    if native is not None:
        # Closes the listener; accepted native requests finish meanwhile.
        await _any(native.close(max(0.0, deadline - loop.time())), forced.wait())
    if rpc is not None:
        from .grpc import stop_streams

        # As native.close() does: open streams read no more requests and end
        # once theirs are answered, or an idle one would hold rpc.stop() its whole grace.
        stop_streams(rpc)
    # Those a client's load started, and those an unload is stopping, first: no server stops twice at once.
    await repository.stop_loaded(timeout=0.0 if forced.is_set() else max(0.0, deadline - loop.time()))
    for server in reversed(started):
        left = 0.0 if forced.is_set() else max(0.0, deadline - loop.time())
        await server.stop(timeout=left)
    if native is not None:
        await native.stop(_BACKSTOP)  # writes what stopping the servers answered
    # Only now may a second signal cut the listeners short: every call has
    # its answer from ferrobatch (cut off earlier, it would get a transport error).
    forcing = asyncio.ensure_future(force())
    try:
        results = await asyncio.gather(*listeners, return_exceptions=True)
    finally:
        forcing.cancel()
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            log.warning("shutdown: %s", result)


def _uvicorn_server(config: uvicorn.Config) -> uvicorn.Server:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server minus its signal handlers: serve() owns the signals."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


async def _serve_http(http: uvicorn.Server) -> None:
    try:
        await http.serve()
    except SystemExit:
        pass  # uvicorn's way to fail a start; it has logged why (a port in use, say)


async def _bound_port(http: uvicorn.Server, task: asyncio.Task[None]) -> int:
    """Waits for uvicorn to listen; the port it bound (the one given, or the
    one picked for port 0)."""
    while not http.started:
        if task.done():
            task.result()
            config = http.config
            raise StartupError(f"HTTP: cannot listen on {config.host}:{config.port}")
        await asyncio.sleep(0.01)
    port: int = http.servers[0].sockets[0].getsockname()[1]
    return port


@contextlib.contextmanager
def _signals(stop: asyncio.Event, delayed: asyncio.Event, forced: asyncio.Event) -> Iterator[None]:
    """SIGINT/SIGTERM: the first sets ``stop``; the next ``delayed`` while
    the drain delay runs, else ``forced``."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []

    def handle(sig: signal.Signals) -> None:
        if stop.is_set() and not delayed.is_set():
            log.warning("%s again: ending the drain delay", sig.name)
            delayed.set()
        elif stop.is_set():
            log.warning("%s again: not waiting for requests in flight", sig.name)
            forced.set()
        else:
            log.info("%s: shutting down gracefully", sig.name)
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, handle, sig)
        except (NotImplementedError, RuntimeError, ValueError):
            continue  # not the main thread, or no signal support: rely on `stop`
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextlib.contextmanager
def serve_in_thread(
    servers: Sequence[Server], config: ServeConfig | None = None, *, start_timeout: float = 60.0
) -> Iterator[Listening]:
    """Runs :func:`serve` on a background thread with its own event loop while
    inside the block (for tests, notebooks, or a synchronous program); yields
    where it listens. Leaving the block shuts it down gracefully and joins.

    The servers must not be running yet: they are started on that loop.
    """
    ready: queue.SimpleQueue[Listening | BaseException] = queue.SimpleQueue()
    loop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        loop_box.append((asyncio.get_running_loop(), stop))
        await serve(servers, config, on_ready=ready.put, stop=stop)

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            ready.put(exc)

    thread = threading.Thread(target=target, name="ferrobatch-serve", daemon=True)
    thread.start()
    try:
        first = ready.get(timeout=start_timeout)
    except queue.Empty:
        # Stopped and joined before raising: no listener or started model is left behind.
        _stop_serving(loop_box, thread)
        raise RuntimeError(f"serve did not become ready within {start_timeout}s") from None
    if isinstance(first, BaseException):
        thread.join()
        raise first
    try:
        yield first
    finally:
        _stop_serving(loop_box, thread)
        if not ready.empty():
            leftover = ready.get()
            if isinstance(leftover, BaseException):
                raise leftover


def _stop_serving(loop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]], thread: threading.Thread) -> None:
    """Sets serve_in_thread's stop event from this thread and joins its thread."""
    while not loop_box and thread.is_alive():
        time.sleep(0.01)  # its loop is not running yet
    if loop_box:
        loop, stop = loop_box[0]
        with contextlib.suppress(RuntimeError):  # the loop has closed already
            loop.call_soon_threadsafe(stop.set)
    thread.join()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def run(
    servers: Sequence[Server],
    config: ServeConfig | None = None,
    *,
    loop: str = "auto",
) -> int:
    """Blocking :func:`serve` on a fresh event loop (uvloop when installed and
    ``loop`` is "auto" or "uvloop"). Returns the process exit status."""
    config = config or ServeConfig()
    check_config(config)
    if config.switch_interval is not None:
        sys.setswitchinterval(config.switch_interval)
    logging.basicConfig(level=config.log_level.upper(), format=_log_settings.FORMAT)
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    if loop == "uvloop" or (loop == "auto" and _has("uvloop")):
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(serve(servers, config))
    _join_leftover_threads()
    return 0


def _join_leftover_threads() -> None:
    """Waits, as the interpreter's exit would, for the threads still running
    after :func:`serve` (a warm-up that a signal interrupted goes on on its
    own thread), but with SIGINT/SIGTERM still handled: the next one ends
    the process at once, with status 0, as a second signal does while serving."""
    leftover = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
    if not leftover or threading.current_thread() is not threading.main_thread():
        return

    def exit_now(signum: int, frame: object) -> None:
        log.warning("%s again: exiting without waiting for them", signal.Signals(signum).name)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the warm-up's thread cannot be stopped, and a normal exit would join it

    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, exit_now) for sig in handled}  # before saying so: a signal told of is handled
    names = ", ".join(t.name for t in leftover)
    log.info("waiting for the threads still running (%s: a warm-up, say) to end; a second signal exits at once", names)
    try:
        for thread in leftover:
            thread.join()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``ferrobatch serve`` command line."""
    parser.add_argument(
        "target",
        nargs="?",
        help="module:attr or file.py:attr naming a Server, a list of them, or a function"
        " returning either (module is looked up in the current directory first)",
    )
    parser.add_argument("--demo", action="store_true", help="serve the built-in demo MLP as 'mlp'")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000; 0: any free)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0: any free)")
    parser.add_argument(
        "--frontend",
        default="native",
        choices=["native", "python"],
        help="who answers HTTP and gRPC: native (Rust, the default) or python (uvicorn + Starlette, grpcio)",
    )
    parser.add_argument("--no-http", action="store_true", help="serve gRPC only")
    parser.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    parser.add_argument(
        "--graceful-timeout",
        type=_seconds,
        default=30.0,
        help="seconds to wait for accepted requests on shutdown; those still waiting then"
        " get 503 / UNAVAILABLE (default 30)",
    )
    parser.add_argument(
        "--drain-delay",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, say not ready (503) but go on serving for this long before"
        " closing the listeners, so a load balancer stops sending first; a second signal"
        " ends it early (default 0)",
    )
    parser.add_argument(
        "--threads",
        type=_count,
        default=None,
        metavar="N",
        help="native front-end: runtime threads, across which connections spread (default: half"
        " the cores the process may run on, the rest left to the models)",
    )
    parser.add_argument(
        "--max-connections",
        type=_count,
        default=10_000,
        metavar="N",
        help="native front-end: connections open at once; a new one beyond is closed at once (default 10000)",
    )
    parser.add_argument(
        "--max-streams",
        type=_count,
        default=1024,
        metavar="N",
        help="native front-end: HTTP/2 (h2c, gRPC) streams in flight per connection (default 1024)",
    )
    parser.add_argument(
        "--max-stream-backlog",
        type=_size,
        default=MAX_STREAM_BACKLOG,
        metavar="BYTES",
        help="bytes of a decoupled model's responses one stream (gRPC ModelStreamInfer, HTTP generate_stream)"
        " holds unread by its client; a response past them fails its request (default 64 MiB)",
    )
    parser.add_argument(
        "--header-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="native front-end: time for a request's headers (and a new connection's first"
        " bytes) to arrive before the connection is closed (default 30)",
    )
    parser.add_argument(
        "--body-timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="native front-end: time for a request's body to arrive; 408 after (default 60)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="native front-end: a connection with no request in flight this long is closed (default 300)",
    )
    parser.add_argument(
        "--keepalive-interval",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="HTTP/2 connections (native: h2c and gRPC; python: gRPC) are pinged this often and closed"
        " when a ping goes unanswered for --keepalive-timeout; 0: no pings (default 60)",
    )
    parser.add_argument(
        "--grpc-infer-response-compression-level",
        choices=COMPRESSION_LEVELS,
        default="none",
        help="compress gRPC responses: low with gzip, medium and high with deflate (each the other when a"
        " call accepts only that one), as Triton's flag; none (default) sends them as they are",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=_seconds,
        metavar="SECONDS",
        help="how long a keepalive ping may go unanswered (default: --keepalive-interval)",
    )
    parser.add_argument(
        "--http-header-forward-pattern",
        metavar="REGEX",
        help="native front-end: HTTP headers whose names match join the request's parameters"
        " (for models built with_requests)",
    )
    parser.add_argument(
        "--grpc-header-forward-pattern",
        metavar="REGEX",
        help="native front-end: the same for gRPC metadata",
    )
    parser.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="APIS:HEADER=VALUE",
        help="answer the HTTP API groups APIS (comma-separated: health, metadata, inference, shared-memory,"
        " model-config, model-repository, statistics, trace, logging) only to requests whose HEADER is"
        " VALUE, 403 otherwise; repeatable, one group per API",
    )
    parser.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="PROTOCOLS:KEY=VALUE",
        help="the same for gRPC: the calls need triton-grpc-protocol-KEY: VALUE in their metadata,"
        " UNAVAILABLE otherwise",
    )
    parser.add_argument(
        "--max-body-size",
        type=_size,
        default=MAX_BODY_SIZE,
        metavar="BYTES",
        help=f"largest request body (HTTP) or message (gRPC) accepted (default {MAX_BODY_SIZE})",
    )
    parser.add_argument(
        "--max-decompressed-size",
        type=_size,
        default=MAX_DECOMPRESSED_SIZE,
        metavar="BYTES",
        help="most bytes a gzip or deflate HTTP body may expand to; 413 beyond (default"
        f" {MAX_DECOMPRESSED_SIZE}). Responses are gzip or deflate coded when Accept-Encoding asks",
    )
    _add_flag(
        parser,
        "--allow-client-shm",
        False,
        "let clients register POSIX shared-memory regions and name them in requests for inputs and"
        " outputs (Triton's system shared-memory extension; off by default: a client that may register"
        " regions may read or overwrite any /dev/shm object this process may open)",
    )
    _add_flag(
        parser,
        "--grpc-use-ssl",
        False,
        "serve gRPC over TLS, with --grpc-server-cert and --grpc-server-key (Triton's; HTTP stays plaintext)",
    )
    _add_flag(
        parser,
        "--grpc-use-ssl-mutual",
        False,
        "gRPC over TLS where clients must present a certificate that --grpc-root-cert signs",
    )
    parser.add_argument("--grpc-server-cert", metavar="PEM", help="the gRPC server's certificate chain (PEM file)")
    parser.add_argument("--grpc-server-key", metavar="PEM", help="the certificate's private key (PEM file)")
    parser.add_argument(
        "--grpc-root-cert", metavar="PEM", help="the certificates that sign clients' certificates (PEM file)"
    )
    _add_flag(
        parser,
        "--exit-on-error",
        True,
        "a model that fails to start stops the server from starting (default true); false: the"
        " others serve, it is left unloaded (and the server not ready, with --strict-readiness)",
    )
    _add_flag(
        parser,
        "--strict-readiness",
        True,
        "/v2/health/ready says ready only while every model is (default true); false: while the"
        " server serves, whatever its models' state",
    )
    parser.add_argument(
        "--id",
        default=SERVER_ID,
        metavar="NAME",
        help=f"the name server metadata answers, as Triton's --id (default {SERVER_ID!r}; Triton's is 'triton')",
    )
    parser.add_argument(
        "--model-control-mode",
        choices=MODEL_CONTROL_MODES,
        default="none",
        help="Triton's model control: 'explicit' lets clients unload a model and load it again"
        " (tritonclient's load_model / unload_model); 'none' (default) refuses both",
    )
    parser.add_argument(
        "--load-model",
        action="append",
        dest="load_models",
        metavar="NAME",
        help="with --model-control-mode=explicit: a model to start with the server (repeat it for"
        " several; '*' alone: every model, the default); the others wait, unloaded, for a load",
    )
    parser.add_argument(
        "--expose-errors",
        action="store_true",
        help="send the text of a model's exceptions to clients (default: their type and a"
        " request id; the log has the traceback)",
    )
    parser.add_argument(
        "--share",
        metavar="NAME",
        default=None,
        help="also serve processes of this user through shared memory: ferrobatch.connect(NAME)"
        " (NAME.MODEL each when serving several models)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also serve GET /metrics on this port (Triton's is 8002; 0: any free); the HTTP port serves it either way",
    )
    parser.add_argument(
        "--vertex-ai",
        action="store_true",
        help="also serve Vertex AI's prediction endpoint (Triton's --allow-vertex-ai): its routes from"
        " AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE, its port from --vertex-ai-port, else AIP_HTTP_PORT, else 8080",
    )
    parser.add_argument("--vertex-ai-port", type=int, default=None, metavar="PORT", help="Vertex AI's port")
    parser.add_argument(
        "--vertex-ai-default-model",
        default=None,
        metavar="MODEL",
        help="the model Vertex AI's predict route infers (needed when several are served)",
    )
    parser.add_argument(
        "--sagemaker",
        action="store_true",
        help="also serve SageMaker's inference endpoint (Triton's --allow-sagemaker: GET /ping, POST /invocations):"
        " the model from SAGEMAKER_TRITON_DEFAULT_MODEL_NAME (else the one served), the port from --sagemaker-port,"
        " else SAGEMAKER_BIND_TO_PORT, else 8080",
    )
    parser.add_argument("--sagemaker-port", type=int, default=None, metavar="PORT", help="SageMaker's port")
    parser.add_argument(
        "--no-cpu-metrics",
        action="store_true",
        help="leave the machine's CPU and memory (nv_cpu_*) and the process's (process_*) out of /metrics",
    )
    parser.add_argument(
        "--no-gpu-metrics", action="store_true", help="leave the GPUs' metrics (nv_gpu_*, from NVML) out of /metrics"
    )
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument(
        "--log-file", metavar="PATH", help="write the log to this file (appended) instead of standard error"
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.001,
        help="the interpreter's GIL switch interval in seconds (default 0.001; 0: Python's own)",
    )


def _positive(what: str, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number > 0, and at most ``most`` when given
    (``what`` names it in errors)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
        return value

    return parse


_size = _positive("a number of bytes")
_count = _positive("a whole number")


def _add_flag(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    """A boolean option as Triton's take one: ``--name``, ``--name true`` or ``--name=false``."""
    parser.add_argument(name, nargs="?", const=True, default=default, type=_flag, metavar="true|false", help=help)


def _flag(text: str) -> bool:
    """An argparse type: a boolean as Triton's options take one."""
    value = {"true": True, "1": True, "on": True, "false": False, "0": False, "off": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with parsed ``serve`` arguments (for ``parser.error``), or None."""
    if args.demo == (args.target is not None):
        return "give either a target (module:attr) or --demo"
    if args.header_timeout <= 0 or args.body_timeout <= 0 or args.idle_timeout <= 0:
        return "--header-timeout, --body-timeout and --idle-timeout must be > 0 seconds"
    if args.no_http and args.no_grpc:
        return "--no-http and --no-grpc leave nothing to serve; drop one of them"
    return None


def _print_target_traceback(exc: TargetError) -> None:
    """The traceback of the target's error from its own first frame on (the
    loader's frames, ferrobatch's and importlib's, say nothing to its author)."""
    error = exc.__cause__
    if error is None:
        return
    frames = error.__traceback__
    while frames is not None and _is_loader_frame(frames.tb_frame.f_code.co_filename):
        frames = frames.tb_next
    # With no frame of its own left (a factory called with too few arguments), the message says it all;
    # a SyntaxError still shows its line.
    if frames is not None or isinstance(error, SyntaxError):
        traceback.print_exception(type(error), error, frames, file=sys.stderr)


def _is_loader_frame(filename: str) -> bool:
    importlib_dir = os.path.dirname(importlib.__file__ or "") + os.sep
    return filename == __file__ or filename.startswith(("<frozen importlib", importlib_dir))


def main(args: argparse.Namespace) -> int:
    """Runs ``ferrobatch serve`` with parsed ``args``; returns the exit status."""
    problem = check_arguments(args)
    if problem is not None:
        print(f"ferrobatch serve: error: {problem}", file=sys.stderr)
        return 2
    config = ServeConfig(
        host=args.host,
        http_port=None if args.no_http else args.http_port,
        frontend=args.frontend,
        grpc_port=None if args.no_grpc else args.grpc_port,
        graceful_timeout=args.graceful_timeout,
        log_level=args.log_level,
        log_file=args.log_file,
        access_log=args.access_log,
        switch_interval=args.switch_interval or None,
        expose_errors=args.expose_errors,
        max_body_size=args.max_body_size,
        max_decompressed_size=args.max_decompressed_size,
        drain_delay=args.drain_delay,
        threads=args.threads,
        max_connections=args.max_connections,
        max_streams=args.max_streams,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        idle_timeout=args.idle_timeout,
        keepalive_interval=args.keepalive_interval,
        keepalive_timeout=args.keepalive_timeout,
        grpc_infer_response_compression_level=args.grpc_infer_response_compression_level,
        http_header_forward_pattern=args.http_header_forward_pattern,
        grpc_header_forward_pattern=args.grpc_header_forward_pattern,
        http_restricted_api=tuple(args.http_restricted_api),
        grpc_restricted_protocol=tuple(args.grpc_restricted_protocol),
        allow_client_shm=args.allow_client_shm,
        model_control_mode=args.model_control_mode,
        load_models=args.load_models,
        exit_on_error=args.exit_on_error,
        strict_readiness=args.strict_readiness,
        grpc_use_ssl=args.grpc_use_ssl,
        grpc_use_ssl_mutual=args.grpc_use_ssl_mutual,
        grpc_server_cert=args.grpc_server_cert,
        grpc_server_key=args.grpc_server_key,
        grpc_root_cert=args.grpc_root_cert,
        server_id=args.id,
        max_stream_backlog=args.max_stream_backlog,
        share=args.share,
        metrics_port=args.metrics_port,
        cpu_metrics=not args.no_cpu_metrics,
        gpu_metrics=not args.no_gpu_metrics,
    )
    try:
        if args.vertex_ai:
            config.vertex_ai = VertexAI.from_env(args.vertex_ai_port, args.vertex_ai_default_model)
        elif args.vertex_ai_port is not None or args.vertex_ai_default_model is not None:
            raise ValueError("--vertex-ai-port and --vertex-ai-default-model need --vertex-ai")
        if args.sagemaker:
            config.sagemaker = SageMaker.from_env(args.sagemaker_port)
        elif args.sagemaker_port is not None:
            raise ValueError("--sagemaker-port needs --sagemaker")
        check_config(config)
    except ValueError as exc:
        print(f"ferrobatch serve: error: {exc}", file=sys.stderr)
        return 2
    # As `python -m` does: a target module in the current directory imports
    # (the `ferrobatch` script's own directory is first on sys.path instead).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        if args.demo:
            from .demo import make_demo_server

            servers = [make_demo_server()]
        else:
            servers = load_servers(args.target)
    except TargetError as exc:
        _print_target_traceback(exc)
        print(f"ferrobatch serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"ferrobatch serve: {exc}", file=sys.stderr)
        return 2
    try:
        return run(servers, config, loop=args.loop)
    except (StartupError, ValueError) as exc:
        print(f"ferrobatch serve: {exc}", file=sys.stderr)
        return 1
    except ModelError as exc:
        log.error("a model failed to start", exc_info=exc)
        print(f"ferrobatch serve: {exc}", file=sys.stderr)
        return 1
