"""One model, many processes: ``server.share(name)`` exposes a running server
through shared memory, and ``fb.connect(name)`` in any process of the same
user returns a client with the API of ``server.client()``.

A client writes each request's bytes into its own cells of the shared
segment and pushes a descriptor on a lock-free ring; the server's thread
queues it into the same batcher local callers use, and each batch writes
the client's rows back and wakes the client process once. See
``rust/core/src/shm`` for the protocol.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch

from . import _core
from ._requests import Parameter, encode_parameters
from ._torch import make_coerce
from ._variable import core_shape, is_variable, layouts, padded_dims, shared_result
from .client import _is_tensordict, _to_tensordict, flatten_inputs
from .errors import ServerClosedError
from .server import whole_in
from .specs import TensorSpec

if TYPE_CHECKING:
    from .server import Server

__all__ = ["Shared", "SharedClient", "connect"]

log = logging.getLogger("ferrobatch")

#: Bumped in a forked child: its clients reconnect instead of using the parent's slot.
_fork_generation = 0


def _after_fork() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)

#: Timeouts at least this long arm no timer (no deadline, as in ``infer``).
_NO_TIMER = 1e9


class Answered(Protocol):
    """Whom a request's answer is handed to, on its event loop's thread (a
    ``concurrent.futures.Future`` is one)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...


class Shared:
    """A server shared under a name (what :meth:`Server.share` returns), until
    the server stops: then requests still pending fail with
    :class:`ServerClosedError` and the segment is removed."""

    def __init__(self, name: str, core: _core.SharedServer) -> None:
        self.name = name
        self._core = core

    def clients(self) -> list[tuple[int, int]]:
        """``[(slot, pid)]`` of the client processes connected now."""
        return self._core.clients()

    @property
    def in_flight(self) -> int:
        """Requests from clients accepted and not answered yet."""
        return self._core.in_flight

    @property
    def reclaimed(self) -> int:
        """Client slots reclaimed so far (clients that closed or died)."""
        return self._core.reclaimed

    @property
    def faults(self) -> int:
        """Faults survived so far: resets of a request ring a client process
        corrupted, and clients closed for writing what the protocol never
        writes into their slot (each is logged on the ``ferrobatch`` logger)."""
        return self._core.faults

    def _stop_accepting(self) -> None:
        self._core.stop_accepting()

    def _close(self, message: str) -> None:
        self._core.close(message)

    def __repr__(self) -> str:
        return f"Shared(name={self.name!r}, clients={len(self.clients())}, in_flight={self.in_flight})"


def _spec_tuples(specs: tuple[TensorSpec, ...]) -> list[tuple[str, str, list[int], torch.dtype | None]]:
    """Outputs as the binding takes them (a varying model's are read by its
    codec: only their names count there)."""
    return [(s.name, s.dtype, [max(d, 0) for d in s.shape], None if s.is_bytes else s.torch_dtype) for s in specs]


def _spec_meta(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "dtype": spec.dtype,
        "shape": list(spec.shape),
        "ragged": spec.ragged,
        "pad_value": spec.pad_value,
        "optional": spec.optional,
    }


def _spec_of(meta: Mapping[str, Any]) -> TensorSpec:
    return TensorSpec(
        str(meta["name"]),
        str(meta["dtype"]),
        tuple(int(d) for d in meta["shape"]),
        ragged=meta["ragged"],
        pad_value=meta["pad_value"],
        optional=bool(meta["optional"]),
    )


#: A cell's bytes are a 32-bit count in the segment (a multiple of 8).
MAX_CELL_BYTES = (1 << 32) - 8


def share(
    server: Server,
    name: str,
    *,
    max_clients: int = 32,
    rows_per_client: int = 1024,
    ring_size: int = 4096,
    mode: int = 0o600,
    cell_bytes: int = 1024,
    metadata: Mapping[str, Any] | None = None,
) -> Shared:
    """See :meth:`Server.share`."""
    batcher, registry = server._native_parts()
    variable = is_variable((*server.inputs, *server.outputs))
    try:
        extra = json.loads(json.dumps(dict(metadata or {}), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serializable: {exc}") from None
    meta = json.dumps(
        {
            "metadata": extra,
            "ferrobatch": _core.__version__,
            "model": server.name,
            "max_batch_size": server.max_batch_size,
            "max_batch_elements": server.max_batch_elements,
            "default_timeout": server.default_timeout,
            "cell_bytes": cell_bytes if variable else 0,
            "inputs": [_spec_meta(s) for s in server.inputs],
            "outputs": [_spec_meta(s) for s in server.outputs],
        }
    )
    for option, value, most in (
        ("max_clients", max_clients, _core.MAX_SHARED_CLIENTS),
        ("rows_per_client", rows_per_client, _core.MAX_SHARED_CELLS),
        ("cell_bytes", cell_bytes, MAX_CELL_BYTES),
    ):
        if not whole_in(value, 1, most):
            raise ValueError(f"{option} must be an int from 1 to {most}, got {value!r}")
    if cell_bytes % 8:
        raise ValueError(f"cell_bytes must be a multiple of 8, got {cell_bytes}")
    codec = None
    if variable:
        outputs = [(s.name, s.dtype, None if s.is_bytes else s.torch_dtype) for s in server.outputs]
        codec = _core.V2Codec(server.name, outputs, max_body_size=sys.maxsize, max_elements=sys.maxsize)
    if not whole_in(ring_size, 2, _core.MAX_SHARED_RING) or ring_size & (ring_size - 1):
        raise ValueError(f"ring_size must be a power of two from 2 to {_core.MAX_SHARED_RING}, got {ring_size!r}")
    if not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ValueError(f"mode must be file permissions such as 0o600, got {mode!r}")
    core = _core.SharedServer(
        name,
        batcher,
        registry,
        _spec_tuples(server.outputs),
        meta,
        model_name=server.name,
        max_clients=max_clients,
        rows_per_client=rows_per_client,
        ring_size=ring_size,
        mode=mode,
        codec=codec,
        cell_bytes=cell_bytes if variable else 0,
    )
    if core.replaced is not None:
        log.warning("ferrobatch: %s", core.replaced)
    # What servers killed before their stop left in /dev/shm (under other names) goes now.
    stale = _core.remove_stale_segments()
    if stale:
        log.warning("ferrobatch: removed %d stale shared segment(s) of servers that are gone: %s", len(stale), stale)
    log.info("ferrobatch: model '%s' shared as '%s'", server.name, name)
    return Shared(name, core)


#: Every live client, closed at exit (before the interpreter goes, so their
#: collector threads never touch a finalizing interpreter).
_live: weakref.WeakSet[SharedClient] = weakref.WeakSet()
_live_lock = threading.Lock()


def _close_all() -> None:
    with _live_lock:
        clients = list(_live)
    for client in clients:
        client.close()


atexit.register(_close_all)


def connect(name: str, timeout: float = 5.0, *, owner: int | str | None = None) -> SharedClient:
    """A client of the server shared as ``name`` (``server.share(name)``), in
    this process: the methods and errors of ``server.client()``, plus
    :meth:`SharedClient.close`. Waits up to ``timeout`` seconds for the
    server to share the name; then raises :class:`ServerClosedError`. A
    segment of another ferrobatch version raises :class:`FerrobatchError`
    naming both versions.

    Only a segment owned by this user is trusted: whoever owns it reads
    every request and writes every answer, so one of another user (who may
    have taken the name first) raises :class:`FerrobatchError` naming its
    owner, unless ``owner`` names that user (a uid or a user name).
    """
    return SharedClient(name, timeout, owner=owner)


def _uid(owner: int | str | None) -> int | None:
    if owner is None or isinstance(owner, int):
        return owner
    import pwd

    try:
        return pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise ValueError(f"owner: no user named {owner!r}") from None


def _reconnect(name: str, timeout: float, owner: int | str | None) -> SharedClient:
    return SharedClient(name, timeout, owner=owner)


class SharedClient:
    """A client of a model shared by another process (get one with
    :func:`ferrobatch.connect`).

    Share it across tasks, event loops and threads of this process. It
    pickles: its name travels and the unpickling process connects anew
    (``multiprocessing`` workers, spawn or fork). A forked child that uses a
    client connected before the fork connects again on first use. Use
    ``close()`` (or ``with``) to give its slot back; at exit it is closed.
    """

    def __init__(self, name: str, timeout: float = 5.0, *, owner: int | str | None = None) -> None:
        self.name = name
        self._timeout = timeout
        self._owner = owner
        self._owner_uid = _uid(owner)
        self._core: _core.SharedClient | None = None
        self._generation = -1
        self._lock = threading.Lock()
        self._closed = False
        self.model = ""
        self.max_batch_size = 0
        self.inputs: tuple[TensorSpec, ...] = ()
        self.outputs: tuple[TensorSpec, ...] = ()
        #: What the server shared with (``server.share(..., metadata=)``).
        self.metadata: dict[str, Any] = {}
        self._default_timeout: float | None = None
        self._input_names: frozenset[str] = frozenset()
        self._connect()
        with _live_lock:
            _live.add(self)

    def _connect(self) -> _core.SharedClient:
        with self._lock:
            if self._core is not None and self._generation == _fork_generation:
                return self._core
            if self._closed:
                raise ServerClosedError(f"the client of '{self.name}' was closed")
            deadline = time.monotonic() + max(0.0, self._timeout)
            while True:
                try:
                    self._core = self._open()
                    break
                except ServerClosedError:  # not shared yet, or still starting
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.02)
            self._generation = _fork_generation
            return self._core

    def _open(self) -> _core.SharedClient:
        meta = json.loads(_core.shared_meta(self.name, self._owner_uid))
        self.model = str(meta["model"])
        self.max_batch_size = int(meta["max_batch_size"])
        self.inputs = tuple(_spec_of(s) for s in meta["inputs"])
        self.outputs = tuple(_spec_of(s) for s in meta["outputs"])
        self.metadata = dict(meta.get("metadata") or {})
        # The server's timeout for requests that give none: this client arms its timer.
        default_timeout = meta.get("default_timeout")
        self._default_timeout = None if default_timeout is None else float(default_timeout)
        self._input_names = frozenset(s.name for s in self.inputs)
        cell_bytes = int(meta["cell_bytes"])
        return _core.SharedClient(
            self.name,
            [(s.name, s.dtype, core_shape(s), None if s.is_bytes else s.torch_dtype) for s in self.inputs],
            _spec_tuples(self.outputs),
            model_name=self.model,
            max_batch_size=self.max_batch_size,
            tensor_type=torch.Tensor,
            coerce=make_coerce(self.inputs),
            empty=torch.empty,
            owner=self._owner_uid,
            optional=[s.optional for s in self.inputs],
            layouts=layouts(self.inputs),
            padded_dims=padded_dims(self.inputs),
            max_batch_elements=meta["max_batch_elements"],
            cell_bytes=cell_bytes,
            varying=functools.partial(shared_result, self.outputs) if cell_bytes else None,
        )

    def _live_core(self) -> _core.SharedClient:
        core = self._core
        if core is not None and self._generation == _fork_generation:
            return core
        return self._connect()

    async def infer(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """As :meth:`Client.infer`: one sample in, ``{output: tensor}`` out.
        ``parameters`` take at most 256 bytes as JSON here."""
        return await self._infer(inputs, timeout, False, priority, encode_parameters(parameters))

    async def infer_batch(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> dict[str, torch.Tensor]:
        """As :meth:`Client.infer_batch`: ``n`` rows that join one batch together."""
        out: dict[str, torch.Tensor] = await self._infer(inputs, timeout, True, priority, encode_parameters(parameters))
        return out

    async def _infer(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None,
        batched: bool,
        priority: int | None,
        parameters: str | None,
    ) -> Any:
        core = self._live_core()
        if timeout is None:
            timeout = self._default_timeout
        tensordict = False
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            tensordict = _is_tensordict(inputs)
            inputs = flatten_inputs(inputs, self._input_names if tensordict else None)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        key = core.submit(inputs, timeout, batched, future, loop, priority, parameters)
        timer = None
        if timeout is not None and timeout < _NO_TIMER:
            timer = loop.call_later(timeout, core.expire, key, timeout)
        try:
            out = await future
        except asyncio.CancelledError:
            core.cancel(key)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            del future, inputs
        return _to_tensordict(out) if tensordict else out

    def _submit_threadsafe(
        self,
        inputs: dict[str, Any],
        loop: asyncio.AbstractEventLoop,
        *,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """One sample from any thread, answered through ``loop`` (running on
        another thread): a Future of its outputs, or of the error ``infer``
        would raise. Queued from the calling thread; no callback per request."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        try:
            self._submit_to(inputs, future, loop, encode_parameters(parameters))
        except BaseException as exc:  # noqa: BLE001 - the caller's to see, on its Future
            future.set_exception(exc)
        return future

    def _submit_to(
        self, inputs: dict[str, Any], target: Answered, loop: asyncio.AbstractEventLoop, parameters: str | None
    ) -> None:
        """Queues one sample from any thread; ``loop``'s thread hands its
        outputs to ``target.set_result`` (or the error to ``set_exception``)
        unless ``target.done()``. Raises what refuses it at once."""
        self._live_core().submit(inputs, None, False, target, loop, None, parameters)

    def infer_sync(
        self,
        inputs: Mapping[str, Any],
        timeout: float | None = None,
        *,
        priority: int | None = None,
        parameters: Mapping[str, Parameter] | None = None,
    ) -> Any:
        """As :meth:`Client.infer_sync`: blocking, from any thread but an event
        loop's; the thread waits with the GIL released."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "infer_sync() blocks and was called from a thread running an event loop; "
                "use `await client.infer(...)` there"
            )
        core = self._live_core()
        if timeout is None:
            timeout = self._default_timeout
        encoded = encode_parameters(parameters)
        if type(inputs) is not dict and isinstance(inputs, Mapping):
            if _is_tensordict(inputs):
                flat = flatten_inputs(inputs, self._input_names)
                return _to_tensordict(core.infer_blocking(flat, timeout, False, priority, encoded))
            inputs = flatten_inputs(inputs)
        return core.infer_blocking(inputs, timeout, False, priority, encoded)

    @property
    def pending(self) -> int:
        """Requests of this client (in this process) not answered yet."""
        core = self._core
        return 0 if core is None or self._generation != _fork_generation else core.pending

    def close(self) -> None:
        """Gives the client's slot back; requests still waiting fail with
        :class:`ServerClosedError`. Idempotent."""
        with self._lock:
            self._closed = True
            core, self._core = self._core, None
        if core is not None and self._generation == _fork_generation:
            core.close()

    def __enter__(self) -> SharedClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, tuple[str, float, int | str | None]]:
        return (_reconnect, (self.name, self._timeout, self._owner))

    def __repr__(self) -> str:
        return f"SharedClient(name={self.name!r}, model={self.model!r})"
