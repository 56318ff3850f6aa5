"""Model instances as threads versus as processes (``Server(instance_kind=...)``),
in one run: how requests/s grows with instances when the model's work holds
the GIL, and when it does not.

Models (``x`` float32[64] in, ``y`` float32[1] out):

- ``python``: pure-Python work per row (a loop over the row's values, about
  40 µs a row), the kind of pre- and post-processing PyTriton users write
  around a model: it holds the GIL;
- ``mlp``: Linear 64→256, ReLU, Linear 256→1 in torch: torch releases the GIL.

For each model, kind (``thread``, ``process``) and number of instances (1 up to
the usable cores, or ``--instances``), one server with ``max_batch_size`` 64
and a 1 ms window is loaded by C callers (``--callers``, default 256) on the
benchmark's event loop, each awaiting one request at a time, for
``--seconds`` after a warm-up; the cases take turns over ``--runs`` runs and
the table shows the medians of requests/s, and each one's ratio to one
instance of the same kind. torch's intra-op threads: ferrobatch's default
budget. The callers share the cores with the instances, the same for every
case.

    python benches/python/bench_instances.py              # 3 runs of 5 s
    python benches/python/bench_instances.py --quick      # 1 run of 2 s

Output: the table on stdout, JSON lines in ``benches/results/instances.jsonl``
(replaced by each run).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
RESULTS = ROOT / "benches" / "results" / "instances.jsonl"
WIDTH = 64


def python_work(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pure-Python work per row: holds the GIL throughout."""
    out = []
    for row in inputs["x"].tolist():
        total = 0.0
        for _ in range(8):
            for v in row:
                total += math.sin(v) * 0.5
        out.append([total])
    return {"y": torch.tensor(out, dtype=torch.float32)}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(WIDTH, 256)
        self.b = torch.nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


async def measure(model: str, kind: str, instances: int, args: argparse.Namespace) -> dict[str, Any]:
    import ferrobatch as fb

    fn: Any = python_work if model == "python" else MLP().eval()
    server = fb.Server(
        [fn] * instances,
        inputs=[fb.TensorSpec("x", "float32", (WIDTH,))],
        outputs=[fb.TensorSpec("y", "float32", (1,))],
        max_batch_size=64,
        max_delay=0.001,
        instance_kind=kind,  # type: ignore[arg-type]
        name=f"{model}-{kind}-{instances}",
    )
    async with server:
        client = server.client()
        x = torch.randn(WIDTH)
        done = 0
        measuring = False
        stop_at = time.monotonic() + args.warmup + args.seconds

        async def caller() -> None:
            nonlocal done
            while time.monotonic() < stop_at:
                await client.infer({"x": x})
                done += measuring

        async def window() -> tuple[float, int, float]:
            nonlocal measuring
            await asyncio.sleep(args.warmup)
            measuring = True
            started, cpu0 = time.monotonic(), _cpu_seconds()
            await asyncio.sleep(args.seconds)
            measuring = False
            return time.monotonic() - started, done, _cpu_seconds() - cpu0

        results = await asyncio.gather(window(), *(caller() for _ in range(args.callers)))
        elapsed, n, cpu = results[0]
        stats = server.stats()
    return {
        "model": model,
        "kind": kind,
        "instances": instances,
        "rps": n / elapsed,
        "mean_batch": stats["mean_batch_size"],
        "cpu_us_per_request": cpu / n * 1e6 if n else float("nan"),
        "torch_threads": stats["torch_threads"],
    }


def _cpu_seconds() -> float:
    """CPU time of this process and its children (instance processes included), from /proc."""
    root = os.getpid()
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == root or int(fields[1]) == root:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="python,mlp")
    parser.add_argument("--instances", default=None, help="comma-separated (default: 1 up to the usable cores)")
    parser.add_argument("--callers", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds, args.warmup = 1, 2.0, 0.5
    cores = len(os.sched_getaffinity(0))
    counts = [int(n) for n in args.instances.split(",")] if args.instances else sorted({1, *range(2, cores + 1, 2)})
    cases = [(m, k, n) for m in args.models.split(",") for k in ("thread", "process") for n in counts]
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for model, kind, n in cases:
            row = asyncio.run(measure(model, kind, n, args))
            row["run"] = run
            rows.append(row)
            print(
                f"run {run} {model:6} {kind:7} x{n}: {row['rps']:9.0f} req/s, batch {row['mean_batch']:.1f},"
                f" {row['cpu_us_per_request']:.0f} us CPU/request",
                flush=True,
            )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w") as out:
        for row in rows:
            out.write(json.dumps({**row, "time": stamp, "usable_cores": cores}) + "\n")
    print(f"\nmedians of {args.runs} run(s), {args.callers} callers, {cores} usable cores (wrote {RESULTS}):")
    print("| model | kind | instances | req/s | × one instance | µs CPU per request |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for model, kind, n in cases:
        mine = [r for r in rows if (r["model"], r["kind"], r["instances"]) == (model, kind, n)]
        one = [r for r in rows if (r["model"], r["kind"], r["instances"]) == (model, kind, 1)]
        rps = statistics.median(r["rps"] for r in mine)
        base = statistics.median(r["rps"] for r in one) if one else float("nan")
        cpu = statistics.median(r["cpu_us_per_request"] for r in mine)
        print(f"| {model} | {kind} | {n} | {rps:,.0f} | {rps / base:.2f} | {cpu:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
