"""Serving: the common workload over HTTP and gRPC, ferrobatch versus PyTriton.

C concurrent callers (C = 1, 64, 512), each awaiting one request at a time
through tritonclient's aio clients; a request is ``{"x": float32[1, 256]}``
(binary tensor data over HTTP, raw contents over gRPC); models ``identity``
and ``mlp`` (Linear 256->256, ReLU, Linear 256->256, eval mode);
``max_batch_size=64``, max delay 1 ms. For every server, protocol, model and
C it reports requests/s, p50 and p99 latency (as the caller sees it), and the
mean batch size where the server exposes it.

Servers, each in its own process:
- ``ferrobatch``: ``python -m ferrobatch serve benches/python/bench_serve.py:make_servers``;
- ``pytriton``: the same models bound to PyTriton (NVIDIA's Triton with a
  Python backend) with its dynamic batcher, when ``nvidia-pytriton`` can be
  imported by this interpreter or by the one given with ``--pytriton-python``
  (PyTriton pins numpy < 2, so it may live in a venv of its own; it needs
  torch there for ``mlp``).

The callers run in ``--client-procs`` processes (C split between them) so the
client is less of a bottleneck; on a small machine clients and server share
the cores, the same for every server.

The servers take turns case by case over ``--runs`` repetitions (so a busy
machine affects them alike); the table shows the medians. Besides req/s and
latency it shows the server's CPU time per request (its process tree, in the
measured window), which does not depend on how fast the client is.

Output: a table on stdout, JSON lines (every run) in ``benches/results/serve.jsonl``,
replaced by each run. ``--report`` renders the table of ``benches/README.md``
from that file.

    python benches/python/bench_serve.py
    python benches/python/bench_serve.py --pytriton-python /path/to/venv/bin/python
    python benches/python/bench_serve.py --quick       # a smoke run
    python benches/python/bench_serve.py --report      # the README's table, from serve.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import functools
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
RESULTS = ROOT / "benches" / "results"
#: The latest run's results: each run replaces them (older ones live in git history).
LATEST = RESULTS / "serve.jsonl"
WIDTH = 256
MAX_BATCH = 64
MAX_DELAY = 0.001


# -- the models (imported by `ferrobatch serve` and by the PyTriton process) -------------------


def _torch_threads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with --torch-threads intra-op threads on whatever thread calls
    it: torch's setting is per thread (OpenMP's), and both servers call their
    model on threads of their own."""
    import threading

    import torch

    threads = int(os.environ.get("BENCH_TORCH_THREADS", "0"))
    done = threading.local()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threads > 0 and not getattr(done, "set", False):
            torch.set_num_threads(threads)
            done.set = True
        return fn(*args, **kwargs)

    return wrapper


def make_servers() -> list[Any]:
    """The ferrobatch servers: ``identity`` and ``mlp``."""
    import torch

    import ferrobatch as fb
    from ferrobatch.demo import make_demo_model

    def identity(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"]}

    specs = {
        "inputs": [fb.TensorSpec("x", "float32", (WIDTH,))],
        "outputs": [fb.TensorSpec("y", "float32", (WIDTH,))],
        "max_batch_size": MAX_BATCH,
        "max_delay": MAX_DELAY,
    }
    return [
        fb.Server(_torch_threads(identity), name="identity", **specs),
        fb.Server(_torch_threads(make_demo_model(WIDTH)), name="mlp", **specs),
    ]


def run_pytriton(http_port: int, grpc_port: int, metrics_port: int) -> None:
    """Serves identity and mlp with PyTriton until SIGTERM/SIGINT."""
    import numpy as np
    import torch
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    sys.path.insert(0, str(ROOT / "python"))
    from ferrobatch.demo import make_demo_model

    mlp = make_demo_model(WIDTH)

    @batch  # type: ignore[misc]
    @_torch_threads
    def identity_fn(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    @batch  # type: ignore[misc]
    @_torch_threads
    def mlp_fn(x: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {"y": mlp({"x": torch.from_numpy(x)})["y"].numpy()}

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, log_verbose=0)
    model_config = ModelConfig(
        max_batch_size=MAX_BATCH,
        batcher=DynamicBatcher(max_queue_delay_microseconds=round(MAX_DELAY * 1e6)),
    )
    with Triton(config=config) as triton:
        for name, fn in (("identity", identity_fn), ("mlp", mlp_fn)):
            triton.bind(
                model_name=name,
                infer_func=fn,
                inputs=[Tensor(name="x", dtype=np.float32, shape=(WIDTH,))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(WIDTH,))],
                config=model_config,
            )
        triton.serve()


# -- the callers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    url: str
    protocol: str
    model: str
    callers: int
    start_at: float  # wall clock: every client process measures the same window
    warmup: float
    seconds: float


def client_process(load: Load, out: Any) -> None:
    """Runs ``load.callers`` callers on one event loop; sends back the
    latencies (seconds) of requests completed inside the measured window."""
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        out.send(runner.run(_drive(load)))
    out.close()


async def _drive(load: Load) -> dict[str, Any]:
    import numpy as np

    if load.protocol == "http":
        import tritonclient.http.aio as client_lib

        client = client_lib.InferenceServerClient(load.url, conn_limit=max(load.callers, 1))
    else:
        import tritonclient.grpc.aio as client_lib  # type: ignore[no-redef]

        client = client_lib.InferenceServerClient(load.url)
    measure_from = load.start_at + load.warmup
    until = measure_from + load.seconds
    latencies: list[float] = []
    errors: list[str] = []

    async def caller(seed: int) -> None:
        x = np.random.default_rng(seed).standard_normal((1, WIDTH)).astype(np.float32)
        tensor = client_lib.InferInput("x", [1, WIDTH], "FP32")
        tensor.set_data_from_numpy(x)
        outputs = [client_lib.InferRequestedOutput("y")]
        while True:
            started = time.time()
            if started >= until:
                return
            try:
                await client.infer(load.model, [tensor], outputs=outputs)
            except Exception as exc:  # noqa: BLE001 - counted, reported
                errors.append(str(exc)[:200])
                await asyncio.sleep(0.01)
                continue
            done = time.time()
            if measure_from <= done < until:
                latencies.append(done - started)

    await asyncio.sleep(max(0.0, load.start_at - time.time()))
    try:
        await asyncio.gather(*(caller(i) for i in range(load.callers)))
    finally:
        await client.close()
    return {"latencies": latencies, "errors": len(errors), "first_error": errors[0] if errors else None}


# -- the servers --------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Endpoint:
    name: str
    http: str
    grpc: str
    metrics: str  # base URL of /metrics
    pid: int  # the server's process; its CPU time counts its descendants too


def cpu_seconds(root: int) -> float:
    """User + system CPU time of process ``root`` and its descendants (Linux;
    NaN elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return float("nan")
    children: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: ppid
        times[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def wait_ready(url: str, proc: subprocess.Popen[bytes], seconds: float = 180) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode}")
            try:
                if client.is_server_ready() and all(client.is_model_ready(m) for m in ("identity", "mlp")):
                    return
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError(f"the server at {url} was not ready within {seconds}s")


def stop(proc: subprocess.Popen[bytes], seconds: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def ferrobatch_server(log: Path) -> Iterator[Endpoint]:
    http, grpc = free_ports(2)
    cmd = [
        sys.executable, "-m", "ferrobatch", "serve", f"{HERE}:make_servers",
        "--http-port", str(http), "--grpc-port", str(grpc), "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            wait_ready(f"127.0.0.1:{http}", proc)
            yield Endpoint("ferrobatch", f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}", proc.pid)
        finally:
            stop(proc)


@contextmanager
def pytriton_server(python: str, log: Path) -> Iterator[Endpoint]:
    http, grpc, metrics = free_ports(3)
    cmd = [
        python, str(HERE), "--pytriton-server",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = dict(os.environ)
    # Triton's Python-backend stub links libpython; point it at this
    # interpreter's own (a system copy of another patch release breaks it).
    libdir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(f"127.0.0.1:{http}", proc)
            yield Endpoint(
                "pytriton", f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}", proc.pid
            )
        finally:
            stop(proc, seconds=90)


def pytriton_python(arg: str | None) -> str | None:
    """The interpreter that runs PyTriton: the one given, else this one if it can."""
    candidates = [arg] if arg else [sys.executable]
    for python in candidates:
        if (python and shutil.which(python)) or (python and Path(python).exists()):
            probe = subprocess.run([python, "-c", "import pytriton.triton"], capture_output=True)
            if probe.returncode == 0:
                return python
    return None


def scrape_batches(metrics_url: str, model: str) -> tuple[float, float]:
    """(rows, model executions) of ``model`` from a Triton-style /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10).read().decode()
    values = {}
    for name in ("nv_inference_count", "nv_inference_exec_count"):
        found = re.search(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
        values[name] = float(found.group(1)) if found else float("nan")
    return values["nv_inference_count"], values["nv_inference_exec_count"]


# -- one measurement ---------------------------------------------------------------------------


@dataclass
class Result:
    server: str
    protocol: str
    model: str
    callers: int
    client_procs: int
    seconds: float
    requests: int
    errors: int
    rps: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    server_cpu_us: float  # server CPU time per request in the measured window
    first_error: str | None = None


def measure(endpoint: Endpoint, protocol: str, model: str, callers: int, args: argparse.Namespace) -> Result:
    import numpy as np

    procs = max(1, min(args.client_procs, callers))
    shares = [callers // procs + (1 if i < callers % procs else 0) for i in range(procs)]
    url = endpoint.http if protocol == "http" else endpoint.grpc
    start_at = time.time() + 1.0  # time to spawn the client processes
    ctx = mp.get_context("spawn")
    pipes, workers = [], []
    for share in shares:
        receive, send = ctx.Pipe(duplex=False)
        load = Load(url, protocol, model, share, start_at, args.warmup, args.seconds)
        worker = ctx.Process(target=client_process, args=(load, send), daemon=True)
        worker.start()
        send.close()
        pipes.append(receive)
        workers.append(worker)
    before = scrape_batches(endpoint.metrics, model)
    time.sleep(max(0.0, start_at + args.warmup - time.time()))
    cpu_before = cpu_seconds(endpoint.pid)
    time.sleep(max(0.0, start_at + args.warmup + args.seconds - time.time()))
    cpu = cpu_seconds(endpoint.pid) - cpu_before
    parts = [p.recv() for p in pipes]
    for w in workers:
        w.join()
    after = scrape_batches(endpoint.metrics, model)
    rows, execs = after[0] - before[0], after[1] - before[1]
    latencies = np.concatenate([np.asarray(p["latencies"], dtype=np.float64) for p in parts])
    errors = sum(p["errors"] for p in parts)
    first_error = next((p["first_error"] for p in parts if p["first_error"]), None)
    n = len(latencies)
    return Result(
        server=endpoint.name,
        protocol=protocol,
        model=model,
        callers=callers,
        client_procs=procs,
        seconds=args.seconds,
        requests=n,
        errors=errors,
        rps=n / args.seconds,
        p50_ms=float(np.percentile(latencies, 50) * 1e3) if n else float("nan"),
        p99_ms=float(np.percentile(latencies, 99) * 1e3) if n else float("nan"),
        mean_batch=rows / execs if execs > 0 else float("nan"),
        server_cpu_us=cpu / n * 1e6 if n else float("nan"),
        first_error=first_error,
    )


# -- reporting ---------------------------------------------------------------------------------


def medians(results: list[Result]) -> list[Result]:
    """One result per case: the median of each figure over the runs."""
    cases: dict[tuple[str, str, str, int], list[Result]] = {}
    for r in results:
        cases.setdefault((r.server, r.protocol, r.model, r.callers), []).append(r)
    merged = []
    for runs in cases.values():
        first = runs[0]
        figures = {
            f: statistics.median(getattr(r, f) for r in runs)
            for f in ("rps", "p50_ms", "p99_ms", "mean_batch", "server_cpu_us")
        }
        errors = sum(r.errors for r in runs)
        merged.append(replace(first, **figures, errors=errors, requests=sum(r.requests for r in runs)))
    return merged


def print_table(results: list[Result]) -> None:
    header = (
        f"{'server':<11}{'proto':<6}{'model':<9}{'C':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'batch':>7}{'cpu us/req':>11}{'errors':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.server:<11}{r.protocol:<6}{r.model:<9}{r.callers:>5}{r.rps:>10.0f}"
            f"{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{r.mean_batch:>7.1f}{r.server_cpu_us:>11.0f}{r.errors:>8}"
        )


def print_ratios(results: list[Result]) -> None:
    """ferrobatch against PyTriton, case by case; the target is checked at C=512."""
    by_key = {(r.server, r.protocol, r.model, r.callers): r for r in results}
    lines = []
    for (server, protocol, model, callers), r in sorted(by_key.items()):
        other = by_key.get(("pytriton", protocol, model, callers))
        if server != "ferrobatch" or other is None or not other.rps:
            continue
        line = (
            f"  {protocol:<5}{model:<9}C={callers:<4} req/s x{r.rps / other.rps:.2f}"
            f"   p99 {r.p99_ms:.1f} ms vs {other.p99_ms:.1f} ms"
            f"   server CPU per request x{other.server_cpu_us / r.server_cpu_us:.2f} less"
        )
        if callers == 512:
            met = r.rps >= 10 * other.rps and r.p99_ms < other.p99_ms
            line += "   target (>= 10x req/s, lower p99): " + ("met" if met else "MISSED")
        lines.append(line)
    if lines:
        print("\nferrobatch / PyTriton:")
        print("\n".join(lines))


def markdown(path: Path) -> str:
    """The table of benches/README.md (medians over the runs) from a results file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fields = Result.__dataclass_fields__
    results = medians([Result(**{k: v for k, v in row.items() if k in fields}) for row in rows])
    meta = rows[0]
    runs = max(row["run"] for row in rows) + 1
    commit = f", ferrobatch {meta['ferrobatch_commit']}" if meta.get("ferrobatch_commit") else ""
    out = [
        f"<!-- python benches/python/bench_serve.py --report {path.name}: `{meta['command']}`,"
        f" {meta['date']}{commit}; {meta['cpus']} CPUs, Python {meta['python']}; medians of {runs} run(s) -->",
        "",
        "| server | proto | model | C | req/s | p50 ms | p99 ms | batch | cpu us/req |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {"ferrobatch": "ferrobatch", "pytriton": "PyTriton"}
    for r in results:
        out.append(
            f"| {names.get(r.server, r.server)} | {r.protocol} | {r.model} | {r.callers} | {r.rps:.0f} |"
            f" {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.mean_batch:.1f} | {r.server_cpu_us:.0f} |"
        )
    return "\n".join(out)


def ferrobatch_commit() -> str | None:
    """The git commit of the checkout the bench runs from, if any."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", default="1,64,512", help="comma-separated C values (default 1,64,512)")
    parser.add_argument("--models", default="identity,mlp")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--servers", default="ferrobatch,pytriton")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per case (default 5)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="repetitions; the table shows medians (default 3)")
    parser.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--pytriton-python", help="interpreter with nvidia-pytriton (default: this one)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in both servers (default 1; 0: torch's default)",
    )
    parser.add_argument("--out", type=Path, help="output prefix (default benches/results/serve, replaced by each run)")
    parser.add_argument("--quick", action="store_true", help="C=1,64, 1 s per case")
    parser.add_argument(
        "--report",
        type=Path,
        nargs="?",
        const=LATEST,
        metavar="RESULTS.jsonl",
        help="run nothing: print the Markdown table of benches/README.md from a run's results"
        " (default benches/results/serve.jsonl)",
    )
    # Internal: the PyTriton server process.
    parser.add_argument("--pytriton-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pytriton_server:
        run_pytriton(args.http_port, args.grpc_port, args.metrics_port)
        return 0
    if args.report:
        print(markdown(args.report))
        return 0
    if args.quick:
        args.callers, args.seconds, args.warmup, args.runs = "1,64", 1.0, 0.5, 1

    os.environ["BENCH_TORCH_THREADS"] = str(args.torch_threads)  # inherited by the servers
    callers = [int(c) for c in args.callers.split(",")]
    models = args.models.split(",")
    protocols = args.protocols.split(",")
    servers = args.servers.split(",")
    stamp = dt.datetime.now(dt.UTC)
    prefix = args.out or LATEST.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    meta = {
        "date": stamp.isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "ferrobatch_commit": ferrobatch_commit(),
        # The interpreter's path says nothing about the run: left out.
        "command": " ".join(
            [Path(sys.argv[0]).name] + ["PYTRITON_PYTHON" if a == args.pytriton_python else a for a in sys.argv[1:]]
        ),
        "torch_threads": args.torch_threads,
    }
    print(f"# bench_serve {meta['date']}  {meta['cpus']} CPUs  python {meta['python']}")

    results: list[Result] = []
    jsonl = prefix.with_suffix(".jsonl")
    with contextlib.ExitStack() as stack, jsonl.open("w") as out:
        endpoints = []
        for server in servers:
            if server == "pytriton":
                python = pytriton_python(args.pytriton_python)
                if python is None:
                    print("# pytriton: skipped (nvidia-pytriton is not importable; see --pytriton-python)")
                    continue
                endpoints.append(stack.enter_context(pytriton_server(python, logs / "pytriton.log")))
            elif server == "ferrobatch":
                endpoints.append(stack.enter_context(ferrobatch_server(logs / "ferrobatch.log")))
            else:
                parser.error(f"unknown server {server!r}")
        # Servers take turns case by case, so a noisy machine affects them alike.
        for run in range(args.runs):
            for protocol in protocols:
                for model in models:
                    for c in callers:
                        for endpoint in endpoints:
                            r = measure(endpoint, protocol, model, c, args)
                            results.append(r)
                            out.write(json.dumps({**meta, "run": run, **asdict(r)}) + "\n")
                            out.flush()
                            print(
                                f"  [{run}] {r.server} {r.protocol} {r.model} C={r.callers}: {r.rps:.0f} req/s,"
                                f" p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms, batch {r.mean_batch:.1f},"
                                f" server CPU {r.server_cpu_us:.0f} us/request,"
                                f" errors {r.errors}" + (f" ({r.first_error})" if r.first_error else ""),
                                flush=True,
                            )
    results = medians(results)
    print()
    print_table(results)
    print_ratios(results)
    print(f"\nresults: {jsonl.relative_to(ROOT) if jsonl.is_relative_to(ROOT) else jsonl}")
    print(f"server logs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
