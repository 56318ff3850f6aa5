"""Chaos across processes: shared-memory clients in processes of their own
(asyncio tasks and threads), killed with ``kill -9`` while their requests are
queued and inside the model, giving up by cancellation and deadlines, beside
model failures, a full queue and a stop under load; then the server's own
process killed and left unreaped. Every surviving caller gets exactly one
answer or a typed error within a bound, its rows are its own, ``stats()``
counts what the callers saw, and nothing is left in ``/dev/shm``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest
import torch

import ferrobatch as fb

WIDTH = 8
INPUTS = [fb.TensorSpec("x", "float32", (WIDTH,))]
OUTPUTS = [fb.TensorSpec("y", "float32", (WIDTH,))]
#: Every caller's bound: an answer or a typed error within it.
BOUND = 60.0

#: A client process: ``name seed requests give_up``. Prints "running" once it
#: has an answer, then (if it lives) its tally as JSON, with the time
#: (CLOCK_MONOTONIC, shared by every process) of its last ServerClosedError.
#: give_up=1 adds cancellations and deadlines to the mix. A caller stops at
#: its first ServerClosedError.
CLIENT = r"""
import asyncio, json, random, sys, threading, time, torch, ferrobatch as fb
name, seed, total, give_up = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
rng = random.Random(seed)
tally = {}
closed = threading.Event()
closed_at = [0.0]
def count(what):
    tally[what] = tally.get(what, 0) + 1
def outcome(call):
    try:
        out, x = call()
    except fb.ModelError: count("model_error")
    except fb.QueueFullError: count("queue_full")
    except fb.DeadlineExceededError: count("deadline_exceeded")
    except fb.ServerClosedError:
        count("server_closed")
        closed_at[0] = max(closed_at[0], time.monotonic())
        closed.set()
    else:
        count("succeeded" if torch.equal(out["y"], x * 2) else "wrong_row")
client = fb.connect(name)
def x_for(i):
    x = torch.full((8,), float(i % 1000))
    if rng.random() < 0.02:
        x[0] = -1e9  # a poisoned row: the model raises for its batch
    return x
async def main():
    left = total
    first = asyncio.Event()
    async def one():
        nonlocal left
        while left > 0 and not closed.is_set():
            left -= 1
            x = x_for(left)
            kind = rng.random() if give_up else 1.0
            try:
                if kind < 0.05:
                    out = await asyncio.wait_for(client.infer({"x": x}), rng.uniform(0.0001, 0.003))
                elif kind < 0.10:
                    out = await client.infer({"x": x}, timeout=rng.uniform(0.0001, 0.003))
                else:
                    out = await client.infer({"x": x})
            except fb.FerrobatchError as e:  # DeadlineExceededError is a TimeoutError too
                outcome(lambda: (_ for _ in ()).throw(e))
                continue
            except (asyncio.CancelledError, TimeoutError):
                count("cancelled")
                continue
            outcome(lambda: (out, x))
            if not first.is_set():
                first.set()
                print("running", flush=True)
    def thread():
        for i in range(total // 20):
            if closed.is_set():
                break
            x = x_for(i)
            outcome(lambda: (client.infer_sync({"x": x}), x))
    t = threading.Thread(target=thread)
    t.start()
    await asyncio.gather(*(one() for _ in range(48)))
    await asyncio.to_thread(t.join)
asyncio.run(main())
client.close()
print(json.dumps({"tally": tally, "closed_at": closed_at[0]}), flush=True)
"""

#: A server process holding a slow model: ``name``.
SERVER = r"""
import asyncio, sys, time, torch, ferrobatch as fb
def slow(batch):
    time.sleep(0.005)
    return {"y": batch["x"] * 2}
async def main():
    server = fb.Server(slow, inputs=[fb.TensorSpec("x", "float32", (8,))],
                       outputs=[fb.TensorSpec("y", "float32", (8,))], max_batch_size=16)
    async with server:
        server.share(sys.argv[1])
        print("ready", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""


def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = batch["x"]
    if bool((x[:, 0] < -1e6).any()):
        raise RuntimeError("a poisoned row")
    time.sleep(0.001)  # batches last: requests wait queued and inside the model
    return {"y": x * 2}


def unique(test: str) -> str:
    return f"fbchaos-{test}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def leftovers() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("ferrobatch.fbchaos-") and str(os.getpid()) in f]


def start(processes: list[subprocess.Popen[str]], script: str, *args: object) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    processes.append(p)
    return p


async def first_line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    return (await asyncio.wait_for(asyncio.to_thread(p.stdout.readline), BOUND)).strip()


async def report_of(p: subprocess.Popen[str]) -> tuple[Counter[str], float]:
    """A client process's tally, and when it last saw ServerClosedError."""
    out, err = await asyncio.wait_for(asyncio.to_thread(p.communicate), BOUND)
    assert p.returncode == 0, err[-2000:]
    report = json.loads(out.strip().splitlines()[-1])
    return Counter(report["tally"]), float(report["closed_at"])


async def tally_of(p: subprocess.Popen[str]) -> Counter[str]:
    return (await report_of(p))[0]


@pytest.mark.timeout(240)
async def test_clients_killed_and_giving_up_harm_no_other_client(processes: list[subprocess.Popen[str]]) -> None:
    server = fb.Server(model, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=32, max_delay=0.0005)
    async with server:
        share = server.share(unique("kill"))
        survivors = [start(processes, CLIENT, share.name, seed, 3000, 1) for seed in range(3)]
        victims = [start(processes, CLIENT, share.name, 100 + seed, 10**9, 1) for seed in range(2)]
        for p in victims:
            assert await first_line(p) == "running"
        await asyncio.sleep(0.3)  # the victims have requests queued and in the model
        for p in victims:
            os.kill(p.pid, signal.SIGKILL)
        tallies = [await tally_of(p) for p in survivors]
        seen = sum(tallies, Counter[str]())
        assert seen["wrong_row"] == 0, seen
        # Every request of every survivor resolved: 3000 tasks' and 150 threads' each.
        assert all(sum(t.values()) == 3000 + 150 for t in tallies), tallies
        assert seen["server_closed"] == 0, seen
        for outcome in ("succeeded", "model_error", "cancelled", "deadline_exceeded"):
            assert seen[outcome] > 0, (outcome, seen)
        # The victims' slots come back, and nothing they sent is left inside.
        deadline = time.monotonic() + 10
        while (share.reclaimed < 2 or share.in_flight) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert share.reclaimed >= 2 and share.in_flight == 0, (share.reclaimed, share.in_flight)
        # And the model still answers a new client at once.
        with fb.connect(share.name) as fresh:
            out = await asyncio.wait_for(fresh.infer({"x": torch.ones(WIDTH)}), 5)
            assert torch.equal(out["y"], torch.full((WIDTH,), 2.0))
    assert not leftovers()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("max_delay", [0.0005, 0.0], ids=["max_delay", "greedy"])
async def test_stats_equal_what_client_processes_saw(processes: list[subprocess.Popen[str]], max_delay: float) -> None:
    # No caller gives up here, so each request's outcome is decided by the
    # server alone (a caller that gives up races the answer across processes).
    # Greedy: the drainer holds each drain's requests until its end, and the
    # stop sends what it holds ahead of the workers' close.
    server = fb.Server(
        model, inputs=INPUTS, outputs=OUTPUTS, max_batch_size=32, max_delay=max_delay, max_queue_size=100
    )
    await server.start()
    share = server.share(unique("stats"))
    clients = [start(processes, CLIENT, share.name, seed, 50_000, 0) for seed in range(3)]
    for p in clients:
        assert await first_line(p) == "running"
    await asyncio.sleep(1.0)
    await server.stop(timeout=5)  # under load: the rest fail with ServerClosedError
    tallies = [await tally_of(p) for p in clients]
    seen = sum(tallies, Counter[str]())
    assert seen["wrong_row"] == 0, seen
    stats = server.stats()
    counted = Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]})
    # A request refused by its own process (the segment said the server
    # stopped) never reached the server: those are the callers' only extra.
    refused_at_home = seen["server_closed"] - counted["server_closed"]
    assert refused_at_home >= 0
    counted["server_closed"] += refused_at_home
    assert +counted == +seen, f"stats {dict(+counted)} != callers {dict(+seen)}"
    assert sum(stats["request_durations_us"].values()) == stats["requests_succeeded"]
    for outcome in ("succeeded", "model_error", "queue_full", "server_closed"):
        assert seen[outcome] > 0, (outcome, seen)
    assert not leftovers()


@pytest.mark.timeout(120)
async def test_a_killed_server_left_unreaped_fails_every_client_process_within_a_second(
    processes: list[subprocess.Popen[str]],
) -> None:
    name = unique("server")
    server = start(processes, SERVER, name)
    assert await first_line(server) == "ready"
    clients = [start(processes, CLIENT, name, seed, 10**9, 1) for seed in range(3)]
    for p in clients:
        assert await first_line(p) == "running"
    await asyncio.sleep(0.3)
    os.kill(server.pid, signal.SIGKILL)  # and not reaped: a zombie until the end
    killed = time.monotonic()
    reports = [await report_of(p) for p in clients]
    # Each process ended: every waiting task and thread got ServerClosedError,
    # the last of them within a second of the kill.
    for tally, closed_at in reports:
        assert tally["server_closed"] > 0 and tally["wrong_row"] == 0, tally
        assert closed_at - killed < 1.0, closed_at - killed
    with open(f"/proc/{server.pid}/stat") as stat:
        assert stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    assert not os.path.exists(f"/dev/shm/ferrobatch.{name}"), "the clients removed the dead server's segment"
