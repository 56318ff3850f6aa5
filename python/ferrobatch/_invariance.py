"""Batch invariance: comparing a row computed in a batch with the same
sample computed alone, with dtype-aware tolerances; and the sampler that
does it for live requests (``Server(invariance_sample_rate=r)``).

The sampler runs off the hot path: the worker only copies one row's inputs
and outputs of a sampled batch into a bounded queue (a full queue drops the
sample), and a thread of the sampler's own runs the model on that row alone
and compares. It runs without the instance's weight gate, so it never holds
up a batch; instead it reads the weights' version before and after its call
and keeps the comparison only when both equal the version the batch ran
with (an update in between would make any difference meaningless).
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger("ferrobatch")

Outputs = dict[str, torch.Tensor]

# (rtol, atol) by dtype: torch.testing.assert_close's defaults. Integer and
# bool outputs must match exactly.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for outputs of ``dtype``: ``torch.testing``'s
    defaults for floating and complex dtypes, ``(0, 0)`` (exact) otherwise."""
    return _TOLERANCES.get(dtype, (0.0, 0.0))


def compare(batched: torch.Tensor, alone: torch.Tensor, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """``(max |diff|, ratio)`` of one row against the same sample alone;
    a ratio above 1 is a mismatch (``inf`` for shape, dtype or NaN ones)."""
    if batched.shape != alone.shape or batched.dtype != alone.dtype:
        return math.inf, math.inf
    default_rtol, default_atol = default_tolerance(alone.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    wide = torch.complex128 if alone.is_complex() else torch.float64
    a = batched.detach().cpu().to(wide)
    b = alone.detach().cpu().to(wide)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if bool((nan_a != nan_b).any()):
        return math.inf, math.inf
    a, b = torch.where(nan_a, 0, a), torch.where(nan_b, 0, b)
    if a.numel() == 0:
        return 0.0, 0.0
    diff = (a - b).abs()
    bound = atol + rtol * b.abs()
    max_abs = float(diff.max())
    if max_abs == 0:
        return 0.0, 0.0
    ratio = float(torch.where(bound > 0, diff / bound.clamp_min(1e-300), torch.where(diff > 0, math.inf, 0.0)).max())
    return max_abs, ratio


def row_value(value: Any, row: int) -> Any:
    """Row ``row`` of a batch output: of a tensor or a numpy (BYTES) array,
    or, of a variable-length output, the row at its own length."""
    if hasattr(value, "request_rows"):
        return value.request_rows(row, 1, False)
    return value[row]


def _owned(value: Any) -> Any:
    """``value`` copied out of whatever buffer it views."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return np.array(value, dtype=object, copy=True) if isinstance(value, np.ndarray) else value


def _differs(batched: Any, alone: Any) -> bool:
    if isinstance(batched, torch.Tensor) and isinstance(alone, torch.Tensor):
        return compare(batched, alone, None, None)[1] > 1
    # BYTES: the elements must be equal.
    a, b = np.asarray(batched, dtype=object), np.asarray(alone, dtype=object)
    return a.shape != b.shape or a.tolist() != b.tolist()


@dataclass(frozen=True, slots=True)
class _Sample:
    inputs: dict[str, Any]  # one row, as a batch of one (what run_alone takes)
    outputs: dict[str, Any]  # the same row of each output, as the batch computed it (see row_value)
    version: int  # the weights' version the batch ran with


class InvarianceSampler:
    """Re-runs a fraction ``rate`` of one instance's requests alone and counts
    the ones whose result differed from their batch's (see the module docs).

    ``run_alone(inputs)`` runs the model on a batch of one row (``{name:
    tensor [1, ...]}``, or what a variable-length model takes) and returns
    its outputs; ``version()`` reads the
    weights' version. ``checks``, ``mismatches`` and ``dropped`` are written
    by this sampler's thread or the worker's only, and read by ``stats()``.
    """

    def __init__(
        self,
        rate: float,
        run_alone: Callable[[dict[str, Any]], Mapping[str, Any]],
        version: Callable[[], int],
        *,
        capacity: int = 64,
        seed: int | None = None,
    ) -> None:
        self.rate = rate
        self._run_alone = run_alone
        self._version = version
        self._random = random.Random(seed)
        self._queue: queue.Queue[_Sample | None] = queue.Queue(maxsize=capacity)
        self.checks = 0  # rows re-run alone and compared
        self.mismatches = 0  # of those, rows whose alone result differed
        self.dropped = 0  # samples dropped: the queue was full
        self._thread = threading.Thread(target=self._loop, name="ferrobatch-invariance", daemon=True)
        self._thread.start()

    def offer(self, slot: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor], rows: int) -> None:
        """After a successful batch of ``rows`` rows (worker thread, the slot
        still held): with probability ``rows * rate`` (at most 1), one of its
        rows is copied out to be checked. Cheap when not sampled."""
        self.offer_row(rows, lambda row: ({name: t[row : row + 1] for name, t in slot.items()}, outputs))

    def offer_row(
        self, rows: int, inputs_and_outputs: Callable[[int], tuple[Mapping[str, Any], Mapping[str, Any]]]
    ) -> None:
        """As :meth:`offer`, for any model: ``inputs_and_outputs(row)`` gives
        row ``row`` as a batch of one (views are fine: they are copied here)
        and the batch's outputs."""
        if rows < 2 or self._random.random() >= rows * self.rate:
            return
        row = self._random.randrange(rows)
        inputs, outputs = inputs_and_outputs(row)
        sample = _Sample(
            {name: _owned(value) for name, value in inputs.items()},
            {name: _owned(row_value(value, row)) for name, value in outputs.items()},
            self._version(),
        )
        try:
            self._queue.put_nowait(sample)
        except queue.Full:
            self.dropped += 1

    @property
    def running(self) -> bool:
        """Whether its thread still re-runs samples (a stop() that timed out)."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the sampler's thread once the samples queued are checked."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # a stuck model call: the daemon thread goes with the process
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (sample := self._queue.get()) is not None:
            try:
                self._check(sample)
            except Exception:
                log.debug("ferrobatch: an invariance re-run failed", exc_info=True)

    def _check(self, sample: _Sample) -> None:
        before = self._version()
        with torch.inference_mode():
            alone = self._run_alone(dict(sample.inputs))
        if not before == self._version() == sample.version:
            return  # the weights changed meanwhile: nothing to compare
        differed = False
        for name, batched in sample.outputs.items():
            if name in alone:
                differed |= _differs(batched, row_value(alone[name], 0))
        self.checks += 1
        self.mismatches += differed


def summed(samplers: Sequence[InvarianceSampler]) -> tuple[int, int]:
    """``(checks, mismatches)`` over ``samplers``."""
    return sum(s.checks for s in samplers), sum(s.mismatches for s in samplers)
