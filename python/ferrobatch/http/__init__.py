"""Serving :class:`~ferrobatch.Server` objects over HTTP with the Open Inference
Protocol v2 (KServe v2), as Triton and ``tritonclient`` speak it.

    app = ferrobatch.http.starlette_app([server])     # any ASGI server (uvicorn, ...)
    app = ferrobatch.http.aiohttp_app([server])      # aiohttp; or parent.add_subapp("/x", app)

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server
metadata), ``/v2/models/{name}[/versions/{v}]`` (model metadata), ``.../ready``,
``.../config`` (Triton-style model config), ``POST .../infer``, and
``GET /metrics`` (Prometheus, Triton's metric names; see
:mod:`ferrobatch.metrics`).

Inference takes and returns tensors as JSON ``data`` or with the binary tensor
data extension (``Inference-Header-Content-Length``; ``binary_data_size``,
``binary_data``, ``binary_data_output``), in the datatypes BOOL, INT8..INT64,
UINT8..UINT64, FP16, FP32, FP64 and BF16 (raw 16-bit words in binary; numbers
in JSON). A request may carry ``n`` rows (shape ``[n, *shape]``; metadata shows
``[-1, *shape]``): they join one batch together, and ``n > max_batch_size``
is refused. Errors come back as ``{"error": "..."}``: 400 bad request
(unknown model, input or output, wrong shape or datatype, malformed JSON,
binary sizes that do not add up), 503 queue full or not ready, 504 deadline
passed (the ``timeout`` request parameter, in microseconds), 500 model failure.

With ``manage_servers=True`` (the default) the app's lifespan starts the
servers that are not yet running and stops them, draining accepted requests,
when the app shuts down. Pass ``False`` when you start and stop them yourself,
e.g. when mounting the app inside another app whose lifespan does that.

The framework modules are imported only when their factory is called.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web
    from starlette.applications import Starlette

    from ..server import Server
    from .protocol import ModelRepository

__all__ = ["aiohttp_app", "starlette_app"]


def starlette_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
) -> Starlette:
    """A Starlette (ASGI) app serving ``servers`` (unique names) over v2 REST.

    ``metrics=False`` leaves out ``GET /metrics``. The app's
    :class:`~ferrobatch.http.protocol.ModelRepository` is
    ``app.state.ferrobatch.repository``.
    """
    from ._starlette import starlette_app as make

    return make(servers, manage_servers=manage_servers, metrics=metrics)


def aiohttp_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
    max_body_size: int = 64 * 1024 * 1024,
) -> web.Application:
    """An aiohttp app serving ``servers`` over v2 REST; also works as a
    sub-app (``parent.add_subapp("/prefix", app)``; its ``cleanup_ctx`` then
    runs with the parent's). ``max_body_size`` bounds a request body (bytes).
    """
    from ._aiohttp import aiohttp_app as make

    return make(servers, manage_servers=manage_servers, metrics=metrics, max_body_size=max_body_size)
