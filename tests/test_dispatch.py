"""When batches are dispatched: greedy, max_delay, preferred sizes, min_batch_size."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb


async def test_greedy_serves_a_lone_caller_one_request_per_batch() -> None:
    async with make_server(max_delay=0) as server:
        client = server.client()
        for i in range(20):
            out = await client.infer({"x": sample(i)})
            torch.testing.assert_close(out["y"], sample(2 * i))
        assert server.stats()["batches"] == 20


async def test_greedy_batches_what_the_loop_submitted_in_one_iteration() -> None:
    # Greedy does not mean "the first request alone": requests an event loop
    # submits in one iteration are released to the worker together, at the
    # end of it, so a burst of callers is one batch however fast the worker
    # wakes. Done several times: each burst is one batch, every time.
    async with make_server(max_batch_size=64, max_delay=0) as server:
        client = server.client()
        for burst in range(5):
            calls = (client.infer({"x": sample(i)}) for i in range(64))
            outs = await asyncio.wait_for(asyncio.gather(*calls), timeout=10)
            for i, out in enumerate(outs):
                torch.testing.assert_close(out["y"], sample(2 * i))
            assert server.stats()["batches"] == burst + 1
        # A burst larger than a batch fills batches, then the rest follows.
        calls = (client.infer({"x": sample(i)}) for i in range(100))
        await asyncio.wait_for(asyncio.gather(*calls), timeout=10)
        assert server.stats()["batches"] == 5 + 2


async def test_greedy_serves_requests_submitted_from_threads() -> None:
    # infer_sync runs on the server's loop, which flushes them like its own.
    async with make_server(max_batch_size=8, max_delay=0) as server:
        client = server.client()
        outs = await asyncio.gather(*(asyncio.to_thread(client.infer_sync, {"x": sample(i)}, 10) for i in range(20)))
        for i, out in enumerate(outs):
            torch.testing.assert_close(out["y"], sample(2 * i))


async def test_full_batch_dispatches_without_waiting_for_max_delay() -> None:
    async with make_server(max_batch_size=8, max_delay=30.0) as server:
        client = server.client()
        await asyncio.wait_for(asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(8))), timeout=10)
        assert server.stats()["batches"] == 1
        assert server.stats()["dispatch_reasons"]["full"] == 1


async def test_max_delay_gathers_concurrent_callers_into_one_batch() -> None:
    async with make_server(max_batch_size=64, max_delay=0.2) as server:
        client = server.client()
        await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(5)))
        stats = server.stats()
    assert stats["batches"] == 1
    assert stats["mean_batch_size"] == 5
    assert stats["dispatch_reasons"]["delay_expired"] == 1
    assert stats["release_age_ns"] >= 0.2e9, "released once its oldest request was max_delay old"


async def test_preferred_batch_size_dispatches_before_max_delay() -> None:
    async with make_server(max_batch_size=16, max_delay=30.0, preferred_batch_sizes=(4,)) as server:
        client = server.client()
        await asyncio.wait_for(asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(4))), timeout=10)
        assert server.stats()["batches"] == 1
        assert server.stats()["dispatch_reasons"]["preferred_size"] == 1


async def test_min_batch_size_holds_small_batches_until_enough_rows() -> None:
    async with make_server(max_batch_size=8, max_delay=0, min_batch_size=4) as server:
        client = server.client()
        early = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(3)]
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in early), "three rows are below min_batch_size"
        last = await asyncio.wait_for(client.infer({"x": sample(3)}), timeout=10)
        outs = await asyncio.gather(*early)
        assert server.stats()["batches"] == 1
    torch.testing.assert_close(last["y"], sample(6))
    torch.testing.assert_close(outs[2]["y"], sample(4))


async def test_stop_flushes_a_batch_below_min_batch_size() -> None:
    server = make_server(max_batch_size=8, max_delay=0, min_batch_size=4)
    await server.start()
    task = asyncio.ensure_future(server.client().infer({"x": sample(1)}))
    await asyncio.sleep(0.05)
    await server.stop()
    torch.testing.assert_close((await task)["y"], sample(2))


async def test_dispatch_reasons_sum_to_the_batches() -> None:
    async with make_server(max_batch_size=4, max_delay=0) as server:
        client = server.client()
        for n in (1, 4, 3, 9):
            await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(n)))
        stats = server.stats()
    reasons = stats["dispatch_reasons"]
    assert sum(reasons.values()) == stats["batches"], reasons
    assert reasons["full"] >= 2 and reasons["greedy"] >= 1, reasons
    expected = {
        "full",
        "next_does_not_fit",
        "preferred_size",
        "delay_expired",
        "greedy",
        "adaptive",
        "callers_waiting",
        "shutdown",
    }
    assert set(reasons) == expected


async def test_auto_delay_serves_a_lone_caller_at_once() -> None:
    """One caller at a time: each batch goes as soon as its one request is in,
    never waiting out the cap (5 s here, so a wait would time the test out)."""
    async with make_server(max_batch_size=64, max_delay="auto", max_delay_cap=5.0) as server:
        client = server.client()
        for i in range(20):
            out = await asyncio.wait_for(client.infer({"x": sample(i)}), timeout=2)
            torch.testing.assert_close(out["y"], sample(2 * i))
        reasons = server.stats()["dispatch_reasons"]
    assert reasons["adaptive"] == 20 and reasons["delay_expired"] == 0, reasons


async def test_auto_delay_fills_batches_under_load() -> None:
    """64 callers that each wait for their result: batches grow to what the
    load brings (all 64), where a lone caller's window would take one."""
    async with make_server(max_batch_size=64, max_delay="auto", max_delay_cap=0.05) as server:
        client = server.client()

        async def caller(k: int) -> None:
            for _ in range(30):
                out = await client.infer({"x": sample(k)})
                assert float(out["y"][0]) == 2 * k

        await asyncio.wait_for(asyncio.gather(*(caller(k) for k in range(64))), timeout=60)
        stats = server.stats()
    assert stats["mean_batch_size"] >= 32, stats
    assert sum(stats["dispatch_reasons"].values()) == stats["batches"]


def test_auto_delay_is_checked() -> None:
    with pytest.raises(ValueError, match="max_delay_cap"):
        make_server(max_delay="auto", max_delay_cap=-1.0)
    with pytest.raises(ValueError, match="max_delay"):
        make_server(max_delay="fast")


def test_delay_from_is_checked_and_kept() -> None:
    with pytest.raises(ValueError, match="delay_from"):
        make_server(delay_from="oldest")
    assert make_server(delay_from="free_worker").delay_from == "free_worker"
    assert make_server().delay_from == "request"


async def test_a_request_withdrawn_while_its_batch_fills_never_runs() -> None:
    # A worker gathers a request into a batch that waits out max_delay; the
    # request stays queued meanwhile. Before, it was taken at once: one whose
    # deadline passed (or whose task was cancelled) inside the window still
    # ran with the batch, and queue_depth did not count it.
    seen: list[float] = []

    def record(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.extend(inputs["x"][:, 0].tolist())
        return {"y": inputs["x"] * 2}

    async with make_server(record, max_batch_size=8, max_delay=1.0) as server:
        client = server.client()
        expiring = asyncio.ensure_future(client.infer({"x": sample(1)}, timeout=0.3))
        cancelled = asyncio.ensure_future(client.infer({"x": sample(2)}))
        kept = asyncio.ensure_future(client.infer({"x": sample(3)}))
        await asyncio.sleep(0.02)  # a worker has gathered all three by now (well within 0.3 s)
        assert server.stats()["queue_depth"] == 3
        cancelled.cancel()
        with pytest.raises(fb.DeadlineExceededError):
            await expiring
        torch.testing.assert_close((await asyncio.wait_for(kept, 5))["y"], sample(6))
        assert seen == [3.0], "only the request still waiting ran"
        stats = server.stats()
    assert stats["requests_succeeded"] == 1 and stats["batches"] == 1, stats
    assert stats["requests_failed"]["deadline_exceeded"] == 1 and stats["requests_failed"]["cancelled"] == 1, stats
