"""Checks for models served by ferrobatch.

:func:`check_batch_invariance` answers "does a sample's result depend on
what else is in its batch?": it runs each sample alone and inside batches
of random composition and sizes, and compares. A row-independent model
passes; batch statistics, cross-row attention or padding that leaks
(``x - x.mean(0)``, a reduction over the batch, a kernel that picks its
algorithm by batch size beyond the dtype's tolerance) fail.

    report = ferrobatch.testing.check_batch_invariance(model, samples)
    assert report.ok, report
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.from_thread
import torch

from ._invariance import compare, default_tolerance
from .server import Server

__all__ = ["InvarianceReport", "Mismatch", "check_batch_invariance", "default_tolerance"]

Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Mismatch:
    """One sample's output that differed in a batch from the sample alone.

    ``ratio`` is the largest ``|batched - alone| / (atol + rtol * |alone|)``
    over the output's elements (``inf`` for a shape, dtype or NaN mismatch);
    above 1 is a mismatch.
    """

    sample: int  # index into ``samples``
    output: str
    batch_size: int
    position: int  # the sample's row in that batch
    max_abs_diff: float
    ratio: float


@dataclass
class InvarianceReport:
    """What :func:`check_batch_invariance` found. ``ok`` is True only when
    every sample matched in every batch it was run in."""

    samples: int
    batches: int  # batched runs, besides one alone per sample
    rows_checked: int
    mismatched_samples: int = 0
    worst: list[Mismatch] = field(default_factory=list)  # worst first

    @property
    def ok(self) -> bool:
        return self.mismatched_samples == 0

    def __str__(self) -> str:
        head = (
            f"batch invariance: {'ok' if self.ok else 'FAILED'}: {self.samples} samples, "
            f"{self.batches} batches, {self.rows_checked} rows checked, "
            f"{self.mismatched_samples} samples mismatched"
        )
        lines = [
            f"  sample {m.sample} output '{m.output}' at row {m.position} of a batch of {m.batch_size}: "
            f"max |diff| {m.max_abs_diff:.3g}, {m.ratio:.3g}x the tolerance"
            for m in self.worst
        ]
        return "\n".join([head, *lines])


def _normalize(raw: Any) -> Outputs:
    if isinstance(raw, torch.Tensor):
        return {"output": raw}
    if isinstance(raw, (tuple, list)):
        return {f"output_{i}": t for i, t in enumerate(raw)}
    if isinstance(raw, Mapping) or hasattr(raw, "items"):
        return {str(k): v for k, v in raw.items()}
    raise TypeError(f"the model returned {type(raw).__name__}; expected a tensor, a tuple or a dict of tensors")


def _runner(server_or_model: Server | Callable[..., Any]) -> tuple[Callable[[Outputs], Outputs], int | None]:
    """How to run one batch (``{name: stacked rows}``), and the largest batch."""
    if not isinstance(server_or_model, Server):
        model = server_or_model

        def call_model(batch: Outputs) -> Outputs:
            with torch.inference_mode():
                return _normalize(model(batch))

        return call_model, None
    server = server_or_model
    client = server.client()

    def call_server(batch: Outputs) -> Outputs:
        return dict(anyio.from_thread.run(client.infer_batch, batch, None, token=client._loop_token()))

    return call_server, server.max_batch_size


def check_batch_invariance(
    server_or_model: Server | Callable[..., Any],
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    batch_sizes: Sequence[int] | None = None,
    batches: int = 16,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    worst: int = 10,
) -> InvarianceReport:
    """Runs each sample alone, then inside batches of random composition
    and sizes, and compares every row with the same sample alone.

    ``server_or_model``: a model callable (``dict[str, Tensor]`` of batched
    inputs -> a tensor, a tuple or a dict of tensors), called directly under
    ``torch.inference_mode``; or a :class:`~ferrobatch.Server`, whose whole
    path is checked (staging, padding to buckets, CUDA graphs, compiled
    code): each batch goes in as one ``infer_batch`` request. A server that
    is not running is started in the background for the check and stopped
    after; a running one must be served by an event loop on another thread
    (call this off that loop, e.g. with ``anyio.to_thread.run_sync``).

    ``samples``: one sample each, ``{input: tensor}`` without the batch
    dimension. ``batch_sizes``: the sizes to draw from (default 2, 3, 4, 7,
    8, 15, 16, 31, 32, 63 and 64, capped at the server's
    ``max_batch_size``); ``batches``: how many batched runs at least (more
    if needed so that every sample is in one). A batch draws its rows at
    random from the samples (repeats allowed), in random order.

    Tolerances are per output dtype (:func:`default_tolerance`: those of
    ``torch.testing.assert_close`` for floating dtypes, exact for integers
    and bool); ``rtol`` / ``atol`` override them for every floating output.
    NaN matches NaN. Returns an :class:`InvarianceReport` whose ``ok`` is
    True only when every sample matched, with the ``worst`` mismatches.
    """
    if not samples:
        raise ValueError("check_batch_invariance needs at least one sample")
    names = list(samples[0])
    for i, s in enumerate(samples):
        if list(s) != names:
            raise ValueError(f"sample {i} has inputs {list(s)}; sample 0 has {names}")
    if isinstance(server_or_model, Server) and server_or_model.min_batch_size > 1:
        # Each sample runs alone (its reference): such a server would hold it forever.
        raise ValueError(
            f"check_batch_invariance runs each sample alone, and server '{server_or_model.name}' never runs fewer"
            f" than min_batch_size={server_or_model.min_batch_size} rows: pass its model instead"
        )
    if isinstance(server_or_model, Server) and not server_or_model.running:
        with server_or_model.run_in_background():
            return check_batch_invariance(
                server_or_model, samples, batch_sizes=batch_sizes, batches=batches,
                rtol=rtol, atol=atol, seed=seed, worst=worst,
            )  # fmt: skip
    if isinstance(server_or_model, Server):
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("check_batch_invariance blocks: call it off the event loop (anyio.to_thread.run_sync)")
    run, largest = _runner(server_or_model)
    sizes = list(batch_sizes or (2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64))
    if largest is not None:
        sizes = [min(k, largest) for k in sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"batch_sizes must be >= 1, got {batch_sizes}")
    rng = random.Random(seed)

    def stacked(indices: Sequence[int]) -> Outputs:
        return {name: torch.stack([torch.as_tensor(samples[i][name]) for i in indices]) for name in names}

    alone = [{name: t[0] for name, t in run(stacked([i])).items()} for i in range(len(samples))]
    # Every sample in at least one batch: a shuffled pass first, then at random.
    unseen = list(range(len(samples)))
    rng.shuffle(unseen)
    found: dict[tuple[int, str], Mismatch] = {}
    report = InvarianceReport(samples=len(samples), batches=0, rows_checked=0)
    while report.batches < batches or unseen:
        k = rng.choice(sizes)
        indices = unseen[:k]
        del unseen[:k]
        indices += rng.choices(range(len(samples)), k=k - len(indices))
        rng.shuffle(indices)
        outputs = run(stacked(indices))
        report.batches += 1
        for position, i in enumerate(indices):
            report.rows_checked += 1
            for name, reference in alone[i].items():
                got = outputs.get(name)
                if got is None or got.shape[:1] != (k,):
                    max_abs, ratio = math.inf, math.inf
                else:
                    max_abs, ratio = compare(got[position], reference, rtol, atol)
                if ratio > 1 and ratio > getattr(found.get((i, name)), "ratio", 0.0):
                    found[(i, name)] = Mismatch(i, name, k, position, max_abs, ratio)
    report.mismatched_samples = len({i for i, _ in found})
    report.worst = sorted(found.values(), key=lambda m: m.ratio, reverse=True)[:worst]
    return report
