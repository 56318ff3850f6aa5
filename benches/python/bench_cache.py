"""The response cache against no cache, in one run: what a hit saves and
what a miss costs.

``--callers`` closed-loop callers (asyncio tasks, each awaiting one request
at a time) call a model for ``--seconds``: an MLP (``--width`` wide, three
layers, a ``--cache-mib`` cache), then ``y = x + 1`` on ``--large-width``
floats (large results cheaply, a ``--large-cache-mib`` cache).
Two input patterns, each served with and without ``response_cache``:
*distinct* (every request's inputs differ: all misses, the cache's cost)
and *repeated* (each request picks one of ``--pool`` inputs: after the
first of each, hits). Reports req/s and p50/p99 latency, medians over
``--runs`` (the four configurations interleaved in each run), and the
cache's ratio to no cache for each pattern.

Results: ``benches/results/cache.jsonl`` (replaced by each run).

    python benches/python/bench_cache.py                 # about two minutes
    python benches/python/bench_cache.py --seconds 2 --runs 1 --models mlp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import ferrobatch as fb

RESULTS = Path(__file__).resolve().parent.parent / "results" / "cache.jsonl"


def add_one(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] + 1}


def make_mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    ).eval()  # fmt: skip


async def run_one(cached: bool, pattern: str, args: argparse.Namespace) -> dict[str, Any]:
    spec_x, spec_y = fb.TensorSpec("x", "float32", (args.width,)), fb.TensorSpec("y", "float32", (args.width,))
    server = fb.Server(
        make_mlp(args.width) if args.model == "mlp" else add_one,
        inputs=[spec_x],
        outputs=[spec_y],
        max_batch_size=64,
        max_delay=0.001,
        response_cache=(args.cache_mib << 20) if cached else None,
    )
    pool = [torch.randn(args.width) for _ in range(args.pool)]
    latencies: list[float] = []
    async with server:
        client = server.client()
        deadline = time.perf_counter() + args.seconds

        async def caller(seed: int) -> None:
            rng = random.Random(seed)
            x = torch.randn(args.width)
            n = 0
            while time.perf_counter() < deadline:
                if pattern == "repeated":
                    x = pool[rng.randrange(args.pool)]
                else:
                    n += 1
                    x[0], x[1] = n, seed  # never seen before (exact in float32 below 2**24)
                started = time.perf_counter()
                await client.infer({"x": x})
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(caller(i) for i in range(args.callers)))
        stats = server.stats()
    latencies.sort()
    return {
        "cache": cached,
        "pattern": pattern,
        "req_s": len(latencies) / args.seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "hit_share": stats["cache_hits"] / max(1, stats["cache_hits"] + stats["cache_misses"]) if cached else None,
    }


def scenario(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """The four configurations of one model, interleaved over ``--runs``:
    a summary row each (medians), printed."""
    args = argparse.Namespace(**vars(args))
    args.model = model
    if model == "add":
        args.width, args.cache_mib = args.large_width, args.large_cache_mib
    configs = [(cached, pattern) for pattern in ("distinct", "repeated") for cached in (False, True)]
    runs: dict[tuple[bool, str], list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(args.runs):
        for cached, pattern in configs:  # interleaved: each sees the same machine
            runs[(cached, pattern)].append(asyncio.run(run_one(cached, pattern, args)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    title = f"MLP {args.width}x3" if model == "mlp" else f"y = x + 1 ({args.width} floats)"
    print(
        f"\n{title}, cache {args.cache_mib} MiB, {args.callers} callers, {args.seconds} s each, pool {args.pool}, "
        f"torch threads {torch.get_num_threads()}, medians of {args.runs}"
    )
    print(f"{'inputs':<10}{'cache':<7}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'hits':>7}")
    results = []
    for (cached, pattern), rows in runs.items():
        summary: dict[str, Any] = {
            "model": model,
            "width": args.width,
            "cache_mib": args.cache_mib if cached else None,
            "pattern": pattern,
            "cache": cached,
            "commit": commit,
            "callers": args.callers,
        }
        for key in ("req_s", "p50_ms", "p99_ms"):
            summary[key] = statistics.median(r[key] for r in rows)
        summary["hit_share"] = statistics.median(r["hit_share"] for r in rows) if cached else None
        summary["runs"] = rows
        results.append(summary)
        hits = f"{summary['hit_share']:.0%}" if cached else "-"
        print(
            f"{pattern:<10}{'yes' if cached else 'no':<7}{summary['req_s']:>10.0f}"
            f"{summary['p50_ms']:>9.2f}{summary['p99_ms']:>9.2f}{hits:>7}"
        )
    by = {(r["cache"], r["pattern"]): r for r in results}
    for pattern in ("distinct", "repeated"):
        ratio = by[(True, pattern)]["req_s"] / by[(False, pattern)]["req_s"]
        print(f"{pattern}: cache / no cache = {ratio:.2f}x req/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=256, help="the MLP's width")
    parser.add_argument("--cache-mib", type=int, default=64, help="the MLP's cache")
    parser.add_argument("--large-width", type=int, default=4096, help="y = x + 1's floats per request")
    parser.add_argument("--large-cache-mib", type=int, default=256, help="y = x + 1's cache")
    parser.add_argument("--pool", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="mlp,add", help="mlp, add, or both (default)")
    args = parser.parse_args()
    results = [row for model in args.models.split(",") for row in scenario(args, model.strip())]
    RESULTS.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
