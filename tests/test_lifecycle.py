"""The server's lifecycle at its edges: stop() during start(), a stop() cut
short, a server dropped without stop(), what a stop tells the requests it
ends, and a stopped server started again."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb


class Gate:
    """A model that blocks each call until released (at most 10 s)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.entered.set()
        self.release.wait(10)
        return {"y": inputs["x"] * 2}


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.release.set()  # whatever failed, no model call stays blocked


def worker_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"ferrobatch-{name}-")]


async def wait_until_entered(gate: Gate) -> None:
    assert await asyncio.to_thread(gate.entered.wait, 5), "the model was never called"


# -- stop() during start() ------------------------------------------------------------


async def test_stop_during_warmup_waits_and_the_server_never_runs(gate: Gate) -> None:
    server = make_server(gate, name="stop-in-warmup", warmup=True, max_batch_size=1)
    starting = asyncio.create_task(server.start())
    await wait_until_entered(gate)  # warm-up is in the model
    stopping = asyncio.create_task(server.stop())
    await asyncio.sleep(0.1)
    assert not stopping.done(), "stop() returned while start() was still warming up"
    gate.release.set()
    await asyncio.wait_for(stopping, 5)
    with pytest.raises(fb.ServerClosedError, match="stopped during start"):
        await asyncio.wait_for(starting, 5)
    assert not server.running
    assert worker_threads("stop-in-warmup") == []
    with pytest.raises(fb.ServerClosedError):
        await server.client().infer({"x": sample(1)})
    async with server:  # a start of its own: warmed up again, then it serves
        assert torch.equal((await server.client().infer({"x": sample(1)}))["y"], sample(2))


async def test_stop_timeout_during_warmup_returns_and_start_still_gives_up(gate: Gate) -> None:
    server = make_server(gate, name="stop-timeout-in-warmup", warmup=True, max_batch_size=1)
    starting = asyncio.create_task(server.start())
    await wait_until_entered(gate)
    began = time.monotonic()
    await asyncio.wait_for(server.stop(timeout=0.1), 5)  # the warm-up call is left to finish on its thread
    assert time.monotonic() - began < 2
    assert not server.running
    gate.release.set()
    with pytest.raises(fb.ServerClosedError, match="stopped during start"):
        await asyncio.wait_for(starting, 5)
    assert worker_threads("stop-timeout-in-warmup") == []
    with pytest.raises(fb.ServerClosedError):
        await server.client().infer({"x": sample(1)})


# -- a stop() cut short ---------------------------------------------------------------


async def test_a_cancelled_stop_is_finished_by_the_next(gate: Gate) -> None:
    server = make_server(gate, name="cancelled-stop", max_batch_size=1, max_delay=0)
    await server.start()
    client = server.client()
    in_model = asyncio.create_task(client.infer({"x": sample(1)}))
    await wait_until_entered(gate)
    queued = asyncio.create_task(client.infer({"x": sample(2)}))
    await asyncio.sleep(0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(server.stop(timeout=10), 0.2)
    began = time.monotonic()
    await asyncio.wait_for(server.stop(timeout=0.2), 5)
    assert time.monotonic() - began >= 0.15, "the second stop() gave up at once"
    assert not server.running
    assert repr(server).endswith("stopped)")
    # Both fail now, long before the model call (blocked for 10 s) could answer either.
    await asyncio.wait((queued, in_model), timeout=1)
    for request in (queued, in_model):
        assert request.done()
        with pytest.raises(fb.ServerClosedError):
            request.result()
    gate.release.set()
    for thread in worker_threads("cancelled-stop"):
        thread.join(5)
    assert worker_threads("cancelled-stop") == []


async def test_stop_with_a_nan_timeout_changes_nothing() -> None:
    server = make_server(name="nan-stop")
    await server.start()
    with pytest.raises(ValueError):
        await server.stop(timeout=math.nan)
    assert server.running
    assert torch.equal((await server.client().infer({"x": sample(3)}))["y"], sample(6))
    await server.stop()
    assert not server.running
    assert repr(server).endswith("stopped)")


# -- a server dropped without stop() ------------------------------------------------------


async def start_and_drop(name: str) -> None:
    server = make_server(name=name)
    await server.start()
    assert torch.equal((await server.client().infer({"x": sample(1)}))["y"], sample(2))


async def test_a_dropped_server_ends_its_workers() -> None:
    for i in range(3):
        await start_and_drop(f"dropped{i}")
    gc.collect()
    deadline = time.monotonic() + 5
    while any(worker_threads(f"dropped{i}") for i in range(3)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert [t.name for i in range(3) for t in worker_threads(f"dropped{i}")] == []


# -- what a stop tells the requests it ends -----------------------------------------------


async def test_a_request_in_a_batch_at_stop_is_told_it_was_not_answered(gate: Gate) -> None:
    server = make_server(gate, name="stop-message", max_batch_size=1, max_delay=0)
    await server.start()
    in_model = asyncio.create_task(server.client().infer({"x": sample(1)}))
    await wait_until_entered(gate)
    await server.stop(timeout=0.1)
    with pytest.raises(fb.ServerClosedError) as raised:
        await asyncio.wait_for(in_model, 5)
    assert str(raised.value) == "server 'stop-message' stopped before the request was answered"


async def test_a_running_stream_at_stop_is_told_it_was_not_answered() -> None:
    done = threading.Event()

    def endless(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        while not done.wait(0.01):  # bounded: the test ends it
            yield {"y": inputs["x"]}

    server = make_server(endless, name="stop-stream", decoupled=True)
    await server.start()
    responses = 0

    async def read() -> None:
        nonlocal responses
        async for _ in server.client().stream({"x": sample(1)}):
            responses += 1

    reading = asyncio.create_task(read())
    try:

        async def first_response() -> None:
            while responses == 0:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(first_response(), 5)
        await server.stop(timeout=0.1)
        with pytest.raises(fb.ServerClosedError) as raised:
            await asyncio.wait_for(reading, 5)
        assert str(raised.value) == "server 'stop-stream' stopped before the request was answered"
    finally:
        done.set()


# -- a stopped server started again -------------------------------------------------------


@pytest.mark.parametrize("max_delay", [0.0, 0.001], ids=["greedy", "windowed"])
async def test_a_stopped_server_starts_again_and_its_stats_carry_on(max_delay: float) -> None:
    """Each run has workers and staging of its own; a client made in an
    earlier run serves in the next; stats() count every run; a share ends
    with its run and the server may share itself again."""
    server = make_server(name="again", max_delay=max_delay, max_batch_size=8)
    early = server.client()
    for run in range(3):
        async with server:
            got = await asyncio.gather(*(early.infer({"x": sample(i)}) for i in range(20)))
            assert [int(out["y"][0]) for out in got] == [2 * i for i in range(20)]
            threaded = await asyncio.to_thread(early.infer_sync, {"x": sample(4)})  # a thread's way in too
            assert torch.equal(threaded["y"], sample(8))
            share = server.share(f"fb-again-{run}-{id(server)}")
            with fb.connect(share.name) as other:
                assert torch.equal((await other.infer({"x": sample(3)}))["y"], sample(6))
            assert len(worker_threads("again")) == 1
        stats = server.stats()
        assert stats["requests_succeeded"] == 22 * (run + 1), stats
        assert stats["rows"] == 22 * (run + 1) == sum(size * n for size, n in stats["batch_sizes"].items())
        assert stats["batches"] == sum(stats["dispatch_reasons"].values()) == sum(stats["batch_sizes"].values())
        assert stats["queue_depth"] == 0 and stats["queue_ns"] > 0
        assert worker_threads("again") == []
    with pytest.raises(fb.ServerClosedError, match="not running"):
        await early.infer({"x": sample(1)})


async def test_a_restart_waits_for_no_model_call_left_running_by_stop(gate: Gate) -> None:
    """A model call stop(timeout) left on its thread keeps the server from
    starting again (two calls would run the model at once): a clear
    RuntimeError until it returns, then the start goes ahead."""
    server = make_server(gate, name="left-running", max_batch_size=1, max_delay=0)
    await server.start()
    in_model = asyncio.create_task(server.client().infer({"x": sample(1)}))
    await wait_until_entered(gate)
    await server.stop(timeout=0.1)
    with pytest.raises(fb.ServerClosedError):
        await asyncio.wait_for(in_model, 5)
    with pytest.raises(RuntimeError, match="still finishing a model call"):
        await server.start()
    gate.release.set()
    deadline = time.monotonic() + 5
    while worker_threads("left-running") and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    async with server:
        assert torch.equal((await server.client().infer({"x": sample(2)}))["y"], sample(4))
    stats = server.stats()
    assert stats["requests_succeeded"] == 1 and stats["requests_failed"]["server_closed"] == 1


async def test_a_loop_busy_while_the_server_restarts_gets_each_requests_own_answer() -> None:
    """Each event loop's table of waiting requests outlives a run: the next
    run's batcher numbers its requests on (a request of the new run never
    gets the answer of the old run's request with its id), the stop fails
    only the old run's requests, and an answer posted before the stop is
    its caller's."""
    import anyio.from_thread

    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.2)
        return {"y": inputs["x"] * 2}

    server = make_server(slow, name="ids-on", max_delay=0)
    client = server.client()
    with anyio.from_thread.start_blocking_portal() as portal:  # the server's loop is another
        portal.call(server.start)
        first = asyncio.ensure_future(client.infer({"x": sample(1)}))
        await asyncio.sleep(0.05)  # submitted: its batch runs
        # Submitted once this step ends: after the restart, ahead of the stop's fail_all on this loop.
        second = asyncio.ensure_future(client.infer({"x": sample(5)}))
        time.sleep(0.4)  # this loop busy: the batch answers, and the server restarts meanwhile
        portal.call(server.stop)
        portal.call(server.start)
        assert torch.equal((await asyncio.wait_for(first, 5))["y"], sample(2))
        assert torch.equal((await asyncio.wait_for(second, 5))["y"], sample(10))
        portal.call(server.stop)
    stats = server.stats()
    assert stats["requests_succeeded"] == 2 and sum(stats["requests_failed"].values()) == 0
