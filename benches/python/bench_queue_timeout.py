"""What a ``queue_timeout`` costs the batching worker, next to the same server without one.

With a queue timeout (Triton's ``default_queue_policy`` with ``REJECT``) the
worker gathering a batch must wake when the earliest gathered request's time
is up; it should not wake for every request that arrives meanwhile. This
serves the identity model (16 floats) in process to ``--callers`` asyncio
callers, with and without ``queue_timeout`` (long enough never to expire),
alternating the two in each of ``--runs`` runs, and prints for each the
median requests per second and the voluntary context switches of the whole
process per request (every thread's, from ``/proc/self/task/*/status``: a
worker that sleeps and wakes once per arriving request adds about one per
request), then their ratios:

    python benches/python/bench_queue_timeout.py             # about 20 s
    python benches/python/bench_queue_timeout.py --runs 5 --seconds 3

Linux only (``/proc``). It keeps no results file: the figures and their
commit are in benches/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import statistics
import time

import torch

import ferrobatch as fb

X = fb.TensorSpec("x", "float32", (16,))
Y = fb.TensorSpec("y", "float32", (16,))


def identity(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"]}


def voluntary_switches() -> int:
    """The voluntary context switches of every thread of this process so far."""
    total = 0
    for path in glob.glob("/proc/self/task/*/status"):
        try:
            with open(path) as status:
                total += sum(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
        except OSError:  # a thread that ended meanwhile
            pass
    return total


async def run(queue_timeout: float | None, args: argparse.Namespace) -> tuple[float, float]:
    """``(requests per second, voluntary switches per request)`` of one run."""
    server = fb.Server(
        identity, inputs=[X], outputs=[Y], max_batch_size=64, max_delay=args.max_delay, queue_timeout=queue_timeout
    )
    done = 0
    async with server:
        client = server.client()
        x = torch.ones(16)
        await client.infer({"x": x})  # started and warm
        deadline = time.perf_counter() + args.seconds

        async def caller() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await client.infer({"x": x})
                done += 1

        switches = voluntary_switches()
        began = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(args.callers)))
        took = time.perf_counter() - began
        switches = voluntary_switches() - switches
    return done / took, switches / max(done, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-delay", type=float, default=0.001)
    parser.add_argument("--queue-timeout", type=float, default=10.0, help="long enough that none expires")
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for _ in range(args.runs):
        runs["without"].append(asyncio.run(run(None, args)))
        runs["with"].append(asyncio.run(run(args.queue_timeout, args)))
    print(
        f"identity, in process, {args.callers} asyncio callers, max_batch_size=64, max_delay={args.max_delay}s, "
        f"{args.seconds} s runs, medians of {args.runs} (alternating)"
    )
    print(f"{'queue_timeout':<15}{'req/s':>10}{'switches/request':>18}")
    medians = {}
    for label, rows in runs.items():
        rate = statistics.median(r for r, _ in rows)
        switches = statistics.median(s for _, s in rows)
        medians[label] = (rate, switches)
        print(f"{label:<15}{rate:>10.0f}{switches:>18.3f}")
    (rate_without, sw_without), (rate_with, sw_with) = medians["without"], medians["with"]
    print(f"with / without: req/s {rate_with / rate_without:.3f}x, switches/request {sw_with / sw_without:.2f}x")


if __name__ == "__main__":
    main()
