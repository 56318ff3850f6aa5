"""Versioned weight updates, applied between batches on every instance.

Each instance's worker holds its instance's :class:`Gate` around each
forward pass (on CUDA: around enqueuing it). An update closes every gate at
once: it takes every instance's lock (waiting for the forward passes in
progress), waits for the CUDA work already enqueued, applies the update to
every distinct model (all or nothing: one that fails part-way is undone on
every module), bumps the version, and opens the gates again. So a batch
runs entirely on one version, and no batch runs while only some instances have
the new weights. The version a batch ran with is read under its gate.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

__all__ = ["Gate", "WeightUpdates", "WeightUpdate", "Withdrawable", "apply_all_or_nothing", "check_update"]

# The last part of a state dict key that holds a module's extra state
# (``get_extra_state``): any object, handed to ``set_extra_state`` as it is.
_EXTRA_STATE = "_extra_state"

# A state dict (copied in place into every instance), or a callable run on
# each distinct model (returns anything).
WeightUpdate = Mapping[str, Any] | Callable[[Any], Any]


class Gate:
    """One instance's side of the barrier: ``with gate as version:`` around a
    forward pass. Entering waits while an update is pending (so a busy worker
    cannot starve it), then holds the instance's lock."""

    __slots__ = ("_lock", "_updates")

    def __init__(self, updates: WeightUpdates) -> None:
        self._lock = threading.Lock()
        self._updates = updates

    def __enter__(self) -> int:
        updates = self._updates
        if not updates.open.is_set():
            updates.open.wait()
        self._lock.acquire()
        return updates.version

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()


class WeightUpdates:
    """The version of a server's weights and the barrier that changes it."""

    def __init__(self, instances: int) -> None:
        self.version = 0  # written under every gate's lock; read under any one
        self.count = 0
        self.open = threading.Event()  # cleared while an update waits for the gates
        self.open.set()
        self.gates = [Gate(self) for _ in range(instances)]
        self._serial = threading.Lock()  # one update at a time

    def apply(
        self,
        update: WeightUpdate,
        models: Sequence[Any],
        devices: Sequence[torch.device],
        bump: Callable[[list[Any]], bool] | None = None,
        withdrawable: Withdrawable | None = None,
        undo: bool = True,
    ) -> tuple[int, list[Any]]:
        """Applies ``update`` to every distinct model between batches (blocks;
        call it from a thread that runs no event loop) and returns the new
        version and what the callable returned for each distinct model.

        A state dict is checked against every model (keys, shapes, dtypes)
        before anything is copied, so a bad one changes nothing; an update
        that fails part-way (a callable that raises, a copy refused) is undone
        on every module it touched (``undo=False``: not, and no copy of the
        modules is taken first), and the version stays. ``bump`` decides
        from the callable's results whether the version changes (default:
        always). An update ``withdrawable`` withdrew before the gates were all
        taken changes nothing (returns the version as it is, and no results).
        """
        distinct: dict[int, tuple[Any, list[torch.device]]] = {}
        for model, device in zip(models, devices):
            distinct.setdefault(id(model), (model, []))[1].append(device)
        targets = [model for model, _ in distinct.values()]
        check_update(update, targets)
        cuda = sorted({d for _, ds in distinct.values() for d in ds if d.type == "cuda"}, key=str)
        with self._serial:
            if withdrawable is not None and withdrawable.withdrawn:
                return self.version, []
            self.open.clear()
            taken: list[Gate] = []
            try:
                for gate in self.gates:
                    gate._lock.acquire()
                    taken.append(gate)
                if withdrawable is not None and not withdrawable.begin():
                    return self.version, []
                for device in cuda:  # batches already enqueued finish on the old weights
                    torch.cuda.synchronize(device)
                results = apply_all_or_nothing(update, targets, cuda, undo)
                for device in cuda:  # the copies are done before any batch is enqueued
                    torch.cuda.synchronize(device)
                if bump is None or bump(results):
                    self.version += 1
                    self.count += 1
                return self.version, results
            finally:
                for gate in taken:
                    gate._lock.release()
                self.open.set()


class Withdrawable:
    """An update's caller's way to withdraw it until it begins (its caller
    was cancelled while it waited for the gates)."""

    __slots__ = ("_lock", "_state")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"  # -> "withdrawn" or "begun", once

    @property
    def withdrawn(self) -> bool:
        return self._state == "withdrawn"

    def withdraw(self) -> bool:
        """Whether the update is withdrawn: False once it has begun."""
        with self._lock:
            if self._state == "waiting":
                self._state = "withdrawn"
            return self._state == "withdrawn"

    def begin(self) -> bool:
        """Whether the update may begin: False once it is withdrawn."""
        with self._lock:
            if self._state == "waiting":
                self._state = "begun"
            return self._state == "begun"


def check_update(update: WeightUpdate, models: Sequence[Any]) -> None:
    """Refuses, before anything is touched, an update that is neither a state
    dict nor a callable, or a state dict that does not fit every model."""
    if isinstance(update, Mapping):
        for model in models:
            _check_state_dict(model, update)
    elif not callable(update):
        raise TypeError(f"update must be a state dict or a callable, got {type(update).__name__}")


def apply_all_or_nothing(
    update: WeightUpdate, models: Sequence[Any], cuda: Sequence[torch.device] = (), undo: bool = True
) -> list[Any]:
    """Applies a checked ``update`` to each of ``models`` (distinct) and
    returns what the callable returned for each; if it fails on any, every
    module is put back as it was (from a copy of its state dict taken first)
    and the error raised (``undo=False``: the error only). A model that is
    not a module cannot be put back."""
    # A checked state dict's tensors always copy (see _check_state_dict):
    # only a callable, or extra state (set_extra_state may refuse), can fail
    # part-way, and only then is each module's state copied first (as much
    # memory again as its weights, on their device, while the update runs).
    may_fail = not isinstance(update, Mapping) or any(k.rsplit(".", 1)[-1] == _EXTRA_STATE for k in update)
    snapshots = [_snapshot(model) if undo and may_fail else None for model in models]
    results: list[Any] = []
    try:
        with torch.no_grad():
            for model in models:
                if isinstance(update, Mapping):
                    model.load_state_dict(update, strict=True)  # copy_ in place
                    results.append(None)
                else:
                    results.append(update(model))
    except BaseException:
        with torch.no_grad():
            for model, snapshot in zip(models, snapshots):
                if snapshot is not None:
                    model.load_state_dict(snapshot, strict=False)
        for device in cuda:  # put back before any batch is enqueued
            torch.cuda.synchronize(device)
        raise
    return results


def _snapshot(model: Any) -> dict[str, Any] | None:
    """A copy of a module's state dict, to undo a failed update with."""
    if not isinstance(model, torch.nn.Module):
        return None
    snapshot: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, torch.Tensor):
            snapshot[key] = value.clone()
        else:  # extra state: set_extra_state may keep the object it is given
            try:
                snapshot[key] = copy.deepcopy(value)
            except Exception:  # noqa: BLE001 - an object that cannot be copied is put back as it is
                snapshot[key] = value
    return snapshot


def _check_state_dict(model: Any, state: Mapping[str, Any]) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"a state dict can only update a torch.nn.Module, and the model is a {type(model).__name__};"
            " pass a callable that updates it instead"
        )
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
    for key, value in own.items():
        new = state[key]
        if key.rsplit(".", 1)[-1] == _EXTRA_STATE:
            continue  # any object: set_extra_state decides, under the gates (a failure there is undone)
        if not isinstance(new, torch.Tensor) or new.shape != value.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"state dict entry '{key}': expected shape {tuple(value.shape)}, got {got}")
        # What load_state_dict would fail on half-way, some instances updated
        # and others not: refused before any is touched.
        if new.device.type == "meta" or new.is_sparse or new.layout != torch.strided:
            raise ValueError(
                f"state dict entry '{key}': a dense tensor with data is needed, got {new.device} {new.layout}"
            )
        if (new.is_complex() and not value.is_complex()) or (new.is_quantized and not value.is_quantized):
            raise ValueError(f"state dict entry '{key}': {new.dtype} cannot be copied into {value.dtype}")
        if new.numel() and value.numel():  # any other dtype copy_ refuses: one element tells
            try:
                torch.empty(1, dtype=value.dtype).copy_(new.reshape(-1)[:1].cpu())
            except Exception as exc:  # whatever torch says, the entry cannot be copied
                raise ValueError(f"state dict entry '{key}': {new.dtype} cannot be copied into {value.dtype}") from exc
