"""Chaos: over 100,000 requests from three event loops on three threads, with
cancellations, deadlines, bad inputs, model exceptions (BaseExceptions and
exceptions that fail to format among them), overload and a stop under load.
Every request resolves exactly once, every result is the caller's own, and
``stats()`` counts exactly what the callers saw, outcome by outcome."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import pytest
import torch
from conftest import WIDTH, make_server

import ferrobatch as fb

LOOPS = 3
REQUESTS_PER_LOOP = 38_000  # stopped at 90 %: over 100,000 answered
CONCURRENCY = 192  # tasks per loop


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("cannot format")


POISON = -1.0  # a request whose rows hold it makes any call it is in raise


def chaotic_model(seed: int) -> object:
    """Fails by call count, not by chance alone: a slow machine makes few
    calls, and failure isolation retries an ``Exception`` in halves (its
    batch-mates then succeed), so only a poisoned request, which fails
    every call it is in, or a ``BaseException`` (never retried) surely
    reaches its callers as a ``ModelError``."""
    rng = random.Random(seed)
    calls = 0

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls % 50 == 10:
            raise KeyboardInterrupt
        if calls % 50 == 35:
            raise SystemExit(1)
        if bool((d["x"][:, 0] == POISON).any()):
            raise Unprintable
        roll = rng.random()
        if roll < 0.02:
            raise RuntimeError("model failed")  # its batch-mates are retried
        if roll < 0.03:
            time.sleep(0.003)  # a slow batch: queues fill, deadlines pass
        return {"y": d["x"] * 2}

    return model


async def caller_loop(client: fb.Client, seed: int, tally: Counter[str], stop_submitting: threading.Event) -> None:
    rng = random.Random(seed)
    left = REQUESTS_PER_LOOP

    async def one() -> None:
        nonlocal left
        while left > 0 and not stop_submitting.is_set():
            left -= 1
            value = rng.random()
            x = torch.full((WIDTH,), value)
            kind = rng.random()
            try:
                if kind < 0.01:  # bad input: the wrong shape
                    await client.infer({"x": torch.zeros(WIDTH + 1)})
                    tally["unexpected_success"] += 1
                    continue
                if kind < 0.02:  # poisoned: its own calls fail, its batch-mates' do not
                    await client.infer({"x": torch.full((WIDTH,), POISON)})
                    tally["unexpected_success"] += 1
                    continue
                if kind < 0.06:  # an outer timeout cancels the awaiting task
                    out = await asyncio.wait_for(client.infer({"x": x}), rng.uniform(0.0001, 0.003))
                elif kind < 0.11:  # its own deadline
                    out = await client.infer({"x": x}, timeout=rng.uniform(0.0001, 0.003))
                elif kind < 0.13:  # both at once
                    t = rng.uniform(0.0005, 0.002)
                    out = await asyncio.wait_for(client.infer({"x": x}, timeout=t), t)
                elif kind < 0.16:  # cancelled by someone else while it waits
                    task = asyncio.ensure_future(client.infer({"x": x}))
                    asyncio.get_running_loop().call_later(rng.uniform(0, 0.002), task.cancel)
                    out = await task
                else:
                    out = await client.infer({"x": x})
            except fb.InvalidInputError:
                tally["invalid_input"] += 1
            except fb.QueueFullError:
                tally["queue_full"] += 1
            except fb.DeadlineExceededError:
                tally["deadline_exceeded"] += 1
            except fb.ModelError:
                tally["model_error"] += 1
            except fb.ServerClosedError:
                tally["server_closed"] += 1
            except (asyncio.CancelledError, TimeoutError):
                tally["cancelled"] += 1
            else:
                if float(out["y"][0]) != 2 * float(x[0]):
                    tally["wrong_row"] += 1
                tally["succeeded"] += 1
            if kind > 0.99:
                await asyncio.sleep(0)

    await asyncio.gather(*(one() for _ in range(CONCURRENCY)))


@pytest.mark.parametrize("max_delay", [0.0005, 0.0], ids=["max_delay", "greedy"])
async def test_chaos_every_request_resolves_once_and_stats_match_the_callers(max_delay: float) -> None:
    # 576 callers in flight against a queue of 96: every slow batch overflows it.
    # Greedy: each loop holds its iteration's requests until its flush, and
    # the stop sends what the loops hold ahead of the workers' close.
    server = make_server(chaotic_model(7), max_batch_size=32, max_delay=max_delay, max_queue_size=96)
    await server.start()
    client = server.client()
    tallies = [Counter[str]() for _ in range(LOOPS)]
    stop_submitting = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            asyncio.run(caller_loop(client, 100 + i, tallies[i], stop_submitting))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(LOOPS)]
    for t in threads:
        t.start()
    # Stop under load once most requests are in: the rest run, fail or are refused.
    total = LOOPS * REQUESTS_PER_LOOP
    for _ in range(60_000):
        if sum(sum(t.values()) for t in tallies) >= 0.9 * total:
            break
        await asyncio.sleep(0.002)
    await server.stop(timeout=5)
    stop_submitting.set()
    for t in threads:
        await asyncio.to_thread(t.join, 120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a caller never got an answer"

    seen = sum(tallies, Counter[str]())
    assert seen["wrong_row"] == 0 and seen["unexpected_success"] == 0, seen
    stats = server.stats()
    counted = Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]})
    assert +counted == +seen, f"stats {dict(+counted)} != callers {dict(+seen)}"
    # The histogram counts a success when its batch answers it: a caller
    # that cancelled in the same loop iteration is counted cancelled above
    # and stays in the histogram.
    timed = sum(stats["request_durations_us"].values())
    assert counted["succeeded"] <= timed <= counted["succeeded"] + counted["cancelled"], (timed, counted)
    assert sum(seen.values()) >= 100_000, seen
    # Each kind of chaos happened.
    for outcome in (
        "succeeded",
        "invalid_input",
        "queue_full",
        "deadline_exceeded",
        "cancelled",
        "model_error",
        "server_closed",
    ):
        assert seen[outcome] > 0, (outcome, seen)
