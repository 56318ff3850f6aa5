"""The event-loop thread's cost of submitting one request, next to the asyncio floor's.

At high concurrency the event loop's thread is what limits throughput (see
``bench_e2e.py``'s loop-CPU column), and submitting is the largest part of what
ferrobatch does there per request. This times the submit step alone, in bursts
of 64 requests made back to back on the loop (then awaited, untimed):

- **ferrobatch**: what ``client.infer`` does before it awaits, the one call into
  Rust (find the loop's mailbox, check and queue the request, make its future);
- **asyncio floor**: what the e2e bench's floor does, ``loop.create_future()``
  and a list append (no checks, no queue, no thread);
- **naive batcher**: ``loop.create_future()`` and ``asyncio.Queue.put_nowait``.

    python benches/python/bench_submit.py            # about 20 s
    python benches/python/bench_submit.py --bursts 500

Prints the median and 10th percentile of nanoseconds per request over the
bursts, for each, and ferrobatch's ratio to the floor (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import ferrobatch as fb

BURST = 64


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


async def time_bursts(
    submit: Callable[[dict[str, torch.Tensor]], asyncio.Future[Any]],
    settle: Callable[[list[asyncio.Future[Any]]], Any],
    samples: list[dict[str, torch.Tensor]],
    bursts: int,
) -> list[float]:
    """ns per request of each burst of ``BURST`` submits; each burst is then awaited."""
    clock = time.perf_counter_ns
    per_request = []
    for _ in range(bursts):
        started = clock()
        futures = [submit(sample) for sample in samples]
        per_request.append((clock() - started) / BURST)
        await settle(futures)
    return per_request


async def main(bursts: int) -> None:
    torch.set_num_threads(1)
    loop = asyncio.get_running_loop()
    samples = [{"x": torch.randn(256)} for _ in range(BURST)]
    results: dict[str, list[float]] = {}

    server = fb.Server(
        lambda batch: {"y": batch["x"]},
        inputs=[fb.TensorSpec("x", "float32", (256,))],
        outputs=[fb.TensorSpec("y", "float32", (256,))],
        max_batch_size=BURST,
        max_delay=0.001,
    )

    async def gather(futures: list[asyncio.Future[Any]]) -> None:
        await asyncio.gather(*futures)

    async def resolve(futures: list[asyncio.Future[Any]]) -> None:
        for future in futures:
            future.set_result(None)
        floor_pending.clear()

    floor_pending: list[tuple[Any, asyncio.Future[Any]]] = []

    def floor_submit(sample: dict[str, torch.Tensor]) -> asyncio.Future[Any]:
        future = loop.create_future()
        floor_pending.append((sample, future))
        return future

    queue: asyncio.Queue[tuple[Any, asyncio.Future[Any]]] = asyncio.Queue()

    def naive_submit(sample: dict[str, torch.Tensor]) -> asyncio.Future[Any]:
        future = loop.create_future()
        queue.put_nowait((sample, future))
        return future

    async def drain_queue(futures: list[asyncio.Future[Any]]) -> None:
        while not queue.empty():
            queue.get_nowait()[1].set_result(None)

    async with server:
        submitter = server.client()._submitter

        def ferrobatch_submit(sample: dict[str, torch.Tensor]) -> asyncio.Future[Any]:
            return submitter.submit(sample, None, False)[0]

        systems: list[tuple[str, Any, Any]] = [
            ("ferrobatch", ferrobatch_submit, gather),
            ("asyncio floor", floor_submit, resolve),
            ("naive batcher", naive_submit, drain_queue),
        ]
        for _name, submit, settle in systems:  # warm up every path
            await time_bursts(submit, settle, samples, 50)
        gc.collect()
        gc.freeze()
        # Interleaved rounds, so that a noisy neighbour hits every system alike.
        rounds = 5
        for _ in range(rounds):
            for name, submit, settle in systems:
                results.setdefault(name, []).extend(await time_bursts(submit, settle, samples, bursts // rounds))
        gc.unfreeze()

    floor = statistics.median(results["asyncio floor"])
    print(f"submit cost on the event loop's thread, ns per request ({bursts} bursts of {BURST})")
    print(f"{'system':<16}{'median':>10}{'p10':>10}{'x floor':>10}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<16}{median:>10.0f}{percentile(values, 0.1):>10.0f}{median / floor:>10.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=2000, help="bursts of 64 per system")
    args = parser.parse_args()
    asyncio.run(main(args.bursts))
