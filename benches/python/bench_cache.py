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
cache's ratio to no cache for each pattern. Then *busy*: one instance kept
busy (a model sleeping ``--busy-ms`` per batch, ``--busy-callers`` callers
of distinct inputs) while a probe asks for one input again and again: its
round trip with the cache (a hit, answered as it comes while every instance
runs a batch that takes 10 ms or more) and without (it runs).

Results: ``benches/results/cache.jsonl`` (replaced by each run).

    python benches/python/bench_cache.py                 # about three minutes
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


async def run_busy(cached: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One instance kept busy by ``--busy-callers`` callers of distinct
    inputs (the model sleeps ``--busy-ms`` per batch); one probe caller asks
    for the same input again and again (at random, 10 ms apart on average):
    its round trips."""
    spec_x, spec_y = fb.TensorSpec("x", "float32", (16,)), fb.TensorSpec("y", "float32", (16,))

    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(args.busy_ms / 1000)
        return {"y": inputs["x"] * 2}

    cache = (1 << 20) if cached else None
    server = fb.Server(
        slow, inputs=[spec_x], outputs=[spec_y], max_batch_size=64, max_delay=0.001, response_cache=cache
    )
    probe_times: list[float] = []
    loads = 0
    async with server:
        client = server.client()
        probe = {"x": torch.ones(16)}
        await client.infer(probe)  # kept, with a cache
        deadline = time.perf_counter() + args.seconds

        async def load(seed: int) -> None:
            nonlocal loads
            x, n = torch.zeros(16), 0
            while time.perf_counter() < deadline:
                n += 1
                x[0], x[1] = n, seed + 2
                await client.infer({"x": x})
                loads += 1

        async def ask() -> None:
            gaps = random.Random(0)
            while time.perf_counter() < deadline:
                await asyncio.sleep(gaps.expovariate(1 / 0.01))  # arrivals at random, 10 ms apart on average
                started = time.perf_counter()
                await client.infer(probe)
                probe_times.append(time.perf_counter() - started)

        await asyncio.gather(ask(), *(load(i) for i in range(args.busy_callers)))
    probe_times.sort()
    return {
        "cache": cached,
        "probe_p50_ms": 1000 * probe_times[len(probe_times) // 2],
        "probe_p99_ms": 1000 * probe_times[min(len(probe_times) - 1, int(len(probe_times) * 0.99))],
        "probes": len(probe_times),
        "load_req_s": loads / args.seconds,
    }


def busy_scenario(args: argparse.Namespace) -> list[dict[str, Any]]:
    """A repeated request's round trip while the instance is busy, with and
    without the cache, interleaved over ``--runs``: a row each (medians)."""
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(args.runs):
        for cached in (False, True):
            runs[cached].append(asyncio.run(run_busy(cached, args)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"\nbusy instance: the model sleeps {args.busy_ms} ms per batch, {args.busy_callers} callers of distinct "
        f"inputs, one probe repeating one input (10 ms apart on average); {args.seconds} s each, medians of {args.runs}"
    )
    print(f"{'cache':<7}{'probe p50 ms':>14}{'probe p99 ms':>14}{'probes':>8}{'load req/s':>12}")
    results = []
    for cached, rows in runs.items():
        summary: dict[str, Any] = {"model": "busy", "busy_ms": args.busy_ms, "cache": cached, "commit": commit}
        for key in ("probe_p50_ms", "probe_p99_ms", "probes", "load_req_s"):
            summary[key] = statistics.median(r[key] for r in rows)
        summary["runs"] = rows
        results.append(summary)
        print(
            f"{'yes' if cached else 'no':<7}{summary['probe_p50_ms']:>14.2f}{summary['probe_p99_ms']:>14.2f}"
            f"{summary['probes']:>8.0f}{summary['load_req_s']:>12.0f}"
        )
    ratio = results[0]["probe_p50_ms"] / results[1]["probe_p50_ms"]
    print(f"probe p50: no cache / cache = {ratio:.1f}x")
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
    parser.add_argument("--busy-ms", type=float, default=50.0, help="busy: the model's time per batch")
    parser.add_argument("--busy-callers", type=int, default=8, help="busy: callers keeping the instance busy")
    parser.add_argument("--models", default="mlp,add,busy", help="any of mlp, add, busy (default: all three)")
    args = parser.parse_args()
    results = []
    for model in (m.strip() for m in args.models.split(",")):
        results += busy_scenario(args) if model == "busy" else scenario(args, model)
    RESULTS.write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
