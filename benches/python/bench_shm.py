"""Shared-memory clients against in-process clients, TorchRL's cross-process
transports and binary HTTP over loopback, on one model server.

Each case serves one model (``identity`` or ``mlp`` on ``float32[256]``, from
``e2e_systems.py``, or PyTriton's ``add_sub``: two float32 ``(-1,)`` inputs,
padded, two ``(-1,)`` outputs, requests of 16 elements, which crosses shared
memory in variable-size cells; ``max_batch_size=64``, greedy dispatch) from
this process and drives it for ``--seconds`` (after ``--warmup``), ``--runs``
times (``add_sub``: the in-process and shared-memory cases):

- ``in-process``: ``2 x --callers`` asyncio callers on this process's loop,
  ``await server.client().infer(...)`` in a loop (the same total callers);
- ``shm``: the server shares itself (``server.share``); 2 client processes (``--processes``)
  (spawned once) each run ``--callers`` asyncio callers, ``fb.connect(name)``;
- ``shm +options``: the same, the server with ``priority_levels=2`` and each
  request given ``priority=1`` and ``parameters={"tenant": "a"}``;
- ``http-binary``: ``ferrobatch serve``'s native front-end on 127.0.0.1; the
  same 2 processes each run ``--callers`` callers with ``tritonclient.http.aio``
  (binary tensors in and out);
- ``torchrl-mp`` / ``torchrl-shm``: TorchRL's ``InferenceServer`` with its
  ``MPTransport`` / ``SharedMemoryTransport`` (``num_slots = 2 x callers``);
  2 client processes (clients made before spawning, as TorchRL requires)
  each keep ``--callers`` requests in flight (``client.submit`` futures, the
  oldest awaited and replaced);
- ``torchrl-shm-borrowed``: ``torchrl-shm`` with ``copy_result=False`` (each
  result a view of its response slot, not a copy);
- ``ferrobatch.torchrl-mp`` / ``ferrobatch.torchrl-shm`` /
  ``ferrobatch.torchrl-shm-borrowed``: the same code as the three above with
  ``InferenceServer`` and the transport imported from ``ferrobatch.torchrl``
  (``--transports-only`` runs these six alone);
- ``torchrl-ray`` / ``ferrobatch.torchrl-ray`` (with ``--ray``): the same with
  a ``RayTransport``, its 2 clients on Ray actors of this machine (Ray
  started here with 2 CPUs).

Throughput is completed requests per second inside the measured window,
summed over the client processes; ``p50 @1`` is the median round trip of a
single caller (``in-process`` and ``shm``), over the same window. Every run
is printed; the table gives medians over runs and the ratios the targets
name. Results: ``benches/results/shm.jsonl`` (overwritten).

    python benches/python/bench_shm.py                       # both models, 3 runs
    python benches/python/bench_shm.py --models identity --runs 1 --seconds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_systems import FEATURES, MAX_BATCH_SIZE, make_model, torchrl_available

import ferrobatch as fb

RESULTS = Path(__file__).resolve().parents[1] / "results" / "shm.jsonl"
#: Client processes (Ray actors for the RayTransport cases); ``--processes``.
PROCESSES = 2


#: Elements of each ``add_sub`` request's inputs.
ADD_SUB_ELEMENTS = 16


def add_sub(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PyTriton's add_sub example, padded: each row's own length comes back."""
    a, b, lengths = batch["a"], batch["b"], batch["a_lengths"]
    return {"add": a + b, "add_lengths": lengths, "sub": a - b, "sub_lengths": lengths}


def make_server(kind: str, **options: Any) -> fb.Server:
    if kind == "add_sub":
        variable = [fb.TensorSpec(n, "float32", (-1,), ragged="pad") for n in ("a", "b")]
        results = [fb.TensorSpec(n, "float32", (-1,), ragged="pad") for n in ("add", "sub")]
        return fb.Server(
            add_sub, inputs=variable, outputs=results, max_batch_size=MAX_BATCH_SIZE, max_delay=0, name=kind, **options
        )
    spec = [fb.TensorSpec("x", "float32", (FEATURES,))]
    out = [fb.TensorSpec("y", "float32", (FEATURES,))]
    return fb.Server(
        make_model(kind), inputs=spec, outputs=out, max_batch_size=MAX_BATCH_SIZE, max_delay=0, name=kind, **options
    )


def request_of(kind: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One caller's request to model ``kind``, from its sample ``x``."""
    if kind == "add_sub":
        return {"a": x[:ADD_SUB_ELEMENTS], "b": x[ADD_SUB_ELEMENTS : 2 * ADD_SUB_ELEMENTS]}
    return {"x": x}


#: What ``shm +options`` requests carry.
OPTIONS: dict[str, Any] = {"priority": 1, "parameters": {"tenant": "a"}}


# -- the client processes ---------------------------------------------------------------


async def _callers(
    call: Callable[[torch.Tensor], Any], callers: int, start_at: float, warmup: float, seconds: float
) -> dict[str, Any]:
    """``callers`` loops calling ``call(x)``; completions and round trips
    inside ``[start_at + warmup, + seconds)``."""
    measure_from = start_at + warmup
    until = measure_from + seconds
    latencies: list[float] = []
    errors = 0

    async def caller(seed: int) -> None:
        nonlocal errors
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(seed))
        while True:
            started = time.time()
            if started >= until:
                return
            try:
                await call(x)
            except Exception:  # noqa: BLE001 - counted
                errors += 1
                await asyncio.sleep(0.001)
                continue
            done = time.time()
            if measure_from <= done < until:
                latencies.append(done - started)

    await asyncio.sleep(max(0.0, start_at - time.time()))
    await asyncio.gather(*(caller(i) for i in range(callers)))
    return {
        "count": len(latencies),
        "p50_s": statistics.median(latencies) if latencies else None,
        "errors": errors,
    }


def client_process(conn: Connection) -> None:
    """Runs the ferrobatch-side loads it is sent: ``("shm", name, ...)`` or
    ``("http", url, model, ...)``, each ``(callers, start_at, warmup, seconds)``."""
    torch.set_num_threads(1)
    clients: dict[str, fb.SharedClient] = {}
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        if command[0] == "connect":  # before the clock starts
            clients[command[1]] = fb.connect(command[1], timeout=60)
            conn.send("connected")
            continue
        kind, target, model, callers, start_at, warmup, seconds = command
        if kind.startswith("shm"):
            client = clients[target]
            options = OPTIONS if kind == "shm +options" else {}

            async def shm_call(
                x: torch.Tensor, client: fb.SharedClient = client, options: Any = options, model: str = model
            ) -> Any:
                return await client.infer(request_of(model, x), **options)

            result = asyncio.run(_callers(shm_call, callers, start_at, warmup, seconds))
        else:
            result = asyncio.run(_http(target, model, callers, start_at, warmup, seconds))
        conn.send(result)
    for client in clients.values():
        client.close()


async def _http(url: str, model: str, callers: int, start_at: float, warmup: float, seconds: float) -> dict[str, Any]:
    import tritonclient.http.aio as httpclient

    client = httpclient.InferenceServerClient(url, conn_limit=max(callers, 1))
    outputs = [httpclient.InferRequestedOutput("y", binary_data=True)]

    async def call(x: torch.Tensor) -> Any:
        tensor = httpclient.InferInput("x", [1, FEATURES], "FP32")
        tensor.set_data_from_numpy(x.numpy()[None], binary_data=True)
        return await client.infer(model, [tensor], outputs=outputs)

    try:
        return await _callers(call, callers, start_at, warmup, seconds)
    finally:
        await client.close()


def keep_in_flight(client: Any, callers: int, start_at: float, warmup: float, seconds: float) -> dict[str, Any]:
    """Keeps ``callers`` requests in flight through a TorchRL transport
    client (``client.submit`` futures, the oldest awaited and replaced)."""
    from collections import deque

    from tensordict import TensorDict

    measure_from = start_at + warmup
    until = measure_from + seconds
    tds = [TensorDict({"x": torch.randn(FEATURES)}) for _ in range(callers)]
    time.sleep(max(0.0, start_at - time.time()))
    inflight: deque[tuple[Any, int]] = deque((client.submit(tds[i]), i) for i in range(callers))
    count = 0
    while inflight:
        future, i = inflight.popleft()
        future.result(timeout=120)
        done = time.time()
        if measure_from <= done < until:
            count += 1
        if done < until:
            inflight.append((client.submit(tds[i]), i))
    return {"count": count, "p50_s": None, "errors": 0}


def torchrl_process(conn: Connection, client: Any) -> None:
    """A client process: :func:`keep_in_flight` on each command."""
    torch.set_num_threads(1)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        conn.send(keep_in_flight(client, *command))


class RayCaller:
    """A Ray actor holding one TorchRL transport client (as TorchRL's
    ``RayTransport`` is used): :func:`keep_in_flight` on each call."""

    def __init__(self, client: Any) -> None:
        torch.set_num_threads(1)
        self.client = client

    def run(self, callers: int, start_at: float, warmup: float, seconds: float) -> dict[str, Any]:
        return keep_in_flight(self.client, callers, start_at, warmup, seconds)


# -- the systems ------------------------------------------------------------------------


def window(args: argparse.Namespace) -> tuple[float, float, float]:
    return time.time() + 0.5, args.warmup, args.seconds


def gather(conns: list[Connection], command: tuple[Any, ...]) -> list[dict[str, Any]]:
    for conn in conns:
        conn.send(command)
    return [conn.recv() for conn in conns]


def summarize(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    p50s = [r["p50_s"] for r in results if r["p50_s"] is not None]
    return {
        "req_per_s": sum(r["count"] for r in results) / seconds,
        "p50_us": statistics.median(p50s) * 1e6 if p50s else None,
        "errors": sum(r["errors"] for r in results),
    }


async def in_process(kind: str, callers: int, args: argparse.Namespace) -> dict[str, Any]:
    async with make_server(kind) as server:
        client = server.client()

        async def call(x: torch.Tensor) -> Any:
            return await client.infer(request_of(kind, x))

        start_at, warmup, seconds = window(args)
        result = await _callers(call, callers, start_at, warmup, seconds)
        return summarize([result], seconds)


async def shared(
    kind: str, callers: int, conns: list[Connection], args: argparse.Namespace, system: str = "shm"
) -> dict[str, Any]:
    options = {"priority_levels": 2} if system == "shm +options" else {}
    async with make_server(kind, **options) as server:
        name = f"bench-shm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        server.share(name, rows_per_client=max(1024, 2 * callers))
        await asyncio.to_thread(gather, conns, ("connect", name))
        start_at, warmup, seconds = window(args)
        command = (system, name, kind, callers, start_at, warmup, seconds)
        results = await asyncio.to_thread(gather, conns, command)
        return summarize(results, seconds)


def http_binary(kind: str, callers: int, conns: list[Connection], args: argparse.Namespace) -> dict[str, Any]:
    from ferrobatch.serve import ServeConfig, serve_in_thread

    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    with serve_in_thread([make_server(kind)], config) as listening:
        url = f"127.0.0.1:{listening.http_port}"
        start_at, warmup, seconds = window(args)
        results = gather(conns, ("http", url, kind, callers, start_at, warmup, seconds))
    return summarize(results, seconds)


def torchrl(kind: str, transport_kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.modules.inference_server import InferenceServer, MPTransport, SharedMemoryTransport

    if transport_kind.startswith("ferrobatch."):  # the same code with the imports switched
        from ferrobatch.torchrl import InferenceServer, MPTransport, SharedMemoryTransport

    if transport_kind.endswith("torchrl-ray"):
        return torchrl_ray(kind, transport_kind, args)
    model = make_model(kind)

    class Wrapped(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return model({"x": x})["y"]

    ctx = multiprocessing.get_context("spawn")
    if transport_kind.endswith("torchrl-mp"):
        transport: Any = MPTransport(ctx=ctx)
    else:
        spec = TensorDict({"x": torch.zeros(FEATURES)})
        out = TensorDict({"y": torch.zeros(FEATURES)})
        borrowed = transport_kind.endswith("-borrowed")  # copy_result=False: results are views of their slots
        transport = SharedMemoryTransport(
            spec, out, num_slots=PROCESSES * args.callers, ctx=ctx, copy_result=not borrowed
        )
    module = TensorDictModule(Wrapped(), in_keys=["x"], out_keys=["y"])
    server = InferenceServer(module, transport, max_batch_size=MAX_BATCH_SIZE, min_batch_size=1)
    clients = [transport.client() for _ in range(PROCESSES)]
    pipes = [ctx.Pipe() for _ in range(PROCESSES)]
    procs = [ctx.Process(target=torchrl_process, args=(child, c)) for (_, child), c in zip(pipes, clients)]
    for p in procs:
        p.start()
    for parent, _ in pipes:
        assert parent.recv() == "ready"
    server.start()
    runs = []
    try:
        for _ in range(args.runs):
            start_at, warmup, seconds = window(args)
            results = gather([parent for parent, _ in pipes], (args.callers, start_at, warmup, seconds))
            runs.append(summarize(results, seconds))
            print(f"  {kind:8} {transport_kind:12} {runs[-1]['req_per_s']:10.0f} req/s", flush=True)
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for p in procs:
            p.join(60)
        server.shutdown()
    return runs


def torchrl_ray(kind: str, transport_kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``torchrl()`` with a ``RayTransport``: its clients on Ray actors of this machine."""
    import ray
    from tensordict.nn import TensorDictModule
    from torchrl.modules.inference_server import InferenceServer, RayTransport

    if transport_kind.startswith("ferrobatch."):  # the same code with the imports switched
        from ferrobatch.torchrl import InferenceServer, RayTransport

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, PROCESSES), include_dashboard=False, log_to_driver=False, configure_logging=False)
    model = make_model(kind)

    class Wrapped(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return model({"x": x})["y"]

    transport = RayTransport()
    module = TensorDictModule(Wrapped(), in_keys=["x"], out_keys=["y"])
    server = InferenceServer(module, transport, max_batch_size=MAX_BATCH_SIZE, min_batch_size=1)
    actors = [ray.remote(num_cpus=1)(RayCaller).remote(transport.client()) for _ in range(PROCESSES)]
    server.start()
    runs = []
    try:
        # The actors' start and their clients' first requests (TorchRL's make a
        # queue actor each) are not measured.
        ray.get([a.run.remote(1, time.time(), 0.0, 0.5) for a in actors], timeout=600)
        for _ in range(args.runs):
            start_at, warmup, seconds = window(args)
            results = ray.get([a.run.remote(args.callers, start_at, warmup, seconds) for a in actors], timeout=600)
            runs.append(summarize(results, seconds))
            print(f"  {kind:8} {transport_kind:12} {runs[-1]['req_per_s']:10.0f} req/s", flush=True)
    finally:
        for actor in actors:
            ray.kill(actor)
        server.shutdown()
    return runs


# -- the plan ---------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_system(system: str, kind: str, conns: list[Connection], args: argparse.Namespace) -> dict[str, Any]:
    callers = 1 if system.endswith("@1") else args.callers
    if system.startswith("in-process"):
        return asyncio.run(in_process(kind, callers if callers == 1 else PROCESSES * callers, args))
    if system.startswith("shm"):
        plain = "shm +options" if system == "shm +options" else "shm"
        return asyncio.run(shared(kind, callers, conns[:1] if callers == 1 else conns, args, plain))
    return http_binary(kind, callers, conns, args)


def main() -> None:
    global PROCESSES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="identity,mlp,add_sub")
    parser.add_argument("--callers", type=int, default=256, help="callers per client process (default 256)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-torchrl", action="store_true")
    parser.add_argument("--processes", type=int, default=PROCESSES, help="client processes (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where the results go (default {RESULTS.name})")
    parser.add_argument(
        "--ray", action="store_true", help="also TorchRL's RayTransport and ferrobatch.torchrl's (on Ray actors)"
    )
    parser.add_argument(
        "--transports-only",
        action="store_true",
        help="only TorchRL's transports and ferrobatch.torchrl's (the same TorchRL code, imports switched)",
    )
    args = parser.parse_args()
    PROCESSES = args.processes
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"bench_shm: {' '.join(sys.argv[1:]) or '(defaults)'}; {uptime}", flush=True)
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(PROCESSES)]
    procs = [ctx.Process(target=client_process, args=(child,)) for _, child in pipes]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    for conn in conns:
        assert conn.recv() == "ready"
    rows: list[dict[str, Any]] = []
    try:
        for kind in args.models.split(","):
            runs: dict[str, list[dict[str, Any]]] = {}
            for _ in range(0 if args.transports_only else args.runs):
                systems = ["in-process", "shm", "shm +options", "in-process @1", "shm @1", "http-binary"]
                for system in systems[:-1] if kind == "add_sub" else systems:
                    result = run_system(system, kind, conns, args)
                    runs.setdefault(system, []).append(result)
                    p50 = f"{result['p50_us']:8.0f} us p50" if result["p50_us"] else ""
                    print(f"  {kind:8} {system:14} {result['req_per_s']:10.0f} req/s {p50}", flush=True)
            if not args.no_torchrl and torchrl_available() and kind != "add_sub":
                transports = ["torchrl-mp", "torchrl-shm", "torchrl-shm-borrowed"]
                transports += ["ferrobatch.torchrl-mp", "ferrobatch.torchrl-shm", "ferrobatch.torchrl-shm-borrowed"]
                if args.ray:
                    transports += ["torchrl-ray", "ferrobatch.torchrl-ray"]
                for transport in transports:
                    runs[transport] = torchrl(kind, transport, args)
            for system, results in runs.items():
                rows.append(
                    {
                        "model": kind,
                        "system": system,
                        "callers": (1 if "@1" in system else PROCESSES * args.callers),
                        "processes": 1 if system.startswith("in-process") else (1 if "@1" in system else PROCESSES),
                        "req_per_s": median_of(results, "req_per_s"),
                        "p50_us": median_of(results, "p50_us"),
                        "errors": sum(r["errors"] for r in results),
                        "runs": [round(r["req_per_s"]) for r in results],
                    }
                )
    finally:
        for conn in conns:
            conn.send(None)
        for p in procs:
            p.join(60)
    meta = {
        "command": "python benches/python/bench_shm.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "uptime": uptime,
        "seconds": args.seconds,
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "processes": PROCESSES,
    }
    args.out.parent.mkdir(exist_ok=True)
    with args.out.open("w") as out:
        out.write(json.dumps({"meta": meta}) + "\n")
        for row in rows:
            out.write(json.dumps(row) + "\n")
    report(rows)
    print(f"\nresults: {args.out}")


def report(rows: list[dict[str, Any]]) -> None:
    def get(model: str, system: str, key: str) -> float | None:
        for r in rows:
            if r["model"] == model and r["system"] == system:
                value: float | None = r[key]
                return value
        return None

    print("\n| model | system | callers | req/s (median) | p50 round trip |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in rows:
        p50 = f"{r['p50_us']:.0f} µs" if r["p50_us"] else "—"
        print(f"| {r['model']} | {r['system']} | {r['callers']} | {r['req_per_s']:.0f} | {p50} |")
    print()
    for model in dict.fromkeys(r["model"] for r in rows):
        shm, local = get(model, "shm", "req_per_s"), get(model, "in-process", "req_per_s")
        trl = get(model, "torchrl-shm", "req_per_s")
        trl_mp = get(model, "torchrl-mp", "req_per_s")
        p50, p50_local = get(model, "shm @1", "p50_us"), get(model, "in-process @1", "p50_us")
        parts = []
        if shm and local:
            parts.append(f"shm / in-process {shm / local:.2f}x (target >= 0.7)")
        options = get(model, "shm +options", "req_per_s")
        if shm and options:
            parts.append(f"shm +options / shm {options / shm:.2f}x (target >= 0.9)")
        if shm and trl:
            parts.append(f"shm / torchrl-shm {shm / trl:.1f}x (target >= 10)")
        if shm and trl_mp:
            parts.append(f"shm / torchrl-mp {shm / trl_mp:.1f}x (target >= 50)")
        ours_mp = get(model, "ferrobatch.torchrl-mp", "req_per_s")
        if ours_mp and trl_mp:
            parts.append(f"ferrobatch.torchrl-mp / torchrl-mp {ours_mp / trl_mp:.1f}x (target >= 10)")
        ours_shm = get(model, "ferrobatch.torchrl-shm", "req_per_s")
        if ours_shm and trl:
            parts.append(f"ferrobatch.torchrl-shm / torchrl-shm {ours_shm / trl:.1f}x (target >= 10)")
        for side in ("torchrl", "ferrobatch.torchrl"):
            copied, borrowed = get(model, f"{side}-shm", "req_per_s"), get(model, f"{side}-shm-borrowed", "req_per_s")
            if copied and borrowed:
                parts.append(f"{side}-shm copy_result=False / True {borrowed / copied:.2f}x")
        ours_borrowed, trl_borrowed = (
            get(model, "ferrobatch.torchrl-shm-borrowed", "req_per_s"),
            get(model, "torchrl-shm-borrowed", "req_per_s"),
        )
        if ours_borrowed and trl_borrowed:
            parts.append(f"ferrobatch.torchrl-shm-borrowed / torchrl-shm-borrowed {ours_borrowed / trl_borrowed:.1f}x")
        trl_ray, ours_ray = get(model, "torchrl-ray", "req_per_s"), get(model, "ferrobatch.torchrl-ray", "req_per_s")
        if trl_ray and ours_ray:
            parts.append(f"ferrobatch.torchrl-ray / torchrl-ray {ours_ray / trl_ray:.1f}x")
        if p50 and p50_local:
            parts.append(f"p50@1 shm / in-process {p50 / p50_local:.2f}x (target <= 2)")
        print(f"{model}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
