"""Priority levels under overload, against one FIFO level, in one run.

A model that costs about ``--batch-ms`` per batch of up to 16 rows is offered
more work than it can do: ``--callers`` closed-loop callers (asyncio tasks, each
awaiting one request at a time), a tenth of them urgent (priority 1), the rest
at priority 2. The same load runs with ``priority_levels=2`` and with no levels
(FIFO). Reports per class: completed req/s and p50/p99 latency (medians over
``--runs``, runs interleaved), and the urgent class's p99 with levels against
FIFO's; the low class must still complete requests (``max_priority_wait``
bounds how long it is passed over).

Results: ``benches/results/priority.jsonl`` (replaced by each run).

    python benches/python/bench_priority.py                 # about a minute
    python benches/python/bench_priority.py --seconds 3 --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import ferrobatch as fb

RESULTS = Path(__file__).resolve().parent.parent / "results" / "priority.jsonl"
SPEC_X = fb.TensorSpec("x", "float32", (16,))
SPEC_Y = fb.TensorSpec("y", "float32", (16,))


def make_model(batch_ms: float) -> Any:
    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(batch_ms / 1000)  # a fixed cost per batch, as a GPU kernel launch chain would
        return {"y": inputs["x"] + 1}

    return model


async def run_one(levels: int, callers: int, seconds: float, batch_ms: float, wait: float) -> dict[str, Any]:
    server = fb.Server(
        make_model(batch_ms),
        inputs=[SPEC_X],
        outputs=[SPEC_Y],
        max_batch_size=16,
        max_delay=0.0,
        max_queue_size=100_000,
        priority_levels=levels,
        max_priority_wait=wait if levels else None,
    )
    urgent_callers = max(1, callers // 10)
    latencies: dict[str, list[float]] = {"urgent": [], "low": []}
    x = torch.zeros(16)
    async with server:
        client = server.client()
        deadline = time.perf_counter() + seconds

        async def caller(kind: str) -> None:
            priority = 1 if kind == "urgent" else 2
            out = latencies[kind]
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await client.infer({"x": x}, priority=priority)
                out.append(time.perf_counter() - started)

        kinds = ["urgent"] * urgent_callers + ["low"] * (callers - urgent_callers)
        await asyncio.gather(*(caller(k) for k in kinds))
    row: dict[str, Any] = {"levels": levels, "callers": callers, "seconds": seconds}
    for kind, lat in latencies.items():
        lat.sort()
        row[kind] = {
            "req_s": len(lat) / seconds,
            "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        }
    return row


def median_of(rows: list[dict[str, Any]], kind: str, key: str) -> float | None:
    values = [r[kind][key] for r in rows if r[kind][key] is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch-ms", type=float, default=2.0)
    parser.add_argument("--max-priority-wait", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[int, list[dict[str, Any]]] = {0: [], 2: []}
    for _ in range(args.runs):
        for levels in runs:  # interleaved: both see the same machine
            runs[levels].append(
                asyncio.run(run_one(levels, args.callers, args.seconds, args.batch_ms, args.max_priority_wait))
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = []
    print(f"{args.callers} callers (10% urgent), {args.batch_ms} ms per batch of <= 16, medians of {args.runs}")
    print(f"{'system':<14}{'class':<8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for levels, rows in runs.items():
        name = "2 levels" if levels else "FIFO"
        summary: dict[str, Any] = {"system": name, "commit": commit, "callers": args.callers}
        for kind in ("urgent", "low"):
            cells = {key: median_of(rows, kind, key) for key in ("req_s", "p50_ms", "p99_ms")}
            summary[kind] = cells
            shown = [f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in cells.values()]
            print(f"{name:<14}{kind:<8}{''.join(shown)}")
        results.append(summary)
    fifo, prio = results
    if fifo["urgent"]["p99_ms"] and prio["urgent"]["p99_ms"]:
        ratio = prio["urgent"]["p99_ms"] / fifo["urgent"]["p99_ms"]
        print(
            f"urgent p99 with levels / FIFO: {ratio:.2f}x; low class still completes {prio['low']['req_s']:.0f} req/s"
        )
    RESULTS.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
