"""PyTriton's clients (``pytriton.client``) on tritonclient, for scripts
that call their models the PyTriton way::

    with ModelClient("localhost:8000", "double") as client:       # "grpc://localhost:8001" for gRPC
        out = client.infer_batch(x=np.ones((2, 4), np.float32))   # {"y": array of shape (2, 4)}
        one = client.infer_sample(np.ones(4, np.float32))         # positional: the model's input order

    with FuturesModelClient("localhost", "double") as client:     # from any thread, without blocking
        future = client.infer_batch(x=batch)                      # concurrent.futures.Future

    async with AsyncioModelClient("localhost", "double") as client:
        out = await client.infer_sample(np.ones(4, np.float32))

    with DecoupledModelClient("grpc://localhost:8001", "tokens") as client:  # a decoupled model
        for out in client.infer_sample(np.ones(4, np.float32)):    # each response as it comes
            ...

They talk to any v2 server (ferrobatch's, Triton's). Each reads the model's
config first (``model_config``: a :class:`TritonModelConfig`), waiting for the
model to be ready, unless given one. As PyTriton's, an HTTP server that
cannot be reached (down, stopping) raises :class:`PyTritonClientTimeoutError`
(gRPC's UNAVAILABLE: :class:`PyTritonClientInferenceServerError`). Needs
``tritonclient`` (``pip install 'tritonclient[http,grpc]'``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import http.client
import importlib
import itertools
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from types import ModuleType, TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

import numpy as np

from ..model_config import DynamicBatcher
from ..model_config.triton_model_config import TensorSpec, TritonModelConfig
from .auth import create_auth_headers, extract_access_token_from_headers
from .exceptions import (
    PyTritonClientClosedError,
    PyTritonClientError,
    PyTritonClientInferenceServerError,
    PyTritonClientInvalidUrlError,
    PyTritonClientModelDoesntSupportBatchingError,
    PyTritonClientModelUnavailableError,
    PyTritonClientQueueFullError,
    PyTritonClientTimeoutError,
    PyTritonClientValueError,
)

__all__ = [
    "AsyncioDecoupledModelClient",
    "AsyncioModelClient",
    "DecoupledModelClient",
    "FuturesModelClient",
    "ModelClient",
    "PyTritonClientClosedError",
    "PyTritonClientError",
    "PyTritonClientInferenceServerError",
    "PyTritonClientInvalidUrlError",
    "PyTritonClientModelDoesntSupportBatchingError",
    "PyTritonClientModelUnavailableError",
    "PyTritonClientQueueFullError",
    "PyTritonClientTimeoutError",
    "PyTritonClientValueError",
]

T = TypeVar("T")
Parameters = Mapping[str, str | int | float | bool]


_DEFAULT_PORTS = {"http": 8000, "grpc": 8001}
#: The longest one readiness or config request may take (PyTriton's network timeout).
_MAX_PROBE_S = 60.0
#: The shortest: a request given no time at all could not even be sent.
_MIN_PROBE_S = 0.1
#: How a server (Triton's, ferrobatch's) starts its answer for a model it does not serve ...
_UNKNOWN_MODEL = "Request for unknown model"
#: ... and its status: 400 over HTTP, NOT_FOUND over gRPC (a model's own error is 500 / INTERNAL).
_UNKNOWN_MODEL_STATUSES = frozenset({"400", "404", "StatusCode.NOT_FOUND"})


def _lib(scheme: str, aio: bool = False) -> ModuleType:
    """tritonclient's module for ``scheme`` (imported here: an optional dependency)."""
    return importlib.import_module(f"tritonclient.{scheme}{'.aio' if aio else ''}")


def _utils() -> ModuleType:
    return importlib.import_module("tritonclient.utils")


def _parse_url(url: object) -> tuple[str, str]:
    """``(scheme, host:port)`` of ``[http://|grpc://]host[:port]``."""
    if not isinstance(url, str):
        raise PyTritonClientInvalidUrlError(f"Invalid url {url!r}. Url must be a string.")
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = parts.scheme.lower()
    try:
        port = parts.port  # urllib checks it only when asked
    except ValueError as exc:
        raise PyTritonClientInvalidUrlError(f"Invalid url {url!r}: {exc}") from exc
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise PyTritonClientInvalidUrlError(f"url must be [http://|grpc://]host[:port], got {url!r}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # IPv6 keeps its brackets
    return scheme, f"{host}:{port or _DEFAULT_PORTS[scheme]}"


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What the HTTP clients raise when the server cannot be reached or
    drops the connection (tritonclient leaves them as they are)."""
    errors: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)
    with contextlib.suppress(ImportError):  # aiohttp comes with tritonclient's asyncio HTTP client only
        errors += (importlib.import_module("aiohttp").ClientConnectionError,)
    return errors


def _call_errors() -> tuple[type[BaseException], ...]:
    """Every error of a call to the server that the clients turn into their own."""
    return (_utils().InferenceServerException, *_unreachable_errors())


def _message_of(exc: BaseException) -> str:
    message = exc.message() if hasattr(exc, "message") and callable(exc.message) else None
    return str(message or exc)


def _status_of(exc: BaseException) -> str | None:
    status = exc.status() if hasattr(exc, "status") and callable(exc.status) else None
    return None if status is None else str(status)


def _is_unknown_model(exc: BaseException) -> bool:
    """Whether the server said it serves no such model (not a model's error
    that happens to say so: that one comes as 500 / INTERNAL)."""
    return _status_of(exc) in _UNKNOWN_MODEL_STATUSES and _message_of(exc).startswith(_UNKNOWN_MODEL)


def _grpc_only(url: str, client: str) -> None:
    """Refuses a URL that is not gRPC's for a decoupled model's client (streams are gRPC only)."""
    if _parse_url(url)[0] != "grpc":
        raise PyTritonClientValueError(f"{client} is only supported for grpc protocol")


def parse_model_config(config: Mapping[str, Any]) -> TritonModelConfig:
    """A :class:`TritonModelConfig` from Triton's JSON model config (HTTP's,
    or gRPC's as JSON, whose 64-bit integers are strings)."""
    to_dtype = _utils().triton_to_np_dtype

    def tensors(key: str) -> list[TensorSpec]:
        specs = []
        for t in config.get(key, []):
            dtype = to_dtype(str(t.get("data_type", "TYPE_FP32")).removeprefix("TYPE_").replace("STRING", "BYTES"))
            specs.append(
                TensorSpec(
                    str(t["name"]),
                    tuple(int(d) for d in t.get("dims", [])),
                    np.bytes_ if dtype is np.object_ else dtype,
                    bool(t.get("optional", False)),
                )
            )
        return specs

    max_batch_size = int(config.get("max_batch_size", 0))
    batching = config.get("dynamic_batching")
    batcher = None
    if batching is not None:
        batcher = DynamicBatcher(
            max_queue_delay_microseconds=int(batching.get("max_queue_delay_microseconds", 0)),
            preferred_batch_size=[int(s) for s in batching.get("preferred_batch_size", [])] or None,
            preserve_ordering=bool(batching.get("preserve_ordering", False)),
            priority_levels=int(batching.get("priority_levels", 0)),
            default_priority_level=int(batching.get("default_priority_level", 0)),
        )
    return TritonModelConfig(
        model_name=str(config.get("name", "")),
        max_batch_size=max_batch_size,
        batching=max_batch_size > 0,
        batcher=batcher,
        decoupled=bool(config.get("model_transaction_policy", {}).get("decoupled", False)),
        inputs=tensors("input"),
        outputs=tensors("output"),
        response_cache=bool(config.get("response_cache", {}).get("enable", False)),
    )


class _Requests:
    """What every client shares: the address, the model, and how inputs
    become tritonclient requests and answers become numpy arrays."""

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None,
        init_timeout_s: float | None,
        inference_timeout_s: float | None,
        access_token: str | None,
    ) -> None:
        self.scheme, self.url = _parse_url(url)
        self.model_name = model_name
        self.model_version = model_version or ""
        self.init_timeout_s = 300.0 if init_timeout_s is None else init_timeout_s
        self.inference_timeout_s = 60.0 if inference_timeout_s is None else inference_timeout_s
        self.headers: dict[str, str] = {}
        if access_token is not None:
            self.headers.update(create_auth_headers(access_token, self.scheme))

    def same_as(self, config: TritonModelConfig | None) -> dict[str, Any]:
        """The arguments of a client like this one (``from_existing_client``)."""
        token = extract_access_token_from_headers(self.headers)
        known: dict[str, Any] = {"model_config": config, "ensure_model_is_ready": False} if config else {}
        return {
            "url": f"{self.scheme}://{self.url}",
            "model_name": self.model_name,
            "model_version": self.model_version or None,
            "init_timeout_s": self.init_timeout_s,
            "inference_timeout_s": self.inference_timeout_s,
            "access_token": token,
            **known,
        }

    @property
    def probe_timeout_s(self) -> float:
        """The network timeout of readiness and config requests (PyTriton's: ``init_timeout_s``, at most 60 s)."""
        return max(_MIN_PROBE_S, min(_MAX_PROBE_S, self.init_timeout_s))

    @staticmethod
    def check_call(
        inputs: tuple[np.ndarray, ...],
        named_inputs: Mapping[str, np.ndarray],
        parameters: Parameters | None,
        headers: Mapping[str, Any] | None,
    ) -> None:
        """The checks of a call that need no server, made before anything
        else (the config read included), as PyTriton's clients make them."""
        if not inputs and not named_inputs:
            raise PyTritonClientValueError("Provide input data")
        if inputs and named_inputs:
            raise PyTritonClientValueError("pass the inputs either by position or by name, not both")
        checked(parameters)
        checked(headers)

    def named(
        self, config: TritonModelConfig, inputs: tuple[np.ndarray, ...], named_inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The call's inputs by name (by position: in the model's order)."""
        if not inputs:
            return dict(named_inputs)
        declared = config.inputs or []
        names = [t.name for t in declared]
        # By position: the model's inputs in order; the optional ones at the end may be left out.
        required = max((i + 1 for i, t in enumerate(declared) if not t.optional), default=0)
        if not required <= len(inputs) <= len(names):
            raise PyTritonClientValueError(f"model {self.model_name!r} takes {len(names)} inputs: {names}")
        return dict(zip(names, inputs))

    def tensors(self, lib: ModuleType, inputs: Mapping[str, np.ndarray]) -> list[Any]:
        utils = _utils()
        tensors = []
        for name, array in inputs.items():
            array = np.asarray(array)
            if array.dtype.kind == "U":
                raise UnencodedTextError(
                    f"input {name!r}: Unicode inputs are not supported: encode them first"
                    " (np.char.encode(array, 'utf-8'))"
                )
            tensor = lib.InferInput(name, list(array.shape), utils.np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def merged_headers(self, headers: Mapping[str, Any] | None) -> dict[str, str] | None:
        """The client's headers and the call's, the call's first."""
        # Header values as text: gRPC metadata takes nothing else (PyTriton's examples pass ints).
        merged = {**self.headers, **{k: str(v) for k, v in (headers or {}).items()}}
        return merged or None

    def infer_kwargs(self, parameters: Parameters | None, headers: Mapping[str, str] | None) -> dict[str, Any]:
        """``infer``'s keyword arguments (``check_call`` checked the parameters and headers)."""
        kwargs: dict[str, Any] = {
            "model_version": self.model_version,
            "parameters": dict(parameters) if parameters else None,
            "headers": self.merged_headers(headers),
        }
        if self.scheme == "grpc":
            kwargs["client_timeout"] = self.inference_timeout_s
        return kwargs

    def failed(
        self, exc: BaseException, during: str = "inference", timeout_s: float | None = None
    ) -> PyTritonClientError:
        """The client's error for what a call to the server (``during`` it) raised."""
        timeout_s = self.inference_timeout_s if timeout_s is None else timeout_s
        # socket.timeout and asyncio's are TimeoutError: checked before the other OSErrors.
        if isinstance(exc, TimeoutError):
            return PyTritonClientTimeoutError(f"{during} timed out after {timeout_s} s")
        if isinstance(exc, _unreachable_errors()):
            # As PyTriton's: no connection to the server (down, stopping) is a timeout.
            return PyTritonClientTimeoutError(f"{during} failed: no answer from the server at {self.url}: {exc!r}")
        message = _message_of(exc)
        # The call's deadline, whether the client's gRPC stack or the server (which it told) says so.
        if "Deadline Exceeded" in message or _status_of(exc) == "StatusCode.DEADLINE_EXCEEDED":
            return PyTritonClientTimeoutError(f"{during} timed out: {message}")
        if _is_unknown_model(exc):
            return PyTritonClientModelUnavailableError(message)
        return PyTritonClientInferenceServerError(f"{during} failed: {message}")

    def config_failed(self, exc: BaseException) -> PyTritonClientError:
        """The client's error for what reading the model's config raised."""
        return self.failed(exc, "reading the model config", self.init_timeout_s)

    @staticmethod
    def outputs(result: Any) -> dict[str, np.ndarray]:
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [
            o.name for o in response.outputs
        ]  # fmt: skip
        return {n: result.as_numpy(n) for n in names}

    def probe_kwargs(self, remaining_s: float) -> dict[str, Any]:
        """The keyword arguments of a readiness or config request with
        ``remaining_s`` left to answer (gRPC takes a deadline per call; HTTP's
        client has its own, ``probe_timeout_s``)."""
        kwargs: dict[str, Any] = {"headers": self.headers or None}
        if self.scheme == "grpc":
            kwargs["client_timeout"] = max(_MIN_PROBE_S, min(_MAX_PROBE_S, remaining_s))
        return kwargs

    def config_kwargs(self, remaining_s: float) -> dict[str, Any]:
        """``get_model_config``'s keyword arguments (gRPC's answer as JSON, like HTTP's)."""
        kwargs = self.probe_kwargs(remaining_s)
        if self.scheme == "grpc":
            kwargs["as_json"] = True
        return kwargs

    def config_json(self, raw: Any) -> Mapping[str, Any]:
        """The JSON config tritonclient returned (gRPC's ``as_json`` wraps it)."""
        if self.scheme == "grpc":
            config: Mapping[str, Any] = raw["config"]
            return config
        return dict(raw)

    def not_ready(self, timeout_s: float) -> PyTritonClientTimeoutError:
        return PyTritonClientTimeoutError(f"model {self.model_name!r} not ready at {self.url} in {timeout_s} s")


class UnencodedTextError(PyTritonClientValueError, RuntimeError):
    """A ``str`` (Unicode) input array: PyTriton's clients raise
    ``RuntimeError`` for it, ferrobatch's client errors are
    :class:`PyTritonClientValueError`; this one is both."""


def checked(values: Mapping[str, Any] | None) -> None:
    """Refuses parameters or headers PyTriton's clients refuse: keys that
    are not text, values that are not text, int or bool (a float too, as
    there)."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise PyTritonClientValueError("Parameters and headers must be a dictionary")
    for key, value in values.items():
        if not isinstance(key, str):
            raise PyTritonClientValueError("Parameter/header key must be a string")
        if not isinstance(value, (str, int, bool)):
            raise PyTritonClientValueError("Parameter/header value must be a string, integer or boolean")


def _batched(config: TritonModelConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: a[np.newaxis, ...] for n, a in arrays.items()} if config.batching else dict(arrays)


def _debatched(config: TritonModelConfig, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {n: a[0] for n, a in arrays.items()} if config.batching else dict(arrays)


class ModelClient:
    """A blocking client of one model, as PyTriton's: ``url`` is ``host``,
    ``host:port``, ``http://host:port`` or ``grpc://host:port`` (no scheme:
    HTTP; no port: 8000 for HTTP, 8001 for gRPC). The model's config (its
    inputs' order, whether it batches) is read before the first inference
    (at once with ``lazy_init=False``), after waiting up to
    ``init_timeout_s`` for the model to be ready. Given a ``model_config``,
    the client still waits for the model before its first inference, unless
    ``ensure_model_is_ready=False``. ``inference_timeout_s`` (default 60)
    bounds each request; each readiness or config request takes at most
    what is left of ``init_timeout_s`` (over HTTP: at most
    ``min(60, init_timeout_s)``, as PyTriton's). ``access_token`` is sent as
    Triton's ``triton-access-token``."""

    _streams = False  # True: a decoupled model's client (gRPC only)

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        lazy_init: bool = True,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
        model_config: TritonModelConfig | None = None,
        ensure_model_is_ready: bool = True,
        access_token: str | None = None,
    ) -> None:
        if self._streams:  # a decoupled model's client: streams are gRPC only
            _grpc_only(url, type(self).__name__)
        self._requests = _Requests(url, model_name, model_version, init_timeout_s, inference_timeout_s, access_token)
        self.url, self.scheme = self._requests.url, self._requests.scheme
        self.model_name, self.model_version = model_name, self._requests.model_version
        self._lib = _lib(self.scheme)
        if self.scheme == "http":
            timeout = self._requests.inference_timeout_s
            self._client: Any = self._lib.InferenceServerClient(
                self.url, connection_timeout=timeout, network_timeout=timeout
            )
        else:
            self._client = self._lib.InferenceServerClient(self.url)
        # HTTP's readiness and config requests: a client of their own, made when first needed.
        self._http_prober: Any = None
        self._config = model_config
        # Whether the model was seen ready: a given config with ensure_model_is_ready skips the wait.
        self._model_ready = model_config is not None and not ensure_model_is_ready
        self._closed = False
        if not lazy_init:
            self.model_config  # noqa: B018 - read now: waits for the model

    @classmethod
    def from_existing_client(cls, existing_client: ModelClient) -> Self:
        """A new client of ``existing_client``'s model, address, timeouts and
        access token, with its model config if it has read it (then without
        waiting for the model again), as PyTriton's."""
        return cls(**existing_client._requests.same_as(existing_client._config))

    # -- PyTriton's API -------------------------------------------------------------------------

    def get_lib(self) -> ModuleType:
        """tritonclient's module this client uses (``tritonclient.http`` or ``.grpc``)."""
        return self._lib

    def infer_sample(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """One sample (inputs without the batch dimension) → its outputs."""
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = self._ready_config()
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        return _debatched(config, self._infer(arrays, parameters, headers))

    def infer_batch(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """A batch (inputs with a leading batch dimension) → its outputs."""
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = self._ready_config()
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return self._infer(self._requests.named(config, inputs, named_inputs), parameters, headers)

    @property
    def model_config(self) -> TritonModelConfig:
        """The model's config, read once, after waiting for the model (as
        PyTriton's, whatever ``ensure_model_is_ready`` says)."""
        if self._config is None:
            self._config = self._read_config()
        return self._config

    @property
    def is_batching_supported(self) -> bool:
        return self.model_config.batching

    def wait_for_server(self, timeout_s: float) -> None:
        """Waits until the server says it is ready."""
        self._check_open()
        self._wait(lambda prober, left: bool(prober.is_server_ready(**self._requests.probe_kwargs(left))), timeout_s,
                   lambda: PyTritonClientTimeoutError(f"server at {self.url} not ready in {timeout_s} s"))  # fmt: skip

    def wait_for_model(self, timeout_s: float) -> None:
        """Waits until the server says the model is ready."""
        self._check_open()

        def ready(prober: Any, left_s: float) -> bool:
            return bool(
                prober.is_model_ready(self.model_name, self.model_version, **self._requests.probe_kwargs(left_s))
            )

        self._wait(ready, timeout_s, lambda: self._requests.not_ready(timeout_s))

    def load_model(self, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        """Asks the server to load the model (Triton's repository API, in
        explicit model control mode): ``config``, Triton's configuration as
        JSON, reloads it with new batching on a ferrobatch server; ``files``
        are refused there."""
        try:
            self._client.load_model(self.model_name, config=config, files=files, headers=self._requests.headers or None)
        except _call_errors() as exc:
            raise self._requests.failed(exc, "loading the model") from exc

    def unload_model(self) -> None:
        """Asks the server to unload the model (see :meth:`load_model`)."""
        try:
            self._client.unload_model(self.model_name, headers=self._requests.headers or None)
        except _call_errors() as exc:
            raise self._requests.failed(exc, "unloading the model") from exc

    def close(self) -> None:
        self._closed = True
        if self._http_prober is not None:
            self._http_prober.close()
        self._client.close()

    def __enter__(self) -> ModelClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:  # tritonclient's own errors say less (RuntimeError, ValueError)
            raise PyTritonClientClosedError("ModelClient is closed")

    @property
    def _general_client(self) -> Any:
        """The tritonclient client of readiness and config requests, by the
        name PyTriton's ``ModelClient`` gives it (its own tests hand it to
        :func:`ferrobatch.triton.client.utils.wait_for_server_ready`)."""
        self._check_open()
        return self._prober()

    def _prober(self) -> Any:
        """The client of readiness and config requests: over HTTP, one whose
        network timeout is ``probe_timeout_s`` (HTTP takes no deadline per
        request); over gRPC, the client itself (each request has its own)."""
        if self.scheme != "http":
            return self._client
        if self._http_prober is None:
            timeout = self._requests.probe_timeout_s
            self._http_prober = self._lib.InferenceServerClient(
                self.url, connection_timeout=timeout, network_timeout=timeout
            )
        return self._http_prober

    def _ready_config(self) -> TritonModelConfig:
        """The model's config, once the model was seen ready (waited for once)."""
        config = self.model_config
        if not self._model_ready:
            self.wait_for_model(self._requests.init_timeout_s)
            self._model_ready = True
        return config

    def _read_config(self) -> TritonModelConfig:
        """Waits for the model, then reads its config, within ``init_timeout_s`` in all."""
        self._check_open()
        deadline = time.monotonic() + self._requests.init_timeout_s
        self.wait_for_model(self._requests.init_timeout_s)
        self._model_ready = True
        left_s = deadline - time.monotonic()
        try:
            raw = self._prober().get_model_config(
                self.model_name, self.model_version, **self._requests.config_kwargs(left_s)
            )
        except _call_errors() as exc:
            raise self._requests.config_failed(exc) from exc
        return parse_model_config(self._requests.config_json(raw))

    def _wait(self, ready: Callable[[Any, float], bool], timeout_s: float, timed_out: Callable[[], Exception]) -> None:
        """Asks ``ready(prober, seconds left)`` until it says yes or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready(self._prober(), deadline - time.monotonic()):
                    return
            except _call_errors():
                pass  # not up yet
            if time.monotonic() >= deadline:
                raise timed_out()
            time.sleep(0.05)

    def _infer(
        self, inputs: Mapping[str, np.ndarray], parameters: Parameters | None, headers: Mapping[str, str] | None
    ) -> dict[str, np.ndarray]:
        self._check_open()
        tensors = self._requests.tensors(self._lib, inputs)
        try:
            result = self._client.infer(self.model_name, tensors, **self._requests.infer_kwargs(parameters, headers))
        except _call_errors() as exc:
            raise self._requests.failed(exc) from exc
        return self._requests.outputs(result)


class DecoupledModelClient(ModelClient):
    """PyTriton's client of a decoupled model (gRPC only): ``infer_sample``
    and ``infer_batch`` send the request at once and return an iterator of
    its responses, each as it comes, until the server flags the last one.
    One request at a time per client: the next may start once the iterator
    is exhausted, failed, closed (``close()``) or dropped, iterated or not;
    closing or dropping it early cancels the request (the server stops the
    model once nobody listens to its batch). As PyTriton's, it waits for
    each response as long as the stream lives (``inference_timeout_s`` does
    not bound a stream: a model may take any time between responses); a
    lost connection ends it with an error, and the next call opens a new
    stream. Unlike PyTriton's, it sends ``parameters`` (headers: refused,
    as there)."""

    _streams = True

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        lazy_init: bool = True,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
        model_config: TritonModelConfig | None = None,
        ensure_model_is_ready: bool = True,
        access_token: str | None = None,
    ) -> None:
        super().__init__(
            url, model_name, model_version, lazy_init=lazy_init, init_timeout_s=init_timeout_s,
            inference_timeout_s=inference_timeout_s, model_config=model_config,
            ensure_model_is_ready=ensure_model_is_ready, access_token=access_token,
        )  # fmt: skip
        self._busy = threading.Lock()
        self._streaming = False
        # Set by the stream's callback once gRPC itself ended the stream (a lost
        # connection, a server going down): tritonclient refuses to send on it.
        self._stream_ended = False
        # What the stream's callback hands over: a result, an error, or None (the last response).
        self._responses: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ids = itertools.count()
        # Which stream is current: a cancelled one's late callbacks are dropped.
        self._generation = 0

    def infer_sample(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> Iterator[dict[str, np.ndarray]]:
        """One sample (inputs without the batch dimension) → an iterator of its responses."""
        self._check_stream_call(inputs, named_inputs, parameters, headers)
        config = self._ready_config()
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        return self._stream(arrays, parameters, functools.partial(_debatched, config))

    def infer_batch(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> Iterator[dict[str, np.ndarray]]:
        """A batch (inputs with a leading batch dimension) → an iterator of its responses."""
        self._check_stream_call(inputs, named_inputs, parameters, headers)
        config = self._ready_config()
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return self._stream(self._requests.named(config, inputs, named_inputs), parameters, dict)

    def _check_stream_call(
        self,
        inputs: tuple[np.ndarray, ...],
        named_inputs: Mapping[str, np.ndarray],
        parameters: Parameters | None,
        headers: Mapping[str, str] | None,
    ) -> None:
        """The call's checks that need no server (headers: refused, as PyTriton's)."""
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        if headers:
            raise PyTritonClientValueError("DecoupledModelClient does not support headers")

    def close(self) -> None:
        self._stop_stream()
        super().close()

    def _stop_stream(self) -> None:
        if self._streaming:
            self._generation += 1
            self._streaming = False
            # A response iterator still waiting on this stream (another thread's) is told, not left waiting.
            self._responses.put(PyTritonClientClosedError("the client's stream was stopped"))
            self._responses = queue.SimpleQueue()
            self._client.stop_stream(cancel_requests=True)

    def _open_stream(self) -> bool:
        """Starts a stream unless one is open; whether it started one."""
        if self._streaming:
            return False
        self._stream_ended = False
        callback = functools.partial(self._on_response, self._generation, self._responses)
        self._client.start_stream(callback=callback, headers=self._requests.headers or None)
        self._streaming = True
        return True

    def _stream(
        self,
        inputs: Mapping[str, np.ndarray],
        parameters: Parameters | None,
        shaped: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    ) -> _ResponseIterator:
        """Sends the request now; the iterator of its responses (each ``shaped``)."""
        self._check_open()
        if not self._busy.acquire(blocking=False):
            raise PyTritonClientInferenceServerError("Inference is already in progress")
        try:
            if not self.model_config.decoupled:
                raise PyTritonClientInferenceServerError("Model config is coupled. Use ModelClient instead.")
            send = functools.partial(
                self._client.async_stream_infer,
                self.model_name,
                self._requests.tensors(self._lib, inputs),
                model_version=self.model_version,
                request_id=str(next(self._ids)),
                enable_empty_final_response=True,
                parameters=dict(parameters) if parameters else None,
            )
            if self._stream_ended:
                self._stop_stream()
            if self._open_stream():
                send()
            else:
                try:
                    send()
                except _utils().InferenceServerException:
                    # The stream ended before its callback said so: the request never left. Once more, on a new one.
                    self._stop_stream()
                    self._open_stream()
                    send()
        except _call_errors() as exc:
            self._busy.release()
            raise self._requests.failed(exc) from exc
        except BaseException:
            self._busy.release()
            raise
        return _ResponseIterator(self, self._responses, shaped)

    def _on_response(self, generation: int, responses: queue.SimpleQueue[Any], result: Any, error: Any) -> None:
        """tritonclient's callback of the stream ``generation``, whose responses go to ``responses``."""
        if generation != self._generation:
            return  # a cancelled stream's
        if error is not None:
            # gRPC's own errors carry a status; a response's error (the model's) has none.
            if error.status() is not None:
                self._stream_ended = True
                ended = PyTritonClientInferenceServerError(
                    f"inference failed: the stream to the server ended ({error.status()}: {error.message()});"
                    " the next call opens a new stream"
                )
                ended.__cause__ = error
                error = ended
            responses.put(error)
            return
        flag = result.get_response().parameters.get("triton_final_response")
        responses.put(None if flag is not None and flag.bool_param else result)


class _ResponseIterator(Iterator[dict[str, np.ndarray]]):
    """The responses of one request of a :class:`DecoupledModelClient`, as
    they come (the request is already sent). Its client stays busy until
    the last response or an error, or until this is closed before: that
    cancels the request. Dropped unread, it leaves its client busy, as
    PyTriton's does (its own suite calls twice and expects the second to
    be refused). A generator would not do: one closed before its first
    ``next()`` never runs its ``finally``."""

    def __init__(
        self,
        client: DecoupledModelClient,
        responses: queue.SimpleQueue[Any],
        shaped: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    ) -> None:
        self._client = client
        self._responses = responses  # its stream's: a later stream has its own
        self._shaped = shaped
        self._over = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._over:
            raise StopIteration
        item = self._responses.get()  # a lost connection comes as an error
        if item is None:
            self._end(cancel=False)
            raise StopIteration
        if isinstance(item, BaseException):
            self._end(cancel=False)  # the server's last word on this request
            if isinstance(item, PyTritonClientError):
                raise item
            raise self._client._requests.failed(item) from item
        return self._shaped(self._client._requests.outputs(item))

    def close(self) -> None:
        """Leaves the request: cancels it unless it is over, and frees the client."""
        self._end(cancel=True)

    def _end(self, cancel: bool) -> None:
        if self._over:
            return
        self._over = True
        try:
            if cancel:  # and drop what it still sends
                self._client._stop_stream()
        finally:
            self._client._busy.release()


@dataclasses.dataclass
class _Call:
    """One call submitted to a :class:`FuturesModelClient`: what to run on a worker's client, and its future."""

    run: Callable[[ModelClient], Any]
    future: concurrent.futures.Future[Any]


class _CallQueue:
    """A :class:`FuturesModelClient`'s calls, in order, for its workers:
    bounded (``capacity``; None: unbounded), and closed once: then it takes
    no more calls, while the workers still take every call it holds."""

    def __init__(self, capacity: int | None) -> None:
        self._calls: collections.deque[_Call] = collections.deque()
        self._capacity = capacity
        self._closed = False
        self._idle_workers = 0
        lock = threading.Lock()
        self._has_call = threading.Condition(lock)
        self._has_room = threading.Condition(lock)

    def put(self, call: _Call, wait_s: float | None) -> None:
        """Queues ``call``, waiting up to ``wait_s`` for room (None: as long as it takes)."""
        with self._has_room:
            if not self._has_room.wait_for(self._room_or_closed, wait_s):
                raise PyTritonClientQueueFullError("Queue is full")
            if self._closed:
                raise PyTritonClientClosedError("FutureModelClient is already closed")  # PyTriton's words
            self._calls.append(call)
            self._has_call.notify()

    def wants_worker(self) -> bool:
        """Whether more calls wait than idle workers would take."""
        with self._has_call:
            return len(self._calls) > self._idle_workers

    def take(self) -> _Call | None:
        """The next call, waiting for one; None once closed and empty."""
        with self._has_call:
            self._idle_workers += 1
            self._has_call.wait_for(lambda: self._calls or self._closed)
            self._idle_workers -= 1
            if not self._calls:
                return None
            self._has_room.notify()
            return self._calls.popleft()

    def close(self) -> None:
        with self._has_call:
            self._closed = True
            self._has_call.notify_all()
            self._has_room.notify_all()

    def _room_or_closed(self) -> bool:
        return self._closed or self._capacity is None or len(self._calls) < self._capacity


@contextlib.contextmanager
def _gevent_hub_freed(scheme: str) -> Iterator[None]:
    """Frees the calling thread's gevent hub (an epoll and an eventfd) at
    the end: tritonclient.http runs on gevent, and a worker thread's hub
    lives on after the thread otherwise."""
    try:
        yield
    finally:
        if scheme == "http":
            importlib.import_module("gevent").get_hub().destroy()


class _WorkerClients:
    """Makes the clients of a :class:`FuturesModelClient`'s workers: once
    one has seen the model ready, the next ones get its config and do not
    wait for the model again."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        self._arguments = arguments
        self._known_config: TritonModelConfig | None = None

    def new(self) -> ModelClient:
        if self._known_config is None:
            return ModelClient(**self._arguments)
        return ModelClient(**{**self._arguments, "model_config": self._known_config, "ensure_model_is_ready": False})

    def learn_from(self, client: ModelClient) -> None:
        if self._known_config is None and client._model_ready and client._config is not None:
            self._known_config = client._config


def _work(calls: _CallQueue, clients: _WorkerClients, scheme: str) -> None:
    """A :class:`FuturesModelClient`'s worker: runs calls on a client of its
    own until the queue is closed and empty, then closes that client (in
    this thread, as tritonclient.http's gevent wants) and frees the
    thread's hub. It holds no reference to its FuturesModelClient: one
    dropped unclosed closes its queue (``weakref.finalize``), and its
    workers end."""
    client: ModelClient | None = None
    with _gevent_hub_freed(scheme):
        try:
            while (call := calls.take()) is not None:
                if not call.future.set_running_or_notify_cancel():
                    continue  # cancelled while it waited
                try:
                    client = client or clients.new()
                    result = call.run(client)
                except BaseException as exc:  # noqa: BLE001 - the caller's to see, on its future
                    call.future.set_exception(exc)
                else:
                    clients.learn_from(client)
                    call.future.set_result(result)
        finally:
            if client is not None:
                client.close()


class FuturesModelClient:
    """PyTriton's ``FuturesModelClient``: every call returns a
    ``concurrent.futures.Future`` at once, run by up to ``max_workers``
    threads (None: as many as calls wait), each with a :class:`ModelClient`
    of its own. Up to ``max_queue_size`` calls wait (None: no limit); when
    that many do, a call raises :class:`PyTritonClientQueueFullError`, at
    once with ``non_blocking=True``, else after waiting up to
    ``inference_timeout_s`` for room. Other arguments as
    :class:`ModelClient`'s. ``close()`` refuses later calls
    (:class:`PyTritonClientClosedError`) while every call submitted before
    runs to its end (``wait=True``, the default: ``close`` returns after)."""

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        max_workers: int | None = 128,
        max_queue_size: int | None = 128,
        non_blocking: bool = False,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
        model_config: TritonModelConfig | None = None,
        ensure_model_is_ready: bool = True,
        access_token: str | None = None,
    ) -> None:
        # ValueError, as PyTriton's.
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_queue_size is not None and max_queue_size <= 0:
            raise ValueError("max_queue_size must be greater than 0")
        self._scheme = _parse_url(url)[0]  # a bad URL fails here, not in every future
        arguments = {
            "url": url,
            "model_name": model_name,
            "model_version": model_version,
            "init_timeout_s": init_timeout_s,
            "inference_timeout_s": inference_timeout_s,
            "model_config": model_config,
            "ensure_model_is_ready": ensure_model_is_ready,
            "access_token": access_token,
        }
        self._clients = _WorkerClients(arguments)
        self._max_workers = max_workers
        # A blocked call waits for room as long as PyTriton's: inference_timeout_s, or for good without one.
        self._room_wait_s = 0.0 if non_blocking else inference_timeout_s
        self._calls = _CallQueue(max_queue_size)
        weakref.finalize(self, self._calls.close)  # dropped unclosed: its workers still end
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def infer_sample(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        return self._submit(lambda c: c.infer_sample(*inputs, parameters=parameters, headers=headers, **named_inputs))

    def infer_batch(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        return self._submit(lambda c: c.infer_batch(*inputs, parameters=parameters, headers=headers, **named_inputs))

    def model_config(self) -> concurrent.futures.Future[TritonModelConfig]:
        return self._submit(lambda c: c.model_config)

    def wait_for_model(self, timeout_s: float) -> concurrent.futures.Future[None]:
        return self._submit(lambda c: c.wait_for_model(timeout_s))

    def close(self, wait: bool = True) -> None:
        """Refuses later calls; the workers run every call submitted before,
        then close their clients and end. ``wait``: returns once they have."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._calls.close()
        if wait:
            joined = 0
            while joined < len(self._workers):  # a call submitted as this closed may have started one more
                self._workers[joined].join()
                joined += 1

    def __enter__(self) -> FuturesModelClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _submit(self, run: Callable[[ModelClient], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put(_Call(run, future), self._room_wait_s)
        self._add_worker_if_wanted()
        return future

    def _add_worker_if_wanted(self) -> None:
        with self._lock:
            if self._calls.wants_worker() and (self._max_workers is None or len(self._workers) < self._max_workers):
                worker = threading.Thread(
                    target=_work, args=(self._calls, self._clients, self._scheme), name="ferrobatch-client", daemon=True
                )
                self._workers.append(worker)
                worker.start()


class AsyncioModelClient:
    """PyTriton's ``AsyncioModelClient``: :class:`ModelClient`'s calls as
    coroutines, on tritonclient's asyncio clients (``tritonclient.http.aio``,
    ``tritonclient.grpc.aio``), with its waits: ``await client.model_config``
    reads the config (once), each readiness or config request within what is
    left of ``init_timeout_s``. With ``lazy_init=False``, ``async with``
    reads it on entry (and closes the client if that fails)."""

    _streams = False  # True: a decoupled model's client (gRPC only)

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        lazy_init: bool = True,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
        model_config: TritonModelConfig | None = None,
        ensure_model_is_ready: bool = True,
        access_token: str | None = None,
    ) -> None:
        if self._streams:  # a decoupled model's client: streams are gRPC only
            _grpc_only(url, type(self).__name__)
        self._requests = _Requests(url, model_name, model_version, init_timeout_s, inference_timeout_s, access_token)
        self.url, self.scheme = self._requests.url, self._requests.scheme
        self.model_name, self.model_version = model_name, self._requests.model_version
        self._lib = _lib(self.scheme, aio=True)
        if self.scheme == "http":
            timeout = self._requests.inference_timeout_s
            self._client: Any = self._lib.InferenceServerClient(self.url, conn_timeout=timeout)
        else:
            self._client = self._lib.InferenceServerClient(self.url)
        self._config = model_config
        # Whether the model was seen ready: a given config with ensure_model_is_ready skips the wait.
        self._model_ready = model_config is not None and not ensure_model_is_ready
        self._lazy = lazy_init
        self._closed = False

    @classmethod
    def from_existing_client(cls, existing_client: AsyncioModelClient) -> Self:
        """As :meth:`ModelClient.from_existing_client`."""
        return cls(**existing_client._requests.same_as(existing_client._config))

    def _check_open(self) -> None:
        if self._closed:
            raise PyTritonClientClosedError("ModelClient is closed")

    def get_lib(self) -> ModuleType:
        return self._lib

    async def __aenter__(self) -> AsyncioModelClient:
        if not self._lazy:
            try:
                await self.model_config
            except BaseException:
                await self.close()  # else its HTTP session is left open
                raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._client.close()

    @property
    async def model_config(self) -> TritonModelConfig:
        """The model's config, read once, after waiting for the model (as
        PyTriton's, whatever ``ensure_model_is_ready`` says)."""
        if self._config is None:
            self._config = await self._read_config()
        return self._config

    async def wait_for_model(self, timeout_s: float) -> None:
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while True:
            left_s = deadline - time.monotonic()
            probe = self._client.is_model_ready(
                self.model_name, self.model_version, **self._requests.probe_kwargs(left_s)
            )
            try:
                if await asyncio.wait_for(probe, max(_MIN_PROBE_S, left_s)):
                    return
            except _call_errors():
                pass  # not up yet (a probe past its time: asyncio's TimeoutError)
            if time.monotonic() >= deadline:
                raise self._requests.not_ready(timeout_s)
            await asyncio.sleep(0.05)

    async def infer_sample(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = await self._ready_config()
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        return _debatched(config, await self._infer(arrays, parameters, headers))

    async def infer_batch(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = await self._ready_config()
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return await self._infer(self._requests.named(config, inputs, named_inputs), parameters, headers)

    async def _ready_config(self) -> TritonModelConfig:
        """The model's config, once the model was seen ready (waited for once)."""
        config = await self.model_config
        if not self._model_ready:
            await self.wait_for_model(self._requests.init_timeout_s)
            self._model_ready = True
        return config

    async def _read_config(self) -> TritonModelConfig:
        """Waits for the model, then reads its config, within ``init_timeout_s`` in all."""
        self._check_open()
        deadline = time.monotonic() + self._requests.init_timeout_s
        await self.wait_for_model(self._requests.init_timeout_s)
        self._model_ready = True
        left_s = deadline - time.monotonic()
        read = self._client.get_model_config(
            self.model_name, self.model_version, **self._requests.config_kwargs(left_s)
        )
        try:
            raw = await asyncio.wait_for(read, max(_MIN_PROBE_S, left_s))
        except _call_errors() as exc:
            raise self._requests.config_failed(exc) from exc
        return parse_model_config(self._requests.config_json(raw))

    async def _infer(
        self, inputs: Mapping[str, np.ndarray], parameters: Parameters | None, headers: Mapping[str, str] | None
    ) -> dict[str, np.ndarray]:
        self._check_open()
        tensors = self._requests.tensors(self._lib, inputs)
        kwargs = self._requests.infer_kwargs(parameters, headers)
        try:
            call: Awaitable[Any] = self._client.infer(self.model_name, tensors, **kwargs)
            if self.scheme == "http":
                call = asyncio.wait_for(call, self._requests.inference_timeout_s)
            result = await call
        except _call_errors() as exc:
            raise self._requests.failed(exc) from exc
        return self._requests.outputs(result)


class AsyncioDecoupledModelClient(AsyncioModelClient):
    """PyTriton's asyncio client of a decoupled model (gRPC only):
    ``infer_sample`` and ``infer_batch`` are async generators of the
    request's responses, each as it comes (one stream per call, ended by the
    server after the last response), sent with the call's ``headers`` and
    ``parameters``. Leaving one early cancels its request. As PyTriton's, it
    waits up to ``inference_timeout_s`` for each response: past it, the
    request is cancelled and :class:`PyTritonClientTimeoutError` raised."""

    _streams = True

    async def infer_sample(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """One sample (inputs without the batch dimension) → its responses, as they come."""
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = await self._ready_config()
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        async for out in self._stream(arrays, parameters, headers):
            yield _debatched(config, out)

    async def infer_batch(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """A batch (inputs with a leading batch dimension) → its responses, as they come."""
        self._requests.check_call(inputs, named_inputs, parameters, headers)
        config = await self._ready_config()
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        async for out in self._stream(self._requests.named(config, inputs, named_inputs), parameters, headers):
            yield out

    async def _stream(
        self, inputs: Mapping[str, np.ndarray], parameters: Parameters | None, headers: Mapping[str, str] | None
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        self._check_open()
        if not (await self.model_config).decoupled:
            raise PyTritonClientInferenceServerError("Model config is coupled. Use AsyncioModelClient instead.")
        request = {
            "model_name": self.model_name,
            "model_version": self.model_version,
            "inputs": self._requests.tensors(self._lib, inputs),
            "parameters": dict(parameters) if parameters else None,
        }

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield request

        responses = self._client.stream_infer(one_request(), headers=self._requests.merged_headers(headers))
        finished = False
        try:
            while True:
                try:
                    result, error = await self._next_response(responses)
                except StopAsyncIteration:
                    finished = True
                    return
                if error is not None:
                    finished = True
                    raise self._requests.failed(error) from error
                flag = result.get_response().parameters.get("triton_final_response")
                if flag is not None and flag.bool_param and not result.get_response().outputs:
                    finished = True
                    return
                yield self._requests.outputs(result)
        finally:
            if not finished:  # left early, or timed out: cancel the call
                responses.cancel()

    async def _next_response(self, responses: Any) -> tuple[Any, Any]:
        """The stream's next ``(result, error)``, within ``inference_timeout_s``
        (a lost connection comes as an error)."""
        timeout_s = self._requests.inference_timeout_s
        try:
            pair: tuple[Any, Any] = await asyncio.wait_for(anext(responses), timeout_s)
        except TimeoutError as exc:
            raise PyTritonClientTimeoutError(
                f"model {self.model_name!r} sent no response in {timeout_s} s (inference_timeout_s)"
            ) from exc
        return pair
