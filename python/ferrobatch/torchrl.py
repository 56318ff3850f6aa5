"""TorchRL's ``InferenceServer`` surface on ferrobatch's core: switch with one import.

::

    from ferrobatch.torchrl import InferenceServer, ThreadingTransport

    transport = ThreadingTransport()
    with InferenceServer(policy, transport, max_batch_size=64) as server:
        client = transport.client()                 # or server.client()
        td = client(TensorDict({"observation": obs}))  # -> td["action"], td["policy_version"]
        server.update_model(lambda m: m.load_state_dict(new_weights))  # between batches

What differs from TorchRL's server, and what it costs:

- Batching, queueing and fan-out run in ferrobatch's core (Rust), on an event
  loop and worker thread of the server's own; callers in threads block on a
  ``concurrent.futures.Future``.
- The model is called with a ``TensorDict`` of batch size ``[B, *dims]``
  holding the model's inputs (its ``in_keys`` when it has them, else every
  tensor of the first request), where ``dims`` is the first request's own
  batch size (``[]`` for an unbatched one), as TorchRL stacks requests; the
  result a caller gets is its request (a shallow copy) with the model's
  outputs and the policy version set in it, the version of the request's own
  batch size (a request of batch size ``[3]`` gets three).
- Specs are fixed by the first request (or ``request_spec``): later requests
  must carry the same keys, dtypes and shapes (else ``ValueError``).
- Non-tensor data (``NonTensorData``) travels pickled, one element per row:
  the model gets the batch's values stacked, each caller its own back, and
  a value pickle refuses fails its request with ``TypeError``.
- ``collate_fn`` is honoured: the batch is unbound into the requests' TensorDicts and
  passed through it in Python before the model (about 1-2 us per request more
  than the default path). It sees each request whole (the first request's
  other keys travel as optional inputs). The first request's model call
  (through ``collate_fn``) learns the specs and answers that request.
- Any TorchRL ``InferenceTransport`` (custom ones too) is served through
  TorchRL's own interface (``drain``/``wait_for_work``/``resolve``): a thread
  of the server's drains it into ferrobatch's queue.
- Weight updates (``update_model``, ``update_policy_weights_``, a polled
  ``weight_sync`` scheme) go through the core's barrier: between batches, never
  during a forward pass; each bumps the version stamped into the results.
- A model's exception reaches ``client(td)`` as itself (``ValueError`` stays a
  ``ValueError``), where the core API raises :class:`~ferrobatch.ModelError`
  with it as ``__cause__``.
- :class:`MPTransport` carries requests through ferrobatch's shared memory
  (``server.share`` / ``fb.connect``) once the server knows its specs; each
  client's ``multiprocessing`` Pipe carries what cannot go there (the
  requests before that, those past a process's cells, and model exceptions,
  pickled). Every request's Future resolves: an answer that cannot be read
  fails that request alone; a client whose connection fails (the server went
  away, a broken stream) fails its waiting and later requests with
  :class:`~ferrobatch.ServerClosedError`. :class:`SharedMemoryTransport`
  is the same path with TorchRL's slot rules, and :class:`RayTransport` with
  one Ray actor (``ferrobatch.ray``'s ``Mailbox``) in place of the pipes, for
  clients on Ray actors.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ._requests import RequestInfo, encode_parameters
from ._weights import WeightUpdate, apply_all_or_nothing, check_update
from .client import Client
from .errors import FerrobatchError, ModelError, QueueFullError, ServerClosedError
from .server import Server
from .specs import TensorSpec, dtype_name, example_specs, nested_key

__all__ = [
    "InferenceServer",
    "MPTransport",
    "ProcessInferenceServer",
    "RayTransport",
    "ResultTimeout",
    "SharedMemoryTransport",
    "SlotTransport",
    "ThreadingTransport",
]

#: The rest of ``torchrl.modules.inference_server``'s names, TorchRL's own
#: (configs, the transport and client base classes, its other transports, which
#: this InferenceServer serves through its pump): re-exported, so that a whole
#: import block switches to ``ferrobatch.torchrl``.
_FROM_TORCHRL = (
    "InferenceClient",
    "InferenceDeviceConfig",
    "InferenceServerConfig",
    "InferenceTransport",
    "MonarchTransport",
    "PolicyClientModule",
    "ProcessSlotTransport",
)


def __getattr__(name: str) -> Any:
    if name not in _FROM_TORCHRL:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import torchrl.modules.inference_server as torchrl_inference
    except ImportError as exc:
        raise ImportError(f"ferrobatch.torchrl.{name} is TorchRL's own: pip install torchrl") from exc
    _register_with_torchrl()
    return getattr(torchrl_inference, name)


_registered_with_torchrl = False


def _register_with_torchrl() -> None:
    """Makes this module's transports TorchRL ``InferenceTransport``s
    (virtual subclasses) once TorchRL's module is loaded: checked when a
    transport is made and when a TorchRL name is taken from here, so users
    who never load TorchRL (seconds to import) do not pay for it."""
    global _registered_with_torchrl
    if _registered_with_torchrl:
        return
    torchrl_inference = sys.modules.get("torchrl.modules.inference_server")
    base = getattr(torchrl_inference, "InferenceTransport", None)
    if base is None:
        return
    for transport in (ThreadingTransport, SlotTransport, MPTransport, SharedMemoryTransport, RayTransport):
        base.register(transport)
    _registered_with_torchrl = True


# The core's output carrying the version each row ran with (flat: no dot).
_VERSION = "_ferrobatch_policy_version"

_log = logging.getLogger("ferrobatch")

#: What an MPTransport's share holds: client processes, and each one's
#: requests in flight over shared memory (beyond, they take its pipe).
_MP_MAX_CLIENTS = 64
_MP_ROWS_PER_CLIENT = 256
#: Model exceptions of shared-memory requests kept for their clients to fetch.
_MP_ERRORS_KEPT = 1024
#: The request parameter naming a shared-memory request of an MPTransport client.
_MP_TOKEN = "ferrobatch.mp"
#: How often a client looks for its server's share until it finds it (seconds).
_MP_RETRY = 0.05

NestedKey = str | tuple[str, ...]


#: Where TorchRL's ``PolicyClientModule`` puts the caller's interaction type
#: (an int8 code per element of the request's batch); the server runs the
#: model under it and never hands it to the model.
_INTERACTION_KEY = "_torchrl_inference_interaction_type"
#: TorchRL's codes for tensordict's ``InteractionType`` values (-1: none set).
_INTERACTION_TYPES = ("mode", "median", "mean", "random", "deterministic")


def _interaction_codes(stamps: torch.Tensor) -> list[int]:
    """Each request's interaction code from its stamp (a row of ``stamps``);
    an empty stamp is -1, as TorchRL reads it."""
    flat = stamps.reshape(stamps.shape[0], -1)
    if flat.shape[1] == 0:
        return [-1] * flat.shape[0]
    codes: list[int] = flat[:, 0].tolist()
    return codes


def _interaction_type(code: int | None) -> Any:
    """The context a model call runs in for ``code``: None (unstamped) leaves
    the ambient interaction type; -1 is the module's default, as in TorchRL."""
    if code is None:
        return contextlib.nullcontext()
    from tensordict.nn import InteractionType, set_interaction_type

    if not 0 <= code < len(_INTERACTION_TYPES):
        return set_interaction_type(None)
    return set_interaction_type(InteractionType(_INTERACTION_TYPES[code]))


def _passed(given: torch.Tensor, returned: torch.Tensor, collate_fn: object) -> bool:
    """Whether the model returned the request's tensor ``given`` as it was."""
    if returned is given:
        return True
    if collate_fn is None or returned.shape != given.shape or returned.dtype != given.dtype:
        return False
    return returned.device == given.device and bool(torch.equal(returned, given))


def _name(key: NestedKey) -> str:
    return key if isinstance(key, str) else ".".join(key)


def _leaves(td: Any) -> dict[str, Any]:
    """Every leaf of ``td`` by flat name: its tensors, and its non-tensor
    data (tensordict's ``NonTensorData`` / ``NonTensorStack``) as they are."""
    from tensordict import is_leaf_nontensor

    return {
        _name(key): value for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    }


# Non-tensor data rides the core as a BYTES tensor of the request's batch
# shape, each element pickled (as TorchRL's pipes pickle it): the model gets
# it back stacked (a NonTensorStack of the batch), each caller its own
# elements. An element is a value as it is, a list included: never unrolled
# into more dimensions.


class _Unpicklable:
    """An element of a model's non-tensor output that pickle refused: the
    request it is for fails with ``TypeError`` (the others of its batch do not)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _pack(value: Any, depth: int, *, per_row: bool = False) -> bytes | np.ndarray:
    """Non-tensor data as the core takes it, its first ``depth`` dimensions
    (a request's batch dimensions; a model output's, the batch's too): for
    ``depth`` 0 its value pickled, else an object array of those dimensions,
    one pickled element each. A tensor in its place (tensordict makes one of
    a list of numbers) is taken element by element too. An element pickle
    refuses is a ``TypeError``; ``per_row``: it is marked instead, to fail
    only the request it is for."""
    values = value if isinstance(value, list) else value.tolist()
    elements = _flatten(values, depth)
    shape = _dims(values, depth)
    if math.prod(shape) != len(elements):
        raise ValueError(f"non-tensor data of a ragged shape (its first {depth} dimensions must be whole)")
    packed = np.empty(len(elements), dtype=object)
    packed[:] = [_pickled(element, per_row) for element in elements]
    return packed[0] if depth == 0 else packed.reshape(shape)


def _pickled(element: Any, per_row: bool) -> bytes:
    try:
        return pickle.dumps(element)
    except Exception as exc:  # whatever pickle raises: one typed error
        why = (
            "non-tensor data is pickled on its way through the batcher; "
            f"this value cannot be: {type(exc).__name__}: {exc}"
        )
        if per_row:
            return pickle.dumps(_Unpicklable(why))
        raise TypeError(why) from exc


def _flatten(values: Any, depth: int) -> list[Any]:
    """The elements of a nested list ``depth`` levels deep (an element may itself be a list)."""
    if depth == 0:
        return [values]
    return [element for value in values for element in _flatten(value, depth - 1)]


def _dims(values: Any, depth: int) -> tuple[int, ...]:
    """The first ``depth`` dimensions of a nested list (its first element's, below the first)."""
    dims = []
    for _ in range(depth):
        if not isinstance(values, list):
            raise ValueError(f"non-tensor data with fewer than {depth} batch dimensions")
        dims.append(len(values))
        values = values[0] if values else []
    return tuple(dims)


def _unpack(packed: bytes | np.ndarray) -> Any:
    """``_pack``'s data back: ``NonTensorData`` for one value, else a
    ``NonTensorStack`` of the array's shape (each element a ``NonTensorData``,
    a list one included). An empty element (an optional input a request
    left out) is ``None``; a marked one raises ``TypeError``."""
    from tensordict import NonTensorData, NonTensorStack

    if isinstance(packed, bytes):
        return NonTensorData(_unpickle(packed), batch_size=[])

    def stacked(part: np.ndarray) -> Any:
        if part.ndim == 1:
            return NonTensorStack(*[NonTensorData(_unpickle(bytes(element))) for element in part])
        return NonTensorStack(*[stacked(sub) for sub in part])

    return stacked(packed)


def _unpickle(blob: bytes) -> Any:
    value = pickle.loads(blob) if blob else None
    if isinstance(value, _Unpicklable):
        raise TypeError(value.why)
    return value


def _leaf_spec(name: str, leaf: Any, dims: tuple[int, ...], optional: bool = False) -> TensorSpec:
    """The core's spec of one request's leaf (non-tensor data: BYTES of the
    request's batch dimensions ``dims``)."""
    if isinstance(leaf, torch.Tensor):
        return TensorSpec(name, dtype_name(leaf.dtype), tuple(leaf.shape), optional=optional)
    return TensorSpec(name, "bytes", dims, optional=optional)


def _sample_row(leaf: Any, device: torch.device | str | None, depth: int) -> Any:
    """One request's leaf as a batch of one, as the core hands it to the model."""
    if isinstance(leaf, torch.Tensor):
        return leaf.detach().unsqueeze(0).to(device or "cpu")
    packed = _pack(leaf, depth)
    if isinstance(packed, np.ndarray):
        return packed[np.newaxis]
    row = np.empty(1, dtype=object)
    row[0] = packed
    return row


def _take_rows(column: Any, rows: list[int]) -> Any:
    """The rows ``rows`` of a batch's column (a tensor, or packed non-tensor data)."""
    if isinstance(column, torch.Tensor):
        return column[torch.tensor(rows, device=column.device)]
    return column[rows]


def _join_rows(columns: list[Any]) -> Any:
    if isinstance(columns[0], torch.Tensor):
        return torch.cat(columns)
    return np.concatenate(columns)


def _keyed(names: Sequence[str]) -> tuple[tuple[str, NestedKey], ...]:
    """Flat names with their TensorDict keys (worked out once, not per request)."""
    return tuple((name, nested_key(name)) for name in names)


def _core_request(
    td: Any, inputs: Sequence[tuple[str, NestedKey]], extras: Sequence[tuple[str, NestedKey]]
) -> dict[str, Any]:
    """A request's leaves the core takes, by flat name: the model's
    ``inputs`` (each required), and those of ``extras`` it has (non-tensor
    data packed by the request's batch dimensions)."""
    depth = len(td.batch_size)
    flat = {}
    for name, key in inputs:
        value = td.get(key, None)
        if value is None:
            raise ValueError(f"the request lacks the model's input {name!r}")
        flat[name] = value if isinstance(value, torch.Tensor) else _pack(value, depth)
    for name, key in extras:
        value = td.get(key, None)
        if value is not None:
            flat[name] = value if isinstance(value, torch.Tensor) else _pack(value, depth)
    return flat


def _to_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _leaf_value(value: Any) -> Any:
    """A core input or output as a TensorDict leaf (non-tensor data unpacked)."""
    return value if isinstance(value, torch.Tensor) else _unpack(value)


def _unwrap(error: BaseException) -> BaseException:
    """The model's own exception for a model error (TorchRL's callers catch
    it by type); anything else as it is."""
    if isinstance(error, ModelError) and error.__cause__ is not None:
        return error.__cause__
    return error


class InferenceServer:
    """Auto-batching inference for TorchRL actors, with TorchRL's interface.

    Args:
        model: a callable mapping a batched ``TensorDict`` to a batched
            ``TensorDict`` (e.g. a ``TensorDictModule``).
        transport: :class:`ThreadingTransport` (``None``, ``"auto"`` and
            ``"thread"`` make one), :class:`MPTransport`, or any TorchRL
            ``InferenceTransport`` (``submit``, ``drain``, ``wait_for_work``,
            ``resolve``, ``resolve_exception``): a thread of the server's
            drains it into ferrobatch's queue and resolves each request's
            future as its batch finishes.
        max_batch_size: most requests per forward pass (default 64).
        min_batch_size: a batch waits for this many requests, at most
            ``timeout`` seconds from its oldest (default 1: never waits; a free
            worker takes whatever is queued).
        timeout: seconds, see ``min_batch_size``; also how often ``weight_sync``
            is polled (default 0.01).
        collate_fn: applied to the list of the batch's request TensorDicts
            before the model (in Python; see the module docs for its cost).
        device: where the model runs (moved there); ``None``: where it is.
        weight_sync: a ``torchrl.weight_update`` scheme, polled between batches.
        weight_sync_model_id: the model id the scheme is initialised with.
        policy_version: the first version stamped into results (default 0).
        policy_version_key: where results carry the version; ``None``: not stamped.
        output_device: results are moved there (default: CPU).
        request_spec: one request, to fix the specs at ``start()`` instead of
            at the first request.
        response_spec: one response, for ``transport="distributed"`` with
            ``service_backend="process"`` (its payloads are fixed by both).
        service_backend: where the policy runs: ``"thread"`` (here, the
            default, or what an enclosing ``torchrl.service_backend(...)``
            says), ``"process"`` (a :class:`ProcessInferenceServer` child) or
            ``"ray"`` (a Ray actor, started at once; ``policy_factory`` builds
            the policy there, ``service_backend_options={"remote_config":
            {...}}`` gives the actor's options, clients call it through Ray
            and their calls batch on the actor).
        transport: also ``"distributed"`` with ``service_backend="process"``
            or ``"ray"``: TorchRL's torch.distributed transport (gloo, or
            NCCL; ``transport_options`` are its own), for actors on other
            nodes: each client a pair of process groups of its own, the
            default group untouched, its requests drained into the
            server's batches. With ``"ray"``, its payload layout is learnt
            from a client's first request.
    """

    def __init__(
        self,
        model: Callable[[Any], Any] | None = None,
        transport: Any = None,
        *,
        max_batch_size: int | None = None,
        min_batch_size: int | None = None,
        timeout: float | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | str | None = None,
        weight_sync: Any = None,
        weight_sync_model_id: str = "policy",
        policy_version: int = 0,
        policy_version_key: NestedKey | None = "policy_version",
        output_device: torch.device | str | None = None,
        request_spec: Any = None,
        response_spec: Any = None,
        policy_device: torch.device | str | None = None,
        service_backend: str | None = None,
        num_clients: int | None = None,
        policy_factory: Callable[[], Any] | None = None,
        server_config: Any = None,
        device_config: Any = None,
        service_backend_options: Mapping[str, Any] | None = None,
        transport_options: Mapping[str, Any] | None = None,
    ) -> None:
        # Where the policy lives when it is not here: a child process or a Ray actor.
        self._in_child: ProcessInferenceServer | _RayOwnedServer | None = None
        loose = {
            k: v
            for k, v in (("max_batch_size", max_batch_size), ("min_batch_size", min_batch_size), ("timeout", timeout))
            if v is not None
        }
        if server_config is not None:
            if loose:
                raise ValueError(f"server_config and {', '.join(loose)} are mutually exclusive: give one")
            max_batch_size = server_config.max_batch_size
            min_batch_size = server_config.min_batch_size
            timeout = server_config.timeout
        max_batch_size = 64 if max_batch_size is None else max_batch_size
        min_batch_size = 1 if min_batch_size is None else min_batch_size
        timeout = 0.01 if timeout is None else timeout
        if device_config is not None:
            given = [
                k
                for k, v in (("device", device), ("policy_device", policy_device), ("output_device", output_device))
                if v is not None
            ]
            if given:
                raise ValueError(f"device_config and {', '.join(given)} are mutually exclusive: give one")
            if getattr(device_config, "storing_device", None) is not None:
                raise ValueError(
                    "storing_device is a collector-level setting (where collected data is kept); an inference"
                    " server has policy_device and output_device only"
                )
            policy_device = device_config.policy_device
            resolve = getattr(device_config, "server_output_device", None)
            output_device = resolve() if callable(resolve) else device_config.output_device
        # TorchRL's scoped defaults (`with torchrl.service_backend(...)`), below explicit arguments.
        context_service, context_transport = _torchrl_context()
        service_from_context = service_backend is None and server_config is None and context_service is not None
        if service_backend is None:
            configured = getattr(server_config, "service_backend", None)
            service_backend = configured or context_service or "thread"
        transport_from_context = transport is None and context_transport is not None
        if transport is None:
            transport = context_transport
        if transport_options and not (isinstance(transport, str) or transport is None):
            raise ValueError("transport_options cannot be used with an explicit transport instance.")
        if isinstance(transport, str) or transport is None:
            kind = transport or "auto"
            allowed = _ALLOWED_TRANSPORTS.get(service_backend)
            if allowed is None:
                raise ValueError(
                    _from_context(
                        f"service_backend must be one of {sorted(_ALLOWED_TRANSPORTS)}, got {service_backend!r}",
                        service=service_from_context,
                    )
                )
            if kind not in allowed:
                raise ValueError(
                    _from_context(
                        f"transport={kind!r} is incompatible with service_backend={service_backend!r}.",
                        service=service_from_context,
                        transport=transport_from_context,
                    )
                )
            if transport_options and service_backend != "thread" and kind != "distributed":
                raise ValueError(f"transport_options are for service_backend='thread', not {service_backend!r}")
            if service_backend == "process" and kind in ("auto", "process", "distributed"):
                # TorchRL's process-owned server: a ProcessInferenceServer, fed by
                # pipes, or by torch.distributed pairs.
                if policy_factory is None or model is not None:
                    raise ValueError("service_backend='process' builds the policy in the child: give policy_factory")
                options = dict(service_backend_options or {})
                fed_by: Any = None
                if kind == "distributed":
                    if request_spec is None or response_spec is None:
                        raise ValueError("Process-owned distributed inference requires request_spec and response_spec.")
                    fed_by = _distributed_transport(request_spec, response_spec, transport_options)
                    options["request_spec"] = request_spec
                self._in_child = ProcessInferenceServer(
                    policy_factory,
                    fed_by,
                    mp_context=options.pop("mp_context", None),
                    max_batch_size=max_batch_size,
                    min_batch_size=min_batch_size,
                    timeout=timeout,
                    collate_fn=collate_fn,
                    policy_version=policy_version,
                    policy_version_key=policy_version_key,
                    **options,
                )
                self.service_backend = "process"
                self.transport_kind = "distributed" if kind == "distributed" else "process"
                self.max_batch_size, self.timeout = max_batch_size, float(timeout)
                return  # the model lives in the child: start/shutdown/client/stats go there
            if service_backend == "ray" and kind in ("auto", "ray", "distributed"):
                # TorchRL's Ray-owned server: the policy is built on a Ray actor that serves it.
                if policy_factory is None or model is not None:
                    raise ValueError("service_backend='ray' builds the policy on the Ray actor: give policy_factory")
                self._in_child = _RayOwnedServer(
                    policy_factory,
                    dict(service_backend_options or {}),
                    {
                        "max_batch_size": max_batch_size,
                        "min_batch_size": min_batch_size,
                        "timeout": timeout,
                        "collate_fn": collate_fn,
                        "policy_version": policy_version,
                        "policy_version_key": policy_version_key,
                    },
                    distributed=dict(transport_options or {}) if kind == "distributed" else None,
                )
                self.service_backend = "ray"
                self.transport_kind = "distributed" if kind == "distributed" else "ray"
                self.max_batch_size, self.timeout = max_batch_size, float(timeout)
                return  # the model lives on the actor: start/shutdown/client/stats go there
            if service_backend != "thread" or kind not in _THREAD_TRANSPORTS:
                raise ValueError(
                    f"ferrobatch.torchrl serves service_backend='thread' (transport 'auto'/'thread') and"
                    f" 'process' (transport 'auto'/'process'), got service_backend={service_backend!r},"
                    f" transport={kind!r}"
                )
            if kind == "direct":  # TorchRL's slot transport: one slot per client thread
                if num_clients is None:
                    raise ValueError("transport='direct' requires num_clients.")
                transport = SlotTransport(num_clients, **dict(transport_options or {}))
            else:
                transport = ThreadingTransport(**dict(transport_options or {}))
        if policy_device is not None:
            if device is not None and torch.device(device) != torch.device(policy_device):
                raise ValueError(f"device={device!r} and policy_device={policy_device!r} disagree")
            device = policy_device
        del num_clients  # how many clients a slot transport makes room for: none to make here
        if (model is None) == (policy_factory is None):
            raise ValueError("give either model or policy_factory (it makes the model), not both")
        if model is None:
            assert policy_factory is not None
            model = policy_factory()
        if not callable(model):
            raise TypeError(f"model must be callable, got {type(model).__name__}")
        self.service_backend = "thread"
        if not isinstance(transport, (ThreadingTransport, MPTransport)):
            if not all(callable(getattr(transport, m, None)) for m in _TRANSPORT_METHODS):
                raise TypeError(
                    "transport must be a ThreadingTransport, an MPTransport, or an InferenceTransport"
                    f" (with {', '.join(_TRANSPORT_METHODS)}), got {type(transport).__name__}"
                )
            transport = _PumpedTransport(transport)
        if not 1 <= min_batch_size <= max_batch_size:
            raise ValueError(f"min_batch_size must be in 1..{max_batch_size}, got {min_batch_size}")
        self.model = model
        self.transport: ThreadingTransport | MPTransport | _PumpedTransport = transport
        #: TorchRL's names for what serves the requests and how they come.
        self.transport_kind = (
            "direct"
            if isinstance(transport, SlotTransport)
            else "thread"
            if isinstance(transport, ThreadingTransport)
            else "shared_memory"
            if isinstance(transport, SharedMemoryTransport)
            else "ray"
            if isinstance(transport, RayTransport)
            else "mp"
            if isinstance(transport, MPTransport)
            else "custom"
        )
        self.max_batch_size = max_batch_size
        self.min_batch_size = min_batch_size
        self.timeout = float(timeout)
        self.collate_fn = collate_fn
        self.device = torch.device(device) if device is not None else None
        self.policy_device = self.device  # TorchRL's name for it
        self.output_device = torch.device(output_device) if output_device is not None else None
        self.weight_sync = weight_sync
        self._weight_sync_model_id = weight_sync_model_id
        self.policy_version_key = policy_version_key
        if request_spec is None and isinstance(transport, SharedMemoryTransport):
            request_spec = transport.request_spec  # shared from the start
        self._request_spec = request_spec
        if self.device is not None and isinstance(model, torch.nn.Module):
            model.to(self.device)
        # Updates made before the core server exists count here.
        self._version_base = int(policy_version)
        self._early_lock = threading.Lock()
        self._core: Server | None = None
        self._closing = threading.Event()  # set: the core's queued batches fail without running
        self._client: Client | None = None
        self._in_names: tuple[str, ...] = ()
        self._extra_names: tuple[str, ...] = ()  # the other keys collate_fn sees (optional inputs)
        self._in_keys: tuple[tuple[str, NestedKey], ...] = ()
        self._extra_keys: tuple[tuple[str, NestedKey], ...] = ()
        self._out_keys: list[tuple[str, NestedKey]] = []
        self._build_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None
        self._polling = threading.local()
        self._started_at = time.monotonic()
        # Recent model calls' durations and requests' waits (ms), for the percentiles of stats().
        self._forward_ms: collections.deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        self._queue_ms: collections.deque[float] = collections.deque(maxlen=_STATS_WINDOW)
        # The counts of stats(): those of earlier runs (a restart builds a new
        # core server; TorchRL's counts carry on), and what reset=True zeroes.
        self._totals = dict.fromkeys(_COUNTS, 0)
        self._stats_base = dict.fromkeys(_COUNTS, 0)
        self._probe_ns = 0
        transport._bind(self)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> InferenceServer:
        """Starts the server (its event loop and, once specs are known, its
        workers) and returns it."""
        if self._in_child is not None:
            self._in_child.start()
            return self
        if self.is_alive:
            raise RuntimeError("Server is already running.")
        # The core server of an earlier run (stopped; its stats read until
        # now) does not start again: the first request builds a new one,
        # and the policy version carries on.
        with self._build_lock:
            if self._core is not None:
                self._version_base += self._core.model_version
                self._totals = self._counts()
            self._core, self._client = None, None
        self._stopping.clear()
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="ferrobatch-torchrl-loop", daemon=True)
        self._thread.start()
        ready.wait()
        self._started_at = time.monotonic()
        if self._request_spec is not None:
            self._ensure_core(self._request_spec)  # no request to answer: the probe's answer is dropped
        if self.weight_sync is not None:
            self._init_weight_sync()
            self._poller = threading.Thread(target=self._poll_weights, name="ferrobatch-torchrl-weights", daemon=True)
            self._poller.start()
        self.transport._start()
        return self

    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stops accepting requests, finishes the accepted ones (failing those
        still queued after ``timeout`` seconds) and stops the threads. A
        forward pass still running then answers its callers when it ends,
        as TorchRL's does (its threads end after it)."""
        if self._in_child is not None:
            self._in_child.shutdown(timeout)
            return
        self._stopping.set()
        self.transport._stop()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        def close(_: object = None) -> None:
            if not self.is_alive:  # not restarted meanwhile
                self.transport._close()
            loop.call_soon_threadsafe(loop.stop)

        if self._core is not None and loop.is_running():
            # Unbounded, so that the core never fails a running batch's callers;
            # past ``timeout`` the batches still queued fail without running.
            stopped = asyncio.run_coroutine_threadsafe(self._core.stop(None), loop)
            try:
                stopped.result(timeout)
            except concurrent.futures.TimeoutError:
                self._closing.set()
                stopped.add_done_callback(close)  # when the running forward pass ends
                self._thread = None
                return
            except RuntimeError:
                pass
        close()
        thread.join(timeout)
        if self._poller is not None:
            self._poller.join(timeout)
            self._poller = None
        self._thread = None

    @property
    def is_alive(self) -> bool:
        """Whether the server's thread runs (from ``start()`` to ``shutdown()``)."""
        if self._in_child is not None:
            return self._in_child.is_alive
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def client(self) -> Any:
        """A client of the transport: ``client(td) -> td``."""
        if self._in_child is not None:
            return self._in_child.client()
        return self.transport.client()

    def clients(self, num_clients: int) -> list[Any]:
        """``num_clients`` distinct clients (one per actor, say)."""
        if not isinstance(num_clients, int) or num_clients < 1:
            raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
        return [self.client() for _ in range(num_clients)]

    # -- stats and versions --------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version stamped into results computed from now on."""
        self._not_in_child("policy_version")
        core = self._core
        return self._version_base + (core.model_version if core is not None else 0)

    def stats(self, *, reset: bool = False) -> dict[str, float | int]:
        """TorchRL's keys: ``requests``, ``batches``, ``requests_per_s``,
        ``batches_per_s``, ``avg_batch_size``, ``p50_queue_ms`` /
        ``p95_queue_ms`` (submit to model call, per request) and
        ``p50_forward_ms`` / ``p95_forward_ms`` (per model call, over the
        last 1024 of each), ``policy_version``, ``weight_updates``; and
        ``queue_ms`` / ``forward_ms`` (means). ``reset=True`` starts the
        counts and the windows again after reading them."""
        if self._in_child is not None:
            from_child: dict[str, float | int] = self._in_child.stats(reset=reset)
            return from_child
        counts = self._counts()
        now = time.monotonic()
        elapsed = max(now - self._started_at, 1e-12)
        rows, batches, queue_ns, compute_ns, updates = (counts[k] - self._stats_base[k] for k in _COUNTS)
        stats: dict[str, float | int] = {
            "requests": rows,
            "batches": batches,
            "requests_per_s": rows / elapsed,
            "batches_per_s": batches / elapsed,
            "avg_batch_size": rows / batches if batches else 0.0,
            "p50_queue_ms": _percentile(self._queue_ms, 50),
            "p95_queue_ms": _percentile(self._queue_ms, 95),
            "p50_forward_ms": _percentile(self._forward_ms, 50),
            "p95_forward_ms": _percentile(self._forward_ms, 95),
            "queue_ms": queue_ns / 1e6 / rows if rows else 0.0,
            "forward_ms": compute_ns / 1e6 / batches if batches else 0.0,
            "policy_version": self.policy_version,
            "weight_updates": updates,
        }
        if reset:  # as TorchRL's: every count, weight updates included
            self._stats_base = counts
            self._forward_ms.clear()
            self._queue_ms.clear()
            self._started_at = now
        return stats

    def _counts(self) -> dict[str, int]:
        """The running counts: earlier runs' and the current core server's."""
        core = self._core.stats() if self._core is not None else {}
        return {k: self._totals[k] + int(core.get(k, 0)) for k in _COUNTS}

    # -- weight updates --------------------------------------------------------------------

    def _not_in_child(self, what: str) -> None:
        if self._in_child is not None:
            where = "its Ray actor" if isinstance(self._in_child, _RayOwnedServer) else "its child process"
            raise RuntimeError(
                f"{what}: the policy of a service_backend={self.service_backend!r} server lives in {where}"
            )

    def _apply(
        self, update: WeightUpdate, bump: Callable[[list[Any]], bool] | None = None, *, undo: bool = True
    ) -> Any:
        """Runs ``update(model)``, or copies the state dict ``update`` in,
        between batches (the core's barrier), or at once before the core
        server exists; returns what the callable returned. Either way a state
        dict is checked first and a failed update undone (unless ``undo`` is
        False: no copy of the model is taken), as the core does."""
        self._not_in_child("a weight update")
        with self._build_lock:
            core = self._core
            if core is None:
                with self._early_lock:
                    check_update(update, [self.model])
                    result = apply_all_or_nothing(update, [self.model], undo=undo)[0]
                    if bump is None or bump([result]):
                        self._version_base += 1
                        self._totals["weight_updates"] += 1
                return result
        # The policy itself, not the wrapper the core calls, between batches.
        _, results = core._weights.apply(update, [self.model], core.devices[:1], bump, undo=undo)
        return results[0]

    def update_model(self, update_fn: Callable[[Any], Any], *, mark_weight_update: bool = True) -> Any:
        """Calls ``update_fn(model)`` between batches (never during a forward
        pass) and returns what it returned; bumps the policy version unless
        ``mark_weight_update=False``."""
        return self._apply(update_fn, None if mark_weight_update else (lambda _: False))

    def update_policy_weights_(self, model_id: Any = None, policy_or_weights: Any = None, **kwargs: Any) -> None:
        """Records a weight update (bumps the version), TorchRL's cascade hook.
        With ``policy_or_weights`` (a state dict, a module or a TensorDict of
        weights), copies them into the model first, between batches."""
        del model_id, kwargs
        if getattr(self._polling, "active", False):
            self._polling.applied = True  # weight_sync's receive() applied them, inside the barrier
            return
        weights = policy_or_weights
        if weights is None:
            self._apply(lambda _model: None, undo=False)  # nothing to undo
            return
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        elif hasattr(weights, "flatten_keys") and hasattr(weights, "to_dict"):
            weights = {_name(k): v for k, v in weights.items(include_nested=True, leaves_only=True)}
        if isinstance(weights, Mapping) and isinstance(self.model, torch.nn.Module):
            self._apply(weights)  # checked before anything is copied, as Server.update_weights does
        else:
            self._apply(lambda model: model.load_state_dict(weights))

    def _init_weight_sync(self) -> None:
        ws = self.weight_sync
        if getattr(ws, "context", False) is None:
            ws.context = self  # its receive() cascades into update_policy_weights_
        if not getattr(ws, "initialized_on_receiver", True):
            ws.init_on_receiver(model_id=self._weight_sync_model_id, model=self.model, worker_idx=0)
        if not getattr(ws, "synchronized_on_receiver", True):
            ws.connect(worker_idx=0)

    def _poll_weights(self) -> None:
        ws = self.weight_sync
        if type(ws).__name__ == "SharedMemWeightSyncScheme":
            return  # applied in place by its own thread; versions come through the cascade
        while not self._stopping.wait(self.timeout):

            def receive(_model: Any) -> bool:
                self._polling.active, self._polling.applied = True, False
                try:
                    return ws.receive(timeout=0.0) is not None or self._polling.applied
                finally:
                    self._polling.active = False

            try:
                # Most polls receive nothing: not worth a copy of the model each; a receive
                # that fails part-way is the scheme's to undo, as under TorchRL's own server.
                self._apply(receive, bump=lambda results: bool(results[0]), undo=False)
            except Exception:  # noqa: BLE001 - a failed receive: try again at the next poll
                if self._stopping.is_set():
                    return

    # -- requests ------------------------------------------------------------------------

    def _ensure_core(self, example: Any) -> tuple[Client, dict[str, torch.Tensor] | None]:
        """The core server's client, building and starting the server from
        ``example`` (one request) the first time; then also the example's
        answer (the model ran on it to learn its outputs), else None."""
        client = self._client
        if client is not None:
            return client, None
        with self._build_lock:
            if self._client is not None:
                return self._client, None
            if self._loop is None or self._stopping.is_set():
                raise ServerClosedError("the inference server is not running; call start() first")
            core, first = self._build_core(example)
            asyncio.run_coroutine_threadsafe(core.start(), self._loop).result()
            self._core = core
            self._client = core.client()
            if isinstance(self.transport, MPTransport):
                self.transport._share(core, self)
            return self._client, first

    def _build_core(self, example: Any) -> tuple[Server, dict[str, torch.Tensor]]:
        """The core server for requests like ``example``, and the example's
        answer: the model runs once on it to learn its outputs, and that
        call is the example's own (as TorchRL's first batch would be)."""
        from tensordict import TensorDict

        leaves = _leaves(example)
        if self.policy_version_key is not None:
            leaves.pop(_name(self.policy_version_key), None)
        stamp = leaves.pop(_INTERACTION_KEY, None)  # how to run the model, not its input
        in_keys = getattr(self.model, "in_keys", None)
        model, collate_fn, device = self.model, self.collate_fn, self.device
        extras: dict[str, torch.Tensor] = {}
        if in_keys is not None:
            wanted = {_name(k) for k in in_keys}
            mine = {k: v for k, v in leaves.items() if k in wanted}
            # A collate_fn may build the model's inputs from other keys: then all are required.
            if collate_fn is None or mine:
                extras = {k: v for k, v in leaves.items() if k not in wanted}
                leaves = mine
        if not leaves and stamp is None:
            raise ValueError("the request carries none of the model's inputs")
        # As TorchRL stacks requests: the first request's batch dims follow the batch's.
        dims = tuple(getattr(example, "batch_size", ()))
        inputs = [_leaf_spec(name, leaf, dims) for name, leaf in leaves.items()]
        model_keys = [(s.name, nested_key(s.name)) for s in inputs]
        carried = dict(leaves)
        if collate_fn is not None and len(inputs) + len(extras) <= 64:
            # collate_fn sees each request whole, as TorchRL gives it: the first
            # request's other keys travel too, each optional (a request without
            # it is collated without it).
            inputs += [_leaf_spec(name, leaf, dims, optional=True) for name, leaf in extras.items()]
            carried.update(extras)
        all_keys = [(s.name, nested_key(s.name)) for s in inputs]
        # PolicyClientModule's interaction type, one code per element of a request's
        # batch: optional, so that requests of other clients need none.
        inputs.append(TensorSpec(_INTERACTION_KEY, "int8", dims, optional=bool(inputs)))

        probe_inputs: list[Any] = []  # the probe's input, to tell what the model passed through

        def model_input(batch: Mapping[str, torch.Tensor], requests: Sequence[RequestInfo]) -> Any:
            rows = len(requests)  # one row each
            if collate_fn is None:
                given = TensorDict(
                    {key: _leaf_value(batch[name]) for name, key in model_keys}, batch_size=[rows, *dims], device=device
                )
                if not probe_inputs:
                    probe_inputs.append(given)
                return given
            whole = TensorDict(
                {key: _leaf_value(batch[name]) for name, key in all_keys}, batch_size=[rows, *dims], device=device
            )
            items = list(whole.unbind(0))
            for item, request in zip(items, requests):  # one row per request
                for name in request.absent:
                    if name != _INTERACTION_KEY:
                        del item[nested_key(name)]
            return collate_fn(items)

        def invoke(batch: Mapping[str, torch.Tensor], requests: Sequence[RequestInfo], code: int | None) -> Any:
            with _interaction_type(code):
                result = model(model_input(batch, requests))
            size = getattr(result, "batch_size", None)
            if size is not None and len(size) and size[0] != len(requests):
                # TorchRL's check: never hand one request another's row.
                raise RuntimeError(f"Model returned {size[0]} results for a batch of {len(requests)} inputs.")
            return result

        sample = {name: _sample_row(leaf, device, len(dims)) for name, leaf in carried.items()}
        probe = RequestInfo(rows=1, absent=frozenset() if stamp is not None else frozenset({_INTERACTION_KEY}))
        began = time.perf_counter_ns()
        with torch.no_grad():  # as the worker runs it
            raw = invoke(sample, [probe], None if stamp is None else _interaction_codes(stamp.unsqueeze(0))[0])
        self._probe_ns = time.perf_counter_ns() - began
        produced = _leaves(raw)
        for hidden in (_INTERACTION_KEY, None if self.policy_version_key is None else _name(self.policy_version_key)):
            produced.pop(hidden or "", None)
        # What the model passed through untouched is the request's own: not copied back.
        # Anything else it returned, an input key it wrote included, is a result, as TorchRL's.
        # (collate_fn copies the requests: there, a tensor equal to the request's is taken as passed through).
        tensors = {name: leaf for name, leaf in produced.items() if isinstance(leaf, torch.Tensor)}
        passed = {name for name, t in tensors.items() if name in sample and _passed(sample[name], t, collate_fn)}
        # Non-tensor data: passed through when it is the very object the model was given
        # (with collate_fn, which copies: the same values).
        given = probe_inputs[0] if probe_inputs else None
        depth = 1 + len(dims)  # the batch's rows, then each request's own dims
        for name, leaf in produced.items():
            if name in tensors or name not in sample:
                continue
            if (
                (leaf is given.get(nested_key(name), None))
                if given is not None
                else np.array_equal(sample[name], _pack(leaf, depth))
            ):
                passed.add(name)
        outputs = example_specs(tensors, exclude=passed) if set(tensors) - passed else []
        outputs += [
            _leaf_spec(name, leaf, dims)
            for name, leaf in produced.items()
            if name not in tensors and name not in passed
        ]
        if not outputs:
            raise TypeError("the model returned no outputs besides its inputs")
        out_keys = [(s.name, nested_key(s.name)) for s in outputs]
        objects = {s.name for s in outputs if s.is_bytes}

        def core_output(name: str, value: Any) -> Any:
            """A model output as the core takes it: non-tensor data packed row by
            row (an element pickle refuses fails only its own request)."""
            return _pack(value, depth, per_row=True) if name in objects else value

        first = {name: core_output(name, raw.get(key))[0] for name, key in out_keys}
        first = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in first.items()}
        first[_VERSION] = torch.tensor(0, dtype=torch.int64)

        forward_ms, queue_ms = self._forward_ms, self._queue_ms
        keep_error = self.transport._keep_error if isinstance(self.transport, MPTransport) else None
        closing = self._closing = threading.Event()  # this core's: a restart builds another

        def forward(
            batch: Mapping[str, torch.Tensor], requests: Sequence[RequestInfo], code: int | None
        ) -> dict[str, torch.Tensor]:
            result = invoke(batch, requests, code)
            return {name: core_output(name, result.get(key)) for name, key in out_keys}

        def run(batch: dict[str, torch.Tensor], requests: Sequence[RequestInfo]) -> dict[str, torch.Tensor]:
            queue_ms.extend(r.queued_ns / 1e6 for r in requests)
            began = time.perf_counter_ns()
            try:
                if closing.is_set():  # shutdown's wait ran out: as the core fails what it has not run
                    raise ServerClosedError("server 'policy' stopped before the request could run")
                stamps = batch[_INTERACTION_KEY]
                codes: list[int | None] = [None] * len(requests)
                if any(_INTERACTION_KEY not in r.absent for r in requests):
                    codes = [
                        None if _INTERACTION_KEY in r.absent else code
                        for r, code in zip(requests, _interaction_codes(stamps))
                    ]
                kinds = list(dict.fromkeys(codes))
                if len(kinds) == 1:
                    outputs = forward(batch, requests, kinds[0])
                else:
                    # Requests asking for different interaction types: one model call
                    # per type, the rows put back in order (TorchRL fails such a batch).
                    order = [i for kind in kinds for i, code in enumerate(codes) if code == kind]
                    parts = []
                    for kind in kinds:
                        rows = [i for i, code in enumerate(codes) if code == kind]
                        part = {name: _take_rows(t, rows) for name, t in batch.items()}
                        parts.append(forward(part, [requests[i] for i in rows], kind))
                    back = torch.argsort(torch.tensor(order)).tolist()
                    outputs = {name: _take_rows(_join_rows([part[name] for part in parts]), back) for name in parts[0]}
            except BaseException as exc:
                if keep_error is not None:  # shared-memory clients fetch it over their pipe
                    for request in requests:
                        token = request.parameters.get(_MP_TOKEN)
                        if token is not None:
                            keep_error(str(token), exc)
                raise
            forward_ms.append((time.perf_counter_ns() - began) / 1e6)
            return outputs

        core = Server(
            run,  # type: ignore[arg-type]  # with_requests: called as run(inputs, requests)
            inputs=inputs,
            outputs=outputs,
            max_batch_size=self.max_batch_size,
            max_delay=self.timeout if self.min_batch_size > 1 else 0.0,
            preferred_batch_sizes=range(self.min_batch_size, self.max_batch_size + 1)
            if self.min_batch_size > 1
            else (),
            device=self.device,
            delay_from="free_worker",  # TorchRL's timeout: from when the server is back for more
            version_output=_VERSION,
            name="policy",
            with_requests=True,  # for each request's wait (stats' queue percentiles)
            isolate_failures=False,  # TorchRL fails the whole batch a model call failed
        )
        self._in_names = tuple(leaves)
        self._extra_names = (*(s.name for s in inputs[len(leaves) : -1]), _INTERACTION_KEY)
        self._in_keys, self._extra_keys = _keyed(self._in_names), _keyed(self._extra_names)
        self._out_keys = out_keys
        return core, first

    def _flat(self, td: Any) -> dict[str, Any]:
        """A request's tensors the core takes: the model's inputs, and the
        other keys collate_fn sees that this request has."""
        return _core_request(td, self._in_keys, self._extra_keys)

    def _submit(self, td: Any) -> concurrent.futures.Future[dict[str, torch.Tensor]]:
        client = self._client
        if client is None:
            client, first = self._ensure_core(td)
            if first is not None:
                answered: concurrent.futures.Future[dict[str, torch.Tensor]] = concurrent.futures.Future()
                answered.set_result(self._probe_answered(first))
                return answered
        return client._submit_threadsafe(self._flat(td))

    def _infer_blocking(self, td: Any) -> dict[str, torch.Tensor]:
        client = self._client
        if client is None:
            client, first = self._ensure_core(td)
            if first is not None:
                return self._probe_answered(first)
        return client._submitter.infer_blocking(self._flat(td), None, False)

    def _probe_answered(self, first: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``first``, the answer of the model call that learnt the specs, as
        its request's: counted as one batch of one, as TorchRL's first call."""
        with self._build_lock:
            for key, value in (("rows", 1), ("batches", 1), ("compute_ns", self._probe_ns)):
                self._totals[key] += value
        self._forward_ms.append(self._probe_ns / 1e6)
        return first

    def _result_pairs(
        self, outputs: dict[str, torch.Tensor], batch_size: Sequence[int] = ()
    ) -> list[tuple[NestedKey, torch.Tensor]]:
        """What a request of ``batch_size`` gets added to it: the outputs, and
        the version (one per element of its batch, as TorchRL stamps it)."""
        pairs: list[tuple[NestedKey, Any]] = [(key, _leaf_value(outputs[name])) for name, key in self._out_keys]
        if self.policy_version_key is not None:
            version = outputs[_VERSION]
            if self._version_base:
                version = version + self._version_base
            if len(batch_size):
                version = version.expand(*batch_size).clone()
            pairs.append((self.policy_version_key, version))
        if self.output_device is not None:
            pairs = [(key, _to_device(value, self.output_device)) for key, value in pairs]
        return pairs


#: The counts ``stats()`` keeps across restarts (the core server's names).
_COUNTS = ("rows", "batches", "queue_ns", "compute_ns", "weight_updates")

#: Model calls and requests the percentiles of ``stats()`` are taken over.
_STATS_WINDOW = 1024


def _percentile(samples: collections.deque[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _complete(td: Any, pairs: Sequence[tuple[NestedKey, torch.Tensor]]) -> Any:
    """The request ``td`` with ``pairs`` added, as a new TensorDict (what
    ``td.copy()`` and a ``set`` per pair make). A plain TensorDict on no
    device given top-level keys is built at once from its entries: the
    pairs fit its batch (the server made them so), and a caller thread
    pays for every microsecond here while 63 others wait for the GIL."""
    unsafe = _new_unsafe(td)
    if unsafe is not None and all(type(key) is str for key, _ in pairs):
        entries = dict(td.items())
        entries.pop(_INTERACTION_KEY, None)  # the server's to read, not the caller's (as TorchRL's)
        entries.update(pairs)
        return unsafe(entries, batch_size=td.batch_size, device=None)
    result = td.copy()
    if _INTERACTION_KEY in result.keys():
        del result[_INTERACTION_KEY]
    for key, value in pairs:
        result.set(key, value)
    return result


def _new_unsafe(td: Any) -> Any:
    """``TensorDict._new_unsafe`` for a plain TensorDict on no device, else None."""
    if td.device is not None or type(td) is not _plain_tensordict():
        return None
    return getattr(type(td), "_new_unsafe", None)


@functools.cache
def _plain_tensordict() -> Any:
    from tensordict import TensorDict

    return TensorDict


def _torchrl_context() -> tuple[str | None, str | None]:
    """The service and transport backends that an enclosing
    ``torchrl.service_backend(...)`` / ``torchrl.transport_backend(...)``
    context selects (TorchRL's scoped defaults), or ``None``s without TorchRL."""
    try:
        from torchrl._comm.backends import _get_service_backend, _get_transport_backend
    except ImportError:
        return None, None
    return _get_service_backend(), _get_transport_backend()


def _from_context(message: str, service: bool = False, transport: bool = False) -> str:
    """``message``, naming the TorchRL context that chose the failing setting."""
    contexts = [name for name, chose in (("service_backend", service), ("transport_backend", transport)) if chose]
    if not contexts:
        return message
    return f"{message} (selected by an enclosing {' and '.join(f'torchrl.{c}' for c in contexts)} context.)"


#: TorchRL's transports by service backend (which pairs it accepts), and those served here.
_ALLOWED_TRANSPORTS = {
    "thread": {"auto", "thread", "queue", "direct"},
    "process": {"auto", "process", "shared_memory", "distributed"},
    "ray": {"auto", "ray", "distributed"},
}
_THREAD_TRANSPORTS = {"auto", "thread", "queue", "direct"}

#: What a TorchRL ``InferenceTransport`` offers the server side.
_TRANSPORT_METHODS = ("drain", "wait_for_work", "resolve", "resolve_exception")


class _PumpedTransport:
    """A TorchRL ``InferenceTransport`` (a custom one: TorchRL's own API,
    ``drain``/``wait_for_work``/``resolve``), served by a thread of the
    server's that drains its requests into ferrobatch's queue as they come,
    up to ``max_batch_size`` at a time, and resolves each one's future when
    its batch is done. Batches form in ferrobatch's core, with the requests
    of every other transport of the server."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._server: InferenceServer | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # its client(), submit() and the rest, as they are

    def _bind(self, server: InferenceServer) -> None:
        self._server = server

    def client(self) -> Any:
        return self.inner.client()

    def _start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._pump, name="ferrobatch-torchrl-pump", daemon=True)
        self._thread.start()

    def _stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _close(self) -> None:
        """After the server stopped: what is still in the transport fails."""
        items, futures = self.inner.drain(1 << 30)
        for _, future in zip(items, futures):
            self._fail(future, ServerClosedError("the inference server stopped"))

    def _fail(self, future: Any, error: BaseException) -> None:
        try:
            self.inner.resolve_exception(future, error)
        except Exception:  # noqa: BLE001 - resolved already (cancelled by its caller)
            pass

    def _pump(self) -> None:
        server = self._server
        assert server is not None
        while not self._stopping.is_set():
            self.inner.wait_for_work(server.timeout)
            items, futures = self.inner.drain(server.max_batch_size)
            for td, future in zip(items, futures):
                self._forward(server, td, future)

    def _forward(self, server: InferenceServer, td: Any, future: Any) -> None:
        inner = self.inner

        def settle(done: concurrent.futures.Future[dict[str, torch.Tensor]]) -> None:
            try:
                error = done.exception()
                if error is None:
                    result = _complete(td, server._result_pairs(done.result(), td.batch_size))
            except BaseException as exc:  # noqa: BLE001 - this request's to see
                error = exc
            try:
                if error is not None:
                    inner.resolve_exception(future, _unwrap(error))
                else:
                    inner.resolve(future, result)
            except Exception:  # noqa: BLE001 - resolved already (cancelled by its caller)
                pass

        try:
            server._submit(td).add_done_callback(settle)
        except BaseException as exc:  # noqa: BLE001 - this request's to see
            self._fail(future, _unwrap(exc))


class _TorchRLTransport:
    """What TorchRL's server reads of a transport besides its methods (its
    base class's defaults, which a registered transport does not inherit)."""

    _batched_slot_io = False
    _clients_require_registration = True

    def _set_peer_alive(self, alive_event: Any) -> None:
        """The server's liveness is the clients' own business here (a pipe
        that ends, shared memory that says so): nothing to keep."""


class ThreadingTransport(_TorchRLTransport):
    """Callers in threads of the server's process. ``submit(td)`` (TorchRL's
    transport method) returns a Future; requests submitted before the server
    starts wait for it, and fail with ``ServerClosedError`` if it stops first.

    It is a TorchRL ``InferenceTransport`` (registered once TorchRL is
    loaded) with TorchRL's server-side methods too: a TorchRL
    ``InferenceServer`` (or any loop of ``wait_for_work``/``drain``/
    ``resolve``) serves the requests it holds, as TorchRL's own does."""

    def __init__(self) -> None:
        self._server: InferenceServer | None = None
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._running = False
        self._held: list[tuple[Any, concurrent.futures.Future[Any]]] = []
        _register_with_torchrl()

    def _bind(self, server: InferenceServer) -> None:
        if self._server is not None and self._server is not server:
            raise ValueError("this transport already serves another InferenceServer")
        self._server = server

    def submit(self, td: Any) -> concurrent.futures.Future[Any]:
        """Queues ``td``; its Future resolves with the result (or the error).
        Between a stop and the next start it waits for that start."""
        held = self._hold(td)
        return held if held is not None else ThreadingClient(self).submit(td)

    def _hold(self, td: Any) -> concurrent.futures.Future[Any] | None:
        """Holds ``td`` while ferrobatch's server does not run (until it
        starts again, or for another server's ``drain``), as TorchRL's
        transports queue: its Future; None when the server runs (queue it there)."""
        with self._lock:
            if self._running:
                return None
            held: concurrent.futures.Future[Any] = concurrent.futures.Future()
            held.set_running_or_notify_cancel()
            self._held.append((td, held))
            self._work.notify()
            return held

    # -- TorchRL's server side, for a server other than ferrobatch's --------------------

    def wait_for_work(self, timeout: float) -> None:
        """Blocks until a request is held or ``timeout`` seconds pass."""
        with self._work:
            if not self._held:
                self._work.wait(timeout)

    def drain(self, max_items: int) -> tuple[list[Any], list[concurrent.futures.Future[Any]]]:
        """Takes up to ``max_items`` held requests: their TensorDicts, and the
        callbacks (``resolve`` takes one and its result)."""
        with self._lock:
            taken, self._held = self._held[:max_items], self._held[max_items:]
        return [td for td, _ in taken], [future for _, future in taken]

    def resolve(self, callback: concurrent.futures.Future[Any], result: Any) -> None:
        callback.set_result(result)

    def resolve_exception(self, callback: concurrent.futures.Future[Any], exc: BaseException) -> None:
        callback.set_exception(exc)

    # -- ferrobatch's server -----------------------------------------------------------

    def _start(self) -> None:
        with self._lock:
            self._running = True
            held, self._held = self._held, []
        for td, future in held:
            _chain(ThreadingClient(self).submit(td), future)

    def _stop(self) -> None:
        with self._lock:
            self._running = False

    def _close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for _, future in held:
            future.set_exception(ServerClosedError("the inference server stopped"))

    def client(self) -> ThreadingClient:
        """A callable ``client(td) -> td``, with ``client.submit(td) -> Future``;
        it may be made before the server (or for another server)."""
        return ThreadingClient(self)


class SlotTransport(ThreadingTransport):
    """TorchRL's ``SlotTransport`` (a slot per client thread, for
    ``transport="direct"``) on the thread path: each client queues its
    request from its own thread and blocks on it, with the GIL released.
    ``num_slots`` bounds the clients made; requests come through clients
    only, as in TorchRL."""

    def __init__(self, num_slots: int, *, preallocate: bool = False) -> None:
        del preallocate  # TorchRL's slots' buffers: a request here is copied once, into the batch
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        super().__init__()
        self.num_slots = num_slots
        self._clients = 0

    def submit(self, td: Any) -> concurrent.futures.Future[Any]:
        raise NotImplementedError("a SlotTransport takes requests through its clients: transport.client()(td)")

    def client(self) -> ThreadingClient:
        """A client for one thread (``client(td) -> td``); at most ``num_slots``."""
        with self._lock:
            if self._clients >= self.num_slots:
                raise RuntimeError(f"all {self.num_slots} slots of this SlotTransport have a client")
            self._clients += 1
        return super().client()


def _chain(source: concurrent.futures.Future[Any], target: concurrent.futures.Future[Any]) -> None:
    """Resolves ``target`` as ``source`` resolves."""

    def copy(done: concurrent.futures.Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(done.result())

    source.add_done_callback(copy)


class ThreadingClient:
    """``client(td)`` blocks for the result; ``client.submit(td)`` returns a
    ``concurrent.futures.Future``. Share it between threads freely; it cannot
    leave the process (use :class:`MPTransport` for that). Until the server
    runs, its requests wait in the transport."""

    __slots__ = ("_transport",)

    def __init__(self, transport: ThreadingTransport) -> None:
        self._transport = transport

    def __call__(self, td: Any) -> Any:
        held = self._transport._hold(td)
        if held is not None:
            return held.result()
        server = self._transport._server
        assert server is not None  # it runs
        # Queued from this thread, which then waits for its batch with the GIL
        # released: no hop through the server's event loop.
        error: BaseException | None = None
        try:
            outputs = server._infer_blocking(td)
        except FerrobatchError as exc:
            error = _unwrap(exc)
        if error is not None:
            raise error
        return _complete(td, server._result_pairs(outputs, td.batch_size))

    def submit(self, td: Any) -> concurrent.futures.Future[Any]:
        held = self._transport._hold(td)
        if held is not None:
            return held
        server = self._transport._server
        assert server is not None  # it runs
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        result.set_running_or_notify_cancel()

        def settle(future: concurrent.futures.Future[dict[str, torch.Tensor]]) -> None:
            error = future.exception()
            if error is not None:
                result.set_exception(_unwrap(error))
                return
            try:
                result.set_result(_complete(td, server._result_pairs(future.result(), td.batch_size)))
            except BaseException as exc:  # noqa: BLE001 - the caller's to see
                result.set_exception(exc)

        server._submit(td).add_done_callback(settle)
        return result

    def __reduce__(self) -> Any:
        raise TypeError("a ThreadingTransport client serves threads of one process; use MPTransport across processes")


class MPTransport(_TorchRLTransport):
    """Callers in other processes (``spawn`` or ``fork``).

    Requests ride ferrobatch's shared memory (``server.share`` /
    ``fb.connect``): once the server knows its model's specs (from
    ``request_spec``, or the first request), it shares itself under the
    transport's name, and each client process connects and sends its
    requests there, its tensors copied once into shared cells. Each client
    also has a ``multiprocessing`` Pipe to a thread in the server's process:
    it carries the requests sent before the share exists (and those beyond
    a process's shared cells), and the model's exceptions, pickled, so a
    client raises a model's exception as itself (a pickle never travels
    through the shared segment, which other processes of the user may
    write).

    It is a TorchRL ``InferenceTransport`` (registered once TorchRL is
    loaded) with TorchRL's server-side methods too: without ferrobatch's
    server, a TorchRL ``InferenceServer`` serves its clients through their
    pipes.

    Args:
        ctx: a ``multiprocessing`` context or its name; default ``"spawn"``.
        use_manager: TorchRL's choice of Manager queues over plain ones;
            accepted for compatibility (the clients' pipes serve either way).
    """

    def __init__(self, ctx: Any = None, use_manager: bool = False) -> None:
        del use_manager
        if ctx is None or isinstance(ctx, str):
            ctx = multiprocessing.get_context(ctx or "spawn")
        self._ctx = ctx
        #: The name the server shares itself under once its specs are known.
        self.shm_name = f"ferrobatch-mp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # Model exceptions of shared-memory requests, by request token, until fetched.
        self._errors: collections.OrderedDict[str, BaseException] = collections.OrderedDict()
        self._errors_lock = threading.Lock()
        self._server: InferenceServer | None = None
        self._conns: list[Any] = []
        self._lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self._stopping = threading.Event()
        self._forward: tuple[Any, threading.Lock] | None = None
        self._send_locks: dict[int, threading.Lock] = {}  # by connection: one answer at a time
        _register_with_torchrl()

    def _bind(self, server: InferenceServer) -> None:
        if self._server is not None and self._server is not server:
            raise ValueError("this transport already serves another InferenceServer")
        self._server = server

    def client(self) -> MPClient:
        """A picklable client: pass it to a process; ``client(td) -> td`` there."""
        ours, theirs = self._ctx.Pipe()
        forward = self._forward
        if forward is not None:  # the server runs in a child process: its end goes there
            control, lock = forward
            with lock:
                control.send(("client", ours))
                control.recv()
            ours.close()
        else:
            with self._lock:
                self._conns.append(ours)
        return MPClient(theirs, self.shm_name)

    def _share(self, core: Server, server: InferenceServer) -> None:
        """Shares the core server just built under :attr:`shm_name`, with
        what clients need to make its results TorchRL's (the version base is
        the core's for life). A share that fails leaves the pipes serving.
        A model with non-tensor data is served through the pipes only: its
        requests and answers have no size its clients' cells could hold."""
        if any(spec.is_bytes for spec in (*core.inputs, *core.outputs)):
            _log.info("ferrobatch.torchrl: MPTransport serves through pipes only: the model has non-tensor data")
            return
        meta = {
            "inputs": list(server._in_names),
            "extras": list(server._extra_names),
            "outputs": [name for name, _ in server._out_keys],
            "version": server.policy_version_key
            if server.policy_version_key is None
            else _name(server.policy_version_key),
            "version_base": server._version_base,
            "output_device": None if server.output_device is None else str(server.output_device),
        }
        try:
            core.share(
                self.shm_name,
                max_clients=_MP_MAX_CLIENTS,
                rows_per_client=self._cells_per_client(),
                metadata={"torchrl": meta},
            )
        except (OSError, ValueError, FerrobatchError) as exc:
            _log.warning("ferrobatch.torchrl: MPTransport serves through pipes only: sharing failed: %s", exc)

    def _cells_per_client(self) -> int:
        """Requests a client process may have in shared memory at once (past
        them, its requests take its pipe)."""
        return _MP_ROWS_PER_CLIENT

    def _keep_error(self, token: str, error: BaseException) -> None:
        with self._errors_lock:
            self._errors[token] = error
            while len(self._errors) > _MP_ERRORS_KEPT:
                self._errors.popitem(last=False)

    def _take_error(self, token: str) -> BaseException:
        with self._errors_lock:
            error = self._errors.pop(token, None)
        if error is None:
            return ModelError("the model failed; its exception is no longer kept")
        return _unwrap(error)

    def _forward_to(self, control: Any, lock: threading.Lock) -> None:
        """Clients made from now on have their server end sent over
        ``control`` (a ProcessInferenceServer's child); None: kept here."""
        self._forward = None if control is None else (control, lock)

    def _start(self) -> None:
        self._stopping.clear()
        self._listener = threading.Thread(target=self._listen, name="ferrobatch-torchrl-mp", daemon=True)
        self._listener.start()

    def _stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            self._listener.join(5.0)
            self._listener = None

    def close(self) -> None:
        """Ends every client's connection (TorchRL's ``MPTransport.close``):
        their waiting and later requests fail with ServerClosedError."""
        self._close()

    def _close(self) -> None:
        """After the server has stopped: ends every client's connection, so
        their waiting and later requests fail with ServerClosedError."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _drop(self, conn: Any, *, close: bool) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
            self._send_locks.pop(id(conn), None)
        if close:
            conn.close()  # the client sees its connection end

    def _listen(self) -> None:
        server = self._server
        assert server is not None
        while not self._stopping.is_set():
            with self._lock:
                conns = list(self._conns)
            if not conns:
                self._stopping.wait(0.05)
                continue
            ready: list[Any] = multiprocessing.connection.wait(conns, timeout=0.05)
            for conn in ready:
                received = self._receive(conn)
                if received is not None:
                    self._serve(server, conn, *received)

    def _receive(self, conn: Any) -> tuple[threading.Lock, int, dict[str, Any], Sequence[int]] | None:
        """One request from a client's pipe, ready to serve: its send lock,
        id, tensors and batch size. None: the pipe ended or broke (dropped),
        or it asked for an exception (answered here)."""
        try:
            message = conn.recv()
        except (EOFError, OSError):
            self._drop(conn, close=False)
            return None
        except Exception:  # noqa: BLE001 - not a request: the stream cannot be trusted
            self._drop(conn, close=True)
            return None
        return self._accept(conn, message)

    def _accept(self, conn: Any, message: Any) -> tuple[threading.Lock, int, dict[str, Any], Sequence[int]] | None:
        """``_receive``'s message, read from ``conn``: the request, or None
        (an exception asked for, answered here; not a request: ``conn`` dropped)."""
        try:
            rid, flat, batch_size = message
        except (TypeError, ValueError):  # not a request: the stream cannot be trusted
            self._drop(conn, close=True)
            return None
        lock = self._send_locks.setdefault(id(conn), threading.Lock())
        if flat is None:  # a shared-memory request's exception, asked for by its token
            _reply(conn, lock, rid, False, self._take_error(str(batch_size)))
            return None
        return lock, rid, flat, batch_size

    # -- TorchRL's server side, for a server other than ferrobatch's --------------------

    def wait_for_work(self, timeout: float) -> None:
        """Blocks until a client's pipe has a request, or ``timeout`` seconds."""
        with self._lock:
            conns = list(self._conns)
        if conns:
            multiprocessing.connection.wait(conns, timeout=timeout)
        else:
            time.sleep(min(timeout, 0.05))

    def drain(self, max_items: int) -> tuple[list[Any], list[Any]]:
        """Takes up to ``max_items`` requests waiting in the clients' pipes:
        their TensorDicts, and the callbacks ``resolve`` answers."""

        with self._lock:
            conns = list(self._conns)
        tds: list[Any] = []
        callbacks: list[Any] = []
        for conn in conns:
            while len(tds) < max_items and _has_data(conn):
                received = self._receive(conn)
                if received is None:
                    if conn in self._conns:
                        continue  # it asked for an exception: answered
                    break  # it ended: dropped
                lock, rid, flat, batch_size = received
                tds.append(_request_td(flat, batch_size))
                callbacks.append((conn, lock, rid))
        return tds, callbacks

    def resolve(self, callback: Any, result: Any) -> None:
        conn, lock, rid = callback
        leaves = _leaves(result).items()
        _reply(conn, lock, rid, True, [(nested_key(name), _to_wire(value)) for name, value in leaves])

    def resolve_exception(self, callback: Any, exc: BaseException) -> None:
        conn, lock, rid = callback
        _reply(conn, lock, rid, False, exc)

    # -- ferrobatch's server -----------------------------------------------------------

    @staticmethod
    def _serve(
        server: InferenceServer,
        conn: Any,
        lock: threading.Lock,
        rid: int,
        flat: dict[str, Any],
        batch_size: Sequence[int],
    ) -> None:
        """Submits one request; its answer is sent back whatever happens."""

        def reply(ok: bool, payload: Any) -> None:
            _reply(conn, lock, rid, ok, payload)

        def settle(future: concurrent.futures.Future[dict[str, torch.Tensor]]) -> None:
            try:
                error = future.exception()
                if error is not None:
                    reply(False, _unwrap(error))
                    return
                pairs = server._result_pairs(future.result(), batch_size)
                payload = [(key, _to_wire(value)) for key, value in pairs]
            except BaseException as exc:  # noqa: BLE001 - the client's to see
                reply(False, exc)
                return
            reply(True, payload)

        try:
            server._submit(_request_td(flat, batch_size)).add_done_callback(settle)
        except BaseException as exc:  # noqa: BLE001 - the client's to see
            reply(False, _unwrap(exc))


def _request_td(flat: Mapping[str, Any], batch_size: Sequence[int]) -> Any:
    """A request that came through a control channel (its arrays by flat
    name) as its TensorDict; an array Ray hands over read-only (in its
    object store's memory) is copied."""
    from tensordict import TensorDict

    tensors = {nested_key(name): _from_wire(value) for name, value in flat.items()}
    return TensorDict(tensors, batch_size=list(batch_size))


#: Same-size integer dtypes, by element size: what carries a tensor whose
#: dtype numpy lacks (bfloat16, float8...) through a pipe, bit for bit.
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _to_wire(tensor: Any) -> Any:
    """A tensor as a pipe carries it: a numpy array, or for a dtype numpy
    lacks, its dtype's name and its bits as a same-size integer array.
    Non-tensor data travels as it is (pickled, as TorchRL's pipes send it)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    tensor = tensor.detach().cpu()
    try:
        return tensor.numpy()
    except TypeError:
        bits = tensor.view(_BITS[tensor.element_size()]).numpy()
        return (str(tensor.dtype).removeprefix("torch."), bits)


def _from_wire(value: Any) -> Any:
    """``_to_wire``'s tensor back; an array Ray hands over read-only (in
    its object store's memory) is copied."""
    if not isinstance(value, (tuple, np.ndarray)):
        return value  # non-tensor data
    dtype = None
    if isinstance(value, tuple):
        name, value = value
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"not a torch dtype: {name!r}")
    tensor = torch.from_numpy(value if value.flags.writeable else value.copy())
    return tensor if dtype is None else tensor.view(dtype)


def _has_data(conn: Any) -> bool:
    """Whether ``conn`` can be read without blocking (its end counts: the
    read then says so); a connection closed here has nothing."""
    try:
        return bool(conn.poll())
    except (OSError, ValueError):
        return False


def _reply(conn: Any, lock: threading.Lock, rid: int, ok: bool, payload: Any) -> None:
    """Sends one answer down a client's pipe. The payload travels pickled on
    its own, so a client that cannot rebuild it fails that request alone."""
    try:
        blob = bytes(ForkingPickler.dumps(payload))
    except Exception as exc:  # noqa: BLE001 - an unpicklable error: say what it was
        ok = False
        blob = bytes(ForkingPickler.dumps(RuntimeError(f"{type(payload).__name__}: {payload}; ({exc})")))
    try:
        with lock:
            conn.send((rid, ok, blob))
    except (OSError, ValueError):
        pass  # the client is gone


class SharedMemoryTransport(MPTransport):
    """TorchRL's ``SharedMemoryTransport``, switched by its import: callers in
    other processes whose requests ride ferrobatch's shared memory
    (``server.share`` / ``fb.connect``) from the server's start, its specs
    given here, as :class:`MPTransport`'s do once it knows them.

    TorchRL's rules hold: only the keys of ``request_spec`` travel (a
    request missing one raises ``KeyError``, a CUDA tensor ``ValueError``), a
    result holds the keys of ``response_spec`` only, and at most
    ``num_slots`` requests of a client's process are in flight (``submit``
    blocks for a free slot; a timed-out ``result(timeout)`` raises
    ``queue.Empty`` and leaves the request in flight). Without ferrobatch's
    server, a TorchRL server serves it through the clients' pipes, as
    :class:`MPTransport`.

    ``copy_result=True`` (the default): a result's tensors are its own.
    ``copy_result=False``: as TorchRL's, ``result()`` returns a view of the
    request's response slot (``_response_slots[slot]``, one bank per client
    process, shaped by ``response_spec``), which a later request's result
    read from the same slot overwrites; an answer that does not fit its
    slot fails its request. The slot takes the answer when the result is
    first read, so a request's slot is free again once it is answered."""

    def __init__(
        self,
        request_spec: Any,
        response_spec: Any,
        *,
        num_slots: int,
        ctx: Any = None,
        copy_result: bool = True,
    ) -> None:
        request_keys = _spec_keys(request_spec, "request_spec")
        response_keys = _spec_keys(response_spec, "response_spec")
        if num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {num_slots}")
        super().__init__(ctx=ctx)
        self.request_spec = request_spec
        self.response_spec = response_spec
        self.num_slots = num_slots
        self.copy_result = copy_result
        self._rules = _SlotRules(request_keys, response_keys, num_slots, None if copy_result else response_spec)
        #: With ``copy_result=False``: this process's response slots, as TorchRL names them.
        self._response_slots = self._rules.response_slots

    def client(self) -> MPClient:
        client = super().client()
        client._rules = self._rules
        return client

    def _cells_per_client(self) -> int:
        return self.num_slots  # a process's slots all fit: none overflows to the pipe


class RayTransport(MPTransport):
    """TorchRL's ``RayTransport``, switched by its import: clients passed to
    Ray actors and tasks (or used in the driver's threads).

    On the server's node a client's requests ride ferrobatch's shared
    memory, as :class:`MPTransport`'s do (no Ray call per request). What
    does not ride it (the requests sent before the server knows its specs,
    those of clients on other nodes or past their process's shared cells,
    and the model's exceptions, pickled) goes through one Ray actor of the
    transport's (``ferrobatch.ray``'s ``Mailbox``) instead of pipes, and so
    does a TorchRL ``InferenceServer``'s serving of it.

    Ray is imported when the transport is made, and started if it is not
    (as ``ray.util.queue`` does).

    Args:
        max_queue_size: how many requests wait in the actor at most (a
            client's request past them waits for room); default 1000.
    """

    def __init__(self, *, max_queue_size: int = 1000) -> None:
        try:
            import ray

            from .ray._mailbox import Mailbox
        except ImportError as exc:
            raise ImportError(f"RayTransport needs Ray: pip install 'ferrobatch[ray]' ({exc})") from exc
        super().__init__()
        self.shm_name = f"ferrobatch-ray-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._ray = ray
        self._mailbox = Mailbox.remote(max_queue_size)
        self._ends: dict[str, _RayEnd] = {}
        self._through_actor = 0  # requests served through the actor (not shared memory), for tests
        self._peeked: collections.deque[tuple[str, Any]] = collections.deque()

    def __reduce__(self) -> Any:
        raise TypeError("a RayTransport stays with its server: pass transport.client() to Ray actors")

    def client(self) -> MPClient:
        """A client to pass to a Ray actor or task (or to use here)."""
        return MPClient(_RayConn(self._mailbox), self.shm_name)

    def _start(self) -> None:
        self._ray.get(self._mailbox.reopen.remote())
        super()._start()

    def _close(self) -> None:
        try:
            left = self._ray.get(self._mailbox.close.remote())
        except self._ray.exceptions.RayError:
            return  # the actor is gone: its clients see it
        for client, message in left:
            end = self._end(client)
            accepted = self._accept(end, message)
            if accepted is not None:
                lock, rid, _, _ = accepted
                _reply(end, lock, rid, False, ServerClosedError("the inference server stopped"))

    def _end(self, client: str) -> _RayEnd:
        end = self._ends.get(client)
        if end is None:
            end = self._ends[client] = _RayEnd(self._mailbox, client)
        return end

    def _drop(self, conn: Any, *, close: bool) -> None:
        self._send_locks.pop(id(conn), None)
        self._ends = {client: end for client, end in self._ends.items() if end is not conn}

    def _take(self, max_items: int, timeout: float) -> list[tuple[str, Any]]:
        try:
            taken: list[tuple[str, Any]] = self._ray.get(self._mailbox.take.remote(max_items, timeout))
        except self._ray.exceptions.RayError:
            self._stopping.wait(timeout)
            return []
        return taken

    def _listen(self) -> None:
        server = self._server
        assert server is not None
        while not self._stopping.is_set():
            for client, message in self._take(server.max_batch_size, 0.1):
                end = self._end(client)
                accepted = self._accept(end, message)
                if accepted is not None:
                    self._through_actor += 1
                    self._serve(server, end, *accepted)

    # -- TorchRL's server side, for a server other than ferrobatch's --------------------

    def wait_for_work(self, timeout: float) -> None:
        """Blocks until a request waits in the actor, or ``timeout`` seconds."""
        if not self._peeked:
            self._peeked.extend(self._take(1 << 10, timeout))

    def drain(self, max_items: int) -> tuple[list[Any], list[Any]]:
        """Takes up to ``max_items`` waiting requests: their TensorDicts, and
        the callbacks ``resolve`` answers."""

        if len(self._peeked) < max_items:
            self._peeked.extend(self._take(max_items - len(self._peeked), 0.0))
        tds: list[Any] = []
        callbacks: list[Any] = []
        while self._peeked and len(tds) < max_items:
            client, message = self._peeked.popleft()
            end = self._end(client)
            accepted = self._accept(end, message)
            if accepted is None:
                continue  # it asked for an exception: answered
            lock, rid, flat, batch_size = accepted
            tds.append(_request_td(flat, batch_size))
            callbacks.append((end, lock, rid))
        return tds, callbacks


class _RayConn:
    """A client's end of a :class:`RayTransport`'s control channel: what an
    MPClient's pipe does, through the transport's Mailbox actor. Each copy
    (each process it is passed to) has an answer box of its own."""

    def __init__(self, mailbox: Any) -> None:
        import ray

        self._ray = ray
        self._mailbox = mailbox
        self._id = uuid.uuid4().hex
        self._waiting: collections.deque[Any] = collections.deque()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RayConn, (self._mailbox,))

    def send(self, message: Any) -> None:
        """Queues ``message``, sending it again while the queue is full
        (later and later, up to 0.1 s apart)."""
        pause = 0.005
        while True:
            try:
                queued = self._ray.get(self._mailbox.put.remote(self._id, message))
            except self._ray.exceptions.RayError as exc:
                raise OSError(f"the transport's Ray actor is gone ({type(exc).__name__})") from exc
            if queued is None:  # full: the server takes what is queued meanwhile
                time.sleep(pause)
                pause = min(2 * pause, 0.1)
                continue
            if not queued:
                raise OSError("the inference server stopped")
            return

    def recv(self) -> Any:
        from .ray._mailbox import CLOSED

        while not self._waiting:
            try:
                self._waiting.extend(self._ray.get(self._mailbox.answers.remote(self._id, 1.0)))
            except self._ray.exceptions.RayError as exc:
                raise EOFError(f"the transport's Ray actor is gone ({type(exc).__name__})") from exc
        message = self._waiting.popleft()
        if isinstance(message, str) and message == CLOSED:
            raise EOFError("the inference server stopped")
        return message

    def close(self) -> None:
        pass  # nothing of this process's to release


class _RayEnd:
    """The server's end toward one :class:`RayTransport` client: answers go
    to its box (in order: Ray runs one caller's calls to an actor in turn)."""

    def __init__(self, mailbox: Any, client: str) -> None:
        self._mailbox = mailbox
        self._client = client

    def send(self, message: Any) -> None:
        self._mailbox.answer.remote(self._client, message)

    def close(self) -> None:
        pass


def _spec_keys(spec: Any, what: str) -> list[NestedKey]:
    """The keys of a SharedMemoryTransport spec's leaves, checked as TorchRL does."""
    from tensordict import is_leaf_nontensor

    # Every leaf, non-tensor data too (TorchRL refuses those; plain leaves_only skips them).
    leaves = list(spec.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor))
    for key, value in leaves:
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{what} must have tensor leaves only (a SharedMemoryTransport carries tensors), got a "
                f"{type(value).__name__} at {key!r}: use MPTransport for non-tensor data"
            )
    if not leaves:
        raise ValueError(f"{what} must have at least one tensor leaf")
    if any(value.device.type != "cpu" for _, value in leaves):
        raise ValueError(f"{what} must live in CPU shared memory: its tensors must be on the CPU")
    return [key for key, _ in leaves]


class ResultTimeout(queue.Empty, TimeoutError):
    """A SharedMemoryTransport future's ``result(timeout)`` ran out: TorchRL's
    ``queue.Empty`` and the standard ``TimeoutError`` at once."""


class _SlotFuture(concurrent.futures.Future[Any]):
    """A SharedMemoryTransport request's Future: TorchRL's ``queue.Empty`` on
    a timed-out ``result(timeout)``, and with ``copy_result=False`` the
    answer lent into the request's slot when it is first read."""

    _lend: tuple[_SlotRules, int] | None = None
    _lent: Any = None

    def result(self, timeout: float | None = None) -> Any:
        try:
            answer = super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise ResultTimeout(f"no result within {timeout}s; the request is still in flight") from None
        if self._lend is None:
            return answer
        with self._condition:  # two threads reading it get one view
            if self._lent is None:
                rules, slot = self._lend
                self._lent = rules.lend(slot, answer)
            return self._lent


class _SlotRules:
    """What a SharedMemoryTransport's clients keep to TorchRL's (the class's
    documentation): the declared keys each way, the process's slots, and
    with a ``borrowed`` response spec (``copy_result=False``) the process's
    response slots, results lent into them as views."""

    def __init__(
        self,
        request_keys: list[NestedKey],
        response_keys: list[NestedKey],
        num_slots: int,
        borrowed: Any = None,
    ) -> None:
        self.request_keys, self.response_keys, self.num_slots = request_keys, response_keys, num_slots
        self._borrowed = borrowed
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(num_slots):
            self._free.put(slot)
        self.response_slots: Any = None
        self._slot_views: list[dict[NestedKey, torch.Tensor]] = []
        self._slot_batch: Any = None
        if borrowed is not None:
            batch = tuple(borrowed.batch_size)
            self.response_slots = borrowed.unsqueeze(0).expand(num_slots, *batch).clone()
            self._slot_batch = borrowed.batch_size
            columns = {key: self.response_slots.get(key) for key in response_keys}
            self._slot_views = [{key: column[slot] for key, column in columns.items()} for slot in range(num_slots)]

    def __reduce__(self) -> tuple[Any, ...]:
        # The slots stay behind: each process has slots (and response slots) of its own.
        return (_SlotRules, (self.request_keys, self.response_keys, self.num_slots, self._borrowed))

    def check(self, td: Any) -> None:
        """A missing declared key is a KeyError, a tensor off the CPU a
        ValueError (undeclared keys are left behind by the route)."""
        for key in self.request_keys:
            if td[key].device.type != "cpu":  # a missing key: tensordict's KeyError
                raise ValueError(f"a SharedMemoryTransport takes CPU tensors; {key!r} is not one")

    def take_slot(self) -> int:
        """A free slot of this process, waiting for one."""
        return self._free.get()

    def give_slot(self, slot: int) -> None:
        self._free.put(slot)

    def response(self, td: Any, pairs: Sequence[tuple[NestedKey, torch.Tensor]]) -> Any:
        """The result: the response spec's keys of ``pairs``, in a TensorDict
        of the request's batch size; to be lent (``copy_result=False``):
        their ``{key: tensor}``, checked to fit a slot."""
        given = dict(pairs)
        entries = {}
        for key in self.response_keys:
            value = given.get(key)
            if value is None:
                raise KeyError(f"the server's answer lacks the response spec's key {key!r}")
            entries[key] = value
        if not self._slot_views:
            return _tensordict_of(entries, td.batch_size)
        for key, view in self._slot_views[0].items():
            if entries[key].shape != view.shape:
                raise ValueError(
                    f"the answer's {key!r} has shape {tuple(entries[key].shape)}; "
                    f"its response slot holds {tuple(view.shape)}"
                )
        return entries

    def lend(self, slot: int, answer: dict[NestedKey, torch.Tensor]) -> Any:
        """``answer`` (from ``response``) copied into response slot ``slot``:
        a view of it, as TorchRL's ``copy_result=False`` result."""
        views = self._slot_views[slot]
        for key, view in views.items():
            view.copy_(answer[key])
        return _tensordict_of(dict(views), self._slot_batch)


def _tensordict_of(entries: dict[NestedKey, torch.Tensor], batch_size: Any) -> Any:
    plain = _plain_tensordict()
    if all(type(key) is str for key in entries):  # built at once: the values fit its batch
        return plain._new_unsafe(entries, batch_size=batch_size, device=None)
    result = plain(batch_size=batch_size)
    for key, value in entries.items():
        result.set(key, value)
    return result


class MPClient:
    """``client(td) -> td`` and ``client.submit(td) -> Future`` in any process
    it was passed to (picklable); many threads may share it.

    Every Future resolves. An answer this process cannot read (a model
    exception that cannot be rebuilt here: :class:`~ferrobatch.ModelError`)
    fails its request alone. Once the connection fails (the server went away
    or stopped, or the stream broke), the requests waiting and every later
    one fail with :class:`~ferrobatch.ServerClosedError`."""

    _ids = itertools.count()

    def __init__(self, conn: Any, shm_name: str | None = None, rules: _SlotRules | None = None) -> None:
        self._conn = conn
        self._shm_name = shm_name
        self._rules = rules  # a SharedMemoryTransport's client: TorchRL's slot rules on top
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[concurrent.futures.Future[Any], Any, _SlotRules | None]] = {}
        self._reader: threading.Thread | None = None
        self._closed: ServerClosedError | None = None  # why the connection failed, once it has
        self._route: _SharedRoute | None = None
        self._next_look = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"conn": self._conn, "shm_name": self._shm_name, "rules": self._rules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._conn = state["conn"]
        self._shm_name = state.get("shm_name")
        self._rules = state.get("rules")
        self._setup()

    def _shared(self) -> _SharedRoute | None:
        """This process's shared-memory route to the server, once it shares
        itself (looked for every ``_MP_RETRY`` seconds until then)."""
        route = self._route
        if route is not None and route.usable():
            return route
        self._route = None
        if self._shm_name is None or self._closed is not None:
            return None
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + _MP_RETRY
        self._route = _route_for(self._shm_name)
        return self._route

    def submit(self, td: Any) -> concurrent.futures.Future[Any]:
        rules = self._rules
        if rules is None:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        else:
            rules.check(td)
            future = _SlotFuture()
            slot = rules.take_slot()
            future.add_done_callback(lambda _: rules.give_slot(slot))
            if rules.response_slots is not None:
                future._lend = (rules, slot)
        future.set_running_or_notify_cancel()
        route = self._shared()
        if route is None:
            _chain(self._submit_pipe(td), future)
        else:
            route.submit(td, self, future)
        return future

    def __call__(self, td: Any) -> Any:
        route = self._shared()
        if route is None or _on_event_loop():
            return self.submit(td).result()
        rules = self._rules
        if rules is None:
            return route.call(td, self)
        rules.check(td)
        slot = rules.take_slot()
        try:
            answer = route.call(td, self)
            return answer if rules.response_slots is None else rules.lend(slot, answer)
        finally:
            rules.give_slot(slot)

    def _ask_error(self, token: str) -> concurrent.futures.Future[Any]:
        """The model's exception of shared-memory request ``token``, asked
        for over the pipe (the Future raises it)."""
        return self._send(None, token, None)

    def _submit_pipe(self, td: Any) -> concurrent.futures.Future[Any]:
        sent = td if self._rules is None else td.select(*self._rules.request_keys)
        flat = {name: _to_wire(leaf) for name, leaf in _leaves(sent).items()}
        return self._send(flat, tuple(td.batch_size), td)

    def _send(self, flat: Any, batch_size: Any, td: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        error: BaseException | None = None
        with self._lock:
            if self._closed is not None:
                error = _closed_again(self._closed)
            else:
                rid = next(self._ids)
                self._pending[rid] = (future, td, self._rules)
                if self._reader is None:
                    self._reader = threading.Thread(target=self._read, name="ferrobatch-torchrl-client", daemon=True)
                    self._reader.start()
                try:
                    self._conn.send((rid, flat, batch_size))
                except Exception as exc:  # noqa: BLE001 - the caller's to see, on its Future
                    del self._pending[rid]
                    error = exc
                    if isinstance(exc, (OSError, ValueError)):  # the connection is closed
                        error = _server_went_away(str(exc))
        if error is not None:
            future.set_exception(error)
        return future

    def _read(self) -> None:
        try:
            while True:
                try:
                    rid, ok, blob = self._conn.recv()
                except (EOFError, OSError):
                    raise _server_went_away() from None
                with self._lock:
                    entry = self._pending.pop(rid, None)
                if entry is not None:
                    _answer(*entry, ok, blob)
        except BaseException as exc:  # noqa: BLE001 - whatever ends the reader fails every request
            self._fail_all(exc)

    def _fail_all(self, cause: BaseException) -> None:
        if isinstance(cause, ServerClosedError):
            error = cause
        else:
            error = ServerClosedError(f"the connection to the inference server failed: {type(cause).__name__}: {cause}")
            error.__cause__ = cause
        with self._lock:
            self._closed = error
            pending, self._pending = self._pending, {}
        for future, _, _ in pending.values():
            future.set_exception(_closed_again(error))


class _SharedRoute:
    """An MPTransport's way to its server through shared memory, in one
    client process (its MPClients share it): a ``fb.connect`` client, and
    what makes its results TorchRL's (the share's metadata, from
    ``MPTransport._share``)."""

    def __init__(self, client: Any) -> None:
        meta = client.metadata["torchrl"]
        self.client = client
        self.pid = os.getpid()
        self.closed = False
        self.inputs = _keyed(meta["inputs"])
        self.extras = _keyed(meta["extras"])
        self.outputs = [(name, nested_key(name)) for name in meta["outputs"]]
        self.version = None if meta["version"] is None else nested_key(meta["version"])
        self.version_base = int(meta["version_base"])
        self.output_device = None if meta["output_device"] is None else torch.device(meta["output_device"])

    def usable(self) -> bool:
        return not self.closed and self.pid == os.getpid()

    def close(self) -> None:
        """The server stopped or went away: the next request looks again."""
        self.closed = True
        self.client.close()

    def flat(self, td: Any) -> dict[str, Any]:
        return _core_request(td, self.inputs, self.extras)

    def complete(self, td: Any, outputs: Mapping[str, torch.Tensor], rules: _SlotRules | None = None) -> Any:
        """``td`` with the outputs and the version, as the server's own
        ``_result_pairs`` makes them (with ``rules``: the response only)."""
        pairs: list[tuple[NestedKey, Any]] = [(key, _leaf_value(outputs[name])) for name, key in self.outputs]
        if self.version is not None:
            version = outputs[_VERSION]
            if self.version_base:
                version = version + self.version_base
            if len(td.batch_size):
                version = version.expand(*td.batch_size).clone()
            pairs.append((self.version, version))
        if self.output_device is not None:
            pairs = [(key, _to_device(value, self.output_device)) for key, value in pairs]
        return _complete(td, pairs) if rules is None else rules.response(td, pairs)

    def call(self, td: Any, mp: MPClient) -> Any:
        """One request from this thread, blocking (the GIL released)."""
        token = _mp_token()
        try:
            outputs = self.client.infer_sync(self.flat(td), parameters={_MP_TOKEN: token})
        except QueueFullError:  # this process's shared cells are all in flight
            return mp._submit_pipe(td).result()
        except ModelError as exc:
            raise _model_error(mp, token, exc) from None
        except ServerClosedError as exc:
            self.close()
            raise _server_went_away(str(exc)) from exc
        return self.complete(td, outputs, mp._rules)

    def submit(self, td: Any, mp: MPClient, future: concurrent.futures.Future[Any]) -> None:
        """One request resolving ``future``: queued from this thread, its
        answer completed on this process's background event loop."""
        token = _mp_token()
        answered = _MPAnswer(self, mp, td, future, token)
        try:
            self.client._submit_to(self.flat(td), answered, _background_loop(), encode_parameters({_MP_TOKEN: token}))
        except BaseException as exc:  # noqa: BLE001 - the caller's, on its Future
            answered.set_exception(exc)


class _MPAnswer:
    """Where a shared-memory request of an MPClient is answered (on the
    background loop): its Future gets the request completed as TorchRL's,
    or the error the pipe path would raise. Never raises: the loop hands
    the other answers of its batch on after it."""

    __slots__ = ("route", "mp", "td", "future", "token")

    def __init__(
        self, route: _SharedRoute, mp: MPClient, td: Any, future: concurrent.futures.Future[Any], token: str
    ) -> None:
        self.route, self.mp, self.td, self.future, self.token = route, mp, td, future, token

    def done(self) -> bool:
        return self.future.done()

    def set_result(self, outputs: Mapping[str, torch.Tensor]) -> None:
        try:
            self.future.set_result(self.route.complete(self.td, outputs, self.mp._rules))
        except BaseException as exc:  # noqa: BLE001 - the caller's, on its Future
            self._fail(exc)

    def set_exception(self, error: BaseException) -> None:
        try:
            if isinstance(error, QueueFullError):  # this process's shared cells are all in flight
                _chain(self.mp._submit_pipe(self.td), self.future)
            elif isinstance(error, ModelError):
                fallback, future = error, self.future

                def raise_asked(asked: concurrent.futures.Future[Any]) -> None:
                    future.set_exception(_asked_error(asked, fallback))

                self.mp._ask_error(self.token).add_done_callback(raise_asked)
            elif isinstance(error, ServerClosedError):
                self.route.close()
                self._fail(_server_went_away(str(error)))
            else:
                self._fail(error)
        except BaseException as exc:  # noqa: BLE001 - the caller's, on its Future
            self._fail(exc)

    def _fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


def _asked_error(asked: concurrent.futures.Future[Any], fallback: ModelError) -> BaseException:
    """The model's own exception the pipe brought back, else ``fallback``."""
    error = asked.exception()
    if error is None or isinstance(error, ServerClosedError):
        return fallback
    return error


def _model_error(mp: MPClient, token: str, fallback: ModelError) -> BaseException:
    """The model's own exception of shared-memory request ``token`` (over
    the pipe), as the pipe's requests raise it; ``fallback`` without it."""
    asked = mp._ask_error(token)
    concurrent.futures.wait([asked])
    return _asked_error(asked, fallback)


_tokens = itertools.count()


def _mp_token() -> str:
    """A name for one shared-memory request, unique among the server's clients."""
    return f"{os.getpid()}:{next(_tokens)}"


_routes: dict[str, _SharedRoute] = {}
_routes_lock = threading.Lock()


def _route_for(name: str) -> _SharedRoute | None:
    """This process's route to the server shared as ``name``; None while it
    is not shared (or cannot be joined: then its pipes serve)."""
    with _routes_lock:
        route = _routes.get(name)
        if route is not None and route.usable():
            return route
        _routes.pop(name, None)
    from .shared import connect

    try:
        client = connect(name, timeout=0)
    except (FerrobatchError, OSError, ValueError):
        return None
    if "torchrl" not in client.metadata:
        client.close()
        return None
    made = _SharedRoute(client)
    with _routes_lock:
        route = _routes.setdefault(name, made)
    if route is not made:
        client.close()
    return route


_loop_lock = threading.Lock()
_loop: tuple[int, asyncio.AbstractEventLoop] | None = None


def _background_loop() -> asyncio.AbstractEventLoop:
    """An event loop on a daemon thread of this process, for MPClient
    futures over shared memory (one per process, made on first use)."""
    global _loop
    with _loop_lock:
        if _loop is not None and _loop[0] == os.getpid():
            return _loop[1]
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="ferrobatch-torchrl-mp-loop", daemon=True).start()
        _loop = (os.getpid(), loop)
        return loop


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _distributed_transport(request_spec: Any, response_spec: Any, options: Mapping[str, Any] | None) -> Any:
    """TorchRL's torch.distributed request/reply transport for these specs
    (its options its own): what ``transport="distributed"`` is fed by."""
    try:
        from torchrl._comm.distributed import TorchDistributedTransport
    except ImportError as exc:
        raise ValueError("transport='distributed' is TorchRL's torch.distributed transport: install torchrl") from exc
    return TorchDistributedTransport(request_spec, response_spec, **dict(options or {}))


class _RayActor:
    """The Ray actor of a ``service_backend="ray"`` server: builds the policy
    from its factory, serves it with an :class:`InferenceServer` of its own,
    and answers many calls at once (a threaded actor), so they batch. With
    ``transport="distributed"``, the first client's request fixes the
    payloads of a torch.distributed transport drained into the same server."""

    def __init__(self, policy_factory: Callable[[], Any], kwargs: dict[str, Any]) -> None:
        self.server = InferenceServer(policy_factory=policy_factory, **kwargs).start()
        self._client = self.server.client()
        self._distributed: _PumpedTransport | None = None
        self._lock = threading.Lock()

    def infer(self, td: Any) -> Any:
        return self._client(td)

    def bootstrap_distributed(self, request: Any, options: dict[str, Any]) -> Any:
        """A new client of the actor's torch.distributed transport, made on
        the first call from ``request`` and the response the policy gives it."""
        with self._lock:
            if self._distributed is None:
                response = self._client(request.clone())
                transport = _distributed_transport(request.clone(), response, options)
                pump = _PumpedTransport(transport)
                pump._bind(self.server)
                pump._start()
                self._distributed = pump
            return self._distributed.inner.client()

    def stats(self, reset: bool) -> dict[str, float | int]:
        return self.server.stats(reset=reset)

    def shutdown(self, timeout: float | None) -> None:
        pump, self._distributed = self._distributed, None
        if pump is not None:
            pump._stop()
        self.server.shutdown(timeout)
        if pump is not None:
            pump.inner.close()  # its clients are told: their calls fail at once


class _RayOwnedServer:
    """``service_backend="ray"``: the server on a Ray actor, started with it
    (``remote_config`` gives the actor's options), and clients that call it
    through Ray from any process or actor (they pickle)."""

    def __init__(
        self,
        policy_factory: Callable[[], Any],
        options: dict[str, Any],
        kwargs: dict[str, Any],
        distributed: dict[str, Any] | None = None,
    ) -> None:
        import ray

        if distributed is not None:  # TorchRL's transport, checked here before the actor starts
            try:
                import torchrl._comm.distributed  # noqa: F401
            except ImportError as exc:
                raise ValueError(
                    "transport='distributed' is TorchRL's torch.distributed transport: install torchrl"
                ) from exc
        self._distributed = distributed

        remote_config = dict(options.pop("remote_config", None) or {})
        if options:
            raise ValueError(f"service_backend='ray' takes remote_config only, got {sorted(options)}")
        # Concurrent calls run on threads of the actor: that is how they meet in one batch.
        remote_config.setdefault("max_concurrency", 1024)
        actor_class: Any = ray.remote(_RayActor)
        self._actor = actor_class.options(**remote_config).remote(policy_factory, kwargs)
        ray.get(self._actor.__ray_ready__.remote())  # the actor's constructor ran (or raised)
        self._alive = True

    def start(self) -> None:
        if not self._alive:
            raise RuntimeError("a service_backend='ray' server does not start again once shut down")

    def shutdown(self, timeout: float | None = 5.0) -> None:
        if not self._alive:
            return
        self._alive = False
        import ray

        try:
            ray.get(self._actor.shutdown.remote(timeout), timeout=None if timeout is None else timeout + 5.0)
        except Exception:  # noqa: BLE001 - a dead or stuck actor is ended below all the same
            pass
        ray.kill(self._actor)  # Ray itself keeps running: it is not ours

    @property
    def is_alive(self) -> bool:
        return self._alive

    def client(self) -> _RayServerClient:
        return _RayServerClient(self._actor, self._distributed)

    def stats(self, reset: bool = False) -> dict[str, float | int]:
        import ray

        stats: dict[str, float | int] = ray.get(self._actor.stats.remote(reset))
        return stats


class _RayServerClient:
    """``client(td) -> td`` and ``client.submit(td) -> Future`` of a
    ``service_backend="ray"`` server, through Ray; picklable. A model's
    exception reaches the caller as Ray re-raises it (its cause within).
    With ``transport="distributed"`` (``distributed``: its options), the
    first request asks the actor for a torch.distributed client, which
    carries this and every later request."""

    def __init__(self, actor: Any, distributed: dict[str, Any] | None = None) -> None:
        self._actor = actor
        self._distributed = distributed
        self._pair: Any = None

    def _pair_client(self, td: Any) -> Any:
        if self._pair is None:
            import ray

            assert self._distributed is not None
            try:
                self._pair = ray.get(self._actor.bootstrap_distributed.remote(td, self._distributed))
            except ray.exceptions.RayActorError as exc:
                raise _server_went_away(str(exc)) from exc
        return self._pair

    def submit(self, td: Any) -> Any:
        if self._distributed is not None:
            return self._pair_client(td).submit(td)
        future: concurrent.futures.Future[Any] = self._actor.infer.remote(td).future()
        return future

    def __call__(self, td: Any, timeout: float | None = None) -> Any:
        if self._distributed is not None:
            return self._pair_client(td)(td, timeout=timeout)
        import ray

        return ray.get(self._actor.infer.remote(td), timeout=timeout)


class ProcessInferenceServer:
    """TorchRL's ``ProcessInferenceServer``: an :class:`InferenceServer` (a
    ferrobatch core, its batching and its workers) in a child process of its
    own, fed by an :class:`MPTransport` whose clients were made here, before
    or after ``start()`` (the child shares itself under the transport's
    name, so their requests ride shared memory once it knows its specs).
    ``policy_factory`` builds the policy in the child
    (so it must be picklable: a module-level function); the other keyword
    arguments are :class:`InferenceServer`'s.

    ``start()`` waits up to ``startup_timeout`` seconds for the child to say
    it serves (``TimeoutError`` after, the child killed). ``stats(reset=)``
    and ``health()`` ask the child over a control pipe (one caller at a
    time); ``shutdown()`` stops it gracefully, then kills it after
    ``timeout``. A child that dies closes its end of every client's pipe:
    their waiting and later requests fail with ``ServerClosedError``.

    ``transport`` may also be a TorchRL ``InferenceTransport`` that pickles
    into the child (TorchRL's torch.distributed one): the child drains it
    into its batches, and its clients are told when the child goes away.
    """

    def __init__(
        self,
        policy_factory: Callable[[], Any],
        transport: Any = None,
        *,
        mp_context: Any = None,
        startup_timeout: float = 60.0,
        **server_kwargs: Any,
    ) -> None:
        if isinstance(mp_context, str) or mp_context is None:
            mp_context = multiprocessing.get_context(mp_context or "spawn")
        if isinstance(transport, RayTransport):
            raise TypeError(
                "a RayTransport is served from the driver or by service_backend='ray', not by a child process"
            )
        self.transport = transport if transport is not None else MPTransport(ctx=mp_context)
        served = isinstance(self.transport, MPTransport) or (
            not isinstance(self.transport, ThreadingTransport)
            and all(callable(getattr(self.transport, m, None)) for m in (*_TRANSPORT_METHODS, "client"))
        )
        if not served:
            raise TypeError(
                "a ProcessInferenceServer is fed by an MPTransport or an InferenceTransport that pickles,"
                f" got {type(transport).__name__}"
            )
        # A TorchRL transport's clients watch this flag: cleared when the child is gone.
        self._peer_alive: Any = None
        if hasattr(self.transport, "_set_peer_alive"):
            self._peer_alive = mp_context.Event()
            self._peer_alive.set()
            self.transport._set_peer_alive(self._peer_alive)
        self._factory = policy_factory
        self._ctx = mp_context
        self._startup_timeout = float(startup_timeout)
        self._kwargs = server_kwargs
        self._process: Any = None
        self._control: Any = None
        self._lock = threading.Lock()

    def start(self) -> ProcessInferenceServer:
        if self.is_alive:
            raise RuntimeError("Server is already running.")
        ours, theirs = self._ctx.Pipe()
        conns: list[Any] = []
        if isinstance(self.transport, MPTransport):
            with self.transport._lock:
                conns = list(self.transport._conns)
        feed = (conns, self.transport.shm_name) if isinstance(self.transport, MPTransport) else self.transport
        process = self._ctx.Process(
            target=_serve_in_child,
            args=(self._factory, feed, self._kwargs, theirs),
            name="ferrobatch-torchrl-server",
            daemon=True,
        )
        if self._peer_alive is not None:
            self._peer_alive.set()
        process.start()
        theirs.close()
        self._process, self._control = process, ours
        if isinstance(self.transport, MPTransport):
            # The child holds the clients' server ends now: closed here, so a
            # child that dies leaves each client a pipe that ends.
            with self.transport._lock:
                self.transport._conns = [c for c in self.transport._conns if c not in conns]
            for conn in conns:
                conn.close()
            self.transport._forward_to(ours, self._lock)
        if self._peer_alive is not None:
            watch = threading.Thread(
                target=_clear_when_gone, args=(process, self._peer_alive), name="ferrobatch-torchrl-watch", daemon=True
            )
            watch.start()
        if not ours.poll(self._startup_timeout):
            self._kill()
            raise TimeoutError(f"the server process did not report readiness in {self._startup_timeout} s")
        try:
            ready = ours.recv()
        except (EOFError, OSError):
            ready = "exited before it served"
        if ready != "ready":
            self._kill()
            raise RuntimeError(f"the server process failed to start: {ready}")
        return self

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.join(5.0)  # reaped: no zombie left
        if self._peer_alive is not None:
            self._peer_alive.clear()
        if isinstance(self.transport, MPTransport):
            self.transport._forward_to(None, self._lock)
        if self._control is not None:
            self._control.close()
            self._control = None

    def shutdown(self, timeout: float | None = 5.0) -> None:
        process = self._process
        if process is None:
            return
        try:
            self._request_control("stop", timeout)
        except (RuntimeError, EOFError, OSError):
            pass  # dead already: reaped below
        process.join(timeout)
        self._kill()

    @property
    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def client(self) -> Any:
        """A new client (of an MPTransport: its pipe's other end handed to
        the running child)."""
        return self.transport.client()

    def stats(self, *, reset: bool = False) -> dict[str, Any]:
        stats: dict[str, Any] = self._request_control("stats", reset)
        return stats

    def health(self) -> dict[str, Any]:
        """``process_alive`` and the child's pid; never raises."""
        alive = self.is_alive
        return {"process_alive": alive, "pid": self._process.pid if alive else None}

    def _request_control(self, verb: str, argument: Any = None) -> Any:
        with self._lock:
            if not self.is_alive or self._control is None:
                raise RuntimeError("the server process is not running")
            try:
                self._control.send((verb, argument))
                ok, answer = self._control.recv()
            except (EOFError, OSError) as exc:
                raise RuntimeError("the server process is not alive") from exc
        if not ok:
            raise RuntimeError(answer)
        return answer

    def __enter__(self) -> ProcessInferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _clear_when_gone(process: Any, alive: Any) -> None:
    """Clears ``alive`` once ``process`` has exited (its clients stop waiting)."""
    multiprocessing.connection.wait([process.sentinel])
    alive.clear()


def _serve_in_child(factory: Callable[[], Any], feed: Any, kwargs: dict[str, Any], control: Any) -> None:
    """The child's side: an InferenceServer over the clients' pipes and
    their shared memory (``feed``: the pipes and the transport's shared
    name) or a TorchRL transport (``feed`` itself), and the control loop
    (stats, stop, new clients' pipes)."""
    transport: Any = feed
    if isinstance(feed, tuple):
        conns, name = feed
        transport = MPTransport()
        transport.shm_name = name  # the clients made in the parent look for this one
        transport._conns.extend(conns)
    try:
        server = InferenceServer(factory(), transport, **kwargs).start()
    except BaseException as exc:  # noqa: BLE001 - the parent's to see
        control.send(f"{type(exc).__name__}: {exc}")
        return
    control.send("ready")
    try:
        while True:
            verb, argument = control.recv()
            if verb == "stop":
                server.shutdown(argument)
                if not isinstance(transport, MPTransport) and callable(getattr(transport, "close", None)):
                    transport.close()  # its clients are told: their calls fail at once
                control.send((True, None))
                return
            if verb == "stats":
                control.send((True, server.stats(reset=bool(argument))))
            elif verb == "client" and isinstance(transport, MPTransport):
                with transport._lock:
                    transport._conns.append(argument)
                control.send((True, None))
            else:
                control.send((False, f"Unknown process-server verb {verb!r}"))
    except (EOFError, OSError):
        server.shutdown(1.0)  # the parent went away


def _closed_again(error: ServerClosedError) -> ServerClosedError:
    """A fresh copy of ``error`` (each Future raises its own)."""
    again = type(error)(str(error))
    again.__cause__ = error.__cause__
    return again


_peer_closed_class: list[type[ServerClosedError]] = []


def _server_went_away(detail: str = "") -> ServerClosedError:
    """The error of a request whose server process went away: a
    :class:`ServerClosedError` that is also TorchRL's
    ``MailboxPeerClosedError`` where TorchRL is installed (what its own
    clients raise then), so code written against either catches it."""
    if not _peer_closed_class:
        bases: tuple[type, ...] = (ServerClosedError,)
        try:
            from torchrl._comm.mailbox import MailboxPeerClosedError
        except ImportError:
            pass
        else:
            bases = (ServerClosedError, MailboxPeerClosedError)
        _peer_closed_class.append(type("PeerClosedError", bases, {"__module__": __name__}))
    message = "the inference server went away (peer closed)" + (f": {detail}" if detail else "")
    return _peer_closed_class[0](message)


def _answer(future: concurrent.futures.Future[Any], td: Any, rules: _SlotRules | None, ok: bool, blob: bytes) -> None:
    """Resolves one request's Future from its answer; whatever fails, fails it alone."""
    try:
        payload = pickle.loads(blob)
        if not ok:
            future.set_exception(payload)
            return
        pairs = [(key, _from_wire(value)) for key, value in payload]
        result = _complete(td, pairs) if rules is None else rules.response(td, pairs)
    except Exception as exc:  # noqa: BLE001 - this request's to see
        error: BaseException = exc
        if not ok:
            error = ModelError(
                f"the model raised an exception this process cannot rebuild: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
        future.set_exception(error)
        return
    future.set_result(result)


_register_with_torchrl()  # TorchRL loaded first: its checks know these transports now
