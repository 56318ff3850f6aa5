"""Clients on several event loops and threads share one server at the same time."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb
from ferrobatch import _core


@pytest.mark.parametrize("max_delay", [0.002, 0.0], ids=["max_delay", "greedy"])
async def test_three_threads_with_their_own_event_loops_share_one_server(max_delay: float) -> None:
    # Greedy: each loop releases its requests at the end of its own
    # iterations (a flush per loop); none may be left waiting for another's.
    per_thread, rounds = 200, 4
    async with make_server(max_batch_size=32, max_delay=max_delay) as server:
        client = server.client()
        failures: list[BaseException] = []

        def run_loop(t: int) -> None:
            async def callers() -> None:
                size = per_thread // rounds
                for r in range(rounds):
                    base = 1000 * t + r * size
                    calls = (client.infer({"x": sample(base + i)}) for i in range(size))
                    outs = await asyncio.wait_for(asyncio.gather(*calls), timeout=20)
                    for i, out in enumerate(outs):
                        torch.testing.assert_close(out["y"], sample(2 * (base + i)))

            try:
                asyncio.run(callers())
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=run_loop, args=(t,)) for t in range(3)]
        for thread in threads:
            thread.start()
        # The server's own loop keeps serving callers meanwhile.
        local = await asyncio.gather(*(client.infer({"x": sample(-i)}) for i in range(50)))
        await asyncio.to_thread(lambda: [th.join(30) for th in threads])
        assert not failures, failures
        for i, out in enumerate(local):
            torch.testing.assert_close(out["y"], sample(-2 * i))
        stats = server.stats()
    assert stats["requests_succeeded"] == 3 * per_thread + 50


async def test_infer_sync_from_a_thread_pool() -> None:
    async with make_server(max_batch_size=16, max_delay=0.002) as server:
        client = server.client()

        def call(i: int) -> torch.Tensor:
            return client.infer_sync({"x": sample(i)}, timeout=10)["y"]

        def run_pool() -> list[torch.Tensor]:
            with ThreadPoolExecutor(max_workers=16) as pool:
                return list(pool.map(call, range(200)))

        results = await asyncio.to_thread(run_pool)
        stats = server.stats()
    for i, y in enumerate(results):
        torch.testing.assert_close(y, sample(2 * i))
    assert stats["requests_succeeded"] == 200
    assert stats["mean_batch_size"] > 1, "threads' requests are batched together"


async def test_infer_sync_after_stop_raises_server_closed() -> None:
    server = make_server()
    async with server:
        pass
    client = server.client()
    error: list[BaseException] = []

    def call() -> None:
        try:
            client.infer_sync({"x": sample(1)})
        except BaseException as exc:  # noqa: BLE001
            error.append(exc)

    await asyncio.to_thread(call)
    assert len(error) == 1 and isinstance(error[0], fb.ServerClosedError)


async def test_a_thread_running_event_loops_one_after_another() -> None:
    # The client caches the last loop it saw; each new loop on the same
    # thread must get its own mailbox (a future of a finished loop would
    # fail to await: "attached to a different loop").
    async with make_server() as server:
        client = server.client()

        def run_loops() -> list[torch.Tensor]:
            outs = []
            for i in range(3):
                out = asyncio.run(asyncio.wait_for(client.infer({"x": sample(i)}), timeout=10))
                outs.append(out["y"])
            return outs

        outs = await asyncio.to_thread(run_loops)
        # And the server's own loop again, after the thread's.
        mine = await client.infer({"x": sample(7)})
    for i, y in enumerate(outs):
        torch.testing.assert_close(y, sample(2 * i))
    torch.testing.assert_close(mine["y"], sample(14))


async def test_the_submitter_looks_a_loop_up_once_until_it_changes_or_the_process_forks() -> None:
    async with make_server() as server:
        lookups: list[asyncio.AbstractEventLoop] = []
        get_running_loop = asyncio.get_running_loop

        def counting() -> asyncio.AbstractEventLoop:
            lookups.append(get_running_loop())
            return lookups[-1]

        # The submitter asks asyncio for the running loop only on a cache miss.
        asyncio.get_running_loop = counting
        try:
            submitter = _core.Submitter(server._loops, server._not_running)
        finally:
            asyncio.get_running_loop = get_running_loop
        submitter.accept(server._batcher)
        futures = [submitter.submit({"x": sample(i)})[0] for i in range(5)]
        assert len(lookups) == 1
        _core.after_fork_in_child()  # as in a forked child: the cache is void
        with pytest.raises(fb.ServerClosedError, match="forked from"):  # and the batcher's workers absent
            submitter.submit({"x": sample(5)})
        submitter.accept(server._batcher)  # as a batcher started after the fork
        futures.append(submitter.submit({"x": sample(5)})[0])
        assert len(lookups) == 2
        outs = await asyncio.wait_for(asyncio.gather(*futures), timeout=10)
        for i, out in enumerate(outs):
            torch.testing.assert_close(out["y"], sample(2 * i))

        def other_loop() -> None:
            async def one() -> None:
                future, _ = submitter.submit({"x": sample(9)})
                torch.testing.assert_close((await future)["y"], sample(18))

            asyncio.run(asyncio.wait_for(one(), timeout=10))

        await asyncio.to_thread(other_loop)
        assert len(lookups) == 3 and lookups[2] is not lookups[1]
        submitter.accept(None)
        with pytest.raises(fb.ServerClosedError):
            submitter.submit({"x": sample(0)})


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
async def test_a_forked_child_is_refused_at_once_not_left_waiting() -> None:
    async with make_server() as server:
        client = server.client()
        await client.infer({"x": sample(1)})
        pid = os.fork()
        if pid == 0:  # the child: none of the server's workers run here
            code = 3
            try:
                client.infer_sync({"x": sample(1)})
            except fb.ServerClosedError as exc:
                code = 0 if "forked from" in str(exc) else 2
            except BaseException:  # noqa: BLE001 - whatever it is, the child must exit here
                code = 4
            os._exit(code)
        deadline = time.monotonic() + 30
        while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if waited[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child was left waiting")
        assert os.waitstatus_to_exitcode(waited[1]) == 0
        assert (await client.infer({"x": sample(2)}))["y"].tolist() == sample(4).tolist()  # the parent serves on


async def test_requests_of_a_loop_that_closed_while_their_batch_ran_are_counted_cancelled() -> None:
    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.3)
        return {"y": inputs["x"] * 2}

    async with make_server(slow, max_delay=0.01) as server:
        client = server.client()

        def close_while_in_flight() -> None:
            loop = asyncio.new_event_loop()

            async def submit() -> None:
                calls = [asyncio.ensure_future(client.infer({"x": sample(1)})) for _ in range(3)]
                await asyncio.sleep(0.05)  # in the model now
                del calls  # never awaited: the loop closes under them

            loop.run_until_complete(submit())
            loop.close()  # its tasks are gone: nobody awaits the answers

        await asyncio.to_thread(close_while_in_flight)
        await asyncio.sleep(0.6)  # the batch ends, posting to the closed loop
        # Another loop's first request sweeps the closed loop's mailbox.
        await asyncio.to_thread(lambda: asyncio.run(client.infer({"x": sample(2)})))
        stats = server.stats()
    assert stats["requests_succeeded"] == 1 and stats["requests_failed"]["cancelled"] == 3, stats


@pytest.mark.parametrize("closed", [False, True], ids=["stopped", "closed"])
async def test_greedy_a_loop_stopped_before_its_flush_holds_up_no_other_loop(closed: bool) -> None:
    # A loop that stops in the iteration it submitted never runs its flush.
    # Its requests must not stand in front of other loops' requests: before,
    # the workers counted ready rows, popped the stopped loop's requests with
    # another loop's rows, and that loop's last request waited for ever.
    async with make_server(max_batch_size=8, max_delay=0.0) as server:
        client = server.client()
        stopped = asyncio.new_event_loop()

        async def submit_then_stop() -> None:
            calls = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(3)]
            await asyncio.sleep(0)  # the calls submit in this iteration ...
            stopped.stop()  # ... and the loop stops before it would flush them
            del calls

        def run_and_stop() -> None:
            task = stopped.create_task(submit_then_stop())
            stopped.run_forever()
            assert task.done()
            if closed:
                stopped.close()

        await asyncio.to_thread(run_and_stop)
        for i in range(3):
            out = await asyncio.wait_for(client.infer({"x": sample(10 + i)}), timeout=5)
            torch.testing.assert_close(out["y"], sample(2 * (10 + i)))
        if not closed:
            # The stopped loop's requests run once it runs again.
            def resume() -> None:
                stopped.call_later(2.0, stopped.stop)
                stopped.run_forever()
                stopped.close()

            await asyncio.to_thread(resume)
        stats = server.stats()
    if not closed:
        assert stats["requests_succeeded"] == 6, stats
