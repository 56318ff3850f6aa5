"""``max_delay="auto"`` against fixed windows (0, 1 ms, 5 ms), in one run.

C closed-loop callers (asyncio tasks, each awaiting one request at a time) run
through ferrobatch until N requests are done, for each window and C in
1, 8, 64, 512, identity and MLP (Linear 256->256, ReLU, Linear 256->256),
``max_batch_size=64``, torch on one thread. Reports req/s, p50/p99 latency and
mean batch size per configuration (medians over ``--runs``, runs interleaved),
and, per load, auto's throughput against the best fixed window's and its p99
against the best fixed p99: the targets are >= 0.9x and <= 1.2x.

Results: ``benches/results/auto_delay.jsonl`` (replaced by each run);
``--report`` prints the tables from it.

    python benches/python/bench_auto_delay.py               # a few minutes
    python benches/python/bench_auto_delay.py --requests 5000 --runs 1
    python benches/python/bench_auto_delay.py --report
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

FEATURES = 256
MAX_BATCH_SIZE = 64
WINDOWS: list[float | str] = ["auto", 0.0, 0.001, 0.005]
RESULTS = Path(__file__).resolve().parent.parent / "results" / "auto_delay.jsonl"


def make_model(name: str) -> Any:
    if name == "identity":
        return lambda d: {"y": d["x"]}
    mlp = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU(), torch.nn.Linear(FEATURES, FEATURES)
    ).eval()
    return lambda d: {"y": mlp(d["x"])}


async def run_one(model: str, window: float | str, callers: int, requests: int) -> dict[str, Any]:
    spec = [fb.TensorSpec("x", "float32", (FEATURES,))]
    server = fb.Server(
        make_model(model),
        inputs=spec,
        outputs=[fb.TensorSpec("y", "float32", (FEATURES,))],
        max_batch_size=MAX_BATCH_SIZE,
        max_delay=window,
    )
    latencies: list[float] = []
    left = requests
    async with server:
        client = server.client()
        x = torch.randn(FEATURES)

        async def caller() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t = time.perf_counter()
                await client.infer({"x": x})
                latencies.append(time.perf_counter() - t)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = time.perf_counter() - started
        stats = server.stats()
    latencies.sort()
    return {
        "model": model,
        "window": window,
        "callers": callers,
        "rps": len(latencies) / elapsed,
        "p50_us": latencies[len(latencies) // 2] * 1e6,
        "p99_us": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6,
        "batch": stats["mean_batch_size"],
    }


def report(rows: list[dict[str, Any]]) -> str:
    medians: dict[tuple[str, str, int], dict[str, float]] = {}
    keys = sorted({(r["model"], str(r["window"]), r["callers"]) for r in rows if "model" in r})
    for key in keys:
        runs = [r for r in rows if "model" in r and (r["model"], str(r["window"]), r["callers"]) == key]
        medians[key] = {m: statistics.median(r[m] for r in runs) for m in ("rps", "p50_us", "p99_us", "batch")}
    meta = next((r for r in rows if "commit" in r), {})
    out = [f"commit {meta.get('commit', '?')}, {meta.get('runs', '?')} run(s), medians", ""]
    out += [
        "| model | C | window | req/s | p50 µs | p99 µs | batch |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for (model, window, callers), m in sorted(medians.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        out.append(
            f"| {model} | {callers} | {window} | {m['rps']:,.0f} | {m['p50_us']:,.0f} | {m['p99_us']:,.0f} "
            f"| {m['batch']:.1f} |"
        )
    out += ["", "| model | C | auto / best fixed req/s (>= 0.9) | auto p99 / best fixed p99 (<= 1.2) |"]
    out += ["| --- | ---: | ---: | ---: |"]
    for model, callers in sorted({(k[0], k[2]) for k in medians}):
        fixed = [m for (mo, w, c), m in medians.items() if mo == model and c == callers and w != "auto"]
        auto = medians.get((model, "auto", callers))
        if not fixed or auto is None:
            continue
        best_rps = max(m["rps"] for m in fixed)
        best_p99 = min(m["p99_us"] for m in fixed)
        out.append(f"| {model} | {callers} | {auto['rps'] / best_rps:.2f} | {auto['p99_us'] / best_p99:.2f} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--callers", default="1,8,64,512")
    p.add_argument("--models", default="identity,mlp")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report", nargs="?", const=RESULTS, type=Path, metavar="RESULTS.jsonl")
    args = p.parse_args()
    if args.report is not None:
        print(report([json.loads(line) for line in args.report.read_text().splitlines()]))
        return
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows: list[dict[str, Any]] = [{"commit": commit, "runs": args.runs}]
    for run in range(args.runs):
        for model in args.models.split(","):
            for callers in map(int, args.callers.split(",")):
                for window in WINDOWS:
                    n = min(args.requests, 2000) if callers == 1 else args.requests
                    row = asyncio.run(run_one(model, window, callers, n))
                    row["run"] = run
                    rows.append(row)
                    print(
                        f"run {run} {model:8} C={callers:<4} {window!s:6} {row['rps']:>9,.0f} req/s "
                        f"p50 {row['p50_us']:>7,.0f} us p99 {row['p99_us']:>8,.0f} us batch {row['batch']:5.1f}",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(report(rows))
    print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
