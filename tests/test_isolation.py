"""Failure isolation: a batch whose model call raises is retried in halves,
so only the requests that fail on their own get ModelError."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb
from ferrobatch._executor import isolate

BAD = -1.0  # a row whose first element is this makes the model raise


class Poisoned:
    """y = 2x, unless a row is marked BAD: then the whole call raises."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = d["x"]
        with self.lock:
            self.sizes.append(x.shape[0])
        if bool((x[:, 0] == BAD).any()):
            raise ValueError("poisoned row")
        return {"y": x * 2}


def marked(i: int) -> torch.Tensor:
    return torch.full((4,), BAD) if i == 13 else sample(i)


async def infer_32(server: fb.Server, x: Any = marked) -> list[Any]:
    client = server.client()
    return await asyncio.gather(*(client.infer({"x": x(i)}) for i in range(32)), return_exceptions=True)


async def test_one_poisoned_request_in_a_batch_of_32_fails_alone() -> None:
    model = Poisoned()
    async with make_server(model, max_batch_size=32, max_delay=5.0) as server:
        results = await infer_32(server)
        stats = server.stats()
    assert model.sizes[0] == 32  # one batch of 32, then the halves
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == [13]
    err = results[13]
    assert isinstance(err, fb.ModelError) and isinstance(err.__cause__, ValueError)
    for i, r in enumerate(results):
        if i != 13:
            torch.testing.assert_close(r["y"], sample(2 * i))
    assert stats["requests_succeeded"] == 31
    assert stats["requests_failed"]["model_error"] == 1
    assert stats["retry_calls"] == 10  # two halves at each of log2(32) levels
    assert stats["isolated_failures"] == 1
    assert stats["failed_batches"] == 1


async def test_without_isolation_the_whole_batch_fails() -> None:
    model = Poisoned()
    async with make_server(model, max_batch_size=32, max_delay=5.0, isolate_failures=False) as server:
        results = await infer_32(server)
        stats = server.stats()
    assert model.sizes == [32]
    assert all(isinstance(r, fb.ModelError) for r in results)
    assert stats["retry_calls"] == 0 and stats["isolated_failures"] == 0


async def test_a_model_failing_on_every_row_costs_at_most_one_extra_call_per_request() -> None:
    model = Poisoned()
    async with make_server(model, max_batch_size=32, max_delay=5.0) as server:
        results = await infer_32(server, lambda i: torch.full((4,), BAD))
        stats = server.stats()
    assert model.sizes[0] == 32
    assert all(isinstance(r, fb.ModelError) for r in results)
    assert len(model.sizes) - 1 == stats["retry_calls"] <= 32
    assert stats["requests_failed"]["model_error"] == 32


async def test_a_poisoned_multi_row_request_fails_whole_and_alone() -> None:
    model = Poisoned()
    async with make_server(model, max_batch_size=16, max_delay=5.0) as server:
        client = server.client()
        rows = torch.stack([sample(100), torch.full((4,), BAD), sample(101)])
        singles = [client.infer({"x": sample(i)}) for i in range(5)]
        batched = client.infer_batch({"x": rows})
        more = [client.infer({"x": sample(i)}) for i in range(5, 10)]
        results = await asyncio.gather(*singles, batched, *more, return_exceptions=True)
    assert isinstance(results[5], fb.ModelError)
    outs = results[:5] + results[6:]
    for i, r in enumerate(outs):
        torch.testing.assert_close(r["y"], sample(2 * i))


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3), GeneratorExit()])
async def test_errors_that_mean_the_process_is_going_down_are_not_retried(exc: BaseException) -> None:
    calls = 0

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc
        return {"y": d["x"] * 2}

    async with make_server(model, max_batch_size=8, max_delay=5.0) as server:
        client = server.client()
        results = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(8)), return_exceptions=True)
        stats = server.stats()
    assert all(isinstance(r, fb.ModelError) and r.__cause__ is exc for r in results)
    assert calls == 1 and stats["retry_calls"] == 0


def test_isolate_splits_by_request_and_keeps_rows_together() -> None:
    """Requests of 1, 3, 2 and 2 rows, the one at row 4 bad: the halves are
    cut between requests, never inside one."""
    request_rows = [(0, 1), (1, 3), (4, 2), (6, 2)]
    seen: list[tuple[int, int]] = []

    def call(start: int, rows: int) -> dict[str, torch.Tensor]:
        seen.append((start, rows))
        if start <= 4 < start + rows:
            raise ValueError("bad")
        return {"y": torch.arange(start, start + rows)}

    result = isolate(request_rows, ValueError("first"), call)
    assert seen == [(0, 4), (4, 4), (4, 2), (6, 2)]
    assert [start for start, _ in result.failed] == [4]
    assert [(s, n) for s, n, _ in result.done] == [(0, 4), (6, 2)]
    assert result.calls == 4 and result.alone == 1


@pytest.mark.parametrize("requests", [2, 3, 5, 6, 7])
def test_one_bad_request_in_a_small_batch_fails_alone(requests: int) -> None:
    """3 or 5 requests need more halving calls (4, 6) than requests: the
    budget allows a lone bad request's path, so its neighbours never fail
    with it (with a budget of n calls, 3 requests failed two)."""
    request_rows = [(i, 1) for i in range(requests)]

    def call(start: int, rows: int) -> dict[str, torch.Tensor]:
        if start <= requests - 1 < start + rows:
            raise ValueError("bad")
        return {"y": torch.arange(start, start + rows)}

    result = isolate(request_rows, ValueError("first"), call)
    assert [start for start, _ in result.failed] == [requests - 1]
    assert result.calls <= max(requests, 2 * (requests - 1).bit_length())


@pytest.mark.gpu
async def test_a_poisoned_request_fails_alone_on_a_cuda_instance() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = d["x"]
        # A host check, as input validation in a model does: it raises while the call is enqueued.
        if bool((x[:, 0] == BAD).any()):
            raise ValueError("poisoned row")
        return {"y": x * 2}

    async with make_server(model, max_batch_size=32, max_delay=5.0, device="cuda") as server:
        results = await infer_32(server)
        stats = server.stats()
    assert [i for i, r in enumerate(results) if isinstance(r, BaseException)] == [13]
    for i, r in enumerate(results):
        if i != 13:
            torch.testing.assert_close(r["y"], sample(2 * i))
    assert stats["requests_succeeded"] == 31 and stats["retry_calls"] == 10
