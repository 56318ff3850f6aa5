"""Each request resolves exactly once and is counted once, as its caller saw
it: odd exceptions, odd timeouts, cancellation racing delivery, stuck models,
short-lived event loops and failed requests' inputs."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from conftest import make_server, sample

import ferrobatch as fb


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("__str__ failed too")


@pytest.fixture
def no_cycle_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_a_model_error_whose_str_raises_still_resolves_every_request() -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise Unprintable()

    async with make_server(model, max_batch_size=8, max_delay=0.01) as server:
        client = server.client()
        results = await asyncio.wait_for(
            asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(6)), return_exceptions=True),
            timeout=10,
        )
        stats = server.stats()
    assert all(isinstance(r, fb.ModelError) for r in results), results
    assert all(isinstance(r.__cause__, Unprintable) for r in results)
    assert "Unprintable" in str(results[0])
    assert stats["requests_failed"]["model_error"] == 6


async def test_rows_that_cannot_be_taken_from_the_outputs_are_a_model_error() -> None:
    class NoRows(torch.Tensor):
        def unbind(self, dim: int = 0) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
            raise RuntimeError("unbind failed")

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": (d["x"] * 2).as_subclass(NoRows)}

    async with make_server(model, max_batch_size=8, max_delay=0.01) as server:
        client = server.client()
        results = await asyncio.wait_for(
            asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(4)), return_exceptions=True),
            timeout=10,
        )
        stats = server.stats()
    assert all(isinstance(r, fb.ModelError) for r in results), results
    assert all(isinstance(r.__cause__, RuntimeError) for r in results)
    assert stats["requests_failed"]["model_error"] == 4
    assert stats["requests_succeeded"] == 0


@pytest.mark.parametrize("timeout", [math.inf, 1e19, 1e300, 1e9])
async def test_an_infinite_or_huge_timeout_means_no_deadline(timeout: float) -> None:
    async with make_server() as server:
        out = await server.client().infer({"x": sample(3)}, timeout=timeout)
        torch.testing.assert_close(out["y"], sample(6))
        assert server.stats()["requests_succeeded"] == 1


@pytest.mark.parametrize("timeout", [-1.0, math.nan, -math.inf])
async def test_a_negative_or_nan_timeout_is_invalid_input(timeout: float) -> None:
    async with make_server() as server:
        with pytest.raises(fb.InvalidInputError, match="timeout"):
            await server.client().infer({"x": sample(3)}, timeout=timeout)
        assert server.stats()["requests_failed"]["invalid_input"] == 1


async def test_a_max_delay_too_long_to_represent_waits_for_a_full_batch() -> None:
    server = make_server(max_batch_size=2, max_delay=1e30)
    async with server:
        client = server.client()
        outs = await asyncio.wait_for(
            asyncio.gather(client.infer({"x": sample(1)}), client.infer({"x": sample(2)})), timeout=10
        )
        assert server.stats()["batches"] == 1
    torch.testing.assert_close(outs[1]["y"], sample(4))


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_a_cancel_in_the_iteration_its_batch_is_delivered_counts_once(cancel_first: bool) -> None:
    """The loop drains a batch and cancels its callers in the same iteration
    (either order): each caller saw a cancellation, and stats say so."""
    entered, release = threading.Event(), threading.Event()

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        release.wait(10)
        return {"y": d["x"] * 2}

    async with make_server(model, max_batch_size=4, max_delay=0) as server:
        client = server.client()
        tasks = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(4)]
        while not entered.is_set():
            await asyncio.sleep(0.001)
        (mailbox,) = server._loops.mailboxes()
        # Deliver without ringing the loop's own reader, so that the drain
        # and the cancels below run in one callback, as in one iteration.
        asyncio.get_running_loop().remove_reader(mailbox.doorbell_fd)
        release.set()
        while server.stats()["batches"] < 1:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the worker has posted the batch
        if cancel_first:
            for t in tasks:
                t.cancel()
        mailbox.drain()
        if not cancel_first:
            for t in tasks:
                t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stats = server.stats()
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
    assert stats["requests_failed"]["cancelled"] == 4, stats
    assert stats["requests_succeeded"] == 0, stats


async def test_a_deadline_and_an_outer_cancel_together_count_once() -> None:
    release = threading.Event()

    def slow(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        release.wait(10)
        return {"y": d["x"] * 2}

    async with make_server(slow, max_batch_size=1, max_delay=0) as server:
        client = server.client()
        outcomes = []
        for i in range(20):
            try:
                await asyncio.wait_for(client.infer({"x": sample(i)}, timeout=0.01), 0.01)
                outcomes.append("succeeded")
            except fb.DeadlineExceededError:
                outcomes.append("deadline_exceeded")
            except (asyncio.CancelledError, TimeoutError):
                outcomes.append("cancelled")
        release.set()
        stats = server.stats()
    failed = {k: v for k, v in stats["requests_failed"].items() if v}
    assert sum(failed.values()) + stats["requests_succeeded"] == 20, stats
    assert failed.get("cancelled", 0) == outcomes.count("cancelled"), (outcomes, failed)
    assert failed.get("deadline_exceeded", 0) == outcomes.count("deadline_exceeded"), (outcomes, failed)


STUCK_MODEL_SCRIPT = textwrap.dedent(
    """
    import asyncio, threading, torch
    import ferrobatch as fb

    def stuck(d):
        threading.Event().wait()  # never returns

    async def main():
        spec = fb.TensorSpec("x", "float32", (4,))
        server = fb.Server(stuck, inputs=[spec], outputs=[fb.TensorSpec("y", "float32", (4,))])
        await server.start()
        client = server.client()
        calls = [asyncio.ensure_future(client.infer({"x": torch.zeros(4)})) for _ in range(3)]
        await asyncio.sleep(0.2)
        await server.stop(timeout=0.2)
        results = await asyncio.gather(*calls, return_exceptions=True)
        print(sorted(type(r).__name__ for r in results))

    asyncio.run(main())
    """
)


def test_stop_gives_up_on_a_model_call_that_never_returns_and_the_process_exits() -> None:
    done = subprocess.run([sys.executable, "-c", STUCK_MODEL_SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The one the model holds and the ones still queued: all told the server closed.
    assert done.stdout.strip() == str(["ServerClosedError"] * 3), done.stdout


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_short_lived_event_loops_leave_no_state_or_fds_behind() -> None:
    """``asyncio.run`` 1,000 times against one server: each closed loop's
    mailbox and doorbell go (before, each loop kept an eventfd, and 3,000
    loops failed with EMFILE under ``ulimit -n 256``), and memory stays flat."""
    server = make_server()
    counts = {"ok": 0}

    async def one(i: int) -> None:
        out = await server.client().infer({"x": sample(i)})
        assert out["y"][0] == 2 * i
        counts["ok"] += 1

    with server.run_in_background():
        for i in range(100):  # warm: allocator pools, caches
            asyncio.run(one(i))
        fds_before, rss_before = len(os.listdir("/proc/self/fd")), _rss_bytes()
        for i in range(1000):
            asyncio.run(one(i))
        fds_after, rss_after = len(os.listdir("/proc/self/fd")), _rss_bytes()
        live = len(server._loops.mailboxes())
        stats = server.stats()
    assert counts["ok"] == 1100
    assert stats["requests_succeeded"] == 1100, "counts of dropped loops are kept"
    assert live <= 3, f"{live} loop mailboxes kept for 1,100 closed loops"
    assert fds_after <= fds_before + 4, (fds_before, fds_after)
    assert rss_after - rss_before < 16 << 20, f"RSS grew {(rss_after - rss_before) >> 20} MiB over 1,000 loops"


@pytest.mark.parametrize("outcome", ["model_error", "deadline", "cancelled", "server_closed"])
async def test_a_failed_requests_inputs_are_freed_by_refcount(outcome: str, no_cycle_collector: None) -> None:
    release = threading.Event()

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if outcome == "model_error":
            raise RuntimeError("failed")
        release.wait(10)
        return {"y": d["x"] * 2}

    server = make_server(model, max_batch_size=1, max_delay=0)
    await server.start()
    try:
        client = server.client()
        blocker = asyncio.ensure_future(client.infer({"x": sample(0)}))  # holds the worker
        await asyncio.sleep(0.05)
        x = sample(1)
        alive = weakref.ref(x)
        task = asyncio.ensure_future(client.infer({"x": x}, timeout=0.05 if outcome == "deadline" else None))
        del x
        await asyncio.sleep(0.01)
        if outcome == "cancelled":
            task.cancel()
        elif outcome == "server_closed":
            await server.stop(timeout=0)  # the model still holds the blocker
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 - any failure will do
            error: BaseException | None = exc
        else:
            error = None
        assert error is not None, outcome
        del error, task
        assert alive() is None, f"{outcome}: the inputs outlived the request"
    finally:
        release.set()
        await server.stop()
        await asyncio.gather(blocker, return_exceptions=True)


def test_run_in_background_serves_threads_without_an_event_loop() -> None:
    server = make_server(max_delay=0.005)
    with server.run_in_background():
        assert server.ready
        client = server.client()
        outs: list[torch.Tensor] = []
        threads = [
            threading.Thread(target=lambda i=i: outs.append(client.infer_sync({"x": sample(i)})["y"])) for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(float(o[0]) for o in outs) == [2.0 * i for i in range(8)]
    assert not server.running
    with pytest.raises(fb.ServerClosedError):
        client.infer_sync({"x": sample(1)})
