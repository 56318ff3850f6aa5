"""Serving :class:`~ferrobatch.Server` objects over HTTP with the Open Inference
Protocol v2 (KServe v2), as Triton and ``tritonclient`` speak it.

    app = ferrobatch.http.starlette_app([server])     # any ASGI server (uvicorn, ...)
    app = ferrobatch.http.aiohttp_app([server])      # aiohttp; or parent.add_subapp("/x", app)

Routes: ``GET /v2/health/live``, ``/v2/health/ready``, ``/v2`` (server
metadata), ``/v2/models/{name}[/versions/{v}]`` (model metadata), ``.../ready``,
``.../config`` (Triton-style model config), ``.../stats`` and
``/v2/models/stats`` (Triton's statistics of one model or all, from
``Server.stats()``), ``POST /v2/repository/index`` (Triton's index: each
model READY or UNAVAILABLE; ``{"ready": true}`` lists the ready ones),
``POST .../infer``, ``POST .../generate`` and ``.../generate_stream`` (Triton's
generate extension: see :mod:`ferrobatch.http._generate`), and ``GET /metrics`` (Prometheus, Triton's metric names,
typed; see :mod:`ferrobatch.metrics`). Other paths are 404 ``{"error": "Not
Found"}``; a known path with another method is 405, with ``Allow``. Every
front-end routes from one table (``ferrobatch.http._endpoint.ROUTES``;
``Endpoint.dispatch`` answers a request from it without a framework).

Inference takes and returns tensors as JSON ``data`` or with the binary tensor
data extension (``Inference-Header-Content-Length``; ``binary_data_size``,
``binary_data``, ``binary_data_output``), in the datatypes BOOL, INT8..INT64,
UINT8..UINT64, FP16, FP32, FP64 and BF16 (raw 16-bit words in binary; numbers
in JSON). A request may carry ``n`` rows (shape ``[n, *shape]``; metadata shows
``[-1, *shape]``): they join one batch together, and ``n > max_batch_size``
is refused. Errors come back as ``{"error": "..."}``: 400 bad request
(unknown model, input or output, wrong shape or datatype, malformed JSON,
binary sizes that do not add up), 413 body too large (``max_body_size``
bytes as sent, ``max_decompressed_size`` after undoing a gzip or deflate
``Content-Encoding``; 64 MiB each by default, as gRPC's message limit), 503
queue full or not ready (with ``Connection: close`` while shutting down), 504
deadline passed (the ``timeout`` request parameter, in microseconds), 500
model failure. A 500 says the exception's type and a request id; the log has
its traceback under that id, and its message goes to the client only with
``expose_errors=True`` (it may carry paths or data).

With ``manage_servers=True`` (the default) the app's lifespan starts the
servers that are not yet running and stops them, draining accepted requests,
when the app shuts down. A Starlette app mounted in another
(``Mount("/triton", starlette_app(server))``) gets no lifespan: it starts the
servers on its first request instead (readiness is 503 until they are up)
and stops them when the event loop shuts down (the end of ``asyncio.run``,
as uvicorn runs). Pass ``False`` when you start and stop them yourself,
e.g. in the parent app's lifespan.

The framework modules are imported only when their factory is called.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..client import MAX_STREAM_BACKLOG
from .protocol import MAX_BODY_SIZE, MAX_DECOMPRESSED_SIZE

if TYPE_CHECKING:
    from aiohttp import web
    from starlette.applications import Starlette

    from ..server import Server
    from .protocol import ModelRepository

__all__ = ["AIOHTTP_HANDLER_ARGS", "aiohttp_app", "starlette_app"]

#: The aiohttp server settings :func:`aiohttp_app` sets for itself
#: (``web.Application(handler_args=...)``): bodies reach it as sent (it
#: undoes ``Content-Encoding`` itself, by the rules of the other front-ends),
#: and a client that disconnects cancels its handler, withdrawing its
#: request. A sub-app runs on its parent's server: give the parent them too.
AIOHTTP_HANDLER_ARGS: Mapping[str, Any] = {"auto_decompress": False, "handler_cancellation": True}


def starlette_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
    expose_errors: bool | None = None,
    max_body_size: int = MAX_BODY_SIZE,
    max_decompressed_size: int = MAX_DECOMPRESSED_SIZE,
    http_restricted_api: Sequence[str] = (),
    allow_client_shm: bool = False,
    max_stream_backlog: int = MAX_STREAM_BACKLOG,
) -> Starlette:
    """A Starlette (ASGI) app serving ``servers`` (unique names) over v2 REST.

    ``metrics=False`` leaves out ``GET /metrics``. ``expose_errors``: send
    model exceptions' text to clients (``None``: the repository's setting,
    off unless a :class:`~ferrobatch.http.protocol.ModelRepository` says
    otherwise). ``max_body_size`` and ``max_decompressed_size`` bound a
    request body in bytes (413 beyond). ``http_restricted_api``: Triton's
    ``--http-restricted-api`` groups, ``"<apis>:<header>=<value>"`` each
    (see :class:`ferrobatch.serve.ServeConfig`): a request to a route of a
    restricted API group without that header gets 403.
    ``allow_client_shm``: clients may register shared-memory regions and
    name them in requests (Triton's system shared-memory extension; see
    :class:`~ferrobatch.http.protocol.ModelRepository`).
    ``max_stream_backlog``: the most bytes of a decoupled model's responses
    one ``generate_stream`` holds before its client reads them (a response
    past them ends the stream with an error event, counted ``queue_full``).
    The app's repository is ``app.state.ferrobatch.repository``.
    """
    from ._starlette import starlette_app as make

    return make(
        servers,
        manage_servers=manage_servers,
        metrics=metrics,
        expose_errors=expose_errors,
        max_body_size=max_body_size,
        max_decompressed_size=max_decompressed_size,
        http_restricted_api=http_restricted_api,
        allow_client_shm=allow_client_shm,
        max_stream_backlog=max_stream_backlog,
    )


def aiohttp_app(
    servers: Server | Iterable[Server] | ModelRepository,
    *,
    manage_servers: bool = True,
    metrics: bool = True,
    expose_errors: bool | None = None,
    max_body_size: int = MAX_BODY_SIZE,
    max_decompressed_size: int = MAX_DECOMPRESSED_SIZE,
    http_restricted_api: Sequence[str] = (),
    allow_client_shm: bool = False,
    max_stream_backlog: int = MAX_STREAM_BACKLOG,
) -> web.Application:
    """An aiohttp app serving ``servers`` over v2 REST; also works as a
    sub-app (``parent.add_subapp("/prefix", app)``; its ``cleanup_ctx`` then
    runs with the parent's). The options are :func:`starlette_app`'s.
    """
    from ._aiohttp import aiohttp_app as make

    return make(
        servers,
        manage_servers=manage_servers,
        metrics=metrics,
        expose_errors=expose_errors,
        max_body_size=max_body_size,
        max_decompressed_size=max_decompressed_size,
        http_restricted_api=http_restricted_api,
        allow_client_shm=allow_client_shm,
        max_stream_backlog=max_stream_backlog,
    )
