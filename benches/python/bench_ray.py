"""Ray Serve: batching inside the replica and before the hop, against Ray's own ceiling.

A local Ray cluster (127.0.0.1, 2 CPUs, no dashboard); one replica per
system, every replica and the callers on the same machine. C closed-loop
callers (asyncio tasks in this process, each awaiting one request at a time,
``{"x": float32[256]}``) run for ``--warmup`` seconds, then ``--seconds`` are
measured: req/s counts the requests completed in that window, p50 and p99 are
their latencies (submit to result, as the caller saw them). Systems, each its own Serve application:

- ``noop``: a deployment whose method returns its input, one handle call per
  sample: Ray's ceiling per handle call, whatever batches inside the replica;
- ``serve.batch``: Ray's ``@serve.batch`` (``max_batch_size=64``,
  ``batch_wait_timeout_s=0.001``), one handle call per sample, the model run
  on the stacked batch;
- ``ferrobatch``: ``ferrobatch.ray.deployment`` (``max_batch_size=64``,
  ``max_delay=0.001``), one handle call per sample (``handle.infer``);
- ``fb.client``: ``ferrobatch.ray.client`` on that same deployment: this
  process's requests batched locally (``max_batch_size=64``, 1 ms), one
  ``infer_batch`` handle call per batch.

Models: ``identity`` and ``mlp`` (Linear 256->256, ReLU, Linear 256->256,
eval), torch on one thread in every replica. C in 64 and 512. Ray's defaults
otherwise (its access log included); ``max_ongoing_requests=1024`` for all.
Each case runs ``--runs`` times, interleaved; the table shows medians (req/s,
p50, p99, the mean rows per model call, or per handle call for
``fb.client``, and the CPU time per request of the replica's process and of
this one, the callers' process, read from /proc over the measured window:
on a shared machine these move less than req/s does) and, per model and C,
the ratios the targets are about:
ferrobatch's per-sample calls against ``noop`` (target >= 0.9x) and
``fb.client`` against ``serve.batch`` (target >= 10x at 512 callers, with a
lower p99).

Results: ``benches/results/ray.jsonl`` (every run; replaced by each run).
``--report`` prints the tables from it.

    python benches/python/bench_ray.py                    # about 8 minutes on 2 cores
    python benches/python/bench_ray.py --runs 1 --seconds 2
    python benches/python/bench_ray.py --report
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray import cloudpickle, serve

import ferrobatch as fb
import ferrobatch.ray as fray

FEATURES = 256
MAX_BATCH_SIZE = 64
MAX_DELAY = 0.001
MAX_ONGOING = 1024
NO_CPU = {"num_cpus": 0}  # every replica and the callers share the 2 cores; Ray need not reserve them
SYSTEMS = ["noop", "serve.batch", "ferrobatch", "fb.client"]
RESULTS = Path(__file__).resolve().parent.parent / "results" / "ray.jsonl"

# The replicas cannot import this file: its functions and classes travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_model(name: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    if name == "identity":
        return lambda d: {"y": d["x"]}
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU(), torch.nn.Linear(FEATURES, FEATURES)
    ).eval()
    return lambda d: {"y": mlp(d["x"])}


def server_factory(model: str) -> Callable[[], fb.Server]:
    def make_server() -> fb.Server:
        torch.set_num_threads(1)
        return fb.Server(
            make_model(model),
            inputs=[fb.TensorSpec("x", "float32", (FEATURES,))],
            outputs=[fb.TensorSpec("y", "float32", (FEATURES,))],
            max_batch_size=MAX_BATCH_SIZE,
            max_delay=MAX_DELAY,
            name=model,
        )

    return make_server


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options=NO_CPU)
class Noop:
    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return inputs

    async def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid()}


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options=NO_CPU)
class ServeBatch:
    def __init__(self, model: str) -> None:
        torch.set_num_threads(1)
        self.model = make_model(model)

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=MAX_DELAY)
    async def infer(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        x = torch.from_numpy(np.stack([i["x"] for i in inputs]))
        with torch.inference_mode():
            y = self.model({"x": x})["y"].numpy()
        return [{"y": row} for row in y]  # numpy rows: each pickles only its own bytes

    async def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid()}


def deploy(model: str) -> dict[str, Any]:
    """The four systems for ``model``: name -> something with ``await infer(x)``."""
    noop = serve.run(Noop.bind(), name=f"noop-{model}", route_prefix=None)
    batch = serve.run(ServeBatch.bind(model), name=f"batch-{model}", route_prefix=None)
    app = fray.deployment(
        server_factory(model), name=f"fb-{model}", ray_actor_options=NO_CPU, max_ongoing_requests=MAX_ONGOING
    )
    ferro = serve.run(app, name=f"fb-{model}", route_prefix=None)
    client = fray.client(ferro, max_batch_size=MAX_BATCH_SIZE, max_delay=MAX_DELAY)
    client.start()
    pids = {name: h.describe.remote().result()["pid"] for name, h in (("noop", noop), ("serve.batch", batch))}
    pids["ferrobatch"] = pids["fb.client"] = ferro.describe.remote().result()["pid"]
    return {
        "noop": noop.infer,
        "serve.batch": batch.infer,
        "ferrobatch": ferro.infer,
        "fb.client": client,
        "_handle": ferro,
        "_pids": pids,
    }


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def measure(
    call: Callable[[dict[str, Any]], Awaitable[Any]], callers: int, warmup: float, seconds: float, replica: int
) -> dict[str, Any]:
    """Runs the callers; returns req/s, latencies and the CPU time per request of the
    replica's process and of this one (the callers and Ray's handle), in the window."""
    x = {"x": np.random.default_rng(0).standard_normal(FEATURES).astype(np.float32)}
    started = time.perf_counter()
    begin, end = started + warmup, started + warmup + seconds
    latencies: list[float] = []
    errors = 0
    cpu: list[tuple[float, float]] = []

    async def sample_cpu() -> None:
        for at in (begin, end):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            cpu.append((cpu_seconds(replica), time.process_time()))

    async def caller() -> None:
        nonlocal errors
        while True:
            t = time.perf_counter()
            if t >= end:
                return
            try:
                await call(x)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors += 1
                continue
            done = time.perf_counter()
            if begin <= done <= end:  # completions in the window: req/s by Little's law holds
                latencies.append(done - t)

    await asyncio.gather(sample_cpu(), *(caller() for _ in range(callers)))
    latencies.sort()
    n = len(latencies)
    (replica_0, driver_0), (replica_1, driver_1) = cpu
    return {
        "requests": n,
        "errors": errors,
        "rps": n / seconds,
        "replica_cpu_us": (replica_1 - replica_0) / n * 1e6 if n else None,
        "driver_cpu_us": (driver_1 - driver_0) / n * 1e6 if n else None,
        "p50_ms": latencies[n // 2] * 1e3 if n else None,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else None,
    }


async def run_case(systems: dict[str, Any], system: str, callers: int, warmup: float, seconds: float) -> dict[str, Any]:
    handle = systems["_handle"]
    target = systems[system]
    replica = systems["_pids"][system]
    if system == "fb.client":
        before = target.stats()
        result = await measure(target.infer, callers, warmup, seconds, replica)
        after = target.stats()
    else:
        before = await handle.stats.remote()

        async def call(x: dict[str, Any]) -> Any:
            return await target.remote(x)

        result = await measure(call, callers, warmup, seconds, replica)
        after = await handle.stats.remote()
    mean_batch = None
    if system in ("ferrobatch", "fb.client"):  # rows per model call in the replica; per handle call locally
        batches = after["batches"] - before["batches"]
        mean_batch = (after["rows"] - before["rows"]) / batches if batches else None
    return {**result, "mean_batch": mean_batch}


def report(rows: list[dict[str, Any]]) -> str:
    head = rows[0]
    out = [
        f"{head['date']}, {head['cpus']} CPUs, Ray {head['ray']}, ferrobatch {head['ferrobatch_commit']},"
        f" load {head['load1']:.2f} at start; {max(r['run'] for r in rows) + 1} runs, {head['seconds']} s"
        " measured per case; medians",
        "",
        "| model | callers | system | req/s | p50 ms | p99 ms | rows per call"
        " | replica CPU µs/req | caller CPU µs/req |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["callers"], r["system"]), []).append(r)

    def med(key: tuple[str, int, str], field: str) -> float | None:
        values = [r[field] for r in groups.get(key, []) if r[field] is not None]
        return statistics.median(values) if values else None

    def fmt(value: float | None, digits: int = 1) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    cases = sorted({(r["model"], r["callers"]) for r in rows}, key=lambda c: (c[0] != "identity", c[1]))
    for model, callers in cases:
        for system in SYSTEMS:
            key = (model, callers, system)
            if key not in groups:
                continue
            out.append(
                f"| {model} | {callers} | {system} | {fmt(med(key, 'rps'), 0)} | {fmt(med(key, 'p50_ms'))}"
                f" | {fmt(med(key, 'p99_ms'))} | {fmt(med(key, 'mean_batch'))}"
                f" | {fmt(med(key, 'replica_cpu_us'), 0)} | {fmt(med(key, 'driver_cpu_us'), 0)} |"
            )
    out += [
        "",
        "| model | callers | ferrobatch / noop (≥ 0.9) | replica CPU per request, ferrobatch / noop"
        " | fb.client / serve.batch (≥ 10 at 512) | p99 fb.client / serve.batch |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ratio(model: str, callers: int, a: str, b: str, field: str = "rps") -> str:
        x, y = med((model, callers, a), field), med((model, callers, b), field)
        return "—" if x is None or not y else f"{x / y:.2f} ×"

    for model, callers in cases:
        out.append(
            f"| {model} | {callers} | {ratio(model, callers, 'ferrobatch', 'noop')}"
            f" | {ratio(model, callers, 'ferrobatch', 'noop', 'replica_cpu_us')}"
            f" | {ratio(model, callers, 'fb.client', 'serve.batch')}"
            f" | {ratio(model, callers, 'fb.client', 'serve.batch', 'p99_ms')} |"
        )
    return "\n".join(out)


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "ferrobatch_commit": commit(),
        "command": "bench_ray.py " + " ".join(sys.argv[1:]),
        "load1": os.getloadavg()[0],
        "seconds": args.seconds,
    }
    rows: list[dict[str, Any]] = []
    for model in args.models:
        systems = await asyncio.to_thread(deploy, model)
        try:
            for run in range(args.runs):
                for callers in args.callers:
                    for system in args.systems:
                        result = await run_case(systems, system, callers, args.warmup, args.seconds)
                        row = {**meta, "run": run, "model": model, "callers": callers, "system": system, **result}
                        row["load1_case"] = os.getloadavg()[0]
                        rows.append(row)
                        print(
                            f"run {run} {model:8} C={callers:3} {system:11} {row['rps']:9.0f} req/s"
                            f"  p50 {row['p50_ms'] or 0:8.1f} ms  p99 {row['p99_ms'] or 0:8.1f} ms"
                            f"  rows/call {row['mean_batch'] or 0:5.1f}  CPU µs/req replica"
                            f" {row['replica_cpu_us'] or 0:6.0f} caller {row['driver_cpu_us'] or 0:6.0f}"
                            f"  errors {row['errors']}",
                            flush=True,
                        )
        finally:
            await systems["fb.client"].aclose()
            for name in (f"noop-{model}", f"batch-{model}", f"fb-{model}"):
                await asyncio.to_thread(serve.delete, name)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["identity", "mlp"], choices=["identity", "mlp"])
    p.add_argument("--callers", nargs="+", type=int, default=[64, 512])
    p.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--report", nargs="?", const=RESULTS, type=Path, metavar="RESULTS.jsonl")
    args = p.parse_args()
    if args.report is not None:
        print(report([json.loads(line) for line in args.report.read_text().splitlines()]))
        return
    torch.set_num_threads(1)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        address="local",
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy competing for the cores
        rows = asyncio.run(main_async(args))
    finally:
        serve.shutdown()
        ray.shutdown()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print(report(rows))


if __name__ == "__main__":
    main()
