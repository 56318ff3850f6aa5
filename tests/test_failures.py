"""Every request resolves exactly once, whatever fails: the model, the caller,
the deadline, the queue or the server."""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb


class Gate:
    """A model that records what it saw and blocks until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen: list[float] = []

    def __call__(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.seen.extend(d["x"][:, 0].tolist())
        self.entered.set()
        self.release.wait(10)
        return {"y": d["x"] * 2}


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()


async def wait_entered(gate: Gate) -> None:
    for _ in range(500):
        if gate.entered.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the model was never called")


@pytest.mark.parametrize("exc", [RuntimeError("boom"), SystemExit(3), KeyboardInterrupt()])
async def test_model_exception_fails_its_batch_and_the_worker_survives(exc: BaseException) -> None:
    calls = 0

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc
        return {"y": d["x"] * 2}

    # Without isolation: a RuntimeError would be retried (test_isolation).
    async with make_server(model, max_delay=0.01, isolate_failures=False) as server:
        client = server.client()
        results = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(5)), return_exceptions=True)
        assert all(isinstance(r, fb.ModelError) for r in results), results
        err = results[0]
        assert isinstance(err, fb.ModelError) and err.__cause__ is exc
        assert type(exc).__name__ in str(err)
        out = await client.infer({"x": sample(7)})  # the worker is still alive
        torch.testing.assert_close(out["y"], sample(14))
        stats = server.stats()
    assert stats["requests_failed"]["model_error"] == 5
    assert stats["requests_succeeded"] == 1
    assert stats["failed_batches"] == 1


async def test_rows_a_batched_request_cannot_be_sliced_from_are_a_model_error() -> None:
    """Outputs the fan-out cannot take a multi-row request's rows from: those
    callers get a ModelError caused by what indexing raised, counted."""

    class NoSlices(torch.Tensor):
        def __getitem__(self, index: object) -> torch.Tensor:
            raise KeyError("cannot slice")

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": (d["x"] * 2).as_subclass(NoSlices)}

    async with make_server(model, max_batch_size=8, max_delay=0.01) as server:
        client = server.client()
        results = await asyncio.wait_for(
            asyncio.gather(
                *(client.infer_batch({"x": torch.stack([sample(i)] * 2)}) for i in range(3)),
                return_exceptions=True,
            ),
            timeout=10,
        )
        stats = server.stats()
    assert all(isinstance(r, fb.ModelError) and isinstance(r.__cause__, KeyError) for r in results), results
    assert stats["requests_failed"]["model_error"] == 3


async def test_queue_full_is_raised_at_once(gate: Gate) -> None:
    async with make_server(gate, max_batch_size=1, max_delay=0, max_queue_size=2) as server:
        client = server.client()
        first = asyncio.ensure_future(client.infer({"x": sample(0)}))
        await wait_entered(gate)  # the worker holds request 0
        queued = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(fb.QueueFullError, match="max_queue_size"):
            await client.infer({"x": sample(3)})
        assert server.stats()["queue_depth"] == 2
        gate.release.set()
        await asyncio.gather(first, *queued)
        assert server.stats()["requests_failed"]["queue_full"] == 1


async def test_a_request_past_its_deadline_while_queued_is_never_run(gate: Gate) -> None:
    async with make_server(gate, max_batch_size=1, max_delay=0) as server:
        client = server.client()
        first = asyncio.ensure_future(client.infer({"x": sample(0)}))
        await wait_entered(gate)
        with pytest.raises(fb.DeadlineExceededError) as info:
            await client.infer({"x": sample(42)}, timeout=0.05)
        assert isinstance(info.value, TimeoutError)
        gate.release.set()
        await first
        after = await client.infer({"x": sample(1)})
        torch.testing.assert_close(after["y"], sample(2))
    assert 42.0 not in gate.seen
    assert server.stats()["requests_failed"]["deadline_exceeded"] == 1


async def test_requests_with_deadlines_let_go_of_their_inputs_however_they_end(gate: Gate) -> None:
    """A deadline timer and its ticket refer to each other; every way a
    request ends must break that, or its inputs would never be freed."""
    x = sample(7)
    before = sys.getrefcount(x)
    async with make_server(gate, max_batch_size=1, max_delay=0) as server:
        client = server.client()
        first = asyncio.ensure_future(client.infer({"x": sample(0)}, timeout=30))
        await wait_entered(gate)
        for _ in range(3):  # expire while queued
            with pytest.raises(fb.DeadlineExceededError):
                await client.infer({"x": x}, timeout=0.01)
        cancelled = asyncio.ensure_future(client.infer({"x": x}, timeout=30))
        await asyncio.sleep(0)
        cancelled.cancel()
        gate.release.set()
        await first  # resolved with its timer pending
        ok = await client.infer({"x": x}, timeout=30)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        del ok, cancelled, first  # the cancelled task keeps its traceback, and so its inputs
    gc.collect()
    assert sys.getrefcount(x) == before


async def test_failed_requests_let_go_of_their_inputs() -> None:
    def broken(model_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("model failed")

    x = sample(3)
    before = sys.getrefcount(x)
    async with make_server(broken, max_batch_size=4, max_delay=0.001) as server:
        client = server.client()
        for _ in range(5):
            with pytest.raises(fb.ModelError):
                await client.infer({"x": x})
    gc.collect()
    assert sys.getrefcount(x) == before


async def test_deadline_while_in_a_batch_resolves_once_with_the_error(gate: Gate) -> None:
    async with make_server(gate, max_delay=0) as server:
        client = server.client()
        with pytest.raises(fb.DeadlineExceededError):
            await client.infer({"x": sample(5)}, timeout=0.05)
        gate.release.set()
        out = await client.infer({"x": sample(1)})
        torch.testing.assert_close(out["y"], sample(2))
    assert 5.0 in gate.seen
    stats = server.stats()
    assert stats["requests_failed"]["deadline_exceeded"] == 1
    assert stats["requests_succeeded"] == 1


async def test_cancelled_request_is_never_run(gate: Gate) -> None:
    async with make_server(gate, max_batch_size=1, max_delay=0) as server:
        client = server.client()
        first = asyncio.ensure_future(client.infer({"x": sample(0)}))
        await wait_entered(gate)
        doomed = asyncio.ensure_future(client.infer({"x": sample(99)}))
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        gate.release.set()
        await first
        await client.infer({"x": sample(1)})
    assert 99.0 not in gate.seen
    assert server.stats()["requests_failed"]["cancelled"] == 1


async def test_cancelling_one_caller_never_breaks_its_batch(gate: Gate) -> None:
    async with make_server(gate, max_batch_size=8, max_delay=0.02) as server:
        client = server.client()
        tasks = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(4)]
        await wait_entered(gate)  # all four are in the running batch
        tasks[1].cancel()
        gate.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2, 3):
        torch.testing.assert_close(results[i]["y"], sample(2 * i))  # type: ignore[index]


async def test_random_cancellations_and_deadlines_resolve_each_request_exactly_once() -> None:
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    rng = random.Random(1234)

    def slowish(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        threading.Event().wait(rng.uniform(0, 0.003))
        return {"y": d["x"] * 2}

    n = 600
    async with make_server(slowish, max_batch_size=16, max_delay=0.001) as server:
        client = server.client()

        async def one(i: int) -> str:
            timeout = rng.choice([None, None, 0.0005, 0.002, 0.01])
            task = asyncio.ensure_future(client.infer({"x": sample(i)}, timeout=timeout))
            if rng.random() < 0.25:
                await asyncio.sleep(rng.uniform(0, 0.004))
                task.cancel()
            try:
                out = await task
            except asyncio.CancelledError:
                return "cancelled"
            except fb.DeadlineExceededError:
                return "deadline_exceeded"
            torch.testing.assert_close(out["y"], sample(2 * i))
            return "succeeded"

        outcomes = Counter(await asyncio.gather(*(one(i) for i in range(n))))
        await asyncio.sleep(0.05)  # let batches that held withdrawn requests finish
        stats = server.stats()
    assert sum(outcomes.values()) == n
    assert loop_errors == [], "a future was resolved twice, or a callback failed"
    failed = stats["requests_failed"]
    # Server-side, each request is counted once, by how it was resolved...
    assert stats["requests_succeeded"] + failed["deadline_exceeded"] + failed["cancelled"] == n
    # ...and a task cancelled after its request resolved still saw CancelledError.
    assert stats["requests_succeeded"] >= outcomes["succeeded"]
    assert failed["deadline_exceeded"] >= outcomes["deadline_exceeded"]
    assert failed["cancelled"] <= outcomes["cancelled"]
    assert outcomes["succeeded"] and outcomes["deadline_exceeded"] and outcomes["cancelled"]


async def test_infer_before_start_and_after_stop_raises_server_closed() -> None:
    server = make_server()
    with pytest.raises(fb.ServerClosedError, match="not running"):
        await server.client().infer({"x": sample(1)})
    async with server:
        await server.client().infer({"x": sample(1)})
    with pytest.raises(fb.ServerClosedError):
        await server.client().infer({"x": sample(1)})
    await server.start()
    with pytest.raises(RuntimeError, match="already started"):
        await server.start()
    await server.stop()


async def test_stop_drains_accepted_requests_first() -> None:
    def slow(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        threading.Event().wait(0.005)
        return {"y": d["x"] * 2}

    server = make_server(slow, max_batch_size=4, max_delay=0)
    await server.start()
    client = server.client()
    tasks = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(100)]
    await asyncio.sleep(0)  # all submitted
    await server.stop()
    results = await asyncio.gather(*tasks)
    for i, out in enumerate(results):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert server.stats()["requests_succeeded"] == 100


async def test_stop_timeout_fails_whatever_is_still_waiting(gate: Gate) -> None:
    server = make_server(gate, max_batch_size=1, max_delay=0)
    await server.start()
    client = server.client()
    running = asyncio.ensure_future(client.infer({"x": sample(0)}))
    await wait_entered(gate)
    waiting = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(1, 6)]
    await asyncio.sleep(0)
    await server.stop(timeout=0.1)
    results = await asyncio.gather(running, *waiting, return_exceptions=True)
    assert all(isinstance(r, fb.ServerClosedError) for r in results), results
    gate.release.set()
    await asyncio.sleep(0.05)
    assert gate.seen == [0.0], "requests still queued at the timeout never run"
    assert server.stats()["requests_failed"]["server_closed"] == 6


async def test_infer_sync_on_the_event_loop_thread_raises_instead_of_deadlocking(
    server: fb.Server,
) -> None:
    with pytest.raises(RuntimeError, match=r"await client\.infer"):
        server.client().infer_sync({"x": sample(1)})


async def test_expired_and_cancelled_requests_free_their_queue_place_at_once(gate: Gate) -> None:
    async with make_server(gate, max_batch_size=1, max_delay=0, max_queue_size=1) as server:
        client = server.client()
        running = asyncio.ensure_future(client.infer({"x": sample(0)}))
        await wait_entered(gate)  # the worker is busy; nothing will be popped
        with pytest.raises(fb.DeadlineExceededError):
            await client.infer({"x": sample(1)}, timeout=0.02)
        cancelled = asyncio.ensure_future(client.infer({"x": sample(2)}))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert server.stats()["queue_depth"] == 0
        live = asyncio.ensure_future(client.infer({"x": sample(3)}))  # not QueueFullError
        await asyncio.sleep(0)
        gate.release.set()
        await running
        torch.testing.assert_close((await live)["y"], sample(6))
    assert gate.seen == [0.0, 3.0]
