"""Decoupled (streaming) models over gRPC ``ModelStreamInfer``:
``ferrobatch.triton`` versus PyTriton's decoupled mode, in one run.

The model, ``tokens``, is the same function bound by both with only the
import switched (``--serve ferrobatch`` or ``--serve pytriton``): a ``@batch``
generator that takes ``x`` float32 ``(-1,)`` (16 elements per request) and
yields ``--responses`` responses ``{"y": x + i}``, ``decoupled=True``,
``max_batch_size`` 64, 1 ms queue delay.

The driver is h2load (no Python on the request path): C h2c connections,
one call in flight on each; a call is one ``ModelStreamInfer`` stream
carrying one ``ModelInferRequest`` that asks for Triton's empty final
response, answered with ``--responses`` responses and the final one. The
server runs on core 0 (``taskset``), h2load on core 1. Each case is checked
first: one call answered with the right values, as many responses as asked
and the final flag; a call answered with fewer bytes than that counts as an
error. For each server and C it reports calls/s, responses/s, p50 and p99 of
a whole call, and the server's CPU time per call (its process tree, from
/proc); the servers take turns over ``--runs`` runs, and the table shows the
medians and ferrobatch's ratio to PyTriton.

PyTriton runs with ``--pytriton-python`` (default: ``.venv-pytriton`` at the
top of the checkout; ``make bench-serve`` makes it).

    python benches/python/bench_decoupled.py                 # 3 runs, C = 64, 256
    python benches/python/bench_decoupled.py --quick         # a smoke run

Output: the table on stdout, JSON lines in ``benches/results/decoupled.jsonl``
(replaced by each run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))

import serve_loadgen as loadgen  # noqa: E402
from bench_serve import PYTRITON_VENV, cpu_seconds, free_ports, pinned, pytriton_python, stop  # noqa: E402

MODEL = "tokens"
LENGTH = 16  # elements of x per request
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
RESULTS = ROOT / "benches" / "results" / "decoupled.jsonl"


def serve(server: str, http_port: int, grpc_port: int, metrics_port: int, responses: int) -> None:
    """Binds ``tokens`` with ``server``'s PyTriton API and serves until SIGINT."""
    if server == "ferrobatch":
        sys.path.insert(0, str(ROOT / "python"))
        from ferrobatch.triton import Triton, TritonConfig
        from ferrobatch.triton.decorators import batch
        from ferrobatch.triton.model_config import DynamicBatcher, ModelConfig, Tensor
    else:
        from pytriton.decorators import batch  # type: ignore[no-redef]
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor  # type: ignore[no-redef]
        from pytriton.triton import Triton, TritonConfig  # type: ignore[no-redef]

    @batch  # type: ignore[misc]
    def tokens(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for i in range(responses):
            yield {"y": x + np.float32(i)}

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL,
            infer_func=tokens,
            inputs=[Tensor(name="x", dtype=np.float32, shape=(-1,))],
            outputs=[Tensor(name="y", dtype=np.float32, shape=(-1,))],
            config=ModelConfig(
                max_batch_size=64, decoupled=True, batcher=DynamicBatcher(max_queue_delay_microseconds=1000)
            ),
        )
        triton.serve()


def stream_request() -> tuple[loadgen.Request, np.ndarray]:
    """The call h2load repeats (one framed request asking for the empty final
    response) and the request's ``x``."""
    from tritonclient.grpc import service_pb2 as pb

    x = np.arange(LENGTH, dtype=np.float32)[None]
    message = pb.ModelInferRequest(model_name=MODEL, id="bench")
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    tensor = message.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend(x.shape)
    message.raw_input_contents.append(x.tobytes())
    payload = message.SerializeToString()
    body = struct.pack(">BI", 0, len(payload)) + payload
    headers = {"content-type": "application/grpc", "te": "trailers"}
    return loadgen.Request("grpc", MODEL, {"x": x}, ("y",), STREAM_METHOD, body, headers), x


def check(grpc: str, request: loadgen.Request, x: np.ndarray, responses: int) -> int:
    """One call: raises unless it is answered with ``responses`` right
    responses and the final flag; returns the bytes of all its messages
    (framed), for h2load's short-reply check."""
    import grpc as grpclib
    from tritonclient.grpc import service_pb2 as pb

    with grpclib.insecure_channel(grpc) as channel:
        call = channel.stream_stream(STREAM_METHOD)  # bytes in, bytes out
        replies = list(call(iter([request.body[5:]]), timeout=60))
    got = [pb.ModelStreamInferResponse.FromString(r) for r in replies]
    errors = [m.error_message for m in got if m.error_message]
    if errors:
        raise RuntimeError(f"the server answered an error: {errors[0]}")
    finals = [m.infer_response.parameters["triton_final_response"].bool_param for m in got]
    if len(got) != responses + 1 or finals != [False] * responses + [True]:
        raise RuntimeError(f"expected {responses} responses and the final one, got finals {finals}")
    for i, m in enumerate(got[:-1]):
        y = np.frombuffer(m.infer_response.raw_output_contents[0], dtype=np.float32)
        if not np.array_equal(y, x.ravel() + i):
            raise RuntimeError(f"response {i}: wrong values {y[:4]}...")
    return sum(5 + len(r) for r in replies)


@contextmanager
def server_process(server: str, python: str, responses: int, cpu: str, log: Path) -> Iterator[tuple[str, int]]:
    """The server running on ``cpu``: its gRPC address and pid."""
    http, grpc, metrics = free_ports(3)
    cmd = [
        *pinned(cpu), python, str(HERE), "--serve", server, "--responses", str(responses),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = dict(os.environ)
    if server == "pytriton":  # Triton's Python-backend stub links this interpreter's libpython
        libdir = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            import tritonclient.grpc as grpcclient

            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{server} exited with status {proc.returncode}; see {log}")
                try:
                    if client.is_model_ready(MODEL):
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server} was not ready in 180 s; see {log}")
                time.sleep(0.2)
            client.close()
            yield f"127.0.0.1:{grpc}", proc.pid
        finally:
            stop(proc, seconds=90)


def measure(server: str, grpc: str, pid: int, args: argparse.Namespace, c: int, reply_bytes: int) -> dict[str, Any]:
    request, _ = stream_request()
    loadgen.run_h2load(request, grpc, c, args.warmup, args.loadgen_cpu, reply_bytes)
    cpu_before = cpu_seconds(pid)
    load = loadgen.run_h2load(request, grpc, c, args.seconds, args.loadgen_cpu, reply_bytes)
    cpu = cpu_seconds(pid) - cpu_before
    calls = load.requests - load.errors
    return {
        "server": server,
        "connections": c,
        "responses_per_call": args.responses,
        "calls": load.requests,
        "errors": load.errors,
        "calls_per_s": calls / load.elapsed if load.elapsed > 0 else float("nan"),
        "responses_per_s": calls * args.responses / load.elapsed if load.elapsed > 0 else float("nan"),
        "p50_ms": load.p50_us / 1e3,
        "p99_ms": load.p99_us / 1e3,
        "server_cpu_us_per_call": cpu / calls * 1e6 if calls else float("nan"),
        "detail": load.detail or None,
        "load1": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=["ferrobatch", "pytriton"], help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--responses", type=int, default=16, help="responses per request (default 16)")
    parser.add_argument("--connections", default="64,256", help="h2load connections, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--servers", default="ferrobatch,pytriton")
    parser.add_argument("--pytriton-python", default=None, help=f"default: {PYTRITON_VENV}/bin/python")
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--loadgen-cpu", default="1")
    parser.add_argument("--quick", action="store_true", help="1 run of 3 s, C = 64")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.http_port, args.grpc_port, args.metrics_port, args.responses)
        return 0
    if args.quick:
        args.runs, args.seconds, args.warmup, args.connections = 1, 3.0, 1.0, "64"
    missing = loadgen.tools_missing()
    if missing:
        print(f"needs {', '.join(missing)} (make bench-serve installs them)", file=sys.stderr)
        return 2
    pythons = {"ferrobatch": sys.executable}
    servers = args.servers.split(",")
    if "pytriton" in servers:
        python = pytriton_python(args.pytriton_python)
        if python is None:
            print("PyTriton is not installed (make bench-serve makes .venv-pytriton); ferrobatch only", file=sys.stderr)
            servers.remove("pytriton")
        else:
            pythons["pytriton"] = python
    connections = [int(c) for c in args.connections.split(",")]
    request, x = stream_request()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_decoupled-") as tmp:
        for run in range(args.runs):
            for server in servers:  # the servers take turns, run by run
                log = Path(tmp, f"{server}-{run}.log")
                with server_process(server, pythons[server], args.responses, args.server_cpu, log) as (grpc, pid):
                    reply_bytes = check(grpc, request, x, args.responses)
                    for c in connections:
                        row = measure(server, grpc, pid, args, c, reply_bytes)
                        row["run"] = run
                        rows.append(row)
                        print(
                            f"run {run} {server:10} C={c:<4} {row['calls_per_s']:9.0f} calls/s"
                            f" {row['responses_per_s']:10.0f} responses/s  p50 {row['p50_ms']:.1f} ms"
                            f"  p99 {row['p99_ms']:.1f} ms  {row['server_cpu_us_per_call']:.0f} us CPU/call"
                            f"  errors {row['errors']}",
                            flush=True,
                        )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w") as out:
        for row in rows:
            out.write(json.dumps({**row, "time": stamp, "host_cpus": os.cpu_count()}) + "\n")
    print(f"\nmedians of {args.runs} run(s), {args.responses} responses per call (wrote {RESULTS}):")
    print("| server | C | calls/s | responses/s | p50 ms | p99 ms | µs CPU per call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for server in servers:
        for c in connections:
            mine = [r for r in rows if r["server"] == server and r["connections"] == c]
            m = {k: statistics.median(r[k] for r in mine) for k in
                 ("calls_per_s", "responses_per_s", "p50_ms", "p99_ms", "server_cpu_us_per_call")}  # fmt: skip
            medians[server, c] = m
            print(
                f"| {server} | {c} | {m['calls_per_s']:,.0f} | {m['responses_per_s']:,.0f} | {m['p50_ms']:.1f}"
                f" | {m['p99_ms']:.1f} | {m['server_cpu_us_per_call']:.0f} |"
            )
    if "pytriton" in servers and "ferrobatch" in servers:
        print()
        for c in connections:
            ratio = medians["ferrobatch", c]["calls_per_s"] / medians["pytriton", c]["calls_per_s"]
            verdict = "met" if ratio >= 5 else "missed"
            print(f"C={c}: ferrobatch / PyTriton = {ratio:.1f}x calls/s (target >= 5x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
