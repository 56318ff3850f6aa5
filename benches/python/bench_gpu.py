"""GPU benchmarks of ferrobatch's CUDA path, each next to its reference.

1. Host-to-device bandwidth: batches copied from the pinned staging ring by the
   CUDA executor (three in flight, as a server runs them) vs torch's own copy
   of one pinned tensor (``.to("cuda", non_blocking=True)``) and of a pageable
   one; and a server's ingest rate with 1 MiB samples (collation included).
2. Two MLPs (4 layers; 256 wide: launch-bound, 4096 wide: compute-bound) at
   batch 64, ferrobatch eager vs ferrobatch CUDA graphs vs a naive batcher
   (asyncio queue, ``torch.stack``, ``.to("cuda")``, model, ``.cpu()``, one
   batch at a time in a thread): the executor alone (launch + wait, no event
   loop), callers sending 64-row ``infer_batch`` requests, and callers sending
   single samples.
3. GPU busy fraction (union of the model's GPU intervals over wall time) with
   one instance (one stream) vs two instances (two streams) of the same model.

    python benches/python/bench_gpu.py [--seconds 1.5] [--json results.json]

Needs CUDA; prints a table and, with --json, writes every figure to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Any

import torch

import ferrobatch as fb
from ferrobatch._cuda import IN_FLIGHT, CudaExecutor, InFlight
from ferrobatch._torch import allocate_slot, batch_buckets, padding_table, warmup_batches

BATCH = 64


# -- models ----------------------------------------------------------------------------


class MLP(torch.nn.Module):
    """``layers`` Linear layers of ``width``, ReLU between; dict in, dict out."""

    def __init__(self, width: int, layers: int = 4) -> None:
        super().__init__()
        mods: list[torch.nn.Module] = []
        for i in range(layers):
            mods.append(torch.nn.Linear(width, width))
            if i < layers - 1:
                mods.append(torch.nn.ReLU())
        self.net = torch.nn.Sequential(*mods)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": self.net(d["x"])}


class Timed(torch.nn.Module):
    """Records a timing event pair around each call, on the calling stream."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(d)
        end.record()
        self.events.append((start, end))
        return out


def specs(width: int) -> tuple[fb.TensorSpec, fb.TensorSpec]:
    return fb.TensorSpec("x", "float32", (width,)), fb.TensorSpec("y", "float32", (width,))


# -- the naive batcher ----------------------------------------------------------------------


class NaiveBatcher:
    """The batcher people write first: an asyncio.Queue; a task that gathers up
    to max_batch_size rows (or waits max_delay), ``torch.stack``s them, and
    runs ``.to("cuda")``, the model and ``.cpu()`` in a thread, one batch at a time."""

    def __init__(self, model: torch.nn.Module, max_batch_size: int, max_delay: float) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.queue: asyncio.Queue[tuple[torch.Tensor, bool, asyncio.Future[torch.Tensor]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> NaiveBatcher:
        self.task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    async def infer(self, x: torch.Tensor, batched: bool = False) -> torch.Tensor:
        future: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, batched, future))
        return await future

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            y: torch.Tensor = self.model({"x": x.to("cuda")})["y"]
            return y.cpu()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        carry: tuple[torch.Tensor, bool, asyncio.Future[torch.Tensor]] | None = None
        while True:
            items = [carry if carry is not None else await self.queue.get()]
            carry = None
            rows = items[0][0].shape[0] if items[0][1] else 1
            deadline = loop.time() + self.max_delay
            while rows < self.max_batch_size:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), left)
                    except TimeoutError:
                        break
                n = item[0].shape[0] if item[1] else 1
                if rows + n > self.max_batch_size:
                    carry = item
                    break
                items.append(item)
                rows += n
            if all(not batched for _, batched, _ in items):
                x = torch.stack([t for t, _, _ in items])
            else:
                x = torch.cat([t if batched else t[None] for t, batched, _ in items])
            y = await asyncio.to_thread(self._compute, x)
            start = 0
            for t, batched, future in items:
                n = t.shape[0] if batched else 1
                if not future.done():
                    future.set_result(y[start : start + n] if batched else y[start])
                start += n


# -- measurement helpers ------------------------------------------------------------------


async def closed_loop(call: Callable[[], Awaitable[Any]], callers: int, rows_per_call: int, seconds: float) -> float:
    """Rows per second with ``callers`` tasks each awaiting ``call`` in a loop."""
    done = 0
    counting = stop = False

    async def caller() -> None:
        nonlocal done
        while not stop:
            await call()
            if counting:
                done += rows_per_call

    tasks = [asyncio.create_task(caller()) for _ in range(callers)]
    await asyncio.sleep(min(0.5, seconds / 3))  # steady state first
    counting, start, n0 = True, perf_counter(), done
    await asyncio.sleep(seconds)
    n, elapsed = done - n0, perf_counter() - start
    stop = True
    await asyncio.gather(*tasks)
    return n / elapsed


def sync() -> None:
    torch.cuda.synchronize()


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- 1. host-to-device bandwidth -------------------------------------------------------------


def bench_h2d(seconds: float) -> dict[str, float]:
    width = 1 << 18  # 1 MiB float32 rows: 64 MiB batches
    x, y = fb.TensorSpec("x", "float32", (width,)), fb.TensorSpec("y", "float32", (1,))
    nbytes = BATCH * width * 4
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream()

    def timed_copies(copy: Callable[[int], Any]) -> float:
        with torch.cuda.stream(stream):
            for i in range(3):
                copy(i)
            stream.synchronize()
            n, start = 0, perf_counter()
            while perf_counter() - start < seconds:
                for _ in range(8):
                    copy(n)
                    n += 1
            stream.synchronize()
            return gbps(n * nbytes, perf_counter() - start)

    pinned = torch.empty((BATCH, width), pin_memory=True)
    pageable = torch.empty((BATCH, width))
    torch_pinned = timed_copies(lambda i: pinned.to(device, non_blocking=True))
    torch_pageable = timed_copies(lambda i: pageable.to(device, non_blocking=True))

    # The executor's path: launch from a ring of pinned slots, IN_FLIGHT deep.
    executor = CudaExecutor(lambda d: {"y": d["x"][:, :1]}, device, [x], [y], BATCH)
    slots = [{"x": allocate_slot([x], BATCH, pin=True)[0]} for _ in range(IN_FLIGHT)]
    with torch.cuda.device(device), torch.cuda.stream(executor.stream):
        flights: list[InFlight] = []
        for i in range(IN_FLIGHT):
            flights.append(executor.launch(slots[i], BATCH))
        for f in flights:
            f.wait()
        flights.clear()
        n, start = 0, perf_counter()
        while perf_counter() - start < seconds:
            if len(flights) == IN_FLIGHT:
                flights.pop(0).wait()
            flights.append(executor.launch(slots[n % IN_FLIGHT], BATCH))
            n += 1
        for f in flights:
            f.wait()
        ring = gbps(n * nbytes, perf_counter() - start)

    async def ingest() -> float:
        server = fb.Server(lambda d: {"y": d["x"][:, :1]}, inputs=[x], outputs=[y], max_batch_size=BATCH,
                           max_delay=0.0, device="cuda")  # fmt: skip
        batch = torch.randn(BATCH, width)
        async with server:
            client = server.client()
            rows_per_s = await closed_loop(lambda: client.infer_batch({"x": batch}), 4, BATCH, seconds)
        return rows_per_s * width * 4 / 1e9

    server_ingest = asyncio.run(ingest())
    return {
        "torch_pinned_gbps": torch_pinned,
        "torch_pageable_gbps": torch_pageable,
        "ring_gbps": ring,
        "ring_vs_torch_pinned": ring / torch_pinned,
        "server_ingest_gbps": server_ingest,
    }


# -- 2. MLPs: executor, batched callers, single-sample callers --------------------------------


def bench_executor(model: torch.nn.Module, width: int, graphs: bool, seconds: float) -> float:
    """Rows/s of launch + wait at batch 64, IN_FLIGHT deep, no event loop."""
    x, y = specs(width)
    device = torch.device("cuda", torch.cuda.current_device())
    buckets = batch_buckets(BATCH, ())
    executor = CudaExecutor(model, device, [x], [y], BATCH,
                            pad_to=padding_table(buckets) if graphs else None, cuda_graphs=graphs)  # fmt: skip
    slots = [{"x": allocate_slot([x], BATCH, pin=True)[0]} for _ in range(IN_FLIGHT)]
    for s in slots:
        s["x"].normal_()
    why = executor.warm_up(warmup_batches([x], None), buckets, slots[0])
    assert why is None and (executor.graphed_buckets == buckets) == graphs, why
    with torch.cuda.device(device), torch.cuda.stream(executor.stream):
        flights: list[InFlight] = []
        n, start = 0, perf_counter()
        while perf_counter() - start < seconds:
            for _ in range(16):
                if len(flights) == IN_FLIGHT:
                    flights.pop(0).wait()
                flights.append(executor.launch(slots[n % IN_FLIGHT], BATCH))
                n += 1
        for f in flights:
            f.wait()
        return n * BATCH / (perf_counter() - start)


async def bench_serving(
    model: torch.nn.Module, width: int, mode: str, seconds: float, single_callers: int
) -> dict[str, float]:
    x_spec, y_spec = specs(width)
    batch = torch.randn(BATCH, width)
    sample = torch.randn(width)
    out: dict[str, float] = {}
    if mode == "naive":
        async with NaiveBatcher(model, BATCH, 0.001) as naive:
            out["batch64_rows_per_s"] = await closed_loop(lambda: naive.infer(batch, True), 4, BATCH, seconds)
            out["single_rows_per_s"] = await closed_loop(lambda: naive.infer(sample), single_callers, 1, seconds)
        return out
    server = fb.Server(model, inputs=[x_spec], outputs=[y_spec], max_batch_size=BATCH, max_delay=0.001,
                       device="cuda", cuda_graphs=mode == "graphs", name=f"mlp{width}")  # fmt: skip
    async with server:
        client = server.client()
        out["batch64_rows_per_s"] = await closed_loop(lambda: client.infer_batch({"x": batch}), 4, BATCH, seconds)
        before = server.stats()
        out["single_rows_per_s"] = await closed_loop(lambda: client.infer({"x": sample}), single_callers, 1, seconds)
        after = server.stats()
        out["single_mean_batch"] = (after["rows"] - before["rows"]) / max(1, after["batches"] - before["batches"])
    return out


# -- 3. GPU busy fraction, one vs two streams ----------------------------------------------------


async def bench_busy(width: int, instances: int, seconds: float) -> dict[str, float]:
    torch.manual_seed(0)
    timed = Timed(MLP(width)).cuda().eval()
    x_spec, y_spec = specs(width)
    batch = torch.randn(BATCH, width)
    server = fb.Server([timed] * instances, inputs=[x_spec], outputs=[y_spec], max_batch_size=BATCH,
                       max_delay=0.001, device="cuda")  # fmt: skip
    async with server:
        client = server.client()
        sync()
        timed.events.clear()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        wall_start = perf_counter()
        rows_per_s = await closed_loop(lambda: client.infer_batch({"x": batch}), 8, BATCH, seconds)
        sync()
        wall_ms = (perf_counter() - wall_start) * 1e3
        events = list(timed.events)
    intervals = sorted((ref.elapsed_time(s), ref.elapsed_time(e)) for s, e in events)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in intervals:
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        busy += cur_e - cur_s
    span = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else wall_ms
    return {"busy_fraction": busy / span, "batch64_rows_per_s": rows_per_s, "batches": len(events)}


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="measured seconds per figure")
    parser.add_argument("--single-callers", type=int, default=512)
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--uvloop", action="store_true", help="run the event loop on uvloop")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs CUDA")
    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", *sys.argv]),
    }

    h2d = bench_h2d(args.seconds)
    results["h2d"] = h2d
    print(f"# {results['device']}, torch {results['torch']}, Python {results['python']}")
    print("\n## host-to-device, 64 MiB batches")
    print(f"torch pinned .to(cuda)      {h2d['torch_pinned_gbps']:7.1f} GB/s")
    print(f"torch pageable .to(cuda)    {h2d['torch_pageable_gbps']:7.1f} GB/s")
    print(f"ferrobatch ring (executor)  {h2d['ring_gbps']:7.1f} GB/s  ({h2d['ring_vs_torch_pinned']:.0%} of pinned)")
    print(f"ferrobatch server ingest    {h2d['server_ingest_gbps']:7.1f} GB/s  (collation included)")

    results["mlp"] = {}
    for width in (256, 4096):
        torch.manual_seed(0)
        model = MLP(width).cuda().eval()
        row: dict[str, Any] = {
            "executor_eager_rows_per_s": bench_executor(model, width, False, args.seconds),
            "executor_graphs_rows_per_s": bench_executor(model, width, True, args.seconds),
        }
        for mode in ("naive", "eager", "graphs"):
            row[mode] = asyncio.run(bench_serving(model, width, mode, args.seconds, args.single_callers))
        results["mlp"][width] = row
        print(f"\n## MLP {width} wide x 4 layers, batch {BATCH} (rows/s)")
        print(f"{'':28}{'naive':>12}{'eager':>12}{'graphs':>12}{'eager/naive':>13}{'graphs/eager':>14}")
        ex_e, ex_g = row["executor_eager_rows_per_s"], row["executor_graphs_rows_per_s"]
        print(f"{'executor (no event loop)':28}{'':>12}{ex_e:12,.0f}{ex_g:12,.0f}{'':>13}{ex_g / ex_e:13.2f}x")
        for key, label in (("batch64_rows_per_s", "infer_batch(64 rows)"), ("single_rows_per_s", "infer(1 row)")):
            n, e, g = (row[m][key] for m in ("naive", "eager", "graphs"))
            print(f"{label:28}{n:12,.0f}{e:12,.0f}{g:12,.0f}{e / n:12.2f}x{g / e:13.2f}x")
        print(f"{'mean batch, infer(1 row)':28}{'':>12}{row['eager']['single_mean_batch']:12.1f}"
              f"{row['graphs']['single_mean_batch']:12.1f}")  # fmt: skip
        del model
        torch.cuda.empty_cache()

    results["busy"] = {}
    print(f"\n## GPU busy fraction, eager, 8 callers x infer_batch({BATCH} rows)")
    for width in (256, 4096):
        for instances in (1, 2):
            b = asyncio.run(bench_busy(width, instances, args.seconds))
            results["busy"][f"{width}x{instances}"] = b
            print(f"MLP {width:5}, {instances} stream(s): busy {b['busy_fraction']:6.1%}, "
                  f"{b['batch64_rows_per_s']:12,.0f} rows/s")  # fmt: skip

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
