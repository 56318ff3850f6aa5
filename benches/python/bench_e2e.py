"""End-to-end: the same workload through several batching systems, in one run.

C concurrent callers (asyncio tasks; threads for TorchRL) each await one
request at a time until N requests are done; a request is ``{"x": float32[256]}``
and the model ``identity`` or ``mlp`` (Linear 256->256, ReLU, Linear 256->256);
``max_batch_size=64``; ``max_delay`` 1 ms or 0 (greedy). For every system and
configuration it reports requests/s, p50 and p99 latency (submit to result, as
the caller sees it), mean batch size, and whether every response equals the
model's output for that request.

Systems (see ``e2e_systems.py``): ferrobatch on the default event loop and on
uvloop (if installed); ``ferrobatch-all-threads`` (not run unless named):
ferrobatch with its worker at torch's own intra-op setting
(``torch_threads=torch.get_num_threads()``), as before its thread budget; the
asyncio floor (bare futures resolved 64 at a time: an upper bound); a naive
asyncio batcher; TorchRL's InferenceServer with its ThreadingTransport (if
``torchrl`` is installed); ``torchrl-compat``: the same TorchRL workload
(threads calling ``client(TensorDict)``, the same arguments) through
``ferrobatch.torchrl``. With ``torchrl-compat``, the weight-update latency
under load is measured too (64 threads; ``update_model`` every 20 ms; call to
the first result carrying the new version, in ms and batch times).

Every system runs with torch's intra-op threads set to 1 (``--torch-threads``):
on a small machine the event loop and the model thread each need a core.
``--torch-threads 0`` leaves torch's default (every core), as a user who never
set it runs: ferrobatch's workers then take its thread budget, the naive
batcher runs the model on the loop at torch's setting. The
timed section runs with the garbage collector as a service sees it (see
``quiet_gc``).

Output: ``benches/results/e2e.jsonl`` (JSON lines, replaced by each run) and a
PNG plot beside it, a table on stdout (medians over ``--runs``; ratios are
taken within each run, then the median), and the targets met or not.
``--report`` renders the tables of ``benches/README.md`` from the results file.

    python benches/python/bench_e2e.py                 # the full run (minutes)
    python benches/python/bench_e2e.py --quick         # a smoke run (seconds)
    python benches/python/bench_e2e.py --runs 3 --callers 1,512 --systems ferrobatch,floor,naive
    python benches/python/bench_e2e.py --report        # the README's tables, from e2e.jsonl
    python benches/python/bench_e2e.py ragged          # the variable-length workload (e2e_ragged.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_systems as systems

import ferrobatch as fb

uvloop: Any
try:
    import uvloop
except ImportError:  # optional: the `bench` extra
    uvloop = None

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: The latest run's results: each run replaces them (older ones live in git history).
LATEST = RESULTS / "e2e.jsonl"
ALL_SYSTEMS = (
    "ferrobatch",
    "ferrobatch-uvloop",
    "ferrobatch-all-threads",
    "floor",
    "naive",
    "torchrl",
    "torchrl-compat",
)
LABELS = {
    "ferrobatch": "ferrobatch",
    "ferrobatch-uvloop": "ferrobatch (uvloop)",
    "ferrobatch-all-threads": "ferrobatch (torch's threads)",
    "floor": "asyncio floor",
    "naive": "naive asyncio batcher",
    "torchrl": "torchrl InferenceServer",
    "torchrl-compat": "ferrobatch.torchrl",
}


@dataclass(frozen=True)
class Config:
    model: str
    max_delay: float
    callers: int
    requests: int


@dataclass
class Result:
    run: int
    system: str
    model: str
    max_delay: float | None  # None: the system has no delay setting (the floor)
    callers: int
    requests: int
    seconds: float
    requests_per_s: float
    p50_us: float
    p99_us: float
    mean_batch_size: float
    # CPU time per request: the whole process (every thread), and the event
    # loop thread alone (None for thread-based callers). Unlike wall time these
    # hold up when other processes compete for the CPUs.
    cpu_us: float
    loop_cpu_us: float | None
    correct: bool
    max_abs_error: float
    kind: str = field(default="result")


# -- driving one configuration --------------------------------------------------------


class Workload:
    """The inputs of one configuration and the model's output for each."""

    def __init__(self, model: systems.Model, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, systems.FEATURES, generator=gen)
        # One view per request, made before timing (indexing a tensor costs ~1 us).
        self.rows = list(self.x.unbind(0))
        self.expected = model({"x": self.x})["y"]

    def check(self, outputs: list[Any], exact: bool) -> tuple[bool, float]:
        """Every response against the model's output for its request. Exact for
        the identity; for other models within float32 rounding, because batch
        composition changes the order of the GEMM's sums."""
        got = torch.stack([o["y"] for o in outputs])
        err = float((got - self.expected).abs().max()) if got.numel() else 0.0
        if exact:
            return bool(torch.equal(got, self.expected)), err
        return bool(torch.allclose(got, self.expected, rtol=1e-4, atol=1e-5)), err


@dataclass(repr=False)  # its outputs are tens of thousands of tensors: never print them
class Drive:
    """What driving one workload measured."""

    seconds: float
    latency_ns: list[int]
    outputs: list[Any]
    cpu_s: float  # process CPU time, every thread
    loop_cpu_s: float | None  # CPU time of the event loop's thread


async def drive_async(call: systems.AsyncCall, rows: list[torch.Tensor], callers: int) -> Drive:
    """C tasks, each awaiting one request at a time, over ``rows`` (request i is
    made by task i % C)."""
    n = len(rows)
    latency = [0] * n
    outputs: list[Any] = [None] * n
    clock = time.perf_counter_ns

    async def caller(first: int) -> None:
        for i in range(first, n, callers):
            x = rows[i]
            t0 = clock()
            out = await call(x)
            latency[i] = clock() - t0
            outputs[i] = out

    cpu, loop_cpu, started = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(min(callers, n))))
    seconds = time.perf_counter() - started
    return Drive(seconds, latency, outputs, time.process_time() - cpu, time.thread_time() - loop_cpu)


def drive_threads(call: systems.SyncCall, rows: list[torch.Tensor], callers: int) -> Drive:
    """As ``drive_async``, with C threads released together by a barrier."""
    n = len(rows)
    latency = [0] * n
    outputs: list[Any] = [None] * n
    clock = time.perf_counter_ns
    count = min(callers, n)
    barrier = threading.Barrier(count + 1)

    def caller(first: int) -> None:
        barrier.wait()
        for i in range(first, n, callers):
            x = rows[i]
            t0 = clock()
            out = call(x)
            latency[i] = clock() - t0
            outputs[i] = out

    threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    cpu = time.process_time()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    return Drive(seconds, latency, outputs, time.process_time() - cpu, None)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """The garbage collector as a long-running service sees it.

    Objects alive now (the workload's tensors, earlier results) are frozen out
    of the collector's sight, and no full collection runs while the block
    does: the bench keeps every response for its check, and that growing heap
    would otherwise trigger full collections (pauses of many milliseconds)
    that a service, which drops its results, never pays. Young-generation
    collections run as usual, so garbage the system under test makes still
    costs what it costs."""
    gc.collect()
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(threshold[0], threshold[1], 1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def warmup_rows(work: Workload, callers: int) -> list[torch.Tensor]:
    """Enough requests to start threads and touch every code path at this C."""
    return work.rows[: min(len(work.rows), max(1_000, 4 * callers))]


def run_async_system(
    make: Callable[[], systems.AsyncSystem],
    work: Workload,
    callers: int,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None,
) -> tuple[Drive, float]:
    async def main() -> tuple[Drive, float]:
        system = make()
        await system.start()
        try:
            await drive_async(system.call, warmup_rows(work, callers), callers)
            system.reset_counters()
            with quiet_gc():
                drive = await drive_async(system.call, work.rows, callers)
            return drive, system.mean_batch_size()
        finally:
            await system.stop()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


def run_thread_system(system: systems.TorchRL, work: Workload, callers: int) -> tuple[Drive, float]:
    system.start()
    try:
        drive_threads(system.call, warmup_rows(work, callers), callers)
        system.reset_counters()
        with quiet_gc():
            drive = drive_threads(system.call, work.rows, callers)
        return drive, system.mean_batch_size()
    finally:
        system.stop()


def measure(system: str, cfg: Config, model: systems.Model, work: Workload, run: int) -> Result:
    if system in ("ferrobatch", "ferrobatch-uvloop", "ferrobatch-all-threads"):
        factory = uvloop.new_event_loop if system == "ferrobatch-uvloop" and uvloop else None
        # ferrobatch-all-threads: the worker at torch's own setting, as before the thread budget.
        threads = torch.get_num_threads() if system == "ferrobatch-all-threads" else None
        out = run_async_system(
            lambda: systems.Ferrobatch(model, cfg.max_delay, torch_threads=threads), work, cfg.callers, factory
        )
    elif system == "floor":
        out = run_async_system(
            lambda: systems.AsyncioFloor(model, identity=cfg.model == "identity"),
            work,
            cfg.callers,
            None,
        )
    elif system == "naive":
        out = run_async_system(lambda: systems.NaiveBatcher(model, cfg.max_delay), work, cfg.callers, None)
    elif system == "torchrl":
        out = run_thread_system(systems.TorchRL(model, cfg.max_delay), work, cfg.callers)
    elif system == "torchrl-compat":
        out = run_thread_system(systems.TorchRLCompat(model, cfg.max_delay), work, cfg.callers)
    else:
        raise ValueError(f"unknown system {system!r}")
    drive, batch = out
    n = len(work.rows)
    correct, err = work.check(drive.outputs, exact=cfg.model == "identity")
    p50, p99 = np.percentile(np.asarray(drive.latency_ns, dtype=np.float64), [50, 99]) / 1e3
    return Result(
        run=run,
        system=system,
        model=cfg.model,
        max_delay=None if system == "floor" else cfg.max_delay,
        callers=cfg.callers,
        requests=n,
        seconds=drive.seconds,
        requests_per_s=n / drive.seconds,
        p50_us=float(p50),
        p99_us=float(p99),
        mean_batch_size=batch,
        cpu_us=drive.cpu_s / n * 1e6,
        loop_cpu_us=None if drive.loop_cpu_s is None else drive.loop_cpu_s / n * 1e6,
        correct=correct,
        max_abs_error=err,
    )


# -- the plan ----------------------------------------------------------------------------


def plan(args: argparse.Namespace) -> Iterator[tuple[str, Config]]:
    """Every (system, configuration) of one run. The floor has no delay
    setting, so it runs once per model and C (with the first delay)."""
    for model in args.models:
        for delay in args.delays:
            for callers in args.callers:
                n = args.requests_c1 if callers == 1 else args.requests
                cfg = Config(model, delay, callers, n)
                for system in args.systems:
                    if system == "floor" and delay != args.delays[0]:
                        continue
                    yield system, cfg


# -- reporting ----------------------------------------------------------------------------


def key(r: dict[str, Any]) -> tuple[str, float | None, int, str]:
    return (r["model"], r["max_delay"], r["callers"], r["system"])


def median_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, delay, C, system): the median of each figure over runs."""
    groups: dict[tuple[str, float | None, int, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    rows = []
    for (model, delay, callers, system), rs in groups.items():
        rows.append(
            {
                "kind": "median",
                "model": model,
                "max_delay": delay,
                "callers": callers,
                "system": system,
                "runs": len(rs),
                "requests_per_s": statistics.median(r["requests_per_s"] for r in rs),
                "p50_us": statistics.median(r["p50_us"] for r in rs),
                "p99_us": statistics.median(r["p99_us"] for r in rs),
                "mean_batch_size": statistics.median(r["mean_batch_size"] for r in rs),
                "cpu_us": statistics.median(r["cpu_us"] for r in rs),
                "loop_cpu_us": (
                    None if rs[0]["loop_cpu_us"] is None else statistics.median(r["loop_cpu_us"] for r in rs)
                ),
                "correct": all(r["correct"] for r in rs),
            }
        )
    return rows


def find(
    results: list[dict[str, Any]], run: int, system: str, model: str, delay: float, callers: int
) -> dict[str, Any] | None:
    for r in results:
        if (
            r["run"] == run
            and r["system"] == system
            and r["model"] == model
            and r["callers"] == callers
            and (r["max_delay"] == delay or r["max_delay"] is None)
        ):
            return r
    return None


def ratio(
    results: list[dict[str, Any]], runs: int, a: str, b: str, model: str, delay: float, callers: int
) -> float | None:
    """Median over runs of (a's requests/s) / (b's requests/s) within the run."""
    found = []
    for run in range(runs):
        ra = find(results, run, a, model, delay, callers)
        rb = find(results, run, b, model, delay, callers)
        if ra and rb:
            found.append(ra["requests_per_s"] / rb["requests_per_s"])
    return statistics.median(found) if found else None


def fmt_delay(delay: float | None) -> str:
    if delay is None:
        return "-"
    return "greedy" if delay == 0 else f"{delay * 1e3:g} ms"


def print_table(medians: list[dict[str, Any]], order: list[str], delays: list[float]) -> None:
    header = (
        f"{'model':<9} {'max_delay':<9} {'C':>4}  {'system':<24} {'req/s':>9} "
        f"{'p50 us':>8} {'p99 us':>8} {'batch':>6} {'cpu us':>7} {'loop us':>7}  ok"
    )
    print(header)
    print("-" * len(header))
    rank = {s: i for i, s in enumerate(order)}

    def group(m: dict[str, Any]) -> tuple[str, int, int]:
        # The floor has no delay: it is listed with the first delay of the plan.
        delay = delays[0] if m["max_delay"] is None else m["max_delay"]
        return (m["model"], delays.index(delay), m["callers"])

    last = None
    for m in sorted(medians, key=lambda m: (group(m), rank[m["system"]])):
        if last is not None and group(m) != last:
            print()
        last = group(m)
        loop_cpu = "-" if m["loop_cpu_us"] is None else f"{m['loop_cpu_us']:.1f}"
        print(
            f"{m['model']:<9} {fmt_delay(m['max_delay']):<9} {m['callers']:>4}  "
            f"{LABELS[m['system']]:<24} {m['requests_per_s']:>9,.0f} {m['p50_us']:>8,.0f} "
            f"{m['p99_us']:>8,.0f} {m['mean_batch_size']:>6.1f} {m['cpu_us']:>7.1f} "
            f"{loop_cpu:>7}  {'yes' if m['correct'] else 'NO'}"
        )
    print(
        "\nreq/s: requests per second; p50/p99: latency from the call to its result;"
        " batch: mean rows per model call;\ncpu us: process CPU time per request (every"
        " thread); loop us: CPU time of the event-loop thread per request;\nok: every"
        " response equals the model's output for its request."
    )


def targets(results: list[dict[str, Any]], medians: list[dict[str, Any]], runs: int) -> list[dict[str, Any]]:
    """The targets of the end-to-end bench, each with its measured figure."""

    def med(system: str, model: str, delay: float, callers: int) -> dict[str, Any] | None:
        for m in medians:
            if (m["system"], m["model"], m["callers"]) == (system, model, callers) and m["max_delay"] == delay:
                return m
        return None

    checks: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float, at_least: bool, unit: str) -> None:
        met = None if value is None else (value >= goal if at_least else value <= goal)
        checks.append(
            {
                "kind": "target",
                "target": name,
                "value": value,
                "goal": goal,
                "at_least": at_least,
                "unit": unit,
                "met": met,
            }
        )

    add(
        "identity C=512 1ms: ferrobatch / asyncio floor",
        ratio(results, runs, "ferrobatch", "floor", "identity", 0.001, 512),
        0.6,
        True,
        "x",
    )
    add(
        "identity C=512 1ms: ferrobatch / naive batcher",
        ratio(results, runs, "ferrobatch", "naive", "identity", 0.001, 512),
        4.0,
        True,
        "x",
    )
    m = med("ferrobatch", "identity", 0.001, 512)
    add("identity C=512 1ms: ferrobatch p99", m["p99_us"] if m else None, 2000.0, False, "us")
    for delay in (0.001, 0.0):
        add(
            f"mlp C=512 {fmt_delay(delay)}: ferrobatch / naive batcher",
            ratio(results, runs, "ferrobatch", "naive", "mlp", delay, 512),
            2.0,
            True,
            "x",
        )
    for model in ("identity", "mlp"):
        m = med("ferrobatch", model, 0.0, 1)
        add(f"{model} C=1 greedy: ferrobatch p50", m["p50_us"] if m else None, 60.0, False, "us")
    for model in ("identity", "mlp"):
        for delay in (0.001, 0.0):
            add(
                f"{model} C=64 {fmt_delay(delay)}: ferrobatch.torchrl / TorchRL",
                ratio(results, runs, "torchrl-compat", "torchrl", model, delay, 64),
                5.0,
                True,
                "x",
            )
    return checks


def update_latency(system: str, model: systems.Model, work: Workload, callers: int, updates: int) -> dict[str, Any]:
    """Weight-update latency under load: ``callers`` threads call the policy
    non-stop while a trainer calls ``update_model`` every 20 ms; the latency
    of an update is from its call to the first result any caller gets that
    carries its version, also given in batch times (the run's wall time per
    batch)."""
    made = systems.TorchRLCompat(model, 0.0) if system == "torchrl-compat" else systems.TorchRL(model, 0.0)
    server = made.server
    server.start()
    client = server.client()
    td = made._tensordict
    rows = work.rows
    first_seen: dict[int, float] = {}
    called: dict[int, float] = {}
    stop = threading.Event()

    def caller(k: int) -> None:
        i = k
        while not stop.is_set():
            out = client(td({"x": rows[i % len(rows)]}))
            version = int(out["policy_version"])
            if version not in first_seen:
                first_seen.setdefault(version, time.perf_counter())
            i += callers

    def touch(m: Any) -> None:
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.0)

    threads = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(callers)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)  # warm up, then measure
        before = server.stats()
        started = time.perf_counter()
        for _ in range(updates):
            t0 = time.perf_counter()
            server.update_model(touch)
            called[int(server.policy_version)] = t0
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        after = server.stats()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        server.shutdown()
    batches = int(after["batches"]) - int(before["batches"])
    batch_ms = elapsed / batches * 1e3 if batches else float("nan")
    lat_ms = sorted((first_seen[v] - t0) * 1e3 for v, t0 in called.items() if v in first_seen)
    rows_done = int(after["requests"]) - int(before["requests"])
    return {
        "kind": "update_latency",
        "system": system,
        "callers": callers,
        "updates": len(lat_ms),
        "p50_ms": statistics.median(lat_ms) if lat_ms else None,
        "max_ms": lat_ms[-1] if lat_ms else None,
        "batch_ms": batch_ms,
        "p50_batches": statistics.median(lat_ms) / batch_ms if lat_ms else None,
        "mean_batch_size": rows_done / batches if batches else 0.0,
    }


def print_ratios(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    others = [s for s in ("floor", "naive", "torchrl", "torchrl-compat", "ferrobatch-uvloop") if s in args.systems]
    if "ferrobatch" not in args.systems or not others:
        return
    print("\nferrobatch throughput / other system's (median over runs of in-run ratios)")
    print(f"{'model':<9} {'max_delay':<9} {'C':>4}  " + " ".join(f"{LABELS[s]:>24}" for s in others))
    for model in args.models:
        for delay in args.delays:
            for callers in args.callers:
                cells = []
                for s in others:
                    r = ratio(results, args.runs, "ferrobatch", s, model, delay, callers)
                    cells.append(f"{'-' if r is None else f'{r:.2f}x':>24}")
                print(f"{model:<9} {fmt_delay(delay):<9} {callers:>4}  " + " ".join(cells))


def plot(medians: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    panels = [(m, d) for m in args.models for d in args.delays]
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for row, (model, delay) in enumerate(panels):
        ax_t, ax_p = axes[row]
        for system in args.systems:
            pts = sorted(
                (m["callers"], m["requests_per_s"], m["p99_us"])
                for m in medians
                if m["system"] == system and m["model"] == model and (m["max_delay"] == delay or m["max_delay"] is None)
            )
            if not pts:
                continue
            cs = [p[0] for p in pts]
            ax_t.plot(cs, [p[1] for p in pts], marker="o", label=LABELS[system])
            ax_p.plot(cs, [p[2] / 1e3 for p in pts], marker="o", label=LABELS[system])
        for ax, ylabel in ((ax_t, "requests/s"), (ax_p, "p99 latency (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.callers, [str(c) for c in args.callers])
            ax.set_yscale("log")
            ax.set_xlabel("concurrent callers")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}, max_delay {fmt_delay(delay)}")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"ferrobatch end to end ({os.cpu_count()} CPUs, median of {args.runs} run(s))")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# The README's names for the systems, in its column order.
MARKDOWN_LABELS = {
    "ferrobatch": "ferrobatch",
    "ferrobatch-uvloop": "ferrobatch (uvloop)",
    "ferrobatch-all-threads": "ferrobatch (torch's threads)",
    "floor": "asyncio floor",
    "naive": "naive batcher",
    "torchrl": "TorchRL",
    "torchrl-compat": "ferrobatch.torchrl",
}


def fmt_rate(per_s: float) -> str:
    return f"{per_s:,.0f}" if per_s < 1000 else f"{per_s / 1e3:.1f}k"


def fmt_latency(p50_us: float, p99_us: float) -> str:
    if p50_us < 1000:
        return f"{p50_us:.0f} / {p99_us:.0f} µs"
    return f"{p50_us / 1e3:.2f} / {p99_us / 1e3:.2f} ms"


def markdown(meta: dict[str, Any], results: list[dict[str, Any]], args: argparse.Namespace, path: Path) -> str:
    """The tables of benches/README.md: requests/s with p50 / p99 for every
    configuration, CPU time per request at the largest C, and the targets."""
    medians = median_table(results)
    cols = [s for s in ALL_SYSTEMS if s in args.systems]

    def cell(system: str, model: str, delay: float, callers: int) -> dict[str, Any] | None:
        for m in medians:
            if (m["system"], m["model"], m["callers"]) == (system, model, callers) and m["max_delay"] in (delay, None):
                return m
        return None

    def table(rows: list[tuple[str, float, int]], fmt: Callable[[dict[str, Any]], str], once: bool) -> list[str]:
        lines = [
            "| model | max_delay | C | " + " | ".join(MARKDOWN_LABELS[s] for s in cols) + " |",
            "| --- | --- | ---: | " + " | ".join("---:" for _ in cols) + " |",
        ]
        for model, delay, callers in rows:
            cells = []
            for s in cols:
                m = cell(s, model, delay, callers)
                if once and m is not None and m["max_delay"] is None and delay != args.delays[0]:
                    # No max_delay (the floor): its figures are in the first delay's rows.
                    cells.append("(as above)" if callers == args.callers[0] else "")
                else:
                    cells.append("—" if m is None else fmt(m))
            lines.append(f"| {model} | {fmt_delay(delay)} | {callers} | " + " | ".join(cells) + " |")
        return lines

    commit = f", ferrobatch {meta['ferrobatch_commit']}" if meta.get("ferrobatch_commit") else ""
    out = [
        f"<!-- python benches/python/bench_e2e.py --report {path.name}: `{meta['command']}`,"
        f" {meta['date']}{commit}; {meta['cpus']} CPUs, Python {meta['python']}, torch {meta['torch']}"
        f" ({meta['torch_threads']} thread(s)); medians of {args.runs} run(s) -->",
        "",
        "Requests/s · p50 / p99 latency:",
        "",
    ]
    every = [(m, d, c) for m in args.models for d in args.delays for c in args.callers]
    out += table(every, lambda m: f"{fmt_rate(m['requests_per_s'])} · {fmt_latency(m['p50_us'], m['p99_us'])}", True)

    def cpu(m: dict[str, Any]) -> str:
        loop = "—" if m["loop_cpu_us"] is None else f"{m['loop_cpu_us']:.1f}"
        return f"{m['cpu_us']:.1f} / {loop}"

    top = max(args.callers)
    out += [
        "",
        f"CPU time per request at C = {top}, process / event-loop thread (µs):",
        "",
    ]
    out += table([(m, d, top) for m in args.models for d in args.delays], cpu, False)
    out += [
        "",
        "Targets (ferrobatch on the default loop):",
        "",
        "| target | measured | goal | |",
        "| --- | ---: | ---: | --- |",
    ]
    for c in targets(results, medians, args.runs):
        bound = "≥" if c["at_least"] else "≤"
        if c["unit"] == "x":
            value = "—" if c["value"] is None else f"{c['value']:.2f} ×"
            goal = f"{bound} {c['goal']:g} ×"
        else:
            value = "—" if c["value"] is None else f"{c['value']:,.0f} µs"
            goal = f"{bound} {c['goal']:,.0f} µs"
        status = "n/a" if c["value"] is None else ("met" if c["met"] else "not met")
        out.append(f"| {c['target']} | {value} | {goal} | {status} |")
    return "\n".join(out)


# -- main ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
        return lambda text: [kind(v) for v in text.split(",") if v]

    p.add_argument("--quick", action="store_true", help="a smoke run: 5,000 requests (1,000 at C=1), one run")
    p.add_argument("--requests", type=int, default=50_000, help="requests per configuration")
    p.add_argument("--requests-c1", type=int, default=None, help="requests at C=1 (default: --requests / 10)")
    p.add_argument("--callers", type=csv(int), default=[1, 64, 512], help="e.g. 1,64,512")
    p.add_argument("--models", type=csv(str), default=["identity", "mlp"], help="identity,mlp")
    p.add_argument("--delays", type=csv(float), default=[0.001, 0.0], help="max_delay values in seconds, e.g. 0.001,0")
    p.add_argument(
        "--systems",
        type=csv(str),
        default=[s for s in ALL_SYSTEMS if s != "ferrobatch-all-threads"],
        help=f"any of {','.join(ALL_SYSTEMS)}",
    )
    p.add_argument(
        "--runs", type=int, default=1, help="repeat the whole plan; figures are medians, ratios taken within runs"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output prefix (default benches/results/e2e, replaced by each run)"
    )
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--report",
        type=Path,
        nargs="?",
        const=LATEST,
        default=None,
        metavar="RESULTS.jsonl",
        help="run nothing: print the Markdown tables of benches/README.md from a run's results"
        " (default benches/results/e2e.jsonl) and redraw its plot",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a small machine the event loop and"
        " the model thread each need a core, and intra-op threads that lose their"
        " core stall every model call; 0: torch's default)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.requests = 5_000
        args.requests_c1 = args.requests_c1 or 1_000
    if args.requests_c1 is None:
        args.requests_c1 = max(1, args.requests // 10)
    unknown = set(args.systems) - set(ALL_SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {','.join(ALL_SYSTEMS)}")
    skipped = []
    if args.report:
        return args  # the axes come from the results file
    if "ferrobatch-uvloop" in args.systems and uvloop is None:
        skipped.append("ferrobatch-uvloop (uvloop is not installed)")
    for name in ("torchrl", "torchrl-compat"):
        if name in args.systems and not systems.torchrl_available():
            skipped.append(f"{name} (torchrl is not installed: pip install torchrl)")
    for s in skipped:
        print(f"skipping {s}", file=sys.stderr)
        args.systems.remove(s.split()[0])
    for m in args.models:
        if m not in ("identity", "mlp"):
            p.error(f"unknown model {m!r}")
    return args


def ferrobatch_commit() -> str | None:
    """The git commit of the ferrobatch under test, if it runs from a checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(str(fb.__file__)).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_plan(args: argparse.Namespace, argv: list[str], jsonl: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs every (system, configuration) ``args.runs`` times, writing each
    result to ``jsonl`` as it comes."""
    stamp = dt.datetime.now(dt.UTC)
    meta = {
        "kind": "meta",
        "command": " ".join(["python", "benches/python/bench_e2e.py", *argv]),
        "date": stamp.isoformat(timespec="seconds"),
        "ferrobatch_commit": ferrobatch_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "uvloop": getattr(uvloop, "__version__", None),
        "systems": args.systems,
        "runs": args.runs,
        "max_batch_size": systems.MAX_BATCH_SIZE,
    }
    models = {m: systems.make_model(m) for m in args.models}
    cells = [c for _ in range(args.runs) for c in plan(args)]
    results: list[dict[str, Any]] = []
    workloads: dict[tuple[str, int], Workload] = {}
    with jsonl.open("w") as out:
        out.write(json.dumps(meta) + "\n")
        bar = tqdm(total=len(cells), unit="cfg", desc="bench_e2e", file=sys.stderr)
        for run in range(args.runs):
            for system, cfg in plan(args):
                wkey = (cfg.model, cfg.requests)
                if wkey not in workloads:
                    workloads[wkey] = Workload(models[cfg.model], cfg.requests, seed=cfg.requests)
                bar.set_postfix_str(f"run {run + 1} {system} {cfg.model} {fmt_delay(cfg.max_delay)} C={cfg.callers}")
                r = asdict(measure(system, cfg, models[cfg.model], workloads[wkey], run))
                results.append(r)
                out.write(json.dumps(r) + "\n")
                out.flush()
                bar.update()
        bar.close()
        if "torchrl-compat" in args.systems:
            for system in ("torchrl-compat", "torchrl"):
                if system not in args.systems:
                    continue
                model = args.models[-1]
                wkey = (model, args.requests)
                if wkey not in workloads:
                    workloads[wkey] = Workload(models[model], args.requests, seed=args.requests)
                row = update_latency(system, models[model], workloads[wkey], 64, 5 if args.quick else 20)
                row["model"] = model
                out.write(json.dumps(row) + "\n")
                print(
                    f"weight update latency, {LABELS[system]}, {model}, 64 threads: p50 {row['p50_ms']:.2f} ms"
                    f" (max {row['max_ms']:.2f} ms) = {row['p50_batches']:.2f} batch times"
                    f" of {row['batch_ms']:.2f} ms (mean batch {row['mean_batch_size']:.1f})",
                    file=sys.stderr,
                )
        medians = median_table(results)
        for row in (*medians, *targets(results, medians, args.runs)):
            out.write(json.dumps(row) + "\n")
    return meta, results


def load(path: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The meta line and results of an earlier run; sets the plan's axes in
    ``args`` from what the file holds."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    meta = next(r for r in rows if r["kind"] == "meta")
    results = [r for r in rows if r["kind"] == "result"]
    args.systems = [s for s in ALL_SYSTEMS if any(r["system"] == s for r in results)]
    args.models = [m for m in ("identity", "mlp") if any(r["model"] == m for r in results)]
    args.callers = sorted({r["callers"] for r in results})
    delays = {r["max_delay"] for r in results if r["max_delay"] is not None}
    args.delays = sorted(delays, reverse=True)
    args.runs = max(r["run"] for r in results) + 1
    return meta, results


def report(meta: dict[str, Any], results: list[dict[str, Any]], args: argparse.Namespace, prefix: Path) -> int:
    """The table, the in-run ratios, the targets, and the plot next to ``prefix``."""
    medians = median_table(results)
    commit = f"ferrobatch {meta['ferrobatch_commit']}, " if meta.get("ferrobatch_commit") else ""
    print(
        f"\n{meta['command']}\n({meta['date']}, {commit}{meta['cpus']} CPUs, "
        f"torch {meta['torch']} with {meta['torch_threads']} thread(s), python {meta['python']};"
        f" medians of {args.runs} run(s))\n"
    )
    print_table(medians, [s for s in ALL_SYSTEMS if s in args.systems], args.delays)
    print_ratios(results, args)
    print("\ntargets")
    for c in targets(results, medians, args.runs):
        if c["value"] is None:
            status, value = "n/a", "-"
        else:
            status = "met" if c["met"] else "NOT MET"
            value = f"{c['value']:.2f}{c['unit']}" if c["unit"] == "x" else f"{c['value']:,.0f} us"
        bound = ">=" if c["at_least"] else "<="
        print(f"  {c['target']:<48} {value:>10}  ({bound} {c['goal']:g}{c['unit']})  {status}")
    print(f"\nresults: {prefix.with_suffix('.jsonl')}")
    if not args.no_plot:
        png = prefix.with_suffix(".png")
        if plot(medians, args, png):
            print(f"plot:    {png}")
    wrong = [r for r in results if not r["correct"]]
    if wrong:
        print(f"\n{len(wrong)} configuration(s) returned wrong responses", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ragged"]:  # the variable-length workload: see e2e_ragged.py
        import e2e_ragged

        return e2e_ragged.main(argv[1:])
    args = parse_args(argv)
    if args.report:
        meta, results = load(args.report, args)
        print(markdown(meta, results, args, args.report))
        if not args.no_plot:
            plot(median_table(results), args, args.report.with_suffix(".png"))
        return 0
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    prefix = args.out or LATEST.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta, results = run_plan(args, argv, prefix.with_suffix(".jsonl"))
    return report(meta, results, args, prefix)


if __name__ == "__main__":
    sys.exit(main())
