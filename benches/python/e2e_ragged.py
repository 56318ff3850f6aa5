"""The ragged workload of ``bench_e2e.py``: token sequences of random length
(1 to 512, int64 token ids) through an embedding-bag model.

    python benches/python/bench_e2e.py ragged            # the full run (a few minutes)
    python benches/python/bench_e2e.py ragged --quick    # a smoke run

Two measurements, each against its reference in the same run:

1. **Collation** (no model): a batch of 64 sequences of uniform random length
   1-512, already queued, becomes the model's input. ferrobatch: the time of
   ``worker.next_batch()`` (gather and collate in Rust, GIL released) plus the
   views the model gets (``pad``: ``[64, L_max]`` and lengths; ``jagged``: the
   values and offsets). References: the naive Python batcher's pad-and-stack
   (a zeroed ``[64, L_max]`` tensor filled row by row in a Python loop, and a
   lengths tensor), and torch's ``pad_sequence`` (C++). Tokens per second,
   medians over the repetitions; target: jagged >= 5x the naive batcher.

2. **Serving** (the model, an embedding bag of projected tokens:
   ``Embedding(30000, 64)``, per token ``Linear(64, 256)`` + ReLU, summed per
   sequence, ``Linear(256, 64)``; on padded input, padding weighted 0, or on
   values and offsets), lengths from
   a long-tailed distribution (lognormal, median 24, clipped to 1-512):
   closed loop (256 callers, each awaiting one request at a time) for
   throughput, then open loop (Poisson arrivals, the same rates for every system,
   ``--loads``: 0.6, 0.9, 1.2 and 1.5 times the fixed-size padded batcher's
   closed-loop throughput) for p50/p99; at equal throughput means the
   highest of those rates both the fixed-size batcher and the token budget
   kept up with. Systems: ferrobatch padded with ``max_batch_size=64``
   alone (the budget never binds), padded with ``max_batch_elements`` (a token
   budget), jagged with ``max_batch_size=64``, and the naive Python batcher
   (pad-and-stack, ``asyncio.to_thread``). Target: the token budget's p99 <=
   0.5x the fixed-size batcher's.

Results: ``benches/results/e2e.jsonl``, bench_e2e's one results file (its
latest run, either workload; replaced by each run): one ``meta`` line
(command, date, ``uptime``, machine), then one line per measurement.
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
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ferrobatch as fb
from ferrobatch import _core
from ferrobatch._variable import allocate_slot, batch_inputs, core_shape, layouts

RESULTS = Path(__file__).resolve().parents[1] / "results" / "e2e.jsonl"
BATCH = 64
MAX_LEN = 512
VOCAB = 30_000
DIM = 64
HIDDEN = 256
CALLERS = 256

Call = Callable[[torch.Tensor], Awaitable[Any]]


# -- lengths and sequences ---------------------------------------------------------


def uniform_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, MAX_LEN + 1, n)


def long_tail_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Lognormal: median 24 tokens, 1 % over ~300, clipped to 1..512."""
    return np.clip(np.round(rng.lognormal(np.log(24), 1.1, n)), 1, MAX_LEN).astype(np.int64)


def sequences(lengths: np.ndarray, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(n),), generator=g) for n in lengths]


# -- 1. collation ------------------------------------------------------------------


def naive_pad_and_stack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a hand-written Python batcher does with a list of sequences."""
    longest = max(len(s) for s in seqs)
    out = torch.zeros((len(seqs), longest), dtype=torch.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, torch.tensor([len(s) for s in seqs])


def torch_pad_sequence(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    padded = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    return padded, torch.tensor([len(s) for s in seqs])


class CoreCollation:
    """ferrobatch's own batcher and worker, driven by hand: requests are
    queued first, then one ``next_batch()`` is timed (gather + collate, GIL
    released) with the views the model gets."""

    def __init__(self, mode: str) -> None:
        self.spec = fb.TensorSpec("tokens", "int64", (-1,), ragged=mode)
        elements = BATCH * MAX_LEN
        self.slots = [allocate_slot([self.spec], BATCH, elements) for _ in range(2)]
        self.registry = _core.LoopRegistry("bench")
        self.batcher = _core.Batcher(
            [(self.spec.name, self.spec.dtype, core_shape(self.spec), self.spec.torch_dtype)],
            [list(s.values()) for s in self.slots],
            tensor_type=torch.Tensor,
            coerce=lambda value, index, batched: value,
            max_batch_size=BATCH,
            max_delay=10.0,  # the batch goes when full
            min_batch_size=1,
            preferred_batch_sizes=[],
            max_queue_size=10 * BATCH,
            workers=1,
            layouts=layouts([self.spec]),
            max_batch_elements=elements,
        )
        self.submitter = _core.Submitter(self.registry, lambda: RuntimeError("not running"))
        self.submitter.accept(self.batcher)
        self.worker = _core.Worker(self.batcher, self.registry)

    async def collate(self, seqs: list[torch.Tensor]) -> float:
        futures = [self.submitter.submit({"tokens": s})[0] for s in seqs]
        started = time.perf_counter_ns()
        batch = self.worker.next_batch()
        assert batch is not None and batch.rows == len(seqs)
        inputs = batch_inputs([self.spec], self.slots[batch.slot], batch)
        elapsed = time.perf_counter_ns() - started
        assert inputs["tokens"].numel() > 0
        batch.release_slot()
        self.worker.finish(batch, None, RuntimeError("collation only"), ring_now=True)
        await asyncio.gather(*futures, return_exceptions=True)
        return elapsed / 1e9


def bench_collation(reps: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    batches = [sequences(uniform_lengths(rng, BATCH), seed + i) for i in range(reps)]
    tokens = [sum(len(s) for s in b) for b in batches]
    times: dict[str, list[float]] = {"naive": [], "pad_sequence": [], "ferrobatch-pad": [], "ferrobatch-jagged": []}
    for b in batches:
        for name, fn in (("naive", naive_pad_and_stack), ("pad_sequence", torch_pad_sequence)):
            started = time.perf_counter_ns()
            fn(b)
            times[name].append((time.perf_counter_ns() - started) / 1e9)

    async def core(mode: str) -> list[float]:
        collation = CoreCollation(mode)
        await collation.collate(batches[0])  # warm
        return [await collation.collate(b) for b in batches]

    times["ferrobatch-pad"] = asyncio.run(core("pad"))
    times["ferrobatch-jagged"] = asyncio.run(core("jagged"))
    rows = []
    for name, ts in times.items():
        rate = statistics.median(n / t for n, t in zip(tokens, ts))
        rows.append({"kind": "collation", "system": name, "batch": BATCH, "reps": reps,
                     "median_us": statistics.median(ts) * 1e6, "tokens_per_s": rate})  # fmt: skip
    naive = next(r for r in rows if r["system"] == "naive")["tokens_per_s"]
    for r in rows:
        r["vs_naive"] = r["tokens_per_s"] / naive
    return rows


# -- 2. serving ----------------------------------------------------------------------


def make_model(mode: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """An embedding bag whose tokens are projected before they are pooled:
    ``Embedding(30000, 64)``, per token ``Linear(64, 256)`` + ReLU, summed
    over each sequence (padding weighted 0), then ``Linear(256, 64)``. A
    padded batch costs rows x longest token projections, a jagged one the
    tokens it holds."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(VOCAB, DIM).eval()
    project = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU()).eval()
    head = torch.nn.Linear(HIDDEN, DIM).eval()
    if mode == "pad":

        def padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            tokens = batch["tokens"]
            lengths = batch.get("tokens_lengths")
            if lengths is None:  # the naive batcher: padding is token 0
                mask = tokens != 0
            else:
                mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
            pooled = (project(emb(tokens)) * mask[..., None]).sum(1)
            return {"y": head(pooled)}

        return padded

    def jagged(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values, offsets = batch["tokens"], batch["tokens_offsets"]
        rows = offsets.shape[0] - 1
        owner = torch.repeat_interleave(torch.arange(rows), offsets.diff())
        pooled = torch.zeros(rows, HIDDEN).index_add_(0, owner, project(emb(values)))
        return {"y": head(pooled)}

    return jagged


class NaiveRaggedBatcher:
    """The naive asyncio batcher of ``e2e_systems`` for sequences: gathers up
    to 64 (at most ``max_delay`` after the first), pads and stacks them in a
    Python loop, runs the model with ``asyncio.to_thread``."""

    def __init__(self, max_delay: float) -> None:
        self.model = make_model("pad")
        self.max_delay = max_delay
        self.batches = self.rows = 0

    async def start(self) -> None:
        self.queue: asyncio.Queue[tuple[torch.Tensor, asyncio.Future[Any]]] = asyncio.Queue()
        self.task = asyncio.create_task(self._serve())

    async def call(self, x: torch.Tensor) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, future))
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = loop.time() + self.max_delay
            while len(items) < BATCH:
                try:
                    items.append(self.queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            tokens, _ = naive_pad_and_stack([x for x, _ in items])
            ys = (await asyncio.to_thread(self.model, {"tokens": tokens}))["y"].unbind(0)
            for (_, future), y in zip(items, ys):
                if not future.done():
                    future.set_result({"y": y})
            self.batches += 1
            self.rows += len(items)

    async def stop(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def mean_batch(self) -> float:
        return self.rows / max(1, self.batches)


class FerrobatchSystem:
    def __init__(self, mode: str, max_delay: float, budget: int | None) -> None:
        self.server = fb.Server(
            make_model(mode),
            inputs=[fb.TensorSpec("tokens", "int64", (-1,), ragged=mode)],
            outputs=[fb.TensorSpec("y", "float32", (DIM,))],
            max_batch_size=BATCH,
            max_delay=max_delay,
            max_batch_elements=budget or BATCH * MAX_LEN,
            max_queue_size=100_000,
        )

    async def start(self) -> None:
        await self.server.start()
        client = self.server.client()
        self.call: Call = lambda x: client.infer({"tokens": x})

    async def stop(self) -> None:
        await self.server.stop()

    def mean_batch(self) -> float:
        return float(self.server.stats()["mean_batch_size"])


def make_system(name: str, max_delay: float, budget: int) -> Any:
    if name == "naive":
        return NaiveRaggedBatcher(max_delay)
    if name == "ferrobatch-pad":
        return FerrobatchSystem("pad", max_delay, None)
    if name == "ferrobatch-pad-budget":
        return FerrobatchSystem("pad", max_delay, budget)
    if name == "ferrobatch-jagged":
        return FerrobatchSystem("jagged", max_delay, None)
    raise ValueError(name)


async def closed_loop(system: Any, seqs: list[torch.Tensor]) -> dict[str, float]:
    gc.collect()
    await system.start()
    latencies: list[float] = []
    it = iter(seqs)

    async def caller() -> None:
        for x in it:
            started = time.perf_counter()
            await system.call(x)
            latencies.append(time.perf_counter() - started)

    try:
        await asyncio.gather(*(system.call(x) for x in seqs[:BATCH]))  # warm
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        elapsed = time.perf_counter() - started
    finally:
        await system.stop()
    return {"req_per_s": len(latencies) / elapsed, "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)), "mean_batch": system.mean_batch()}  # fmt: skip


async def open_loop(system: Any, seqs: list[torch.Tensor], rate: float, seed: int) -> dict[str, float]:
    """Poisson arrivals at ``rate`` per second; each request's latency from its
    arrival time (so a late submit counts against the system)."""
    gc.collect()
    await system.start()
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(seqs))
    latencies: list[float] = []
    tasks = []

    async def one(x: torch.Tensor, due: float) -> None:
        await system.call(x)
        latencies.append(time.perf_counter() - due)

    try:
        await asyncio.gather(*(system.call(x) for x in seqs[:BATCH]))  # warm
        start = time.perf_counter()
        due = start
        for x, gap in zip(seqs, gaps):
            due += gap
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(x, due)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    finally:
        await system.stop()
    return {"offered_per_s": rate, "req_per_s": len(latencies) / elapsed,
            "p50_ms": 1e3 * float(np.percentile(latencies, 50)),
            "p99_ms": 1e3 * float(np.percentile(latencies, 99)), "mean_batch": system.mean_batch()}  # fmt: skip


SERVING = ("ferrobatch-pad", "ferrobatch-pad-budget", "ferrobatch-jagged", "naive")


def bench_serving(
    n: int, seconds: float, max_delay: float, budget: int, loads: list[float], seed: int
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    seqs = sequences(long_tail_lengths(rng, n), seed)
    rows: list[dict[str, Any]] = []
    for name in SERVING:
        r = asyncio.run(closed_loop(make_system(name, max_delay, budget), seqs))
        rows.append({"kind": "closed", "system": name, "callers": CALLERS, "requests": n, **r})
        print(f"  closed  {name:24} {r['req_per_s']:9.0f} req/s  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms"
              f"  batch {r['mean_batch']:.1f}", flush=True)  # fmt: skip
    # The same rates for every system: shares of the fixed-size batcher's
    # closed-loop throughput (a system that cannot keep up shows fewer req/s).
    fixed = next(r for r in rows if r["system"] == "ferrobatch-pad")["req_per_s"]
    for load in loads:
        rate = load * fixed
        m = int(rate * seconds)
        open_seqs = sequences(long_tail_lengths(np.random.default_rng(seed + 1), m), seed + 1)
        for name in SERVING:
            r = asyncio.run(open_loop(make_system(name, max_delay, budget), open_seqs, rate, seed))
            kept_up = r["req_per_s"] >= 0.95 * rate
            rows.append({"kind": "open", "system": name, "load": load, "requests": m, "kept_up": kept_up, **r})
            print(f"  open    {name:24} {r['req_per_s']:6.0f} of {rate:5.0f} req/s  p50 {r['p50_ms']:8.2f} ms"
                  f"  p99 {r['p99_ms']:8.2f} ms  batch {r['mean_batch']:4.1f}{'' if kept_up else '  (fell behind)'}",
                  flush=True)  # fmt: skip
    return rows


# -- the run -----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_e2e.py ragged", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--reps", type=int, default=200, help="collation: batches timed per system")
    p.add_argument("--requests", type=int, default=20_000, help="serving, closed loop: requests per system")
    p.add_argument("--seconds", type=float, default=10.0, help="serving, open loop: seconds of arrivals per system")
    p.add_argument("--max-delay", type=float, default=0.001)
    p.add_argument("--budget", type=int, default=4096, help="max_batch_elements of the token-budget system")
    p.add_argument(
        "--loads",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[0.6, 0.9, 1.2, 1.5],
        help="open loop: arrival rates, as shares of the fixed-size batcher's closed-loop rate",
    )
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.requests, args.seconds, args.loads = 20, 2_000, 2.0, [0.9]
    return args


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    meta = {
        "kind": "meta",
        "command": "python benches/python/bench_e2e.py ragged " + " ".join(argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "uptime_before": uptime(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "options": {k: str(v) for k, v in vars(args).items()},
    }
    print(f"collation: {args.reps} batches of {BATCH} sequences, lengths uniform 1-{MAX_LEN}", flush=True)
    rows = bench_collation(args.reps, args.seed)
    for r in rows:
        print(f"  {r['system']:20} {r['median_us']:9.1f} us/batch  {r['tokens_per_s'] / 1e6:8.1f} M tokens/s"
              f"  {r['vs_naive']:6.2f}x naive")  # fmt: skip
    print(f"serving: embedding bag ({VOCAB}, {DIM} -> {HIDDEN}), long-tailed lengths, max_delay {args.max_delay}s,"
          f" budget {args.budget}", flush=True)  # fmt: skip
    rows += bench_serving(args.requests, args.seconds, args.max_delay, args.budget, args.loads, args.seed)
    meta["uptime_after"] = uptime()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in [meta, *rows]:
            f.write(json.dumps(row) + "\n")
    jagged = next(r for r in rows if r["kind"] == "collation" and r["system"] == "ferrobatch-jagged")["vs_naive"]
    # At equal throughput: the highest load both the fixed-size batcher and the
    # token budget kept up with.
    both = [
        (r["load"], r, b)
        for r in rows
        for b in rows
        if r["kind"] == b["kind"] == "open" and r["load"] == b["load"]
        and r["system"] == "ferrobatch-pad" and b["system"] == "ferrobatch-pad-budget"
        and r["kept_up"] and b["kept_up"]
    ]  # fmt: skip
    if both:
        load, fixed_open, budget_open = max(both, key=lambda t: t[0])
        p99_ratio = budget_open["p99_ms"] / fixed_open["p99_ms"]
        print(
            f"equal throughput: {budget_open['offered_per_s']:.0f} req/s ({load}x), the highest rate both kept up with"
        )
    else:
        p99_ratio = float("inf")
    closed = {r["system"]: r for r in rows if r["kind"] == "closed"}
    fixed, budgeted = closed["ferrobatch-pad"], closed["ferrobatch-pad-budget"]
    print(f"closed loop ({CALLERS} callers): token budget {budgeted['req_per_s'] / fixed['req_per_s']:.2f}x the"
          f" fixed-size batcher's throughput at {budgeted['p99_ms'] / fixed['p99_ms']:.2f}x its p99")  # fmt: skip
    print(f"target: jagged collation >= 5x naive: {jagged:.1f}x -> {'met' if jagged >= 5 else 'MISSED'}")
    print(f"target: token-budget p99 <= 0.5x fixed-size at equal throughput: {p99_ratio:.2f}x"
          f" -> {'met' if p99_ratio <= 0.5 else 'MISSED'}")  # fmt: skip
    print(f"results: {args.out}")
    return 0
