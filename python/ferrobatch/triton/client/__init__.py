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
model to be ready, unless given one. Needs ``tritonclient``
(``pip install 'tritonclient[http,grpc]'``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from types import ModuleType, TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import urlsplit

import numpy as np

from ..model_config import DynamicBatcher
from ..model_config.triton_model_config import TensorSpec, TritonModelConfig
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
#: Triton's header for its access-restricted endpoints (gRPC: as metadata with its prefix).
_ACCESS_HEADER = "triton-access-token"


def _lib(scheme: str, aio: bool = False) -> ModuleType:
    """tritonclient's module for ``scheme`` (imported here: an optional dependency)."""
    return importlib.import_module(f"tritonclient.{scheme}{'.aio' if aio else ''}")


def _utils() -> ModuleType:
    return importlib.import_module("tritonclient.utils")


def _parse_url(url: str) -> tuple[str, str]:
    """``(scheme, host:port)`` of ``[http://|grpc://]host[:port]``."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise PyTritonClientInvalidUrlError(f"url must be [http://|grpc://]host[:port], got {url!r}")
    return scheme, f"{parts.hostname}:{parts.port or _DEFAULT_PORTS[scheme]}"


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
            prefix = "triton-grpc-protocol-" if self.scheme == "grpc" else ""
            self.headers[prefix + _ACCESS_HEADER] = access_token

    def same_as(self, config: TritonModelConfig | None) -> dict[str, Any]:
        """The arguments of a client like this one (``from_existing_client``)."""
        token = next((v for k, v in self.headers.items() if k.endswith(_ACCESS_HEADER)), None)
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

    def named(
        self, config: TritonModelConfig, inputs: tuple[np.ndarray, ...], named_inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if not inputs and not named_inputs:
            raise PyTritonClientValueError("Provide input data")
        if inputs and named_inputs:
            raise PyTritonClientValueError("pass the inputs either by position or by name, not both")
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
                raise PyTritonClientValueError(
                    f"input {name!r}: text must be encoded first (np.char.encode(array, 'utf-8'))"
                )
            tensor = lib.InferInput(name, list(array.shape), utils.np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def infer_kwargs(self, parameters: Parameters | None, headers: Mapping[str, str] | None) -> dict[str, Any]:
        checked(parameters)
        checked(headers)
        # Header values as text: gRPC metadata takes nothing else (PyTriton's examples pass ints).
        merged = {**self.headers, **{k: str(v) for k, v in (headers or {}).items()}}
        kwargs: dict[str, Any] = {
            "model_version": self.model_version,
            "parameters": dict(parameters) if parameters else None,
            "headers": merged or None,
        }
        if self.scheme == "grpc":
            kwargs["client_timeout"] = self.inference_timeout_s
        return kwargs

    def failed(self, exc: BaseException) -> PyTritonClientError:
        """The client's error for what an inference raised."""
        if isinstance(exc, TimeoutError | asyncio.TimeoutError):
            return PyTritonClientTimeoutError(f"inference timed out after {self.inference_timeout_s} s")
        message = exc.message() if hasattr(exc, "message") and callable(exc.message) else str(exc)
        message = message or str(exc)
        status = exc.status() if hasattr(exc, "status") and callable(exc.status) else None
        # The call's deadline, whether the client's gRPC stack or the server (which it told) says so.
        if "Deadline Exceeded" in message or status == "StatusCode.DEADLINE_EXCEEDED":
            return PyTritonClientTimeoutError(f"inference timed out: {message}")
        if "unknown model" in message:
            return PyTritonClientModelUnavailableError(message)
        return PyTritonClientInferenceServerError(f"inference failed: {message}")

    @staticmethod
    def outputs(result: Any) -> dict[str, np.ndarray]:
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [
            o.name for o in response.outputs
        ]  # fmt: skip
        return {n: result.as_numpy(n) for n in names}

    def config_kwargs(self) -> dict[str, Any]:
        """``get_model_config``'s keyword arguments (gRPC's answer as JSON, like HTTP's)."""
        kwargs: dict[str, Any] = {"headers": self.headers or None}
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
    ``init_timeout_s`` for the model to be ready, unless ``model_config`` is
    given (and ``ensure_model_is_ready=False`` skips the wait).
    ``inference_timeout_s`` (default 60) bounds each request;
    ``access_token`` is sent as Triton's ``triton-access-token``."""

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
        self._config = model_config
        self._ensure_ready = ensure_model_is_ready
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
        config = self.model_config
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
        config = self.model_config
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return self._infer(self._requests.named(config, inputs, named_inputs), parameters, headers)

    @property
    def model_config(self) -> TritonModelConfig:
        """The model's config, read once (after waiting for the model)."""
        if self._config is None:
            self._check_open()
            if self._ensure_ready:
                self.wait_for_model(self._requests.init_timeout_s)
            raw = self._client.get_model_config(self.model_name, self.model_version, **self._requests.config_kwargs())
            self._config = parse_model_config(self._requests.config_json(raw))
        return self._config

    @property
    def is_batching_supported(self) -> bool:
        return self.model_config.batching

    def wait_for_server(self, timeout_s: float) -> None:
        """Waits until the server says it is ready."""
        self._wait(lambda: bool(self._client.is_server_ready(headers=self._requests.headers or None)), timeout_s,
                   lambda: PyTritonClientTimeoutError(f"server at {self.url} not ready in {timeout_s} s"))  # fmt: skip

    def wait_for_model(self, timeout_s: float) -> None:
        """Waits until the server says the model is ready."""
        self._check_open()
        ready = lambda: bool(  # noqa: E731
            self._client.is_model_ready(self.model_name, self.model_version, headers=self._requests.headers or None)
        )
        self._wait(ready, timeout_s, lambda: self._requests.not_ready(timeout_s))

    def load_model(self, config: str | None = None, files: dict[str, bytes] | None = None) -> None:
        """Asks the server to load the model (Triton's repository API; a
        server that serves a fixed set of models, as ferrobatch's, refuses)."""
        try:
            self._client.load_model(self.model_name, config=config, files=files, headers=self._requests.headers or None)
        except _utils().InferenceServerException as exc:
            raise self._requests.failed(exc) from exc

    def unload_model(self) -> None:
        """Asks the server to unload the model (see :meth:`load_model`)."""
        try:
            self._client.unload_model(self.model_name, headers=self._requests.headers or None)
        except _utils().InferenceServerException as exc:
            raise self._requests.failed(exc) from exc

    def close(self) -> None:
        self._closed = True
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

    def _wait(self, ready: Callable[[], bool], timeout_s: float, timed_out: Callable[[], Exception]) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ready():
                    return
            except (OSError, _utils().InferenceServerException):
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
        except (_utils().InferenceServerException, TimeoutError) as exc:
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
        config = self.model_config
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        return self._stream(arrays, parameters, headers, functools.partial(_debatched, config))

    def infer_batch(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> Iterator[dict[str, np.ndarray]]:
        """A batch (inputs with a leading batch dimension) → an iterator of its responses."""
        config = self.model_config
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return self._stream(self._requests.named(config, inputs, named_inputs), parameters, headers, dict)

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
        headers: Mapping[str, str] | None,
        shaped: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
    ) -> _ResponseIterator:
        """Sends the request now; the iterator of its responses (each ``shaped``)."""
        if headers:
            raise PyTritonClientValueError("DecoupledModelClient does not support headers")
        checked(parameters)
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
        except _utils().InferenceServerException as exc:
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


class FuturesModelClient:
    """PyTriton's ``FuturesModelClient``: every call returns a
    ``concurrent.futures.Future`` at once, run by up to ``max_workers``
    threads, each with a :class:`ModelClient` of its own. Arguments as
    :class:`ModelClient`'s; ``close(wait=True)`` waits for what was
    submitted, and later calls raise :class:`PyTritonClientClosedError`."""

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        max_workers: int = 128,
        max_queue_size: int = 128,
        non_blocking: bool = False,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
        model_config: TritonModelConfig | None = None,
        ensure_model_is_ready: bool = True,
        access_token: str | None = None,
    ) -> None:
        if max_workers < 1:
            raise PyTritonClientValueError(f"max_workers must be at least 1, got {max_workers}")
        del max_queue_size, non_blocking  # PyTriton's knobs of its own queue; the executor's is unbounded

        def make() -> ModelClient:
            return ModelClient(
                url,
                model_name,
                model_version,
                init_timeout_s=init_timeout_s,
                inference_timeout_s=inference_timeout_s,
                model_config=model_config,
                ensure_model_is_ready=ensure_model_is_ready,
                access_token=access_token,
            )

        self._make = make
        self._local = threading.local()
        self._clients: list[ModelClient] = []
        self._lock = threading.Lock()
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="ferrobatch-client")

    def _client(self) -> ModelClient:
        client: ModelClient | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._make()
            with self._lock:
                self._clients.append(client)
        return client

    def _submit(self, call: Callable[[ModelClient], T]) -> concurrent.futures.Future[T]:
        with self._lock:
            if self._closed:
                raise PyTritonClientClosedError("FutureModelClient is already closed")  # PyTriton's words
            return self._executor.submit(lambda: call(self._client()))

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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._executor.shutdown(wait=wait)
        for client in self._clients:
            client.close()

    def __enter__(self) -> FuturesModelClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncioModelClient:
    """PyTriton's ``AsyncioModelClient``: :class:`ModelClient`'s calls as
    coroutines, on tritonclient's asyncio clients (``tritonclient.http.aio``,
    ``tritonclient.grpc.aio``). ``await client.model_config`` reads the
    config (once)."""

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
        self._ensure_ready = ensure_model_is_ready
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
            await self.model_config
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
        if self._config is None:
            self._check_open()
            if self._ensure_ready:
                await self.wait_for_model(self._requests.init_timeout_s)
            raw = await self._client.get_model_config(
                self.model_name, self.model_version, **self._requests.config_kwargs()
            )
            self._config = parse_model_config(self._requests.config_json(raw))
        return self._config

    async def wait_for_model(self, timeout_s: float) -> None:
        self._check_open()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if await self._client.is_model_ready(
                    self.model_name, self.model_version, headers=self._requests.headers or None
                ):
                    return
            except (OSError, _utils().InferenceServerException):
                pass  # not up yet
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
        config = await self.model_config
        arrays = _batched(config, self._requests.named(config, inputs, named_inputs))
        return _debatched(config, await self._infer(arrays, parameters, headers))

    async def infer_batch(
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        config = await self.model_config
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        return await self._infer(self._requests.named(config, inputs, named_inputs), parameters, headers)

    async def _infer(
        self, inputs: Mapping[str, np.ndarray], parameters: Parameters | None, headers: Mapping[str, str] | None
    ) -> dict[str, np.ndarray]:
        self._check_open()
        tensors = self._requests.tensors(self._lib, inputs)
        kwargs = self._requests.infer_kwargs(parameters, headers)
        try:
            call = self._client.infer(self.model_name, tensors, **kwargs)
            if self.scheme == "http":
                call = asyncio.wait_for(call, self._requests.inference_timeout_s)
            result = await call
        except (_utils().InferenceServerException, TimeoutError) as exc:
            raise self._requests.failed(exc) from exc
        return self._requests.outputs(result)


class AsyncioDecoupledModelClient(AsyncioModelClient):
    """PyTriton's asyncio client of a decoupled model (gRPC only):
    ``infer_sample`` and ``infer_batch`` are async generators of the
    request's responses, each as it comes (one stream per call, ended by the
    server after the last response). Leaving one early cancels its request.
    As :class:`DecoupledModelClient`, it waits for each response as long as
    the stream lives."""

    _streams = True

    async def infer_sample(  # type: ignore[override]
        self,
        *inputs: np.ndarray,
        parameters: Parameters | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        """One sample (inputs without the batch dimension) → its responses, as they come."""
        config = await self.model_config
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
        config = await self.model_config
        if not config.batching:
            raise PyTritonClientModelDoesntSupportBatchingError(
                f"model {self.model_name!r} does not batch: use infer_sample"
            )
        async for out in self._stream(self._requests.named(config, inputs, named_inputs), parameters, headers):
            yield out

    async def _stream(
        self, inputs: Mapping[str, np.ndarray], parameters: Parameters | None, headers: Mapping[str, str] | None
    ) -> AsyncIterator[dict[str, np.ndarray]]:
        if headers:
            raise PyTritonClientValueError("AsyncioDecoupledModelClient does not support headers")
        checked(parameters)
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

        responses = self._client.stream_infer(one_request(), headers=self._requests.headers or None)
        finished = False
        try:
            while True:
                try:
                    result, error = await anext(responses)  # a lost connection comes as an error
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
            if not finished:  # left early: cancel the call
                responses.cancel()
