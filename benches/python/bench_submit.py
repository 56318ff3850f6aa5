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
    python benches/python/bench_submit.py --report   # the README's table, from submit.jsonl

Prints the median and 10th percentile of nanoseconds per request over the
bursts, for each, and ferrobatch's ratio to the floor (medians); writes them to
``benches/results/submit.jsonl``, replaced by each run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ferrobatch as fb

BURST = 64
ROOT = Path(__file__).resolve().parents[2]
#: The latest run's results: each run replaces them (older ones live in git history).
LATEST = ROOT / "benches" / "results" / "submit.jsonl"
#: The README's names for the systems.
MARKDOWN_LABELS = {
    "ferrobatch": "ferrobatch (`Submitter.submit`: checks, queue, future, ticket)",
    "asyncio floor": "asyncio floor",
    "naive batcher": "naive batcher",
}


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


async def measure(bursts: int) -> dict[str, list[float]]:
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
    return results


def ferrobatch_commit() -> str | None:
    """The git commit of the checkout the bench runs from, if any."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def markdown(path: Path) -> str:
    """The table of benches/README.md from a results file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    meta = rows[0]
    commit = f", ferrobatch {meta['ferrobatch_commit']}" if meta.get("ferrobatch_commit") else ""
    out = [
        f"<!-- python benches/python/bench_submit.py --report {path.name}: `{meta['command']}`,"
        f" {meta['date']}{commit}; {meta['cpus']} CPUs, Python {meta['python']}, torch {meta['torch']};"
        f" {meta['bursts']} bursts of {meta['burst']}, ns per request -->",
        "",
        "| system | median | p10 | × floor |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows[1:]:
        name = MARKDOWN_LABELS.get(r["system"], r["system"])
        out.append(f"| {name} | {r['median_ns']:.0f} | {r['p10_ns']:.0f} | {r['x_floor']:.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=2000, help="bursts of 64 per system")
    parser.add_argument(
        "--out", type=Path, default=LATEST, help="results file (default benches/results/submit.jsonl, replaced)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="?",
        const=LATEST,
        metavar="RESULTS.jsonl",
        help="run nothing: print the Markdown table of benches/README.md from a run's results"
        " (default benches/results/submit.jsonl)",
    )
    args = parser.parse_args()
    if args.report:
        print(markdown(args.report))
        return 0
    results = asyncio.run(measure(args.bursts))
    meta = {
        "kind": "meta",
        "command": " ".join(["python", "benches/python/bench_submit.py", *sys.argv[1:]]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "ferrobatch_commit": ferrobatch_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "bursts": args.bursts,
        "burst": BURST,
    }
    floor = statistics.median(results["asyncio floor"])
    rows = []
    print(f"submit cost on the event loop's thread, ns per request ({args.bursts} bursts of {BURST})")
    print(f"{'system':<16}{'median':>10}{'p10':>10}{'x floor':>10}")
    for name, values in results.items():
        median, p10 = statistics.median(values), percentile(values, 0.1)
        rows.append({"kind": "result", "system": name, "median_ns": median, "p10_ns": p10, "x_floor": median / floor})
        print(f"{name:<16}{median:>10.0f}{p10:>10.0f}{median / floor:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in (meta, *rows)))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
