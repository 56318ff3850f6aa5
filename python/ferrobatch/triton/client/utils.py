"""PyTriton's client helpers (``pytriton.client.utils``) for a ``tritonclient``
client of any v2 server: make one from a URL, wait for the server or a model
to be ready, read a model's config as a
:class:`~ferrobatch.triton.model_config.triton_model_config.TritonModelConfig`.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..model_config.triton_model_config import TritonModelConfig
from . import _call_errors, _parse_url, parse_model_config
from .exceptions import PyTritonClientModelUnavailableError, PyTritonClientTimeoutError

__all__ = ["create_client_from_url", "get_model_config", "wait_for_model_ready", "wait_for_server_ready"]

#: PyTriton's defaults: a client's network timeout, and the waits for a server and for a model.
DEFAULT_NETWORK_TIMEOUT_S = 60.0
DEFAULT_WAIT_FOR_SERVER_READY_TIMEOUT_S = 60.0
DEFAULT_WAIT_FOR_MODEL_TIMEOUT_S = 300.0
#: The longest pause between two readiness questions.
_POLL_S = 1.0


def create_client_from_url(url: str, network_timeout_s: float | None = None) -> Any:
    """A ``tritonclient`` client (HTTP or gRPC, as ``url`` says: no scheme is
    HTTP, no port the scheme's default) whose requests time out after
    ``network_timeout_s`` (HTTP only: tritonclient's gRPC client takes a
    deadline per inference). :class:`PyTritonClientInvalidUrlError` for a bad
    URL."""
    scheme, address = _parse_url(url)
    lib = importlib.import_module(f"tritonclient.{scheme}")
    if scheme == "http" and network_timeout_s is not None:
        return lib.InferenceServerClient(
            address, connection_timeout=network_timeout_s, network_timeout=network_timeout_s
        )
    return lib.InferenceServerClient(address)


def wait_for_server_ready(
    client: Any, timeout_s: float | None = None, headers: Mapping[str, str] | None = None
) -> None:
    """Asks ``client``'s server whether it is live and ready until it says
    so, or raises :class:`PyTritonClientTimeoutError` after ``timeout_s``
    (default 60 s); a server that cannot be reached is asked again."""
    timeout_s = DEFAULT_WAIT_FOR_SERVER_READY_TIMEOUT_S if timeout_s is None else timeout_s

    def ready() -> bool:
        return bool(client.is_server_ready(headers=headers) and client.is_server_live(headers=headers))

    _poll(ready, time.monotonic() + timeout_s, "Waiting for server to be ready timed out.")


def wait_for_model_ready(
    client: Any,
    model_name: str,
    model_version: str | None = None,
    timeout_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Waits for the server, then for ``model_name`` (its latest version
    without ``model_version``), within ``timeout_s`` in all (default 300 s);
    :class:`PyTritonClientTimeoutError` after it."""
    timeout_s = DEFAULT_WAIT_FOR_MODEL_TIMEOUT_S if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout_s
    wait_for_server_ready(client, timeout_s, headers)
    version = model_version or ""

    def ready() -> bool:
        return bool(client.is_model_ready(model_name, version, headers=headers))

    _poll(ready, deadline, f"Waiting for model {model_name}/{version or 'latest'} to be ready timed out.")


def get_model_config(
    client: Any,
    model_name: str,
    model_version: str | None = None,
    timeout_s: float | None = None,
    headers: Mapping[str, str] | None = None,
) -> TritonModelConfig:
    """``model_name``'s config, once it is ready (see
    :func:`wait_for_model_ready`); :class:`PyTritonClientModelUnavailableError`
    when the server cannot give it."""
    wait_for_model_ready(client, model_name, model_version, timeout_s, headers)
    grpc = importlib.import_module("tritonclient.grpc")
    try:
        if isinstance(client, grpc.InferenceServerClient):
            raw = client.get_model_config(model_name, model_version or "", as_json=True, headers=headers)["config"]
        else:
            raw = client.get_model_config(model_name, model_version or "", headers=headers)
    except _call_errors() as exc:
        raise PyTritonClientModelUnavailableError(f"model {model_name!r}: no config: {exc}") from exc
    return parse_model_config(raw)


def _poll(ready: Callable[[], bool], deadline: float, timed_out: str) -> None:
    """Asks ``ready()`` until it says yes; errors reaching the server count as no."""
    while True:
        try:
            if ready():
                return
        except _call_errors():
            pass  # not up yet
        left = deadline - time.monotonic()
        if left <= 0:
            raise PyTritonClientTimeoutError(timed_out)
        time.sleep(min(_POLL_S, left))
