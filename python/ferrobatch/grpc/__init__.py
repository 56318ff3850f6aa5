"""Serving :class:`~ferrobatch.Server` objects over gRPC with the Open Inference
Protocol v2 ``GRPCInferenceService`` (as ``tritonclient.grpc`` speaks it), on
grpcio's asyncio server.

    grpc_server = ferrobatch.grpc.grpc_server([server], "127.0.0.1:8001")
    await grpc_server.start()
    ...
    ferrobatch.grpc.stop_streams(grpc_server)   # open streams end UNAVAILABLE once answered
    await grpc_server.stop(grace=5.0)

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and
ModelInfer (``raw_input_contents`` / ``raw_output_contents``; typed
``contents`` are accepted too), and Triton's ModelConfig, ModelStatistics and
RepositoryIndex (the documents of the HTTP routes). Other RPCs answer
UNIMPLEMENTED. Error statuses: see :class:`InferenceServicer`.

The messages come from ``grpc_predict_v2.proto`` (vendored here); see
``_codegen.py`` to regenerate them. They live in a private protobuf descriptor
pool, so this module and tritonclient can be imported in one process.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..client import MAX_STREAM_BACKLOG

if TYPE_CHECKING:
    import grpc.aio

    from ..http.protocol import ModelRepository
    from ..server import Server
    from ._service import InferenceServicer

__all__ = ["InferenceServicer", "grpc_server", "stop_streams"]

#: Default gRPC message size limit, both ways (bytes).
MAX_MESSAGE_SIZE = 64 * 1024 * 1024


def grpc_server(
    servers: Server | Iterable[Server] | ModelRepository,
    address: str | None = "127.0.0.1:8001",
    *,
    max_message_size: int = MAX_MESSAGE_SIZE,
    options: Sequence[tuple[str, int | str]] = (),
    max_stream_backlog: int = MAX_STREAM_BACKLOG,
    grpc_restricted_protocol: Sequence[str] = (),
    allow_client_shm: bool = False,
    credentials: grpc.ServerCredentials | None = None,
    keepalive_interval: float = 60.0,
    keepalive_timeout: float | None = None,
    response_compression: str = "none",
) -> grpc.aio.Server:
    """A ``grpc.aio.Server`` with the v2 service for ``servers``, bound to
    ``address`` (``None``: bind nothing; call ``add_insecure_port`` or
    ``add_secure_port`` yourself); over TLS with ``credentials``
    (``grpc.ssl_server_credentials(...)``), as ``ServeConfig(grpc_use_ssl=)``.
    ``keepalive_interval`` / ``keepalive_timeout`` (seconds; 0: no pings) and
    ``response_compression`` (Triton's level: none, low, medium, high) as
    ``ServeConfig``'s fields of those names (``grpc_infer_response_compression_level``).
    It is not started, and it does not start or stop the ferrobatch servers.
    Call it on the event loop that will run it. ``max_stream_backlog``: the
    bytes of a decoupled model's responses one ``ModelStreamInfer`` stream
    holds unread by its client (``ServeConfig.max_stream_backlog``).
    ``grpc_restricted_protocol``: Triton's ``--grpc-restricted-protocol``
    groups (``"<protocols>:<key>=<value>"`` each, see ``ServeConfig``): a
    call of a restricted group without ``triton-grpc-protocol-<key>:
    <value>`` in its metadata ends UNAVAILABLE. ``allow_client_shm``:
    clients may register shared-memory regions and name them in requests
    (Triton's system shared-memory extension; for ``servers`` given as
    servers, see :class:`~ferrobatch.http.protocol.ModelRepository`).
    """
    import grpc.aio

    from ._service import InferenceServicer, add_to_server

    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", max_message_size),
            ("grpc.max_send_message_length", max_message_size),
            # A port in use is an error, not a port shared with another process.
            ("grpc.so_reuseport", 0),
            *_keepalive(keepalive_interval, keepalive_timeout),
            *_compression(response_compression),
            *options,
        ]
    )
    servicer = InferenceServicer(servers, max_stream_backlog=max_stream_backlog, allow_client_shm=allow_client_shm)
    add_to_server(servicer, server, grpc_restricted_protocol)
    if address is not None and credentials is not None:
        server.add_secure_port(address, credentials)
    elif address is not None:
        server.add_insecure_port(address)
    return server


#: Triton's gRPC response compression levels, in gRPC's order.
COMPRESSION_LEVELS = ("none", "low", "medium", "high")


def _keepalive(interval: float, timeout: float | None) -> list[tuple[str, int]]:
    """grpcio's options for the keepalive the native front-end's h2 does: a
    ping every ``interval``, with calls in flight or none, as many as it
    takes, the connection closed after ``timeout`` (None: ``interval``)
    without an answer."""
    if not interval:
        return []
    interval_ms = max(1, round(interval * 1000))
    timeout_ms = interval_ms if timeout is None else max(1, round(timeout * 1000))
    return [
        ("grpc.keepalive_time_ms", interval_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # gRPC's core waits for a keepalive ping's answer this long (a minute by default).
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        # Otherwise gRPC's core spaces pings without data by at least 5 minutes.
        ("grpc.http2.min_time_between_pings_ms", interval_ms),
    ]


def _compression(level: str) -> list[tuple[str, int]]:
    """grpcio's default compression level, as Triton sets it on its gRPC
    server: gRPC's core picks each response's coding for the level among
    those its call accepts."""
    if level not in COMPRESSION_LEVELS:
        raise ValueError(
            f"response_compression must be one of {', '.join(map(repr, COMPRESSION_LEVELS))}, got {level!r}"
        )
    index = COMPRESSION_LEVELS.index(level)
    return [("grpc.default_compression_level", index)] if index else []


def stop_streams(server: grpc.aio.Server) -> None:
    """Before ``await server.stop(grace)`` of a server :func:`grpc_server`
    made (on its event loop): each open ModelStreamInfer stream reads no more
    requests, answers those it read, then ends UNAVAILABLE, as on the native
    front-end. Without it, a client keeping an idle stream open holds the
    stop for its whole grace."""
    from ._service import stop_streams as stop

    stop(server)


def __getattr__(name: str) -> object:
    if name == "InferenceServicer":
        from ._service import InferenceServicer

        return InferenceServicer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
