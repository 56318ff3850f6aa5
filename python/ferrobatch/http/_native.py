"""The native HTTP front-end: Rust (tokio + hyper) listens and answers
inference; Python runs the model once per batch.

``POST .../infer`` (identity-encoded), ``/v2/health/*`` and ``.../ready`` are
answered in Rust: a request never becomes a Python object. The rest of the
v2 surface (metadata, config, ``/metrics``, unknown models and routes, and
gzip/deflate bodies) is rare and goes to the same :class:`Endpoint` handlers
as the Python front-end, run on the server's event loop.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from .._core import NativeFrontend
from ..errors import ModelError
from ._endpoint import Endpoint, Reply, _json
from .protocol import ModelRepository, error_message

_MODEL = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?(/ready|/config|/infer)?")
_NOT_FOUND = _json(404, {"error": "Not Found"})

Answer = tuple[int, list[tuple[str, str]], bytes]


class NativeHttp:
    """Listens on ``host:port`` at once (``OSError`` if it cannot); serves
    the models of ``repository`` natively once :meth:`attach` is called
    after they have started (until then, requests go to the Python handlers,
    which answer 503 while a model is not running)."""

    def __init__(
        self,
        repository: ModelRepository,
        host: str,
        port: int,
        *,
        max_body_size: int,
        max_decompressed_size: int,
        threads: int = 1,
    ) -> None:
        self.repository = repository
        self.endpoint = Endpoint(repository, max_decompressed_size=max_decompressed_size)
        self._loop = asyncio.get_running_loop()
        self._frontend = NativeFrontend(
            host, port, self._fallback, threads=threads, max_body_size=max_body_size
        )

    @property
    def port(self) -> int:
        return self._frontend.port

    def attach(self) -> None:
        """Serves the started models natively and turns readiness on."""
        models = []
        for model in self.repository.models:
            batcher, registry = model.server._native_parts()
            models.append((batcher, registry, model.codec, self._describer(model.server.name)))
        self._frontend.serve(models)
        self._frontend.set_ready(True)

    def drain(self) -> None:
        """Readiness 503 and ``Connection: close`` on responses; requests are still served."""
        self._frontend.drain()

    async def close(self, grace: float) -> None:
        """Closes the listener and waits up to ``grace`` seconds for accepted
        requests to be answered; those still waiting stay connected, to get
        the answer stopping the servers gives them."""
        await asyncio.to_thread(self._frontend.close, grace)

    async def stop(self, grace: float) -> None:
        """Waits up to ``grace`` seconds for the answers still being written, then stops."""
        await asyncio.to_thread(self._frontend.stop, grace)

    def _describer(self, name: str):  # type: ignore[no-untyped-def]
        expose = self.repository.expose_errors

        def describe(exc: BaseException) -> str:
            if not isinstance(exc, ModelError):
                wrapped = ModelError(f"model '{name}': {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            return error_message(exc, name, expose=expose)

        return describe

    # -- what Rust does not answer: on the event loop, from a blocking thread ---------

    def _fallback(self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes) -> Answer:
        future = asyncio.run_coroutine_threadsafe(self._dispatch(method, path, dict(headers), body), self._loop)
        reply = future.result()
        return reply.status, list(reply.headers.items()), reply.body

    async def _dispatch(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        return await self.endpoint.dispatch(method, path, headers, body)
