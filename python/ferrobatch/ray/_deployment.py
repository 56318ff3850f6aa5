"""The replica side: a Ray Serve deployment whose replicas each run one
:class:`~ferrobatch.Server` and batch whatever reaches them."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ray import serve

from ..server import Server
from ._autoscaling import CAPACITY, QUEUE_DEPTH, QueueDepthPolicy
from ._wire import to_wire

if TYPE_CHECKING:
    from ray.serve.deployment import Application
    from starlette.requests import Request
    from starlette.responses import Response

    from ..http._endpoint import Endpoint

__all__ = ["DEFAULT_MAX_ONGOING_REQUESTS", "FerrobatchReplica", "deployment"]

log = logging.getLogger("ferrobatch")

#: ``max_ongoing_requests`` when none is given: Ray's own default (5) would
#: cap every batch at 5 rows. Enough for 16 instances of ``max_batch_size=64``;
#: a replica whose server needs more warns (see :func:`deployment`).
DEFAULT_MAX_ONGOING_REQUESTS = 1024

#: The most bytes an HTTP request body may have (413 beyond), as ``ferrobatch serve``.
MAX_BODY_SIZE = 64 << 20


def capacity_warning(max_ongoing_requests: int, server: Server) -> str | None:
    """The warning for a ``max_ongoing_requests`` too low to fill the
    server's batches, or None."""
    instances = len(server.devices)
    needed = server.max_batch_size * instances
    if max_ongoing_requests >= needed:
        return None
    return (
        f"ferrobatch.ray: deployment of model '{server.name}' has max_ongoing_requests={max_ongoing_requests},"
        f" below max_batch_size x instances = {server.max_batch_size} x {instances} = {needed}: Ray lets at most"
        f" {max_ongoing_requests} requests into a replica at once, so its batches cannot fill;"
        f" pass max_ongoing_requests >= {needed} (2x that lets the next batches fill while one runs)"
    )


class FerrobatchReplica:
    """One replica: builds its server with ``make_server()`` (in the replica,
    so on the replica's GPU when Ray gave it one), starts it, and serves it
    through the handle (:meth:`infer`, :meth:`infer_batch`), over HTTP
    through Ray's proxy (``__call__``: the v2 REST routes of
    ``ferrobatch.http``), and to Ray's autoscaler (:meth:`record_autoscaling_stats`).
    Ray drains the replica's ongoing requests before it stops; its
    destructor then stops the server, which runs every request it accepted.
    """

    # Ray awaits an async constructor (the server warms up before the replica
    # counts as started).
    async def __init__(  # type: ignore[misc]
        self,
        make_server: Callable[[], Server],
        max_ongoing_requests: int,
        max_body_size: int = MAX_BODY_SIZE,
        switch_interval: float | None = None,
    ) -> None:
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)
        server = make_server()
        if not isinstance(server, Server):
            raise TypeError(f"make_server must return a ferrobatch.Server, got {type(server).__name__}")
        self._server = server
        self._client = server.client()
        self._max_body_size = max_body_size
        self._max_ongoing_requests = max_ongoing_requests
        self._capacity = server.max_batch_size * len(server.devices)
        self._endpoint: Endpoint | None = None
        self._warnings: list[str] = []
        warning = capacity_warning(max_ongoing_requests, server)
        if warning is not None:
            self._warnings.append(warning)
            log.warning("%s", warning)
            warnings.warn(warning, RuntimeWarning, stacklevel=2)
        await server.start()

    # -- through a DeploymentHandle ---------------------------------------------------

    async def infer(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One sample, batched with everything else reaching this replica:
        ``{output: numpy array}`` (a torch tensor for a dtype numpy lacks).
        Raises what ``Client.infer`` raises (Ray re-raises it at the caller)."""
        return to_wire(await self._client.infer(inputs, timeout, priority=priority, parameters=parameters))

    async def infer_batch(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``n`` rows at once (a leading dimension on every input, at most
        ``max_batch_size``), as ``Client.infer_batch``: they join one batch."""
        return to_wire(await self._client.infer_batch(inputs, timeout, priority=priority, parameters=parameters))

    async def infer_requests(
        self, items: Sequence[tuple[Mapping[str, Any], int | None, Mapping[str, Any] | None]]
    ) -> list[tuple[bool, Any]]:
        """Several requests at once, as :class:`~ferrobatch.ray.RayClient`
        sends a batch: each ``(inputs with a leading rows dimension,
        priority, parameters)`` is submitted as its own ``infer_batch``, so
        each keeps its lengths, priority and parameters. Each answer is
        ``(True, outputs)`` or ``(False, the exception it raised)``, in
        order: one request's failure is its own."""

        async def one(inputs: Mapping[str, Any], priority: int | None, parameters: Any) -> tuple[bool, Any]:
            try:
                outputs = await self._client.infer_batch(inputs, priority=priority, parameters=parameters)
            except Exception as exc:  # noqa: BLE001 - the caller's to raise, not the replica's
                return False, exc
            return True, to_wire(outputs)

        return list(await asyncio.gather(*(one(*item) for item in items)))

    async def stream(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        batched: bool = False,
        priority: int | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A decoupled model's responses to one sample (``batched``: ``n``
        rows), each as the replica's model makes it, as ``Client.stream``;
        called through a handle with ``.options(stream=True)``. Ray
        cancelling the call (its caller went away) cancels the request."""
        stream = self._client.stream_batch if batched else self._client.stream
        async for out in stream(inputs, timeout, priority=priority, parameters=parameters):
            yield to_wire(out)

    async def describe(self) -> dict[str, Any]:
        """What a client needs to batch for this deployment: the specs and
        limits of the model, and this replica's identity and warnings."""
        server = self._server
        return {
            "name": server.name,
            "inputs": list(server.inputs),
            "outputs": list(server.outputs),
            "max_batch_size": server.max_batch_size,
            "batching": server.batching,
            "decoupled": server.decoupled,
            "max_batch_elements": server.max_batch_elements,
            "priority_levels": server.priority_levels,
            "default_priority": server.default_priority,
            "instances": len(server.devices),
            "capacity": self._capacity,
            "max_ongoing_requests": self._max_ongoing_requests,
            "warnings": list(self._warnings),
            "replica": _replica_id(),
            "pid": os.getpid(),
        }

    async def stats(self) -> dict[str, Any]:
        """``Server.stats()`` of this replica, with its ``replica`` id."""
        return {**self._server.stats(), "replica": _replica_id()}

    # -- through Ray's HTTP proxy ------------------------------------------------------

    async def __call__(self, request: Request) -> Response:
        """The v2 REST API (``ferrobatch.http``'s routes) under the
        application's route prefix: ``POST /v2/models/{name}/infer`` with a
        JSON or binary-tensor body, health, metadata, statistics, metrics."""
        from starlette.responses import Response

        from ..http._endpoint import Endpoint, too_large

        if self._endpoint is None:
            self._endpoint = Endpoint(self._server)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body_size:
            reply = too_large(int(length), self._max_body_size)
            return Response(reply.body, status_code=reply.status, headers=reply.headers)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self._max_body_size:
                reply = too_large(None, self._max_body_size)
                return Response(reply.body, status_code=reply.status, headers=reply.headers)
        path: str = request.scope["path"]
        root: str = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        reply = await self._endpoint.dispatch(request.method, path, request.headers, bytes(body))
        return Response(reply.body, status_code=reply.status, headers=reply.headers)

    # -- to Ray -------------------------------------------------------------------------

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray's custom autoscaling metrics: this replica's queue depth and
        capacity, read by :class:`~ferrobatch.ray.QueueDepthPolicy`."""
        return {QUEUE_DEPTH: float(self._server.stats()["queue_depth"]), CAPACITY: float(self._capacity)}

    async def check_health(self) -> None:
        """Ray restarts a replica whose server is no longer running."""
        if not self._server.running:
            raise RuntimeError(f"ferrobatch server '{self._server.name}' is not running")

    def __del__(self) -> Awaitable[None] | None:
        # Ray awaits what this returns, once the replica's ongoing requests
        # have drained (or its graceful_shutdown_timeout_s ran out): the server
        # then runs what it accepted and stops. Returns nothing once stopped,
        # so the garbage collector's call makes no coroutine.
        server: Server | None = getattr(self, "_server", None)
        if server is None or not server.running:
            return None
        return server.stop()


def _replica_id() -> str:
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside a replica (tests calling the class directly)
        return ""


def deployment(
    make_server: Callable[[], Server],
    *,
    name: str = "ferrobatch",
    num_replicas: int | Literal["auto"] | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    target_queue_depth: float | None = None,
    max_body_size: int = MAX_BODY_SIZE,
    switch_interval: float | None = 0.001,
    **options: Any,
) -> Application:
    """A Ray Serve application whose replicas each run ``make_server()``::

        app = ferrobatch.ray.deployment(make_server, name="mlp", num_replicas=2,
                                        ray_actor_options={"num_gpus": 1})
        handle = serve.run(app)
        out = await handle.infer.remote({"x": x})      # one sample per call

    ``make_server`` (a picklable zero-argument callable returning a
    :class:`~ferrobatch.Server`, not yet started) runs in each replica, which
    starts the server and batches every request reaching it: handle calls
    to ``infer`` (one sample: ``{output: numpy array}`` back),
    ``infer_batch`` (n rows), ``describe`` and ``stats``, and HTTP through
    Ray's proxy with ferrobatch's v2 routes under the route prefix
    (``POST /v2/models/{model}/infer`` with a v2 JSON or binary body).

    ``max_ongoing_requests``: requests Ray lets into one replica at once
    (default :data:`DEFAULT_MAX_ONGOING_REQUESTS`); below ``max_batch_size``
    x instances, batches cannot fill, and each replica warns (in its log,
    and in ``describe()["warnings"]``).

    Autoscaling: ``num_replicas="auto"`` or an ``autoscaling_config`` (Ray's
    fields: ``min_replicas``, ``max_replicas``, ``upscale_delay_s``, ...)
    scales on ferrobatch's queue depth: each replica reports it to Ray, and
    :class:`~ferrobatch.ray.QueueDepthPolicy` asks for as many replicas as
    keep ``target_queue_depth`` requests waiting in each (default: one full
    batch per instance). An ``autoscaling_config`` with a ``policy`` of its
    own keeps it.

    ``max_body_size``: the most bytes of an HTTP request body (413 beyond).
    ``switch_interval``: the replica process's ``sys.setswitchinterval``
    (as ``ferrobatch serve`` sets it): Ray's event loops keep the GIL busy,
    and the batcher's worker waits up to this long for it after each torch
    op; None leaves Python's 5 ms.
    Other keywords go to Ray's ``serve.deployment`` (for example
    ``graceful_shutdown_timeout_s``, ``health_check_period_s``).
    """
    if not callable(make_server):
        raise TypeError(f"make_server must be a callable returning a ferrobatch.Server, got {make_server!r}")
    ongoing = DEFAULT_MAX_ONGOING_REQUESTS if max_ongoing_requests is None else max_ongoing_requests
    if not isinstance(ongoing, int) or ongoing < 1:
        raise ValueError(f"max_ongoing_requests must be an int >= 1, got {max_ongoing_requests!r}")
    if not isinstance(max_body_size, int) or max_body_size < 1:
        raise ValueError(f"max_body_size must be an int >= 1, got {max_body_size!r}")
    QueueDepthPolicy(target_queue_depth)  # checks it
    settings: dict[str, Any] = {"name": name, "max_ongoing_requests": ongoing, **options}
    if ray_actor_options is not None:
        settings["ray_actor_options"] = dict(ray_actor_options)
    if num_replicas == "auto" or autoscaling_config is not None:
        if num_replicas not in (None, "auto"):
            raise ValueError("give num_replicas or autoscaling_config, not both")
        config = dict(autoscaling_config or {})
        config.setdefault(
            "policy",
            {"policy_function": QueueDepthPolicy, "policy_kwargs": {"target_queue_depth": target_queue_depth}},
        )
        settings["autoscaling_config"] = config
        if num_replicas == "auto":  # Ray's defaults (1 to 100 replicas, ...) under the given fields
            settings["num_replicas"] = "auto"
    elif num_replicas is not None:
        settings["num_replicas"] = num_replicas
    app: Application = serve.deployment(**settings)(FerrobatchReplica).bind(
        make_server, ongoing, max_body_size, switch_interval
    )
    return app
