"""PyTriton's own models bound by ``ferrobatch.triton`` versus PyTriton 0.7.0
itself, in one run, each model bound by the same function with only the
import switched (``--serve ferrobatch`` or ``--serve pytriton``):

- ``add_sub`` and ``identity``, as PyTriton's examples declare them:
  ``add_sub`` two float32 ``(-1,)`` inputs ``a``, ``b`` (16 elements per
  request) and outputs ``add``, ``sub``; ``identity`` a float64 ``(-1,)``
  input (16 elements) and a BYTES ``(1,)`` one (one 32-byte string), echoed;
  ``@batch``, ``max_batch_size`` 128, the default batcher (greedy; a queue
  delay with ``--queue-delay-us``, for both servers), ``strict=True``;
- ``tokens``: a decoupled ``@batch`` generator taking ``x`` float32
  ``(-1,)`` (16 elements) and yielding ``--responses`` responses
  ``{"y": x + i}``, ``max_batch_size`` 64, 1 ms queue delay.

The load generators run no Python on the request path: wrk for HTTP with
the binary tensor extension (``binary``), h2load for gRPC ``ModelInfer``
(``grpc``) and for ``ModelStreamInfer`` (``stream``: one call is one stream
carrying one request that asks for Triton's empty final response, answered
with ``--responses`` responses and the final one); C connections
(``--connections``), one request or call in flight on each. The server runs
on core 0 (``taskset``), the generator on core 1. Each case is checked
first (the right values; for a stream, as many responses as asked and the
final flag) and a gRPC reply shorter than the checked one counts as an
error. For each server, case and C it reports requests (calls) per second,
p50 and p99, and the server's CPU time per request (its process tree, from
/proc); the servers take turns over ``--runs`` runs, and the table shows
the medians and ferrobatch's ratio to PyTriton.

PyTriton runs with ``--pytriton-python`` (default: ``.venv-pytriton`` at the
top of the checkout; ``make bench-serve`` makes it).

    python benches/python/bench_pytriton.py               # 3 runs of 10 s, C = 256
    python benches/python/bench_pytriton.py --cases stream --connections 64,256
    python benches/python/bench_pytriton.py --quick       # a smoke run

Output: the table on stdout, JSON lines in ``benches/results/pytriton.jsonl``
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))

import serve_loadgen as loadgen  # noqa: E402
from bench_serve import (  # noqa: E402
    PYTRITON_VENV,
    cpu_seconds,
    free_ports,
    pinned,
    pytriton_env,
    pytriton_python,
    stop,
)

MODEL = "tokens"  # the decoupled one
MODELS = ("add_sub", "identity", MODEL)
LENGTH = 16  # elements of each (-1,) input per request
TEXT = b"ferrobatch-" + b"x" * 21  # identity's BYTES input: 32 bytes
#: The cases: (model, protocol) by name.
CASES = {
    "add_sub-binary": ("add_sub", "binary"),
    "add_sub-grpc": ("add_sub", "grpc"),
    "identity-binary": ("identity", "binary"),
    "identity-grpc": ("identity", "grpc"),
    "stream": (MODEL, "stream"),
}
STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
RESULTS = ROOT / "benches" / "results" / "pytriton.jsonl"


def serve(server: str, http_port: int, grpc_port: int, metrics_port: int, responses: int, delay_us: int) -> None:
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

    @batch  # type: ignore[misc]
    def add_sub(a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
        return {"add": a + b, "sub": a - b}

    @batch  # type: ignore[misc]
    def identity(numbers: np.ndarray, text: np.ndarray) -> dict[str, np.ndarray]:
        return {"numbers_out": numbers, "text_out": text}

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(
            model_name="add_sub",
            infer_func=add_sub,
            inputs=[Tensor(name=n, dtype=np.float32, shape=(-1,)) for n in ("a", "b")],
            outputs=[Tensor(name=n, dtype=np.float32, shape=(-1,)) for n in ("add", "sub")],
            config=ModelConfig(max_batch_size=128, batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)),
            strict=True,
        )
        triton.bind(
            model_name="identity",
            infer_func=identity,
            inputs=[
                Tensor(name="numbers", dtype=np.float64, shape=(-1,)),
                Tensor(name="text", dtype=object, shape=(1,)),
            ],
            outputs=[
                Tensor(name="numbers_out", dtype=np.float64, shape=(-1,)),
                Tensor(name="text_out", dtype=object, shape=(1,)),
            ],
            config=ModelConfig(max_batch_size=128, batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)),
            strict=True,
        )
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


def unary_payload(model: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One request's inputs for ``add_sub`` or ``identity`` (batch
    dimension 1) and the outputs it must get back."""
    rng = np.random.default_rng(0)
    if model == "add_sub":
        a, b = (rng.standard_normal((1, LENGTH)).astype(np.float32) for _ in range(2))
        return {"a": a, "b": b}, {"add": a + b, "sub": a - b}
    numbers = rng.standard_normal((1, LENGTH))
    text = np.empty((1, 1), dtype=object)
    text[0, 0] = TEXT
    return {"numbers": numbers, "text": text}, {"numbers_out": numbers, "text_out": text}


@dataclass
class Endpoint:
    server: str
    http: str
    grpc: str
    pid: int


@contextmanager
def server_process(server: str, python: str, responses: int, delay_us: int, cpu: str, log: Path) -> Iterator[Endpoint]:
    """The server running on ``cpu``, every model ready."""
    http, grpc, metrics = free_ports(3)
    cmd = [
        *pinned(cpu), python, str(HERE), "--serve", server, "--responses", str(responses),
        "--queue-delay-us", str(delay_us),
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
    ]  # fmt: skip
    env = pytriton_env(python) if server == "pytriton" else dict(os.environ)
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
                    if all(client.is_model_ready(m) for m in MODELS):
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server} was not ready in 180 s; see {log}")
                time.sleep(0.2)
            client.close()
            yield Endpoint(server, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", proc.pid)
        finally:
            stop(proc, seconds=90)


class Driver:
    """Each case's fixed request, checked once per server, and its load."""

    def __init__(self, responses: int) -> None:
        self.responses = responses
        self.requests: dict[str, loadgen.Request] = {}
        self.expected: dict[str, dict[str, np.ndarray]] = {}
        for case, (model, protocol) in CASES.items():
            if protocol == "stream":
                self.requests[case], x = stream_request()
                self.expected[case] = {"x": x}
            else:
                inputs, outputs = unary_payload(model)
                self.requests[case] = loadgen.make_request(protocol, model, inputs, tuple(outputs))
                self.expected[case] = outputs
        self.reply_bytes: dict[tuple[str, str], int] = {}

    def check(self, endpoint: Endpoint, case: str) -> None:
        request = self.requests[case]
        if CASES[case][1] == "stream":
            length = check(endpoint.grpc, request, self.expected[case]["x"], self.responses)
        else:
            length = loadgen.check(request, endpoint.http, endpoint.grpc, self.expected[case])
        self.reply_bytes[endpoint.server, case] = length

    def load(self, endpoint: Endpoint, case: str, c: int, seconds: float, cpu: str) -> loadgen.LoadResult:
        request = self.requests[case]
        if CASES[case][1] == "binary":
            return loadgen.run_wrk(request, endpoint.http, c, seconds, cpu)
        return loadgen.run_h2load(request, endpoint.grpc, c, seconds, cpu, self.reply_bytes[endpoint.server, case])


def measure(driver: Driver, endpoint: Endpoint, case: str, c: int, args: argparse.Namespace) -> dict[str, Any]:
    driver.load(endpoint, case, c, args.warmup, args.loadgen_cpu)
    cpu_before = cpu_seconds(endpoint.pid)
    load = driver.load(endpoint, case, c, args.seconds, args.loadgen_cpu)
    cpu = cpu_seconds(endpoint.pid) - cpu_before
    done = load.requests - load.errors
    return {
        "server": endpoint.server,
        "case": case,
        "connections": c,
        "responses_per_call": args.responses if CASES[case][1] == "stream" else 1,
        "requests": load.requests,
        "errors": load.errors,
        "rps": done / load.elapsed if load.elapsed > 0 else float("nan"),
        "p50_ms": load.p50_us / 1e3,
        "p99_ms": load.p99_us / 1e3,
        "server_cpu_us": cpu / done * 1e6 if done else float("nan"),
        "detail": load.detail or None,
        "load1": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=["ferrobatch", "pytriton"], help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--responses", type=int, default=16, help="responses per streamed request (default 16)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--queue-delay-us",
        type=int,
        default=0,
        help="add_sub's and identity's max_queue_delay_microseconds, both servers (0, the default: greedy)",
    )
    parser.add_argument("--connections", default="256", help="connections, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--servers", default="ferrobatch,pytriton")
    parser.add_argument("--pytriton-python", default=None, help=f"default: {PYTRITON_VENV}/bin/python")
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--loadgen-cpu", default="1")
    parser.add_argument("--quick", action="store_true", help="1 run of 3 s")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.http_port, args.grpc_port, args.metrics_port, args.responses, args.queue_delay_us)
        return 0
    if args.quick:
        args.runs, args.seconds, args.warmup = 1, 3.0, 1.0
    missing = loadgen.tools_missing()
    if missing:
        print(f"needs {', '.join(missing)} (make bench-serve installs them)", file=sys.stderr)
        return 2
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
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
    driver = Driver(args.responses)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_pytriton-") as tmp:
        for run in range(args.runs):
            for server in servers:  # the servers take turns, run by run
                log = Path(tmp, f"{server}-{run}.log")
                with server_process(
                    server, pythons[server], args.responses, args.queue_delay_us, args.server_cpu, log
                ) as endpoint:
                    for case in cases:
                        driver.check(endpoint, case)
                        for c in connections:
                            row = measure(driver, endpoint, case, c, args)
                            row["run"] = run
                            rows.append(row)
                            print(
                                f"run {run} {server:10} {case:16} C={c:<4} {row['rps']:9.0f}/s"
                                f"  p50 {row['p50_ms']:.1f} ms  p99 {row['p99_ms']:.1f} ms"
                                f"  {row['server_cpu_us']:.0f} us CPU each  errors {row['errors']}",
                                flush=True,
                            )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w") as out:
        for row in rows:
            out.write(
                json.dumps({**row, "queue_delay_us": args.queue_delay_us, "time": stamp, "host_cpus": os.cpu_count()})
                + "\n"
            )
    print(f"\nmedians of {args.runs} run(s) (wrote {RESULTS}); a stream's figures are per call")
    print("| case | C | server | req/s | p50 ms | p99 ms | µs server CPU each | ferrobatch / PyTriton |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for case in cases:
        for c in connections:
            medians: dict[str, dict[str, float]] = {}
            for server in servers:
                mine = [r for r in rows if (r["server"], r["case"], r["connections"]) == (server, case, c)]
                medians[server] = {
                    k: statistics.median(r[k] for r in mine) for k in ("rps", "p50_ms", "p99_ms", "server_cpu_us")
                }
            for server, m in medians.items():
                ratio = ""
                if server == "ferrobatch" and "pytriton" in medians:
                    vs = m["rps"] / medians["pytriton"]["rps"]
                    target = 5 if CASES[case][1] == "stream" else 10
                    ratio = f"{vs:.1f} × (target ≥ {target} ×: {'met' if vs >= target else 'missed'})"
                print(
                    f"| {case} | {c} | {server} | {m['rps']:,.0f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f}"
                    f" | {m['server_cpu_us']:.0f} | {ratio} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
