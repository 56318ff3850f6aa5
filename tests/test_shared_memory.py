"""Shared-memory clients: `server.share(name)` and `fb.connect(name)`, in this
process and in others (spawned, forked, killed)."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import struct
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

import ferrobatch as fb

WIDTH = 8
INPUTS = [fb.TensorSpec("x", "float32", (WIDTH,))]
OUTPUTS = [fb.TensorSpec("y", "float32", (WIDTH,)), fb.TensorSpec("s", "float64", ())]


def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """y = 2x + 1 and s = sum(x): each row's outputs depend only on that row."""
    x = batch["x"]
    if bool((x[:, 0] < -1e6).any()):
        raise RuntimeError("a poisoned row")
    return {"y": x * 2 + 1, "s": x.sum(dim=1, dtype=torch.float64)}


def sample(i: int) -> torch.Tensor:
    return torch.arange(WIDTH, dtype=torch.float32) + i * 0.5


def check(i: int, out: dict[str, torch.Tensor]) -> None:
    x = sample(i)
    assert torch.equal(out["y"], x * 2 + 1), (i, out)
    assert out["s"].item() == pytest.approx(float(x.double().sum())), (i, out)


def unique(test: str) -> str:
    return f"fbtest-{test}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def segment(name: str) -> str:
    return f"/dev/shm/ferrobatch.{name}"


@pytest.fixture
async def shared() -> AsyncIterator[tuple[fb.Server, fb.Shared]]:
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=32, max_delay=0.001)
    async with server:
        yield server, server.share(unique("fixture"))


# -- the API, in one process -------------------------------------------------------


async def test_a_connected_client_gets_each_callers_own_rows(shared: tuple[fb.Server, fb.Shared]) -> None:
    server, share = shared
    with fb.connect(share.name) as client:
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(500)))
        for i, out in enumerate(outs):
            check(i, out)
        batch = await client.infer_batch({"x": torch.stack([sample(i) for i in range(5)])})
        assert batch["y"].shape == (5, WIDTH)
        for i in range(5):
            check(i, {"y": batch["y"][i], "s": batch["s"][i]})
        # Threads: infer_sync queues from the thread and waits without the GIL.
        results: dict[int, dict[str, torch.Tensor]] = {}

        def call(i: int) -> None:
            results[i] = client.infer_sync({"x": sample(i).numpy()})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        await asyncio.to_thread(lambda: [(t.start(), t.join()) for t in threads])
        for i in range(8):
            check(i, results[i])
        assert share.clients() == [(0, os.getpid())]
    stats = server.stats()
    assert stats["requests_succeeded"] == 500 + 1 + 8
    assert stats["mean_batch_size"] > 1, "shared requests are batched together"


async def test_errors_reach_the_client_as_in_process(shared: tuple[fb.Server, fb.Shared]) -> None:
    server, share = shared
    with fb.connect(share.name) as client:
        with pytest.raises(fb.InvalidInputError, match="'x'"):
            await client.infer({"x": torch.zeros(WIDTH + 1)})
        with pytest.raises(fb.InvalidInputError, match="unexpected input"):
            await client.infer({"x": sample(0), "z": sample(0)})
        poisoned = sample(0)
        poisoned[0] = -1e7
        good = asyncio.ensure_future(client.infer({"x": sample(3)}))
        with pytest.raises(fb.ModelError, match="poisoned row"):
            await client.infer({"x": poisoned})
        check(3, await good)  # failure isolation: the batch's other request succeeded
        with pytest.raises(fb.InvalidInputError):
            await client.infer({"x": sample(0)}, timeout=-1)
    with pytest.raises(fb.ServerClosedError):
        await client.infer({"x": sample(0)})
    assert server.stats()["requests_failed"]["model_error"] == 1  # counted where it ran


async def test_refusals_a_client_makes_on_its_side_are_counted_by_the_server() -> None:
    gate = threading.Event()

    def held(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gate.wait(10)
        return model(batch)

    server = fb.Server(held, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=4)
    async with server:
        share = server.share(unique("refusals"), rows_per_client=2)
        with fb.connect(share.name) as client:
            refusals = [
                ({"x": torch.zeros(WIDTH + 1)}, {}),  # wrong shape
                ({"x": torch.zeros(WIDTH, dtype=torch.float64)}, {}),  # wrong dtype
                ({"x": sample(0)}, {"timeout": -1}),
                ({"x": sample(0)}, {"parameters": {"k": "v" * 400}}),  # more than the entry holds
            ]
            for inputs, options in refusals:
                with pytest.raises(fb.InvalidInputError):
                    await client.infer(inputs, **options)
            with pytest.raises(fb.InvalidInputError):  # from a thread
                await asyncio.to_thread(client.infer_sync, {"x": torch.zeros(WIDTH + 1)})
            with pytest.raises(fb.InvalidInputError):  # 3 rows, 2 cells
                await client.infer_batch({"x": torch.zeros(3, WIDTH)})
            held_calls = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(fb.QueueFullError):  # both cells in flight
                await client.infer({"x": sample(2)})
            gate.set()
            for i, call in enumerate(held_calls):
                check(i, await call)
        stats = server.stats()
    failed = stats["requests_failed"]
    assert (failed["invalid_input"], failed["queue_full"], stats["requests_succeeded"]) == (6, 1, 2), stats


async def test_deadline_cancellation_and_full_cells() -> None:
    gate = threading.Event()
    seen: list[float] = []

    def slow(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.extend(batch["x"][:, 0].tolist())
        gate.wait(10)
        return model(batch)

    server = fb.Server(slow, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=1, max_delay=0)
    async with server:
        share = server.share(unique("slow"), rows_per_client=4)
        with fb.connect(share.name) as client:
            first = asyncio.ensure_future(client.infer({"x": sample(0)}))
            while not seen:  # the worker holds the first request
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(client.infer({"x": sample(100)}))
            started = time.monotonic()
            with pytest.raises(fb.DeadlineExceededError):
                await client.infer({"x": sample(200)}, timeout=0.1)
            assert time.monotonic() - started < 5
            # The expired request's cell comes back once the server withdrew it.
            deadline = time.monotonic() + 10
            while client._live_core().cells_in_use != 2:
                assert time.monotonic() < deadline, "the expired request's cell never came back"
                await asyncio.sleep(0.01)
            more = [asyncio.ensure_future(client.infer({"x": sample(300 + i)})) for i in range(2)]
            await asyncio.sleep(0.05)
            # 4 cells, all in flight (first, queued and the two above): refused at once.
            with pytest.raises(fb.QueueFullError, match="rows_per_client=4"):
                await client.infer({"x": sample(400)})
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            # A cancel is a withdrawal sent to the server: only once it was
            # taken (the cell came back) is the request sure never to run.
            deadline = time.monotonic() + 10
            while client._live_core().cells_in_use != 3:
                assert time.monotonic() < deadline, "the cancelled request's cell never came back"
                await asyncio.sleep(0.01)
            gate.set()
            check(0, await first)
            for i, task in enumerate(more):
                check(300 + i, await task)
            assert sample(100)[0].item() not in seen, "a cancelled request ran"
            assert sample(200)[0].item() not in seen, "an expired request ran"
            deadline = time.monotonic() + 10
            while share.in_flight:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert client.pending == 0


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"a": [1]}'])
async def test_parameters_that_are_not_a_json_object_fail_their_request_alone(text: str) -> None:
    """What a client writes into its entry is hostile input: parameters the
    model's side could not read fail that request, and the worker serves on."""
    seen: list[Any] = []

    def with_requests(batch: dict[str, torch.Tensor], requests: list[Any]) -> dict[str, torch.Tensor]:
        seen.extend(r.parameters for r in requests)
        return model(batch)

    server = fb.Server(with_requests, inputs=INPUTS, outputs=OUTPUTS, with_requests=True, max_delay=0)
    async with server:
        share = server.share(unique("params"))
        with fb.connect(share.name) as client:
            # The private submit takes parameters as text, past the public encoder.
            with pytest.raises(fb.InvalidInputError, match=r"parameters must be a JSON object|parameter 'a'"):
                await asyncio.wait_for(client._infer({"x": sample(1)}, None, False, None, text), 10)
            check(2, await asyncio.wait_for(client.infer({"x": sample(2)}, parameters={"k": 1}), 10))
        in_process = server.client()
        with pytest.raises(fb.InvalidInputError):
            await asyncio.wait_for(in_process.infer({"x": sample(3)}, parameters=text), 10)  # type: ignore[arg-type]
        check(4, await asyncio.wait_for(in_process.infer({"x": sample(4)}), 10))
    assert seen == [{"k": 1}, {}]
    stats = server.stats()
    assert (stats["requests_succeeded"], stats["requests_failed"]["invalid_input"]) == (2, 2)


@pytest.mark.parametrize("give_up", ["timeout", "cancel"])
async def test_stats_count_what_shared_callers_saw_when_they_gave_up_during_their_batch(give_up: str) -> None:
    """A caller whose request a batch already holds gives up: in-process and
    shared callers alike are counted as they were answered."""

    def slow(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.3)
        return model(batch)

    async def one(client: Any, i: int, patience: float) -> str:
        try:
            if give_up == "timeout":
                check(i, await client.infer({"x": sample(i)}, timeout=patience))
            else:
                check(i, await asyncio.wait_for(client.infer({"x": sample(i)}), patience))
        except fb.DeadlineExceededError:
            return "deadline_exceeded"
        except (TimeoutError, asyncio.CancelledError):
            return "cancelled"
        return "succeeded"

    counted = {}
    for way in ("in_process", "shared"):
        server = fb.Server(slow, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=16, max_delay=0.01)
        async with server:
            share = server.share(unique("giveup"))
            client = fb.connect(share.name) if way == "shared" else server.client()
            seen = await asyncio.gather(*(one(client, i, 0.1 if i < 4 else 2.0) for i in range(8)))
            assert sorted(seen) == sorted(
                [("deadline_exceeded" if give_up == "timeout" else "cancelled")] * 4 + ["succeeded"] * 4
            )
            deadline = time.monotonic() + 10
            while share.in_flight or (way == "shared" and client.pending):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            if way == "shared":
                client.close()
        stats = server.stats()
        counted[way] = {
            "succeeded": stats["requests_succeeded"],
            **{k: v for k, v in stats["requests_failed"].items() if v},
        }
        assert counted[way] == {seen_as: seen.count(seen_as) for seen_as in set(seen)}, way
    assert counted["in_process"] == counted["shared"]


async def test_stop_fails_waiting_clients_and_removes_the_segment() -> None:
    gate = threading.Event()

    def stuck(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gate.wait(10)
        return model(batch)

    server = fb.Server(stuck, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=1, max_delay=0)
    await server.start()
    share = server.share(unique("stop"))
    assert os.path.exists(segment(share.name))
    client = fb.connect(share.name)
    calls = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(5)]
    await asyncio.sleep(0.2)
    await server.stop(timeout=0.2)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
    closed = [r for r in results if isinstance(r, fb.ServerClosedError)]
    assert len(closed) >= 4, results
    assert not os.path.exists(segment(share.name))
    with pytest.raises(fb.ServerClosedError):
        await client.infer({"x": sample(0)})
    with pytest.raises(fb.ServerClosedError):
        fb.connect(share.name, timeout=0.1)
    client.close()


async def test_segment_permissions_names_and_versions(caplog: pytest.LogCaptureFixture) -> None:
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS)
    async with server:
        name = unique("perm")
        share = server.share(name)
        assert os.stat(segment(name)).st_mode & 0o777 == 0o600
        with pytest.raises(ValueError, match="already shared as"):
            server.share(unique("perm"))
        other_server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS)
        async with other_server:
            with pytest.raises(ValueError, match="already shared by a running server"):
                other_server.share(name)
            other = other_server.share(unique("perm"), mode=0o640)
            assert os.stat(segment(other.name)).st_mode & 0o777 == 0o640
        # A segment of another layout version: refused, naming both versions.
        with open(segment(name), "r+b") as f:
            f.seek(8)
            (layout,) = struct.unpack("<I", f.read(4))
            f.seek(8)
            f.write(struct.pack("<I", layout + 1))
        with pytest.raises(fb.FerrobatchError, match="same ferrobatch version"):
            fb.connect(name)
        with pytest.raises(ValueError):
            server.share("../escape")
        assert share.name == name
    assert not os.path.exists(segment(name))


async def test_a_client_pickles_by_name_and_reconnects(shared: tuple[fb.Server, fb.Shared]) -> None:
    _, share = shared
    client = fb.connect(share.name)
    copy = pickle.loads(pickle.dumps(client))
    assert copy is not client
    check(7, await copy.infer({"x": sample(7)}))
    assert len(share.clients()) == 2
    copy.close()
    client.close()
    deadline = time.monotonic() + 5
    while share.clients():
        assert time.monotonic() < deadline, "closed clients' slots were never reclaimed"
        await asyncio.sleep(0.02)


# -- other processes ---------------------------------------------------------------


def _load(client: fb.SharedClient, seed: int, n: int, done: Any) -> None:
    """A worker process: n requests from 256 concurrent callers, plus some
    from threads, each result checked row by row."""

    async def run() -> int:
        sem = asyncio.Semaphore(256)

        async def one(i: int) -> None:
            async with sem:
                check(i, await client.infer({"x": sample(i)}))

        await asyncio.gather(*(one(seed + i) for i in range(n)))
        return n

    count = asyncio.run(run())
    for i in range(20):
        check(seed + i, client.infer_sync({"x": sample(seed + i)}))
    done.put((os.getpid(), count + 20))
    client.close()


@pytest.mark.parametrize("method", ["spawn", "fork"])
async def test_spawned_and_forked_workers_each_get_their_own_rows(method: str) -> None:
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=64, max_delay=0.001)
    async with server:
        share = server.share(unique(method))
        # Connected here, then pickled (spawn) or inherited (fork): either
        # way each worker ends up with a slot of its own.
        client = fb.connect(share.name)
        check(1, await client.infer({"x": sample(1)}))
        ctx = multiprocessing.get_context(method)
        done = ctx.Queue()
        workers = [ctx.Process(target=_load, args=(client, 10_000 * (w + 1), 2000, done)) for w in range(2)]
        for w in workers:
            w.start()
        results = await asyncio.to_thread(lambda: [done.get(timeout=240) for _ in workers])
        for w in workers:
            await asyncio.to_thread(w.join, 60)
            assert w.exitcode == 0
        assert sorted(n for _, n in results) == [2020, 2020]
        assert {pid for pid, _ in results} == {w.pid for w in workers}
        # The parent's client still works: the children never used its slot.
        check(2, await client.infer({"x": sample(2)}))
        client.close()
        deadline = time.monotonic() + 10
        while share.clients():
            assert time.monotonic() < deadline, share.clients()
            await asyncio.sleep(0.05)
        stats = server.stats()
        assert stats["requests_succeeded"] == 2 + 2 * 2020
        assert stats["mean_batch_size"] > 1


CLIENT_SCRIPT = """
import asyncio, sys, torch, ferrobatch as fb
client = fb.connect(sys.argv[1], timeout=60)
async def main():
    n = 0
    async def one(i):
        nonlocal n
        await client.infer({"x": torch.full((8,), float(i))})
        n += 1
        if n % 200 == 0:
            print(n, flush=True)
    i = 0
    while True:
        await asyncio.gather(*(one(i + k) for k in range(128)))
        i += 128
asyncio.run(main())
"""


async def test_a_killed_client_leaks_nothing_and_harms_no_one(processes: list[Any]) -> None:
    import signal
    import subprocess
    import sys

    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=64, max_delay=0.001)
    async with server:
        share = server.share(unique("killclient"))
        victim = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, share.name], stdout=subprocess.PIPE, text=True)
        processes.append(victim)
        assert victim.stdout is not None
        line = await asyncio.to_thread(victim.stdout.readline)  # mid-load: 200 answered, 128 in flight
        assert line.strip(), "the client process failed"
        with fb.connect(share.name) as survivor:
            load = asyncio.ensure_future(asyncio.gather(*(survivor.infer({"x": sample(i)}) for i in range(300))))
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.wait, 30)
            for i, out in enumerate(await asyncio.wait_for(load, 120)):
                check(i, out)
            # Its slot and every request it had queued are reclaimed.
            deadline = time.monotonic() + 20
            while any(pid == victim.pid for _, pid in share.clients()) or share.in_flight:
                assert time.monotonic() < deadline, (share.clients(), share.in_flight)
                await asyncio.sleep(0.05)
            assert share.reclaimed >= 1
            assert server.stats()["queue_depth"] == 0
            # The server serves on.
            check(5, await survivor.infer({"x": sample(5)}))


SERVER_SCRIPT = """
import asyncio, sys, time, torch, ferrobatch as fb
def slowish(batch):
    time.sleep(0.002)
    return {"y": batch["x"] * 2 + 1, "s": batch["x"].sum(dim=1, dtype=torch.float64)}
async def main():
    server = fb.Server(slowish, inputs=[fb.TensorSpec("x", "float32", (8,))],
                       outputs=[fb.TensorSpec("y", "float32", (8,)), fb.TensorSpec("s", "float64", ())],
                       max_batch_size=32)
    async with server:
        server.share(sys.argv[1])
        print("ready", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_killed_unreaped_server_fails_every_waiting_client_within_a_second(
    processes: list[Any],
) -> None:
    import signal
    import subprocess
    import sys

    name = unique("killserver")
    victim = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT, name], stdout=subprocess.PIPE, text=True)
    processes.append(victim)
    assert victim.stdout is not None
    assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "ready"
    client = fb.connect(name)
    check(3, await client.infer({"x": sample(3)}))
    failed_at: list[float] = []

    async def caller(i: int) -> None:
        while True:
            try:
                check(i, await client.infer({"x": sample(i)}))
            except fb.ServerClosedError:
                failed_at.append(time.monotonic())
                return

    def thread_caller() -> None:
        while True:
            try:
                client.infer_sync({"x": sample(1)})
            except fb.ServerClosedError:
                failed_at.append(time.monotonic())
                return

    threads = [threading.Thread(target=thread_caller) for _ in range(2)]
    for t in threads:
        t.start()
    callers = [asyncio.ensure_future(caller(i)) for i in range(64)]
    await asyncio.sleep(1.0)  # mid-load
    assert not failed_at
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    # Not reaped: the server stays a zombie, which `kill(pid, 0)` takes for alive.
    await asyncio.wait_for(asyncio.gather(*callers), 30)
    await asyncio.to_thread(lambda: [t.join(30) for t in threads])
    assert len(failed_at) == 64 + 2
    assert max(failed_at) - killed < 1.0, max(failed_at) - killed
    with open(f"/proc/{victim.pid}/stat") as stat:
        assert stat.read().rsplit(")", 1)[1].split()[0] == "Z", "the server was a zombie throughout"
    await asyncio.to_thread(victim.wait, 30)
    client.close()
    # The client that saw the server die removed what it left behind.
    assert not os.path.exists(segment(name))
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS)
    async with server:
        server.share(name)
        with fb.connect(name) as fresh:
            check(4, await fresh.infer({"x": sample(4)}))


STOPPING_SERVER_SCRIPT = """
import asyncio, signal, sys, time, torch, ferrobatch as fb
def slow(batch):
    time.sleep(30)
    return {"y": batch["x"] * 2 + 1, "s": batch["x"].sum(dim=1, dtype=torch.float64)}
async def main():
    server = fb.Server(slow, inputs=[fb.TensorSpec("x", "float32", (8,))],
                       outputs=[fb.TensorSpec("y", "float32", (8,)), fb.TensorSpec("s", "float64", ())],
                       max_batch_size=1)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with server:  # its exit stops gracefully: the 30 s batch runs on
        server.share(sys.argv[1])
        print("ready", flush=True)
        await stop.wait()
        print("stopping", flush=True)
asyncio.run(main())
"""


async def test_a_server_killed_while_it_stops_fails_its_waiting_clients(processes: list[Any]) -> None:
    """A graceful stop leaves the segment saying STOPPING while a batch
    runs; the server dying then must still be noticed, though it never
    writes STOPPED."""
    import signal
    import subprocess
    import sys

    name = unique("killstopping")
    victim = subprocess.Popen([sys.executable, "-c", STOPPING_SERVER_SCRIPT, name], stdout=subprocess.PIPE, text=True)
    processes.append(victim)
    assert victim.stdout is not None
    assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "ready"
    client = fb.connect(name)
    in_batch = asyncio.ensure_future(client.infer({"x": sample(1)}))
    await asyncio.sleep(0.5)
    queued = asyncio.ensure_future(client.infer({"x": sample(2)}))
    await asyncio.sleep(0.3)
    victim.send_signal(signal.SIGTERM)
    assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "stopping"
    await asyncio.sleep(0.3)  # the stop has begun: the segment says STOPPING
    os.kill(victim.pid, signal.SIGKILL)  # not reaped: a zombie, as before
    killed = time.monotonic()
    for call in (in_batch, queued):
        with pytest.raises(fb.ServerClosedError):
            await asyncio.wait_for(call, 10)
    assert time.monotonic() - killed < 2.0
    client.close()
    await asyncio.to_thread(victim.wait, 30)
    assert not os.path.exists(segment(name))


def varying(batch: dict[str, Any]) -> dict[str, Any]:
    """A PyTriton-shaped model: ``add`` = a + b for (-1,) rows (padded),
    ``tail`` = each jagged row reversed, ``echo`` = its text upper-cased
    (BYTES (-1,)); a row starting with -1 poisons its request alone."""
    a, b, lengths = batch["a"], batch["b"], batch["a_lengths"]
    if bool((a[:, 0] == -1).any()):
        raise RuntimeError("a poisoned row")
    offsets = batch["t_offsets"].tolist()
    tails = [batch["t"][x:y].flip(0) for x, y in itertools.pairwise(offsets)]
    # Each row's own elements: the input is padded to the batch's longest row,
    # so an echo of the padding would depend on which requests share a batch.
    echo = [[w.upper() for w in row[:n]] for row, n in zip(batch["s"], batch["s_lengths"].tolist(), strict=True)]
    longest = max((len(r) for r in echo), default=0)
    padded = np.full((len(echo), longest), b"", dtype=object)
    for i, row in enumerate(echo):
        padded[i, : len(row)] = row
    return {
        "add": a + b,
        "add_lengths": lengths,
        "tail": torch.cat(tails) if tails else batch["t"],
        "tail_offsets": batch["t_offsets"],
        "echo": padded,
        "echo_lengths": torch.tensor([len(r) for r in echo]),
        "total": (a + b).sum(1),
    }


VARYING_INPUTS = [
    fb.TensorSpec("a", "float32", (-1,), ragged="pad"),
    fb.TensorSpec("b", "float32", (-1,), ragged="pad"),
    fb.TensorSpec("t", "int64", (-1, 2), ragged="jagged"),
    fb.TensorSpec("s", "bytes", (-1,), ragged="pad"),
]
VARYING_OUTPUTS = [
    fb.TensorSpec("add", "float32", (-1,), ragged="pad"),
    fb.TensorSpec("tail", "int64", (-1, 2), ragged="jagged"),
    fb.TensorSpec("echo", "bytes", (-1,), ragged="pad"),
    fb.TensorSpec("total", "float32", ()),
]


def varying_request(n: int) -> dict[str, Any]:
    return {
        "a": torch.arange(n, dtype=torch.float32),
        "b": torch.full((n,), 0.5),
        "t": torch.arange(2 * (n % 3 + 1)).view(-1, 2),
        "s": np.array([b"w%d" % i for i in range(n % 4 + 1)], dtype=object),
    }


def _as_lists(out: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.tolist(), str(v.dtype), tuple(v.shape)) for k, v in out.items()}


async def _varying_calls(client: Any) -> list[Any]:
    """What one client gets for each kind of call (compared across clients)."""
    single = await asyncio.gather(*(client.infer(varying_request(n)) for n in range(1, 40)))
    rows = {
        "a": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
        "b": torch.ones(2, 3),
        "t": torch.arange(8).view(2, 2, 2),
        "s": np.array([[b"x", b"yy"], [b"zzz", b""]], dtype=object),
    }
    batched = await client.infer_batch(rows, priority=1, parameters={"k": "v"})
    with pytest.raises(fb.ModelError, match="poisoned"):
        await client.infer({**varying_request(3), "a": torch.tensor([-1.0, 0, 0])})
    return [_as_lists(o) for o in single] + [_as_lists(batched)]


def _varying_client(name: str, done: Any) -> None:
    async def main() -> list[Any]:
        with fb.connect(name) as client:
            got = await _varying_calls(client)
            big = {**varying_request(1), "a": torch.zeros(300), "b": torch.zeros(300)}
            got.append(_as_lists(await client.infer(big)))  # spans several cells
            return got

    done.put(asyncio.run(main()))


async def test_another_process_sends_bytes_and_variable_length_tensors() -> None:
    server = fb.Server(
        varying,
        inputs=VARYING_INPUTS,
        outputs=VARYING_OUTPUTS,
        max_batch_size=16,
        max_delay=0.002,
        isolate_failures=True,
    )
    async with server:
        share = server.share(unique("varying"), rows_per_client=64, cell_bytes=512)
        ctx = multiprocessing.get_context("spawn")
        done = ctx.Queue()
        worker = ctx.Process(target=_varying_client, args=(share.name, done))
        worker.start()
        got = await asyncio.to_thread(done.get, timeout=120)
        await asyncio.to_thread(worker.join, 60)
        assert worker.exitcode == 0
        expected = await _varying_calls(server.client())
        big = {**varying_request(1), "a": torch.zeros(300), "b": torch.zeros(300)}
        expected.append(_as_lists(await server.client().infer(big)))
    assert got == expected, "shared memory gives what server.client() gives"
    assert got[2]["echo"][0] == [b"W0", b"W1", b"W2", b"W3"] and got[2]["add"][0] == [0.5, 1.5, 2.5]
    assert got[-2]["add"][2] == (2, 3) and got[-2]["echo"][0] == [[b"X", b"YY"], [b"ZZZ", b""]]


async def test_a_varying_request_is_bounded_by_its_cells() -> None:
    server = fb.Server(
        lambda batch: {"y": np.array([[w * 3] for w in batch["s"][:, 0]], dtype=object)},
        inputs=[fb.TensorSpec("s", "bytes", (1,))],
        outputs=[fb.TensorSpec("y", "bytes", (1,))],
    )
    async with server:
        with pytest.raises(ValueError, match="multiple of 8"):
            server.share(unique("odd"), cell_bytes=12)
        share = server.share(unique("bounded"), rows_per_client=8, cell_bytes=64)
        with fb.connect(share.name) as client:
            out = await client.infer({"s": np.array([b"ab"], dtype=object)})
            assert out["y"].tolist() == [b"ababab"]
            # Its input takes 2 cells (128 bytes); its 184-byte output outgrows them.
            with pytest.raises(fb.ModelError, match="cell_bytes"):
                await client.infer({"s": np.array([b"x" * 60], dtype=object)})
            with pytest.raises(fb.InvalidInputError, match="at most 512 fit"):
                await client.infer({"s": np.array([b"x" * 600], dtype=object)})
            assert client._live_core().cells_in_use == 0
        assert server.stats()["requests_failed"]["model_error"] == 1


async def test_connect_trusts_only_this_users_segment_unless_told_whom(shared: tuple[fb.Server, fb.Shared]) -> None:
    import pwd

    _, share = shared
    me = os.getuid()
    with pytest.raises(fb.FerrobatchError, match=f"belongs to uid {me}, not to uid {me + 1}"):
        fb.connect(share.name, owner=me + 1)
    with pytest.raises(ValueError, match="no user named"):
        fb.connect(share.name, owner="no-such-user-here")
    for owner in (None, me, pwd.getpwuid(me).pw_name):
        with fb.connect(share.name, owner=owner) as client:
            check(2, await client.infer({"x": sample(2)}))
            # It pickles with whom it trusts.
            with pickle.loads(pickle.dumps(client)) as clone:
                assert clone._owner == owner


def optional_total(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    absent = [int("w" in r.absent) for r in requests for _ in range(r.rows)]
    return {"total": batch["x"].sum(1) + batch["w"].sum(1), "absent": torch.tensor(absent, dtype=torch.int64)}


def _leave_out(name: str, done: Any) -> None:
    """Another process: one request leaving the optional input out, one giving it."""
    with fb.connect(name) as client:
        left_out = client.infer_sync({"x": torch.ones(2)})
        given = client.infer_sync({"x": torch.ones(2), "w": torch.full((2,), 3.0)})
    done.put([float(left_out["total"]), int(left_out["absent"]), float(given["total"]), int(given["absent"])])


async def test_another_process_may_leave_an_optional_input_out() -> None:
    server = fb.Server(
        optional_total,
        inputs=[fb.TensorSpec("x", "float32", (2,)), fb.TensorSpec("w", "float32", (2,), optional=True)],
        outputs=[fb.TensorSpec("total", "float32", ()), fb.TensorSpec("absent", "int64", ())],
        with_requests=True,
        name="optional",
    )
    async with server:
        share = server.share(unique("optional"))
        ctx = multiprocessing.get_context("spawn")
        done = ctx.Queue()
        worker = ctx.Process(target=_leave_out, args=(share.name, done))
        worker.start()
        got = await asyncio.to_thread(done.get, timeout=120)
        await asyncio.to_thread(worker.join, 60)
        assert worker.exitcode == 0
    assert got == [2.0, 1, 8.0, 0], "zeros in its place, and the model told it was left out"
    assert server.stats()["requests_succeeded"] == 2


async def test_metadata_travels_with_the_share() -> None:
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS)
    async with server:
        with pytest.raises(ValueError, match="JSON-serializable"):
            server.share(unique("meta-bad"), metadata={"x": object()})
        share = server.share(unique("meta"), metadata={"owner": "team-a", "layers": [256, 256]})
        with fb.connect(share.name) as client:
            assert client.metadata == {"owner": "team-a", "layers": [256, 256]}


async def test_a_bytes_scalar_comes_back_as_server_client_gives_it() -> None:
    """A shape-() BYTES output is the ``bytes`` object itself, over shared
    memory as in process (``infer_batch``: an object array of them)."""
    server = fb.Server(
        lambda batch: {"y": np.array([w * 2 for w in batch["s"]], dtype=object)},
        inputs=[fb.TensorSpec("s", "bytes", ())],
        outputs=[fb.TensorSpec("y", "bytes", ())],
    )
    async with server:
        share = server.share(unique("scalar"), rows_per_client=8, cell_bytes=64)
        with fb.connect(share.name) as client:
            for caller in (server.client(), client):
                out = await caller.infer({"s": b"ab"})
                assert type(out["y"]) is bytes and out["y"] == b"abab"
                assert (await asyncio.to_thread(client.infer_sync, {"s": b"c"}))["y"] == b"cc"
                batch = await caller.infer_batch({"s": np.array([b"x", b"yz"], dtype=object)})
                assert batch["y"].tolist() == [b"xx", b"yzyz"]


KILLED_SERVER_SCRIPT = """
import asyncio, sys, torch, ferrobatch as fb
async def main():
    server = fb.Server(lambda b: {"y": b["x"]}, inputs=[fb.TensorSpec("x", "float32", (4,))],
                       outputs=[fb.TensorSpec("y", "float32", (4,))])
    async with server:
        server.share(sys.argv[1])
        print("shared", flush=True)
        await asyncio.sleep(60)
asyncio.run(main())
"""


async def test_a_segment_left_by_a_killed_server_goes_at_the_next_share(processes: list[Any]) -> None:
    """A server killed before its stop leaves its segment in /dev/shm (its
    memory with it); the next share of any name removes it, and leaves the
    segments of servers that run."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    killed_name = unique("killedserver")
    victim = subprocess.Popen(
        [sys.executable, "-c", KILLED_SERVER_SCRIPT, killed_name], stdout=subprocess.PIPE, text=True
    )
    processes.append(victim)
    assert victim.stdout is not None
    assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "shared"
    os.kill(victim.pid, signal.SIGKILL)
    await asyncio.to_thread(victim.wait, 30)
    left = Path(f"/dev/shm/ferrobatch.{killed_name}")
    assert left.exists(), "a killed server cannot remove its segment itself"
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS)
    async with server:
        first = server.share(unique("livingserver"))
        assert not left.exists(), "the next share removed it"
        assert Path(f"/dev/shm/ferrobatch.{first.name}").exists()
