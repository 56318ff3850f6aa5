"""The caller's side: batch this process's requests before the Ray hop, one
handle call per batch."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import anyio.from_thread
import anyio.to_thread

from ..client import Client
from ..server import Server
from ._wire import to_wire

__all__ = ["RayClient", "client"]


class _Forward:
    """The local server's "model": sends its batch as one ``infer_batch``
    handle call (one array per input, rows stacked) and returns the
    replica's rows (one array per output). It runs on a worker thread of the
    local server, which waits for the reply: each instance is one batch in
    flight."""

    def __init__(self, call: Any, call_timeout: float | None) -> None:
        self._call = call
        self._timeout = call_timeout

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        # The batch's tensors view the local staging slot: the slot is not
        # reused before this returns, after Ray has sent the rows.
        response = self._call.remote(to_wire(batch))
        try:
            result: dict[str, Any] = response.result(timeout_s=self._timeout)
        except BaseException:
            response.cancel()
            raise
        return result


class RayClient:
    """ferrobatch's client API for a Ray Serve deployment made by
    :func:`~ferrobatch.ray.deployment`; get one with :func:`client`.

    Requests from any task, event loop or thread of this process queue in a
    local :class:`~ferrobatch.Server` whose model forwards each batch as one
    handle call (Ray picks the replica); each caller gets its own row back.
    So Ray's cost per call is paid once per batch, not once per sample.

    The local server starts on first use (it asks a replica for the model's
    specs first), on an event loop thread of its own, or with ``start()`` /
    ``async with`` / ``with``; ``close()`` / ``aclose()`` runs every request
    already accepted, then stops it. Errors are ferrobatch's: a failed handle
    call (a replica's exception, a dead replica) is a :class:`ModelError`
    whose ``__cause__`` is Ray's exception; with ``isolate_failures`` the
    batch's requests are retried in halves first, so a sample the replica
    refuses fails alone.
    """

    def __init__(
        self,
        handle: Any,
        *,
        max_batch_size: int | None = None,
        max_delay: float = 0.001,
        max_queue_size: int = 10_000,
        batches_in_flight: int = 4,
        call_timeout: float | None = None,
        isolate_failures: bool = True,
    ) -> None:
        if not isinstance(batches_in_flight, int) or batches_in_flight < 1:
            raise ValueError(f"batches_in_flight must be an int >= 1, got {batches_in_flight!r}")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        self._handle = handle
        self._max_batch_size = max_batch_size
        self._max_delay = max_delay
        self._max_queue_size = max_queue_size
        self._batches_in_flight = batches_in_flight
        self._call_timeout = call_timeout
        self._isolate_failures = isolate_failures
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._client: Client | None = None
        # The local server's event loop thread, and how to end it.
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._portal_cm: contextlib.AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._closed = False
        #: What the deployment said about itself (``describe()``), once started.
        self.description: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Starts the local batcher now (blocking: from a thread that runs no
        event loop; ``await client.astart()`` on one). Idempotent."""
        self._started()

    async def astart(self) -> None:
        """:meth:`start` from an event loop (the wait runs on a worker thread)."""
        if self._client is None:
            await anyio.to_thread.run_sync(self._started)

    def _started(self) -> Client:
        with self._lock:
            if self._client is not None:
                return self._client
            if self._closed:
                from ..errors import ServerClosedError

                raise ServerClosedError("this ferrobatch.ray client was closed")
            description: dict[str, Any] = self._handle.describe.remote().result()
            remote_max = int(description["max_batch_size"])
            max_batch_size = min(self._max_batch_size or remote_max, remote_max)
            call = self._handle.infer_batch
            server = Server(
                [_Forward(call, self._call_timeout) for _ in range(self._batches_in_flight)],
                inputs=description["inputs"],
                outputs=description["outputs"],
                max_batch_size=max_batch_size,
                max_delay=self._max_delay,
                max_queue_size=self._max_queue_size,
                device="cpu",
                name=str(description["name"]),
                isolate_failures=self._isolate_failures,
                warmup=False,
            )
            portal_cm = anyio.from_thread.start_blocking_portal()
            portal = portal_cm.__enter__()
            try:
                portal.call(server.start)
            except BaseException as exc:
                portal_cm.__exit__(type(exc), exc, exc.__traceback__)
                raise
            self._portal, self._portal_cm = portal, portal_cm
            self._server, self.description = server, description
            self._client = server.client()
            return self._client

    def close(self, timeout: float | None = None) -> None:
        """Stops the local batcher: every accepted request still runs (within
        ``timeout`` seconds; then those waiting fail with
        :class:`ServerClosedError`); later calls raise it. Idempotent."""
        with self._lock:
            self._closed = True
            portal, portal_cm, server = self._portal, self._portal_cm, self._server
            self._portal = self._portal_cm = None
        if portal is None or portal_cm is None or server is None:
            return
        try:
            portal.call(server.stop, timeout)
        finally:
            portal_cm.__exit__(None, None, None)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from an event loop (the wait runs on a worker thread)."""
        await anyio.to_thread.run_sync(self.close, timeout)

    def __enter__(self) -> RayClient:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> RayClient:
        await self.astart()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- requests -------------------------------------------------------------------------

    async def infer(self, inputs: Mapping[str, Any], timeout: float | None = None) -> Any:
        """One sample, as :meth:`ferrobatch.Client.infer`: batched with this
        process's other requests, sent with them in one handle call.
        ``timeout``, cancellation and errors behave as there."""
        local = self._client
        if local is None:
            await self.astart()
            local = self._client
            assert local is not None
        return await local.infer(inputs, timeout)

    async def infer_batch(self, inputs: Mapping[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """``n`` rows that travel together, as :meth:`ferrobatch.Client.infer_batch`."""
        local = self._client
        if local is None:
            await self.astart()
            local = self._client
            assert local is not None
        return await local.infer_batch(inputs, timeout)

    def infer_sync(self, inputs: Mapping[str, Any], timeout: float | None = None) -> Any:
        """Blocking :meth:`infer`, for threads that run no event loop."""
        local = self._client or self._started()
        return local.infer_sync(inputs, timeout)

    @property
    def server(self) -> Server | None:
        """The local batcher (None before it starts)."""
        return self._server

    def stats(self) -> dict[str, Any]:
        """The local batcher's ``stats()``: its ``batches`` are handle calls,
        its ``mean_batch_size`` the rows per call. Empty before it starts."""
        return self._server.stats() if self._server is not None else {}


def client(
    handle: Any,
    *,
    max_batch_size: int | None = None,
    max_delay: float = 0.001,
    max_queue_size: int = 10_000,
    batches_in_flight: int = 4,
    call_timeout: float | None = None,
    isolate_failures: bool = True,
) -> RayClient:
    """A client with ferrobatch's API that batches this process's requests
    before they cross to ``handle``'s deployment (one made by
    :func:`~ferrobatch.ray.deployment`)::

        client = ferrobatch.ray.client(serve.get_deployment_handle("mlp", app_name="mlp"))
        out = await client.infer({"x": x})           # or client.infer_sync(...) from a thread

    ``max_batch_size``: rows per handle call (default and at most the
    deployment's ``max_batch_size``); ``max_delay``: seconds a batch may wait
    to fill; ``batches_in_flight``: handle calls outstanding at once (each a
    worker thread of the local batcher); ``call_timeout``: seconds one handle
    call may take (None: no limit); ``isolate_failures``: see
    :class:`~ferrobatch.Server`. See :class:`RayClient`.
    """
    return RayClient(
        handle,
        max_batch_size=max_batch_size,
        max_delay=max_delay,
        max_queue_size=max_queue_size,
        batches_in_flight=batches_in_flight,
        call_timeout=call_timeout,
        isolate_failures=isolate_failures,
    )
