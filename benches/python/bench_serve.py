"""Serving: the common workload over HTTP and gRPC, ferrobatch versus PyTriton.

Two drivers. ``--driver wrk`` (the default) drives the servers with native
load generators, so that no Python client sets the pace: ``wrk`` for HTTP
(``json``: a v2 JSON body; ``binary``: the binary tensor extension;
``generate``, when asked for: Triton's generate extension, each input by
name as a flat array) and
``h2load`` for gRPC (a length-prefixed ``ModelInferRequest``), each posting
one fixed request (``serve_loadgen.py``) over C connections (64, 256), one
request in flight on each. The server runs pinned to one core (``taskset -c
0``), the generator to the other (``taskset -c 1``); every case gets a warm-up
run, then a measured one. For each server, protocol, model and C it reports
requests/s, p50 and p99 latency (as the generator saw them), the mean batch
size, and the server's CPU time per request: the utime + stime of its process
tree, from /proc/PID/stat, over the measured run, divided by the requests
completed. It also records the 1-minute load average and how busy each of the
two cores was (from /proc/stat), since other work on the machine shows there.
Needs ``wrk``, ``h2load`` and ``taskset`` (``make bench-serve`` installs them).

Models: ``identity`` and ``mlp`` take ``x`` float32[256] (fixed shapes);
``--models`` adds PyTriton's usual shapes (wrk driver only): ``add_sub``
(two float32 ``(-1,)`` inputs ``a``, ``b`` of 16 elements per request, outputs
``add``, ``sub``, as PyTriton's add_sub example) and ``bytes_echo`` (BYTES
``(1,)``, one 32-byte string, echoed). ferrobatch serves ``(-1,)`` padded
(``ragged="pad"``), as ``ferrobatch.triton`` binds it; PyTriton binds the same
shapes. Issue 24's targets compare them with identity in the same run.
``token_stream`` is a decoupled model for Triton's ``generate_stream`` (the
opt-in protocol it is driven over): it answers each request with 8
responses, each the request's 32-byte string, one Server-Sent Event each.

``--driver aio``: C concurrent callers (C = 1, 64, 512), each awaiting one request at a time
through tritonclient's aio clients; a request is ``{"x": float32[1, 256]}``
(binary tensor data over HTTP, raw contents over gRPC); models ``identity``
and ``mlp`` (Linear 256->256, ReLU, Linear 256->256, eval mode);
``max_batch_size=64``, max delay 1 ms. For every server, protocol, model and
C it reports requests/s, p50 and p99 latency (as the caller sees it), and the
mean batch size where the server exposes it.

Servers, each in its own process:
- ``ferrobatch``: ``python -m ferrobatch serve benches/python/bench_serve.py:make_servers``
  (the native front-end: Rust answers HTTP and gRPC, Python runs the model);
- ``ferrobatch-python``: the same with ``--frontend python`` (uvicorn + Starlette, grpcio);
- ``ferrobatch-gzip``: the native front-end with ``--grpc-infer-response-compression-level low``,
  its gRPC load asking for gzip: what compressing each reply costs;
- ``ferrobatch-tls``: the native front-end with gRPC over TLS (``--grpc-use-ssl``, a throwaway
  CA's certificate; h2load over ``https``): what TLS costs beside ``ferrobatch``'s h2c;
- ``hyper-echo``: a bare hyper server on the native front-end's stack that answers each
  request with its own body (``rust/serve/examples/echo.rs``): the ceiling, wrk driver only;
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

PyTriton runs with the interpreter given by ``--pytriton-python``, else the
one of ``.venv-pytriton`` at the top of the checkout (``make bench-serve``
makes it), else this one.

Output: a table on stdout, JSON lines (every run) in ``benches/results/serve.jsonl``,
replaced by each run. ``--report`` renders the table of ``benches/README.md``
from that file.

    python benches/python/bench_serve.py                # wrk and h2load, 3 runs
    python benches/python/bench_serve.py --driver aio   # tritonclient's aio clients
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
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import serve_loadgen as loadgen

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
RESULTS = ROOT / "benches" / "results"
#: The latest run's results: each run replaces them (older ones live in git history).
LATEST = RESULTS / "serve.jsonl"
#: Where ``make bench-serve`` puts PyTriton's own venv (it pins numpy < 2).
PYTRITON_VENV = ROOT / ".venv-pytriton"
WIDTH = 256
#: PyTriton's usual shapes: add_sub's requests carry this many elements per
#: (-1,) input, bytes_echo's one string of this many bytes.
ADD_SUB_LENGTH = 16
BYTES_LENGTH = 32
#: token_stream's responses per request.
TOKENS = 8
#: Every model each server serves.
MODELS = ("identity", "mlp", "add_sub", "bytes_echo", "token_stream")
#: Models that stream their responses (decoupled): driven over generate_stream only.
DECOUPLED = ("token_stream",)
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


def _identity(inputs: dict[str, Any]) -> dict[str, Any]:
    return {"y": inputs["x"]}


def make_servers() -> list[Any]:
    """The ferrobatch servers: ``identity`` and ``mlp`` (fixed shapes), and
    PyTriton's usual shapes: ``add_sub`` (two FP32 ``(-1,)`` inputs and
    outputs, padded) and ``bytes_echo`` (BYTES ``(1,)`` in and out)."""
    import torch

    import ferrobatch as fb
    from ferrobatch.demo import make_demo_model

    def identity(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"]}

    def add_sub(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a, b, lengths = inputs["a"], inputs["b"], inputs["a_lengths"]
        return {"add": a + b, "add_lengths": lengths, "sub": a - b, "sub_lengths": lengths}

    def bytes_echo(inputs: dict[str, Any]) -> dict[str, Any]:
        return {"y": inputs["x"]}

    def token_stream(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for _ in range(TOKENS):
            yield {"y": inputs["x"]}

    batching = {"max_batch_size": MAX_BATCH, "max_delay": MAX_DELAY}
    # --scaling --instances cores: one worker per server core for the fixed-shape models,
    # threads or (--instance-kind process) processes.
    instances = int(os.environ.get("BENCH_INSTANCES", "1"))
    kind = os.environ.get("BENCH_INSTANCE_KIND", "thread")
    mlp = make_demo_model(WIDTH)
    specs = {
        "inputs": [fb.TensorSpec("x", "float32", (WIDTH,))],
        "outputs": [fb.TensorSpec("y", "float32", (WIDTH,))],
        "instance_kind": kind,
        **batching,
    }
    if kind == "process":  # sent to the processes: picklable models (torch threads: the server's budget)
        fixed = [
            fb.Server([_identity] * instances, name="identity", **specs),
            fb.Server([mlp] * instances, name="mlp", **specs),
        ]
    else:
        fixed = [
            fb.Server([_torch_threads(identity)] * instances, name="identity", **specs),
            fb.Server([_torch_threads(mlp)] * instances, name="mlp", **specs),
        ]
    variable = [fb.TensorSpec(name, "float32", (-1,), ragged="pad") for name in ("a", "b", "add", "sub")]
    return [
        *fixed,
        fb.Server(_torch_threads(add_sub), name="add_sub", inputs=variable[:2], outputs=variable[2:], **batching),
        fb.Server(
            bytes_echo,
            name="bytes_echo",
            inputs=[fb.TensorSpec("x", "bytes", (1,))],
            outputs=[fb.TensorSpec("y", "bytes", (1,))],
            **batching,
        ),
        fb.Server(
            token_stream,
            name="token_stream",
            inputs=[fb.TensorSpec("x", "bytes", (1,))],
            outputs=[fb.TensorSpec("y", "bytes", (1,))],
            decoupled=True,
            **batching,
        ),
    ]


def payload(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One request's inputs for ``model`` (batch dimension 1) and the outputs
    it must get back, by name."""
    import numpy as np

    rng = np.random.default_rng(0)
    if model in ("identity", "mlp"):
        x = rng.standard_normal((1, WIDTH)).astype(np.float32)
        if model == "identity":
            return {"x": x}, {"y": x}
        import torch

        from ferrobatch.demo import make_demo_model

        with torch.inference_mode():
            return {"x": x}, {"y": make_demo_model(WIDTH)({"x": torch.from_numpy(x)})["y"].numpy()}
    if model == "add_sub":
        a, b = (rng.standard_normal((1, ADD_SUB_LENGTH)).astype(np.float32) for _ in range(2))
        return {"a": a, "b": b}, {"add": a + b, "sub": a - b}
    if model in ("bytes_echo", "token_stream"):
        text = np.empty((1, 1), dtype=object)
        text[0, 0] = bytes(rng.integers(ord("a"), ord("z") + 1, BYTES_LENGTH, dtype=np.uint8))
        # token_stream: its responses' elements, in order.
        return {"x": text}, {"y": text if model == "bytes_echo" else np.repeat(text, TOKENS, axis=0)}
    raise ValueError(f"unknown model {model!r}")


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
    def add_sub_fn(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        return {"add": a + b, "sub": a - b}

    @batch  # type: ignore[misc]
    def bytes_echo_fn(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    @batch  # type: ignore[misc]
    def token_stream_fn(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for _ in range(TOKENS):
            yield {"y": x}

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
        triton.bind(
            model_name="add_sub",
            infer_func=add_sub_fn,
            inputs=[Tensor(name=n, dtype=np.float32, shape=(-1,)) for n in ("a", "b")],
            outputs=[Tensor(name=n, dtype=np.float32, shape=(-1,)) for n in ("add", "sub")],
            config=model_config,
        )
        triton.bind(
            model_name="bytes_echo",
            infer_func=bytes_echo_fn,
            inputs=[Tensor(name="x", dtype=np.bytes_, shape=(1,))],
            outputs=[Tensor(name="y", dtype=np.bytes_, shape=(1,))],
            config=model_config,
        )
        triton.bind(
            model_name="token_stream",
            infer_func=token_stream_fn,
            inputs=[Tensor(name="x", dtype=np.bytes_, shape=(1,))],
            outputs=[Tensor(name="y", dtype=np.bytes_, shape=(1,))],
            config=replace(model_config, decoupled=True),
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
    #: gRPC over TLS: the CA that signs the server's certificate (None: h2c).
    grpc_root: Path | None = None
    #: The load's ``grpc-accept-encoding`` (None: not sent): its replies come
    #: compressed, so their length is not checked per reply (the one checked
    #: request is, decompressed).
    accept_encoding: str | None = None


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
                if client.is_server_ready() and all(client.is_model_ready(m) for m in MODELS):
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


def pinned(cpu: str | None) -> list[str]:
    """The command prefix that runs a program on ``cpu`` only (its threads and children too)."""
    return ["taskset", "-c", cpu] if cpu is not None else []


@contextmanager
def ferrobatch_server(
    log: Path,
    cpu: str | None = None,
    frontend: str = "native",
    threads: int | None = None,
    wrapper: Sequence[str] = (),
    ready_seconds: float = 180,
    tls: bool = False,
    compression: str | None = None,
) -> Iterator[Endpoint]:
    """``ferrobatch serve`` with this file's models, run by ``wrapper`` (a
    profiler's command line) when given; ``tls``: gRPC over TLS, with a
    throwaway CA's certificate (written beside ``log``); ``compression``:
    gRPC responses compressed at that level (its load asks for gzip)."""
    http, grpc = free_ports(2)
    cmd = [
        *pinned(cpu), *wrapper, sys.executable, "-m", "ferrobatch", "serve", f"{HERE}:make_servers",
        "--http-port", str(http), "--grpc-port", str(grpc), "--log-level", "warning", "--frontend", frontend,
        *(["--threads", str(threads)] if threads else []),
    ]  # fmt: skip
    name = "ferrobatch" if frontend == "native" else f"ferrobatch-{frontend}"
    root = None
    if tls:
        import trustme

        ca, root = trustme.CA(), log.with_suffix(".ca.pem")
        issued = ca.issue_cert("127.0.0.1")
        ca.cert_pem.write_to_path(str(root))
        issued.cert_chain_pems[0].write_to_path(str(log.with_suffix(".cert.pem")))
        issued.private_key_pem.write_to_path(str(log.with_suffix(".key.pem")))
        cmd += ["--grpc-use-ssl", "--grpc-server-cert", str(log.with_suffix(".cert.pem"))]
        cmd += ["--grpc-server-key", str(log.with_suffix(".key.pem"))]
        name += "-tls"
    if compression is not None:
        cmd += ["--grpc-infer-response-compression-level", compression]
        name += "-gzip"
    # It imports this file, which imports serve_loadgen beside it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(f"127.0.0.1:{http}", proc, ready_seconds)
            yield Endpoint(
                name, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}", proc.pid, root,
                accept_encoding="gzip" if compression else None,
            )  # fmt: skip
        finally:
            stop(proc)


#: The bare hyper server (rust/serve/examples/echo.rs): the ceiling of the stack.
ECHO = ROOT / "target" / "release" / "examples" / "echo"


@contextmanager
def echo_server(log: Path, cpu: str | None = None) -> Iterator[Endpoint]:
    """A bare hyper server on the native front-end's stack answering every
    request with its own body: what serving costs with no model, no codec and
    no batching. It serves HTTP/1.1 and h2c on one port (gRPC's bytes echoed)."""
    build = ["cargo", "build", "--release", "--quiet", "-p", "ferrobatch-serve", "--example", "echo"]
    subprocess.run(build, cwd=ROOT, check=True)
    (port,) = free_ports(1)
    with log.open("wb") as out:
        proc = subprocess.Popen([*pinned(cpu), str(ECHO), str(port)], stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the echo server did not start")
                time.sleep(0.05)
            address = f"127.0.0.1:{port}"
            yield Endpoint("hyper-echo", address, address, "", proc.pid)
        finally:
            stop(proc)


@contextmanager
def pytriton_server(python: str, log: Path, cpu: str | None = None) -> Iterator[Endpoint]:
    http, grpc, metrics = free_ports(3)
    cmd = [
        *pinned(cpu), python, str(HERE), "--pytriton-server",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = pytriton_env(python)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(f"127.0.0.1:{http}", proc)
            yield Endpoint(
                "pytriton", f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}", proc.pid
            )
        finally:
            stop(proc, seconds=90)


def pytriton_env(python: str) -> dict[str, str]:
    """This process's environment for a PyTriton server run by ``python``:
    Triton's Python-backend stub links libpython, so ``LD_LIBRARY_PATH``
    starts with that interpreter's own (a system copy of another patch
    release breaks it)."""
    env = dict(os.environ)
    libdir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    return env


def pytriton_python(arg: str | None) -> str | None:
    """The interpreter that runs PyTriton: the one given, else .venv-pytriton's,
    else this one, if it can."""
    candidates = [arg] if arg else [str(PYTRITON_VENV / "bin" / "python"), sys.executable]
    for python in candidates:
        if (python and shutil.which(python)) or (python and Path(python).exists()):
            probe = subprocess.run([python, "-c", "import pytriton.triton"], capture_output=True)
            if probe.returncode == 0:
                return python
    return None


def scrape_batches(metrics_url: str, model: str) -> tuple[float, float]:
    """(rows, model executions) of ``model`` from a Triton-style /metrics
    (NaN for a server without one)."""
    import urllib.request

    if not metrics_url:
        return float("nan"), float("nan")
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
    driver: str = "aio"  # "aio": tritonclient's aio callers; "wrk": wrk / h2load (callers = connections)
    load1: float = float("nan")  # the 1-minute load average when the case started
    server_core_busy: float = float("nan")  # fraction of the server's core busy (any process), wrk driver
    loadgen_core_busy: float = float("nan")  # the same for the load generator's core


FIGURES = ("rps", "p50_ms", "p99_ms", "mean_batch", "server_cpu_us", "load1", "server_core_busy", "loadgen_core_busy")


def answers(protocol: str, model: str) -> bool:
    """Whether ``model`` is driven over ``protocol``: a decoupled one over
    ``generate_stream`` only (its other ways answer once)."""
    return model not in DECOUPLED or protocol == "generate_stream"


def measure(endpoint: Endpoint, protocol: str, model: str, callers: int, args: argparse.Namespace) -> Result:
    import numpy as np

    procs = max(1, min(args.client_procs, callers))
    shares = [callers // procs + (1 if i < callers % procs else 0) for i in range(procs)]
    url = endpoint.http if protocol == "http" else endpoint.grpc
    load1 = os.getloadavg()[0]
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
        load1=load1,
    )


class Native:
    """The wrk / h2load driver: fixed requests and their checked reply lengths."""

    def __init__(self, models: list[str], protocols: list[str]) -> None:
        payloads = {model: payload(model) for model in models}
        self.expected = {model: expected for model, (_, expected) in payloads.items()}
        self.requests = {
            (p, m): loadgen.make_request(p, m, payloads[m][0], tuple(payloads[m][1]))
            for p in protocols
            for m in models
            if answers(p, m)
        }
        self.reply_length: dict[tuple[str, str, str], int] = {}

    def _load(self, endpoint: Endpoint, protocol: str, model: str, c: int, seconds: float, cpu: str) -> Any:
        request = self.requests[protocol, model]
        key = (endpoint.name, protocol, model)
        if endpoint.name == "hyper-echo":  # no model: its replies are the requests
            self.reply_length[key] = 0
        elif key not in self.reply_length:  # the server answers these bytes right, once per server
            self.reply_length[key] = loadgen.check(
                request, endpoint.http, endpoint.grpc, self.expected[model], endpoint.grpc_root
            )
        if protocol == "grpc":
            tls = endpoint.grpc_root is not None
            length = self.reply_length[key]
            if endpoint.accept_encoding is not None:
                request = replace(
                    request, headers={**request.headers, "grpc-accept-encoding": endpoint.accept_encoding}
                )
                length = 0
            return loadgen.run_h2load(request, endpoint.grpc, c, seconds, cpu, length, tls)
        return loadgen.run_wrk(request, endpoint.http, c, seconds, cpu)

    def measure(self, endpoint: Endpoint, protocol: str, model: str, c: int, args: argparse.Namespace) -> Result:
        load1 = os.getloadavg()[0]
        cpu = args.loadgen_cpu
        if args.warmup > 0:
            self._load(endpoint, protocol, model, c, args.warmup, cpu)
        before = scrape_batches(endpoint.metrics, model)
        server_cores, load_cores = loadgen.cpu_list(args.server_cpu), loadgen.cpu_list(cpu)
        busy_before = loadgen.cpu_busy(server_cores + load_cores)
        cpu_before = cpu_seconds(endpoint.pid)
        load = self._load(endpoint, protocol, model, c, args.seconds, cpu)
        cpu_used = cpu_seconds(endpoint.pid) - cpu_before
        busy_after = loadgen.cpu_busy(server_cores + load_cores)
        after = scrape_batches(endpoint.metrics, model)
        rows, execs = after[0] - before[0], after[1] - before[1]
        n = load.requests
        return Result(
            server=endpoint.name,
            protocol=protocol,
            model=model,
            callers=c,
            client_procs=1,
            seconds=load.elapsed,
            requests=n,
            errors=load.errors,
            rps=n / load.elapsed if load.elapsed > 0 else float("nan"),
            p50_ms=load.p50_us / 1e3,
            p99_ms=load.p99_us / 1e3,
            mean_batch=rows / execs if execs > 0 else float("nan"),
            server_cpu_us=cpu_used / n * 1e6 if n else float("nan"),
            first_error=load.detail or None,
            driver="wrk",
            load1=load1,
            server_core_busy=_mean_busy(busy_before, busy_after, server_cores),
            loadgen_core_busy=_mean_busy(busy_before, busy_after, load_cores),
        )


def _mean_busy(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], cores: list[int]
) -> float:
    return statistics.fmean(loadgen.busy_fraction(before, after, c) for c in cores) if cores else float("nan")


def scaling_points(total: int) -> list[tuple[int, str, str]]:
    """``(server cores, server cpu list, load generator cpu list)`` per point:
    the server on 1, 2, 4, ... cores from core 0, the load generators on all
    the others, as long as at least one core is left to them."""
    points = []
    n = 1
    while n < total:
        points.append((n, "0" if n == 1 else f"0-{n - 1}", str(n) if n == total - 1 else f"{n}-{total - 1}"))
        n *= 2
    return points


def run_scaling(args: argparse.Namespace, models: list[str], protocols: list[str], callers: list[int]) -> int:
    """``--scaling``: ``ferrobatch serve --threads n`` pinned to n cores, the
    load generators on the rest, n = 1, 2, 4, ... below the machine's cores;
    req/s and server CPU per request per point, the speedup over one core,
    a plot beside the results."""
    cores = sorted(os.sched_getaffinity(0))
    if cores != list(range(len(cores))):
        print(f"--scaling needs cores 0..n-1 (this process may run on {cores})", file=sys.stderr)
        return 2
    points = scaling_points(len(cores))
    if not points:
        print("--scaling needs at least 2 cores: one for the server, one for the load generators", file=sys.stderr)
        return 2
    prefix = args.out or LATEST.with_suffix("")  # the bench's one results file: its latest run
    prefix.parent.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench_serve-scaling-"))
    native = Native(models, protocols)
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    meta = {
        "date": stamp,
        "machine": platform.machine(),
        "cpus": len(cores),
        "python": platform.python_version(),
        "ferrobatch_commit": ferrobatch_commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    print(f"# bench_serve --scaling {stamp}  {len(cores)} cores  points {[p[0] for p in points]}")
    rows: list[dict[str, Any]] = []
    with (prefix.with_suffix(".jsonl")).open("w") as out:
        for n, server_cpu, load_cpu in points:
            point = argparse.Namespace(**{**vars(args), "server_cpu": server_cpu, "loadgen_cpu": load_cpu})
            instances = n if args.instances == "cores" else 1
            os.environ["BENCH_INSTANCES"] = str(instances)  # inherited by the server
            os.environ["BENCH_INSTANCE_KIND"] = args.instance_kind
            with ferrobatch_server(logs / f"ferrobatch-{n}.log", server_cpu, threads=n) as endpoint:
                for model in models:
                    for protocol in protocols:
                        for c in callers:
                            # Named by its cores, so --report keeps the points apart.
                            name = f"ferrobatch ({n} core{'s' if n > 1 else ''})"
                            runs = [
                                replace(native.measure(endpoint, protocol, model, c, point), server=name)
                                for _ in range(args.runs)
                            ]
                            point_meta = {
                                "server_cores": n,
                                "instances": instances,
                                "instance_kind": args.instance_kind,
                            }
                            for i, r in enumerate(runs):
                                out.write(json.dumps({**meta, "run": i, **point_meta, **asdict(r)}) + "\n")
                            out.flush()
                            best = medians(runs)[0]
                            row = {"server_cores": n, "instances": instances, **asdict(best)}
                            rows.append(row)
                            print(
                                f"  {n} core(s), {instances} instance(s), {protocol} {model} C={c}:"
                                f" {best.rps:.0f} req/s,"
                                f" {best.server_cpu_us:.1f} us CPU/request, batch {best.mean_batch:.1f},"
                                f" server cores {best.server_core_busy:.0%} busy, errors {best.errors}",
                                flush=True,
                            )
    print(
        "\n| model | protocol | C | server cores | instances | req/s | server CPU µs/request"
        " | mean batch | server cores busy | vs 1 core |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        one = next(x["rps"] for x in rows if x["server_cores"] == 1 and
                   (x["model"], x["protocol"], x["callers"]) == (r["model"], r["protocol"], r["callers"]))  # fmt: skip
        print(
            f"| {r['model']} | {r['protocol']} | {r['callers']} | {r['server_cores']} | {r['instances']} |"
            f" {r['rps']:,.0f} | {r['server_cpu_us']:.1f} | {r['mean_batch']:.1f} | {r['server_core_busy']:.0%} |"
            f" {r['rps'] / one:.2f} × |"
        )
    plot_scaling(rows, prefix.with_suffix(".png"))
    print(f"\nresults: {prefix.with_suffix('.jsonl')}, plot: {prefix.with_suffix('.png')}; server logs: {logs}")
    return 0


def plot_scaling(rows: list[dict[str, Any]], path: Path) -> None:
    """req/s against server cores, one line per model, protocol and C."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# plot skipped: matplotlib is not installed")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["model"], r["protocol"], r["callers"]) for r in rows}):
        points = sorted((r["server_cores"], r["rps"]) for r in rows if (r["model"], r["protocol"], r["callers"]) == key)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{key[0]} {key[1]} C={key[2]}")
    ax.set_xlabel("server cores (ferrobatch serve --threads n, pinned)")
    ax.set_ylabel("requests / s")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- reporting ---------------------------------------------------------------------------------


def medians(results: list[Result]) -> list[Result]:
    """One result per case: the median of each figure over the runs."""
    cases: dict[tuple[str, str, str, str, int], list[Result]] = {}
    for r in results:
        cases.setdefault((r.driver, r.server, r.protocol, r.model, r.callers), []).append(r)
    merged = []
    for runs in cases.values():
        first = runs[0]
        figures = {f: statistics.median(getattr(r, f) for r in runs) for f in FIGURES}
        errors = sum(r.errors for r in runs)
        merged.append(replace(first, **figures, errors=errors, requests=sum(r.requests for r in runs)))
    return merged


#: Server CPU µs per request of ``ferrobatch serve`` with the MLP at 256 connections before the
#: request path moved to Rust (issue 12, measured with wrk / h2load as here, before this bench had
#: the driver); the issue's target is at most half of these on JSON and binary.
BEFORE_CPU_US = {"json": 329.0, "binary": 113.0, "grpc": 341.0}
TARGET_SHARE = {"json": 0.5, "binary": 0.5}


#: Issue 13's targets for the native front-end, identity, 256 connections: req/s at least, and
#: at least these multiples of PyTriton's and the bare hyper echo's req/s.
NATIVE_RPS = {"binary": 60_000.0, "grpc": 40_000.0, "json": 30_000.0}
NATIVE_VS_PYTRITON = {"binary": 15.0, "grpc": 10.0}
NATIVE_VS_ECHO = {"binary": 0.4}
NATIVE_CPU_US = {"binary": 15.0}


def native_targets(results: list[Result]) -> list[str]:
    """Issue 13's targets, checked on the wrk driver's medians: identity, 256 connections."""
    by_key = {(r.server, r.protocol, r.model, r.callers): r for r in results if r.driver == "wrk"}
    lines = []
    for protocol in ("binary", "grpc", "json"):
        r = by_key.get(("ferrobatch", protocol, "identity", 256))
        if r is None:
            continue
        checks = [f"{r.rps:.0f} req/s (target >= {NATIVE_RPS[protocol]:.0f}: " + _met(r.rps >= NATIVE_RPS[protocol])]
        for other, wanted in (("pytriton", NATIVE_VS_PYTRITON), ("hyper-echo", NATIVE_VS_ECHO)):
            o = by_key.get((other, protocol, "identity", 256))
            if protocol in wanted and o is not None and o.rps:
                ratio = r.rps / o.rps
                checks.append(f"x{ratio:.2f} {other} (target >= {wanted[protocol]}: " + _met(ratio >= wanted[protocol]))
        if protocol in NATIVE_CPU_US:
            limit = NATIVE_CPU_US[protocol]
            checks.append(
                f"{r.server_cpu_us:.1f} µs CPU/request (target <= {limit:.0f}: " + _met(r.server_cpu_us <= limit)
            )
        lines.append(f"{protocol}: " + "; ".join(checks))
    return lines


#: Issue 24's targets, 256 connections: PyTriton's usual shapes on the native front-end, as a
#: share of the fixed-shape identity's req/s in the same run, and at least this multiple of
#: PyTriton serving the same model; add_sub's server CPU per request at most this multiple of
#: identity's.
SHAPES_VS_IDENTITY = {"add_sub": 0.7, "bytes_echo": 0.5}
SHAPES_VS_PYTRITON = 10.0
ADD_SUB_CPU_VS_IDENTITY = 1.5


def shapes_targets(results: list[Result]) -> list[str]:
    """Issue 24's targets, checked on the wrk driver's medians: binary and gRPC, 256 connections."""
    by_key = {(r.server, r.protocol, r.model, r.callers): r for r in results if r.driver == "wrk"}
    lines = []
    for protocol in ("binary", "grpc", "json"):
        identity = by_key.get(("ferrobatch", protocol, "identity", 256))
        for model, share in SHAPES_VS_IDENTITY.items():
            r = by_key.get(("ferrobatch", protocol, model, 256))
            if r is None or identity is None or not identity.rps:
                continue
            ratio = r.rps / identity.rps
            checks = [f"{r.rps:.0f} req/s, x{ratio:.2f} identity (target >= {share}: " + _met(ratio >= share)]
            other = by_key.get(("pytriton", protocol, model, 256))
            if other is not None and other.rps:
                vs = r.rps / other.rps
                checks.append(
                    f"x{vs:.1f} PyTriton (target >= {SHAPES_VS_PYTRITON:.0f}: " + _met(vs >= SHAPES_VS_PYTRITON)
                )
            cpu = r.server_cpu_us / identity.server_cpu_us
            line = f"{r.server_cpu_us:.1f} µs CPU/request, x{cpu:.2f} identity's"
            if model == "add_sub":
                line += f" (target <= {ADD_SUB_CPU_VS_IDENTITY}: " + _met(cpu <= ADD_SUB_CPU_VS_IDENTITY)
            checks.append(line)
            lines.append(f"{protocol} {model}: " + "; ".join(checks))
    return lines


def _met(ok: bool) -> str:
    return "met)" if ok else "MISSED)"


def targets(results: list[Result]) -> list[str]:
    """Issue 12's targets, checked on the wrk driver's medians: ferrobatch, MLP, 256 connections."""
    lines = []
    for r in results:
        if (r.driver, r.server, r.model, r.callers) != ("wrk", "ferrobatch", "mlp", 256):
            continue
        before = BEFORE_CPU_US.get(r.protocol)
        if before is None:
            continue
        line = (
            f"{r.protocol}: {r.server_cpu_us:.0f} µs of server CPU per request"
            f" (was {before:.0f}: x{r.server_cpu_us / before:.2f})"
        )
        share = TARGET_SHARE.get(r.protocol)
        if share is not None:
            met = r.server_cpu_us <= share * before
            line += f"; target <= {share * before:.0f} µs: " + ("met" if met else "MISSED")
        lines.append(line)
    return lines


def print_table(results: list[Result]) -> None:
    header = (
        f"{'server':<18}{'proto':<16}{'model':<13}{'C':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'batch':>7}{'cpu us/req':>11}{'errors':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.server:<18}{r.protocol:<16}{r.model:<13}{r.callers:>5}{r.rps:>10.0f}"
            f"{r.p50_ms:>9.2f}{r.p99_ms:>9.2f}{r.mean_batch:>7.1f}{r.server_cpu_us:>11.0f}{r.errors:>8}"
        )


def print_ratios(results: list[Result]) -> None:
    """ferrobatch against PyTriton, case by case; the aio driver's target is checked at C=512,
    the wrk driver's (issue 12) against the figures before."""
    by_key = {(r.server, r.protocol, r.model, r.callers): r for r in results}
    lines = []
    for (server, protocol, model, callers), r in sorted(by_key.items()):
        other = by_key.get(("pytriton", protocol, model, callers))
        if server != "ferrobatch" or other is None or not other.rps:
            continue
        line = (
            f"  {protocol:<16}{model:<13}C={callers:<4} req/s x{r.rps / other.rps:.2f}"
            f"   p99 {r.p99_ms:.1f} ms vs {other.p99_ms:.1f} ms"
            f"   server CPU per request x{other.server_cpu_us / r.server_cpu_us:.2f} less"
        )
        if callers == 512 and r.driver == "aio":
            met = r.rps >= 10 * other.rps and r.p99_ms < other.p99_ms
            line += "   target (>= 10x req/s, lower p99): " + ("met" if met else "MISSED")
        lines.append(line)
    if lines:
        print("\nferrobatch / PyTriton:")
        print("\n".join(lines))
    tls = [
        f"  {server:<16}{model:<13}conns={callers:<4} req/s x{r.rps / plain.rps:.2f}"
        f"   server CPU per request {plain.server_cpu_us:.1f} -> {r.server_cpu_us:.1f} us"
        f"   p99 {plain.p99_ms:.2f} -> {r.p99_ms:.2f} ms"
        for (server, protocol, model, callers), r in sorted(by_key.items())
        if server in ("ferrobatch-tls", "ferrobatch-gzip")
        and protocol == "grpc"
        and (plain := by_key.get(("ferrobatch", protocol, model, callers))) is not None
        and plain.rps
    ]
    if tls:
        print("\ngRPC over TLS or with gzip replies / h2c (ferrobatch native):")
        print("\n".join(tls))
    checked = targets(results)
    if checked:
        print("\nferrobatch serve, mlp, 256 connections (issue 12):")
        print("\n".join(f"  {line}" for line in checked))
    checked = native_targets(results)
    if checked:
        print("\nferrobatch serve (native front-end), identity, 256 connections (issue 13):")
        print("\n".join(f"  {line}" for line in checked))
    checked = shapes_targets(results)
    if checked:
        print("\nferrobatch serve (native front-end), PyTriton's usual shapes, 256 connections (issue 24):")
        print("\n".join(f"  {line}" for line in checked))


def markdown(path: Path) -> str:
    """The table of benches/README.md (medians over the runs) from a results file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    fields = Result.__dataclass_fields__
    results = medians([Result(**{k: v for k, v in row.items() if k in fields}) for row in rows])
    meta = rows[0]
    runs = max(row["run"] for row in rows) + 1
    commit = f", ferrobatch {meta['ferrobatch_commit']}" if meta.get("ferrobatch_commit") else ""
    wrk = all(r.driver == "wrk" for r in results)
    load = [row["load1"] for row in rows if row.get("load1") is not None]
    loads = f"; 1-min load {min(load):.2f}-{max(load):.2f}" if load else ""
    out = [
        f"<!-- python benches/python/bench_serve.py --report {path.name}: `{meta['command']}`,"
        f" {meta['date']}{commit}; {meta['cpus']} CPUs, Python {meta['python']}; medians of {runs} run(s){loads} -->",
        "",
        f"| server | proto | model | {'conns' if wrk else 'C'} | req/s | p50 ms | p99 ms | batch | cpu us/req |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names = {
        "ferrobatch": "ferrobatch (native)",
        "ferrobatch-python": "ferrobatch (python)",
        "ferrobatch-tls": "ferrobatch (native, gRPC over TLS)",
        "ferrobatch-gzip": "ferrobatch (native, gzip gRPC replies)",
        "pytriton": "PyTriton",
        "hyper-echo": "hyper echo",
    }
    for r in results:
        out.append(
            f"| {names.get(r.server, r.server)} | {r.protocol} | {r.model} | {r.callers} | {r.rps:.0f} |"
            f" {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.mean_batch:.1f} | {r.server_cpu_us:.0f} |"
        )
    checked = targets(results)
    if checked:
        out += ["", "Issue 12's targets (ferrobatch, mlp, 256 connections):", ""]
        out += [f"- {line}" for line in checked]
    checked = native_targets(results)
    if checked:
        out += ["", "Issue 13's targets (the native front-end, identity, 256 connections):", ""]
        out += [f"- {line}" for line in checked]
    checked = shapes_targets(results)
    if checked:
        out += ["", "Issue 24's targets (the native front-end, PyTriton's usual shapes, 256 connections):", ""]
        out += [f"- {line}" for line in checked]
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
    parser.add_argument(
        "--driver",
        choices=("wrk", "aio"),
        default="wrk",
        help="wrk: wrk and h2load, pinned, with the server pinned to the other core (default);"
        " aio: tritonclient's aio clients in --client-procs processes",
    )
    parser.add_argument(
        "--callers",
        "--connections",
        dest="callers",
        help="comma-separated C values: connections (wrk; default 64,256) or callers (aio; default 1,64,512)",
    )
    parser.add_argument(
        "--models",
        default="identity,mlp",
        help=f"comma-separated, of {','.join(MODELS)} (default identity,mlp; the others: wrk only;"
        " token_stream, decoupled: generate_stream only)",
    )
    parser.add_argument(
        "--protocols",
        help="comma-separated: json,binary,grpc (wrk, the default; generate and generate_stream too when named)"
        " or http,grpc (aio, the default)",
    )
    parser.add_argument("--server-cpu", default="0", help="the core the server is pinned to (wrk; default 0)")
    parser.add_argument("--loadgen-cpu", default="1", help="the core wrk / h2load are pinned to (wrk; default 1)")
    parser.add_argument(
        "--servers",
        default="ferrobatch,ferrobatch-python,pytriton,hyper-echo",
        help="comma-separated: ferrobatch (the native front-end), ferrobatch-python (uvicorn +"
        " Starlette, grpcio), ferrobatch-tls (the native front-end, gRPC over TLS), ferrobatch-gzip"
        " (its gRPC replies gzip-compressed), pytriton,"
        " hyper-echo (a bare hyper server echoing each request: the ceiling; wrk driver only)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per case (default 5)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="repetitions; the table shows medians (default 3)")
    parser.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)))
    parser.add_argument(
        "--pytriton-python", help="interpreter with nvidia-pytriton (default: .venv-pytriton's, else this one)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads in both servers (default 1; 0: torch's default)",
    )
    parser.add_argument("--out", type=Path, help="output prefix (default benches/results/serve, replaced by each run)")
    parser.add_argument("--quick", action="store_true", help="one run, 1 s per case (aio: C=1,64; wrk: C=64)")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="ferrobatch serve on 1, 2, 4, ... pinned cores (--threads n), wrk/h2load on the rest;"
        " of --models (default identity,mlp); results in serve.jsonl (each point its own server name) and a plot",
    )
    parser.add_argument(
        "--instances",
        choices=("1", "cores"),
        default="1",
        help="--scaling: model instances (worker threads) of identity and mlp per point:"
        " 1 (default) or one per server core",
    )
    parser.add_argument(
        "--instance-kind",
        choices=("thread", "process"),
        default="thread",
        help="--scaling: identity and mlp instances as worker threads (default) or processes (instance_kind)",
    )
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
    wrk = args.driver == "wrk"
    if args.quick:
        args.callers = args.callers or ("64" if wrk else "1,64")
        args.seconds, args.warmup, args.runs = 1.0, (1.0 if wrk else 0.5), 1
    args.callers = args.callers or ("64,256" if wrk else "1,64,512")
    args.protocols = args.protocols or (",".join(loadgen.PROTOCOLS) if wrk else "http,grpc")
    if wrk:
        missing = loadgen.tools_missing()
        if missing:
            parser.error(f"--driver wrk needs {', '.join(missing)} (make bench-serve installs them)")
        if args.server_cpu == args.loadgen_cpu:
            parser.error("--server-cpu and --loadgen-cpu must differ")

    os.environ["BENCH_TORCH_THREADS"] = str(args.torch_threads)  # inherited by the servers
    # A load generator opens a socket per connection: lift the soft descriptor
    # limit (often 1024) to the hard one, for it and the servers.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.scaling:
        if not wrk:
            parser.error("--scaling needs --driver wrk")
        models = args.models.split(",")
        return run_scaling(args, models, args.protocols.split(","), [int(c) for c in args.callers.split(",")])
    callers = [int(c) for c in args.callers.split(",")]
    models = args.models.split(",")
    if unknown := [m for m in models if m not in MODELS]:
        parser.error(f"unknown model(s): {', '.join(unknown)} (known: {', '.join(MODELS)})")
    if not wrk and (fixed_only := [m for m in models if m not in ("identity", "mlp")]):
        parser.error(f"--driver aio drives identity and mlp only, not {', '.join(fixed_only)}")
    protocols = args.protocols.split(",")
    known = (*loadgen.PROTOCOLS, *loadgen.OPT_IN_PROTOCOLS) if wrk else ("http", "grpc")
    if unknown := [p for p in protocols if p not in known]:
        parser.error(f"unknown protocol(s) for --driver {args.driver}: {', '.join(unknown)}")
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
    print(
        f"# bench_serve {meta['date']}  {meta['cpus']} CPUs  python {meta['python']}  driver {args.driver}"
        f"  load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    server_cpu = args.server_cpu if wrk else None
    native = Native(models, protocols) if wrk else None

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
                endpoints.append(stack.enter_context(pytriton_server(python, logs / "pytriton.log", server_cpu)))
            elif server == "ferrobatch":
                endpoints.append(stack.enter_context(ferrobatch_server(logs / "ferrobatch.log", server_cpu)))
            elif server == "ferrobatch-python":
                log = logs / "ferrobatch-python.log"
                endpoints.append(stack.enter_context(ferrobatch_server(log, server_cpu, "python")))
            elif server == "ferrobatch-gzip":
                log = logs / "ferrobatch-gzip.log"
                endpoints.append(stack.enter_context(ferrobatch_server(log, server_cpu, compression="low")))
            elif server == "ferrobatch-tls":
                log = logs / "ferrobatch-tls.log"
                endpoints.append(stack.enter_context(ferrobatch_server(log, server_cpu, tls=True)))
            elif server == "hyper-echo":
                if not wrk:
                    parser.error("hyper-echo needs --driver wrk")
                endpoints.append(stack.enter_context(echo_server(logs / "echo.log", server_cpu)))
            else:
                parser.error(f"unknown server {server!r}")
        # Servers take turns case by case, so a noisy machine affects them alike.
        for run in range(args.runs):
            for protocol in protocols:
                for model in (m for m in models if answers(protocol, m)):
                    for c in callers:
                        for endpoint in endpoints:
                            if native is not None:
                                r = native.measure(endpoint, protocol, model, c, args)
                            else:
                                r = measure(endpoint, protocol, model, c, args)
                            results.append(r)
                            out.write(json.dumps({**meta, "run": run, **asdict(r)}) + "\n")
                            out.flush()
                            print(
                                f"  [{run}] {r.server} {r.protocol} {r.model} C={r.callers}: {r.rps:.0f} req/s,"
                                f" p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms, batch {r.mean_batch:.1f},"
                                f" server CPU {r.server_cpu_us:.0f} us/request, load {r.load1:.2f},"
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
