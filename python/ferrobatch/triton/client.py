"""PyTriton's ``ModelClient`` (``pytriton.client``) on tritonclient, for
scripts that call their models the PyTriton way::

    with ModelClient("localhost:8000", "double") as client:       # "grpc://localhost:8001" for gRPC
        out = client.infer_batch(x=np.ones((2, 4), np.float32))   # {"y": array of shape (2, 4)}
        one = client.infer_sample(np.ones(4, np.float32))         # positional: the model's input order

It talks to any v2 server (ferrobatch's, Triton's). Needs ``tritonclient``
(``pip install 'tritonclient[http,grpc]'``).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping
from types import ModuleType, TracebackType
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from .exceptions import PyTritonError

__all__ = [
    "ModelClient",
    "PyTritonClientError",
    "PyTritonClientInferenceServerError",
    "PyTritonClientModelUnavailableError",
    "PyTritonClientTimeoutError",
    "PyTritonClientValueError",
]


class PyTritonClientError(PyTritonError):
    """Base class of the client's errors."""


class PyTritonClientValueError(PyTritonClientError):
    """Inputs or arguments the client cannot send."""


class PyTritonClientTimeoutError(PyTritonClientError):
    """The server, the model or an inference took longer than allowed."""


class PyTritonClientModelUnavailableError(PyTritonClientError):
    """The model is not (or not yet) served."""


class PyTritonClientInferenceServerError(PyTritonClientError):
    """The server answered the inference with an error (the message says which)."""


_DEFAULT_PORTS = {"http": 8000, "grpc": 8001}


def _lib(scheme: str) -> ModuleType:
    """tritonclient's module for ``scheme`` (imported here: an optional dependency)."""
    return importlib.import_module(f"tritonclient.{scheme}")


class ModelClient:
    """A blocking client of one model, as PyTriton's: ``url`` is ``host``,
    ``host:port``, ``http://host:port`` or ``grpc://host:port`` (no scheme:
    HTTP; no port: 8000 for HTTP, 8001 for gRPC). The model's config (its
    inputs' order, whether it batches) is read before the first inference,
    waiting up to ``init_timeout_s`` for the model to be ready (at once in
    ``__init__`` with ``lazy_init=False``). ``inference_timeout_s`` (default
    60) bounds each request."""

    def __init__(
        self,
        url: str,
        model_name: str,
        model_version: str | None = None,
        *,
        lazy_init: bool = True,
        init_timeout_s: float | None = None,
        inference_timeout_s: float | None = None,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        scheme = parts.scheme.lower()
        if scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise PyTritonClientValueError(f"url must be [http://|grpc://]host[:port], got {url!r}")
        self.url = f"{parts.hostname}:{parts.port or _DEFAULT_PORTS[scheme]}"
        self.scheme = scheme
        self.model_name = model_name
        self.model_version = model_version or ""
        self._init_timeout_s = 300.0 if init_timeout_s is None else init_timeout_s
        self._inference_timeout_s = 60.0 if inference_timeout_s is None else inference_timeout_s
        self._lib = _lib(scheme)
        if scheme == "http":
            timeout = self._inference_timeout_s
            self._client: Any = self._lib.InferenceServerClient(
                self.url, connection_timeout=timeout, network_timeout=timeout
            )
        else:
            self._client = self._lib.InferenceServerClient(self.url)
        self._config: dict[str, Any] | None = None
        if not lazy_init:
            self.model_config  # noqa: B018 - read now: waits for the model

    # -- PyTriton's API -------------------------------------------------------------------------

    def infer_sample(
        self,
        *inputs: np.ndarray,
        parameters: Mapping[str, str | int | float | bool] | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """One sample (inputs without the batch dimension) → its outputs."""
        if self.is_batching_supported:
            inputs = tuple(a[np.newaxis, ...] for a in inputs)
            named_inputs = {n: a[np.newaxis, ...] for n, a in named_inputs.items()}
        result = self._infer(inputs, named_inputs, parameters, headers)
        return {n: a[0] for n, a in result.items()} if self.is_batching_supported else result

    def infer_batch(
        self,
        *inputs: np.ndarray,
        parameters: Mapping[str, str | int | float | bool] | None = None,
        headers: Mapping[str, str] | None = None,
        **named_inputs: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """A batch (inputs with a leading batch dimension) → its outputs."""
        if not self.is_batching_supported:
            raise PyTritonClientValueError(f"model {self.model_name!r} does not batch: use infer_sample")
        return self._infer(inputs, named_inputs, parameters, headers)

    @property
    def model_config(self) -> dict[str, Any]:
        """The model's config (Triton's JSON form), read once."""
        if self._config is None:
            self.wait_for_model(self._init_timeout_s)
            if self.scheme == "grpc":
                self._config = self._client.get_model_config(self.model_name, self.model_version, as_json=True)[
                    "config"
                ]
            else:
                self._config = self._client.get_model_config(self.model_name, self.model_version)
        assert self._config is not None
        return self._config

    @property
    def is_batching_supported(self) -> bool:
        return int(self.model_config.get("max_batch_size", 0)) > 0

    def wait_for_model(self, timeout_s: float) -> None:
        """Waits until the server says the model is ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._client.is_model_ready(self.model_name, self.model_version):
                    return
            except (OSError, self._utils().InferenceServerException):
                pass  # not up yet
            if time.monotonic() >= deadline:
                raise PyTritonClientTimeoutError(f"model {self.model_name!r} not ready at {self.url} in {timeout_s} s")
            time.sleep(0.05)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ModelClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _utils() -> ModuleType:
        return importlib.import_module("tritonclient.utils")

    def _infer(
        self,
        inputs: tuple[np.ndarray, ...],
        named_inputs: Mapping[str, np.ndarray],
        parameters: Mapping[str, str | int | float | bool] | None,
        headers: Mapping[str, str] | None,
    ) -> dict[str, np.ndarray]:
        if inputs and named_inputs:
            raise PyTritonClientValueError("pass the inputs either by position or by name, not both")
        if inputs:
            names = [i["name"] for i in self.model_config.get("input", [])]
            if len(inputs) != len(names):
                raise PyTritonClientValueError(f"model {self.model_name!r} takes {len(names)} inputs: {names}")
            named_inputs = dict(zip(names, inputs))
        utils = self._utils()
        tensors = []
        for name, array in named_inputs.items():
            array = np.asarray(array)
            if array.dtype.kind == "U":
                raise PyTritonClientValueError(
                    f"input {name!r}: text must be encoded first (np.char.encode(array, 'utf-8'))"
                )
            tensor = self._lib.InferInput(name, list(array.shape), utils.np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        extra: dict[str, Any] = {"client_timeout": self._inference_timeout_s} if self.scheme == "grpc" else {}
        try:
            result = self._client.infer(
                self.model_name,
                tensors,
                model_version=self.model_version,
                parameters=dict(parameters) if parameters else None,
                headers=dict(headers) if headers else None,
                **extra,
            )
        except utils.InferenceServerException as exc:
            message = exc.message() or str(exc)
            if "Deadline Exceeded" in message:
                raise PyTritonClientTimeoutError(f"inference timed out: {message}") from exc
            if "unknown model" in message:
                raise PyTritonClientModelUnavailableError(message) from exc
            raise PyTritonClientInferenceServerError(f"inference failed: {message}") from exc
        except TimeoutError as exc:  # tritonclient.http: the socket's timeout
            raise PyTritonClientTimeoutError(f"inference timed out after {self._inference_timeout_s} s") from exc
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [
            o.name for o in response.outputs
        ]  # fmt: skip
        return {n: result.as_numpy(n) for n in names}
