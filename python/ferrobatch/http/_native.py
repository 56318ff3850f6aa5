"""The native front-end: Rust (tokio + hyper for HTTP, tonic for gRPC)
listens and answers inference; Python runs the model once per batch.

HTTP: ``POST .../infer`` (identity, gzip or deflate bodies; responses
gzip or deflate coded when ``Accept-Encoding`` asks), Triton's ``.../generate``
and ``.../generate_stream`` (a decoupled model's responses streamed as
events), ``/v2/health/*`` and ``.../ready`` are answered in Rust: a request
never becomes a Python object. The rest of the v2 surface (metadata, config,
``/metrics``, unknown models and routes, other content codings) is rare and
goes to the same :class:`Endpoint` handlers as the Python front-end
(``Endpoint.dispatch``, one routing table), run on the server's event loop;
none of its replies streams.

gRPC: KServe's six RPCs of ``inference.GRPCInferenceService`` are
answered in Rust, the metadata from the documents the repository gives at
start-up. Triton's ``ModelConfig``, ``ModelStatistics`` and
``RepositoryIndex`` (rare; statistics change while serving) come back to
Python as protobuf bytes and are answered by the grpcio servicer's code
(:mod:`ferrobatch.grpc._extensions`), on the server's event loop.

A request handed to Python is a task on the event loop; no thread waits for
it. Its answer goes back through the ``FallbackAnswer`` it came with, and a
client that goes away cancels the task (a request still queued is withdrawn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._core import FallbackAnswer, NativeFrontend
from ..client import MAX_STREAM_BACKLOG
from ..errors import FerrobatchError, ModelError
from ..server import Server, front_end_threads, hold_front_end_cores
from ._endpoint import Endpoint, Reply
from .protocol import ModelRepository, ServedModel, error_message

Answer = tuple[int, list[tuple[str, str]], bytes]
TensorMeta = tuple[str, str, list[int]]
T = TypeVar("T")

log = logging.getLogger("ferrobatch.serve")


class NativeListeners:
    """Listens at once on ``host:http_port`` and ``host:grpc_port`` (``None``:
    not that one; ``OSError`` naming the address if it cannot); serves the
    models of ``repository`` natively once :meth:`attach` is called after
    they have started. Until then HTTP requests go to the Python handlers,
    which answer 503 while a model is not running, and gRPC inference answers
    UNAVAILABLE; readiness says not ready."""

    def __init__(
        self,
        repository: ModelRepository,
        host: str,
        http_port: int | None,
        grpc_port: int | None = None,
        *,
        max_body_size: int,
        max_decompressed_size: int,
        threads: int | None = None,
        max_connections: int = 10_000,
        max_streams: int = 1024,
        header_timeout: float = 30.0,
        body_timeout: float = 60.0,
        idle_timeout: float = 300.0,
        keepalive_interval: float = 60.0,
        keepalive_timeout: float | None = None,
        grpc_response_compression: str = "none",
        http_header_forward_pattern: str | None = None,
        grpc_header_forward_pattern: str | None = None,
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
        http_restricted_api: Sequence[str] = (),
        grpc_restricted_protocol: Sequence[str] = (),
        strict_readiness: bool = True,
        grpc_server_cert: str | None = None,
        grpc_server_key: str | None = None,
        grpc_root_cert: str | None = None,
        grpc_use_ssl_mutual: bool = False,
    ) -> None:
        self.repository = repository
        self.endpoint = Endpoint(repository, max_decompressed_size=max_decompressed_size)
        self._loop = asyncio.get_running_loop()
        server = repository.server_metadata()
        #: The runtime's threads: connections spread across them.
        self.threads = front_end_threads() if threads is None else threads
        self._frontend = NativeFrontend(
            host,
            http_port,
            self._fallback,
            grpc_port=grpc_port,
            server_metadata=(server["name"], server["version"], list(server["extensions"])),
            model_metadata=[_model_metadata(repository.model_metadata(s.name)) for s in repository.servers],
            grpc_fallback=None if grpc_port is None else self._grpc_fallback,
            threads=self.threads,
            max_body_size=max_body_size,
            max_decompressed_size=max_decompressed_size,
            max_connections=max_connections,
            max_streams=max_streams,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            idle_timeout=idle_timeout,
            keepalive_interval=keepalive_interval,
            keepalive_timeout=keepalive_timeout,
            grpc_response_compression=grpc_response_compression,
            http_header_forward_pattern=http_header_forward_pattern,
            grpc_header_forward_pattern=grpc_header_forward_pattern,
            max_stream_backlog=max_stream_backlog,
            http_restricted_api=list(http_restricted_api),
            grpc_restricted_protocol=list(grpc_restricted_protocol),
            strict_readiness=strict_readiness,
            grpc_server_cert=grpc_server_cert,
            grpc_server_key=grpc_server_key,
            grpc_root_cert=grpc_root_cert,
            grpc_use_ssl_mutual=grpc_use_ssl_mutual,
        )
        #: Readiness as :meth:`set_ready` last said (a drain turns it off).
        self._ready = False
        hold_front_end_cores(self.threads)
        self._holding = True
        #: The servers whose readiness this front-end follows, and its watcher of each.
        self._watching: list[tuple[Server, Callable[[bool], object]]] = []
        #: What it serves of each model (its server's batcher of the run that serves).
        self._served: dict[str, tuple[Any, ...]] = {}
        #: The servers whose later runs it serves, and its hook on each.
        self._following: list[tuple[Server, Callable[[], object]]] = []

    @property
    def http_port(self) -> int | None:
        return self._frontend.port

    @property
    def grpc_port(self) -> int | None:
        return self._frontend.grpc_port

    def attach(self) -> None:
        """Serves the started models natively (the loaded ones) and turns
        readiness on; from now on a model unloaded is no longer served, one
        loaded is served (Triton's model control)."""
        self._serve(self.repository.loaded_models)
        self.repository.on_model_control(self._model_control)
        self.set_ready(True)

    def add(self, model: ServedModel) -> None:
        """Serves ``model`` (its server started) natively too, from now on:
        a model added to the repository while serving."""
        self._frontend.know([_model_metadata(self.repository.model_metadata(model.server.name))])
        self._serve([model])

    def _serve(self, models: Sequence[ServedModel]) -> None:
        for model in models:
            batcher, registry = model.server._native_parts()
            self._served[model.server.name] = (batcher, registry, model.codec, self._describer(model.server.name))
        self._frontend.serve(list(self._served.values()))
        followed = {server for server, _ in self._following}
        for model in models:
            if model.server in followed:
                continue  # loaded again: its run hook served it
            # Readiness follows the model's instances (all down: 503, until one is back).
            watcher = functools.partial(self._frontend.set_model_ready, model.server.name)
            model.server._watch_readiness(watcher)
            self._watching.append((model.server, watcher))
            # A server stopped and started again serves through its new run's batcher.
            hook = functools.partial(self._serve_again, model)
            model.server._on_each_run(hook)
            self._following.append((model.server, hook))

    def _model_control(self, model: ServedModel, loaded: bool) -> None:
        """A client loaded ``model`` (served now, if its run hook has not
        already), or unloaded it (no longer served: its requests are
        answered as to a model without versions, its accepted ones finish)."""
        name = model.server.name
        if loaded:
            if name not in self._served:
                self._serve([model])
        elif self._served.pop(name, None) is not None:
            self._frontend.serve(list(self._served.values()))
        self.set_ready(self._ready)  # a model that failed to start may be loaded, or unloaded, now

    def _serve_again(self, model: Any) -> None:
        """``model``'s server runs again: served through that run's batcher
        (the other models as they were), readiness as each server's is."""
        batcher, registry = model.server._native_parts()
        self._served[model.server.name] = (batcher, registry, model.codec, self._describer(model.server.name))
        self._frontend.serve(list(self._served.values()))
        for server, watcher in self._watching:  # the models served anew start out ready
            watcher(server._native.instances_up())

    def set_ready(self, ready: bool) -> None:
        """Readiness (HTTP and gRPC) says ``ready`` (with strict readiness, also
        the served models' and that no model failed to start); requests are
        served either way."""
        self._ready = ready
        repository = self.repository
        self._frontend.set_ready(ready and not (repository.strict_readiness and repository.failed_models))

    def drain(self) -> None:
        """Readiness 503 (gRPC: not ready) and ``Connection: close`` on HTTP
        responses; requests are still served."""
        self._frontend.drain()

    async def close(self, grace: float) -> None:
        """Closes the listeners and waits up to ``grace`` seconds for accepted
        requests to be answered; those still waiting stay connected, to get
        the answer stopping the servers gives them."""
        await asyncio.to_thread(self._frontend.close, grace)

    async def stop(self, grace: float) -> None:
        """Waits up to ``grace`` seconds for the answers still being written, then stops."""
        await asyncio.to_thread(self._frontend.stop, grace)
        self.repository.on_model_control(self._model_control, add=False)
        for server, watcher in self._watching:  # a stopped front-end is told nothing more
            server._unwatch_readiness(watcher)
        self._watching.clear()
        for server, hook in self._following:
            server._on_each_run(hook, add=False)
        self._following.clear()
        if self._holding:
            self._holding = False
            hold_front_end_cores(-self.threads)

    def _describer(self, name: str) -> Callable[[BaseException], str]:
        expose = self.repository.expose_errors

        def describe(exc: BaseException) -> str:
            # Another of ferrobatch's errors is passed on as it is (a
            # forwarding model's downstream refused the request): its words.
            if not isinstance(exc, FerrobatchError):
                wrapped = ModelError(f"model '{name}': {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            return error_message(exc, name, expose=expose)

        return describe

    # -- what Rust does not answer: tasks on the event loop, started from a blocking thread --

    def _start(self, answer: Awaitable[T], done: FallbackAnswer, convert: Callable[[T], Any]) -> Callable[[], bool]:
        """Runs ``answer`` on the loop; ``done`` gets ``convert(result)``, or
        None if it failed (logged). Returns what cancels it."""

        async def run() -> T:
            return await answer

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)

        def finished(future: concurrent.futures.Future[T]) -> None:
            if future.cancelled():
                return  # the client went away: nobody waits for it
            error = future.exception()
            if error is not None:
                log.error("answering a request failed", exc_info=error)
                done(None)
                return
            done(convert(future.result()))

        future.add_done_callback(finished)
        return future.cancel

    def _fallback(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes, done: FallbackAnswer
    ) -> Callable[[], bool]:
        dispatched = self.endpoint.dispatch(method, path, dict(headers), body)
        return self._start(dispatched, done, self._answer)

    @staticmethod
    def _answer(reply: Reply) -> tuple[int, list[tuple[str, str]], bytes]:
        # Rust answers every generate route: no reply that comes here streams.
        return reply.status, list(reply.headers.items()), reply.body

    def _grpc_fallback(self, method: str, request: bytes, done: FallbackAnswer) -> Callable[[], bool]:
        from ..grpc import _extensions  # protobuf is needed only with gRPC

        return self._start(_extensions.answer(self.repository, method, request), done, lambda reply: reply)


def _model_metadata(meta: dict[str, Any]) -> tuple[str, str, list[TensorMeta], list[TensorMeta]]:
    """``(name, platform, inputs, outputs)`` of a model metadata document."""

    def tensors(docs: list[dict[str, Any]]) -> list[TensorMeta]:
        return [(t["name"], t["datatype"], list(t["shape"])) for t in docs]

    return meta["name"], meta["platform"], tensors(meta["inputs"]), tensors(meta["outputs"])
