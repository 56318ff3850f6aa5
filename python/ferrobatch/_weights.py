"""Versioned weight updates, applied between batches on every instance.

Each instance's worker holds its instance's :class:`Gate` around each
forward pass (on CUDA: around enqueuing it). An update closes every gate at
once: it takes every instance's lock (waiting for the forward passes in
progress), waits for the CUDA work already enqueued, applies the update to
every distinct model, bumps the version, and opens the gates again. So a batch
runs entirely on one version, and no batch runs while only some instances have
the new weights. The version a batch ran with is read under its gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

__all__ = ["Gate", "WeightUpdates", "WeightUpdate"]

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
    ) -> tuple[int, list[Any]]:
        """Applies ``update`` to every distinct model between batches (blocks;
        call it from a thread that runs no event loop) and returns the new
        version and what the callable returned for each distinct model.

        A state dict is checked against every model (keys, shapes) before
        anything is copied, so a bad one changes nothing. ``bump`` decides
        from the callable's results whether the version changes (default:
        always).
        """
        distinct: dict[int, tuple[Any, list[torch.device]]] = {}
        for model, device in zip(models, devices):
            distinct.setdefault(id(model), (model, []))[1].append(device)
        if isinstance(update, Mapping):
            for model, _ in distinct.values():
                _check_state_dict(model, update)
        elif not callable(update):
            raise TypeError(f"update must be a state dict or a callable, got {type(update).__name__}")
        cuda = sorted({d for _, ds in distinct.values() for d in ds if d.type == "cuda"}, key=str)
        with self._serial:
            self.open.clear()
            taken: list[Gate] = []
            try:
                for gate in self.gates:
                    gate._lock.acquire()
                    taken.append(gate)
                for device in cuda:  # batches already enqueued finish on the old weights
                    torch.cuda.synchronize(device)
                results: list[Any] = []
                with torch.no_grad():
                    for model, _ in distinct.values():
                        if isinstance(update, Mapping):
                            model.load_state_dict(update, strict=True)  # copy_ in place
                            results.append(None)
                        else:
                            results.append(update(model))
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
        if not isinstance(new, torch.Tensor) or new.shape != value.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise ValueError(f"state dict entry '{key}': expected shape {tuple(value.shape)}, got {got}")
        # What load_state_dict would fail on half-way, some instances updated
        # and others not: refused before any is touched.
        if new.device.type == "meta" or new.is_sparse or new.layout != torch.strided:
            raise ValueError(
                f"state dict entry '{key}': a dense tensor with data is needed, got {new.device} {new.layout}"
            )
        if new.is_complex() and not value.is_complex():
            raise ValueError(f"state dict entry '{key}': {new.dtype} cannot be copied into {value.dtype}")
