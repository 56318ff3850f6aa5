"""ferrobatch.testing.check_batch_invariance: a sample's result must not
depend on what else is in its batch."""

from __future__ import annotations

import pytest
import torch
from conftest import WIDTH, X, Y, double, make_server

import ferrobatch as fb
from ferrobatch.testing import check_batch_invariance, default_tolerance

SAMPLES = [{"x": torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))} for i in range(40)]


def centred(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Batch-dependent: subtracts the batch mean (alone, every row is 0)."""
    return {"y": d["x"] - d["x"].mean(0)}


def test_a_row_independent_model_passes() -> None:
    linear = torch.nn.Linear(WIDTH, WIDTH)
    report = check_batch_invariance(lambda d: linear(d["x"]), SAMPLES)
    assert report.ok, report
    assert report.mismatched_samples == 0 and report.worst == []
    assert report.rows_checked >= len(SAMPLES) and report.batches >= 16


def test_a_batch_dependent_model_is_caught_with_its_worst_rows() -> None:
    report = check_batch_invariance(centred, SAMPLES)
    assert not report.ok
    assert report.mismatched_samples == len(SAMPLES)
    assert len(report.worst) == 10
    ratios = [m.ratio for m in report.worst]
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] > 1
    worst = report.worst[0]
    assert worst.output == "y" and worst.batch_size > 1 and 0 <= worst.position < worst.batch_size
    assert "FAILED" in str(report) and f"sample {worst.sample}" in str(report)


def test_a_difference_within_the_dtype_tolerance_passes_and_beyond_it_fails() -> None:
    def jitter(scale: float):  # type: ignore[no-untyped-def]
        def model(d: dict[str, torch.Tensor]) -> torch.Tensor:
            x = d["x"]
            return x * (1 + scale * (x.shape[0] > 1))

        return model

    half = [{"x": s["x"].half()} for s in SAMPLES]
    assert check_batch_invariance(jitter(1e-4), half).ok  # float16: rtol 1e-3
    assert not check_batch_invariance(jitter(1e-4), SAMPLES).ok  # float32: rtol 1.3e-6
    assert check_batch_invariance(jitter(1e-4), SAMPLES, rtol=1e-3).ok


def test_integer_outputs_must_match_exactly() -> None:
    def count(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return (d["x"] > 0).sum(1) + (d["x"].shape[0] > 8)

    assert default_tolerance(torch.int64) == (0.0, 0.0)
    report = check_batch_invariance(count, SAMPLES, batch_sizes=[16])
    assert not report.ok and report.worst[0].output == "output"
    assert check_batch_invariance(count, SAMPLES, batch_sizes=[2, 8]).ok


def test_a_server_is_checked_through_its_whole_path() -> None:
    assert check_batch_invariance(make_server(double, max_delay=0), SAMPLES).ok
    report = check_batch_invariance(make_server(centred, max_delay=0), SAMPLES)
    assert not report.ok
    assert max(m.batch_size for m in report.worst) <= 16  # the server's max_batch_size


def test_a_server_that_never_runs_a_sample_alone_is_refused_not_waited_on() -> None:
    with pytest.raises(ValueError, match="min_batch_size=4"):
        check_batch_invariance(make_server(double, min_batch_size=4), SAMPLES)
    assert check_batch_invariance(double, SAMPLES).ok  # its model, as the message says


async def test_a_server_on_this_event_loop_is_refused() -> None:
    async with fb.Server(double, inputs=[X], outputs=[Y]) as server:
        with pytest.raises(RuntimeError, match="off the event loop"):
            check_batch_invariance(server, SAMPLES)
