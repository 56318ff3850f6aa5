"""Triton's system shared-memory extension against binary HTTP, for large
tensors, on ferrobatch and on PyTriton 0.7.0 (its Triton), in one run.

Each server binds, with its PyTriton API (the same function, only the import
switched), one model per request size ``n`` (``--sizes``, elements):
``echo<n>``, a float32 ``(n,)`` input ``x`` returned as ``y``, ``@batch``,
``max_batch_size`` 4, greedy. ferrobatch runs with
``TritonConfig(allow_client_shm=True)`` (off by default, as in Triton since
``--allow-client-shm``); PyTriton's Triton allows client shared memory by
default. Both keep PyTriton's default security config, so the regions are
registered with the server's access token.

For each size two requests are checked once (the right values back) and then repeated by wrk (C
connections, ``--connections``; no Python on the request path):

- ``binary``: ``x`` in the body (the binary tensor extension), ``y`` in
  the response;
- ``shm``: ``x`` read from a registered region, ``y`` written into another
  (every request the same regions: the body is a few hundred bytes of JSON).

The server runs on core 0 (``taskset``), wrk on core 1. For each server,
size and mode: requests per second, p50, p99 and the server's CPU time per
request (its process tree, from /proc); the servers take turns over
``--runs`` runs; the table gives medians, shm's ratio to binary on the same
server, and ferrobatch's ratio to PyTriton in the same mode.

    python benches/python/bench_system_shm.py                    # 3 runs of 5 s
    python benches/python/bench_system_shm.py --quick            # a smoke run

Output: the table on stdout, JSON lines in ``benches/results/system_shm.jsonl``
(replaced by each run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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

RESULTS = ROOT / "benches" / "results" / "system_shm.jsonl"
ACCESS_HEADER = "triton-access-token"


def model(n: int) -> str:
    return f"echo{n}"


def serve(server: str, http_port: int, grpc_port: int, token_file: str, sizes: list[int]) -> None:
    """Binds ``echo<n>`` for each size with ``server``'s PyTriton API, writes
    the access token to ``token_file`` and serves until SIGINT."""
    if server == "ferrobatch":
        sys.path.insert(0, str(ROOT / "python"))
        from ferrobatch.triton import Triton, TritonConfig
        from ferrobatch.triton.decorators import batch
        from ferrobatch.triton.model_config import ModelConfig, Tensor

        config = TritonConfig(http_port=http_port, grpc_port=grpc_port, allow_metrics=False, allow_client_shm=True)
    else:
        from pytriton.decorators import batch  # type: ignore[no-redef]
        from pytriton.model_config import ModelConfig, Tensor  # type: ignore[no-redef]
        from pytriton.triton import Triton, TritonConfig  # type: ignore[no-redef]

        config = TritonConfig(http_port=http_port, grpc_port=grpc_port, allow_metrics=False)

    @batch  # type: ignore[misc]
    def echo(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    with Triton(config=config) as triton:
        for n in sizes:
            triton.bind(
                model_name=model(n),
                infer_func=echo,
                inputs=[Tensor(name="x", dtype=np.float32, shape=(n,))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(n,))],
                config=ModelConfig(max_batch_size=4),
                strict=True,
            )
        Path(token_file).write_text(triton.get_access_token())
        triton.serve()


class Endpoint:
    def __init__(self, server: str, http: str, pid: int, token: str) -> None:
        self.server, self.http, self.pid, self.token = server, http, pid, token


@contextmanager
def server_process(server: str, python: str, cpu: str, tmp: Path, run: int, sizes: list[int]) -> Iterator[Endpoint]:
    """The server running on ``cpu``, its models ready."""
    http, grpc = free_ports(2)
    token_file, log = tmp / f"{server}-{run}.token", tmp / f"{server}-{run}.log"
    cmd = [
        *pinned(cpu), python, str(HERE), "--serve", server, "--http-port", str(http), "--grpc-port", str(grpc),
        "--token-file", str(token_file), "--sizes", ",".join(map(str, sizes)),
    ]  # fmt: skip
    env = pytriton_env(python) if server == "pytriton" else dict(os.environ)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(f"127.0.0.1:{http}")
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{server} exited with status {proc.returncode}; see {log}")
                try:
                    if all(client.is_model_ready(model(n)) for n in sizes) and token_file.exists():
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server} was not ready in 180 s; see {log}")
                time.sleep(0.2)
            client.close()
            yield Endpoint(server, f"127.0.0.1:{http}", proc.pid, token_file.read_text())
        finally:
            stop(proc, seconds=90)


class Regions:
    """One input and one output region per size, made once, destroyed at the end."""

    def __init__(self, sizes: list[int]) -> None:
        import tritonclient.utils.shared_memory as shm

        self.shm = shm
        self.x = {n: np.random.default_rng(n).standard_normal((1, n)).astype(np.float32) for n in sizes}
        self.handles: dict[str, Any] = {}
        self.keys: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        for n in sizes:
            for side in ("in", "out"):
                name = f"{side}{n}"
                self.keys[name] = f"/fb-bench-{tag}-{name}"
                self.sizes[name] = n * 4
                self.handles[name] = shm.create_shared_memory_region(name, self.keys[name], n * 4)
            shm.set_shared_memory_region(self.handles[f"in{n}"], [self.x[n]])

    def register(self, endpoint: Endpoint) -> None:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(endpoint.http)
        headers = {ACCESS_HEADER: endpoint.token}
        for name, key in self.keys.items():
            client.register_system_shared_memory(name, key, self.sizes[name], headers=headers)
        client.close()

    def output(self, n: int) -> np.ndarray:
        return self.shm.get_contents_as_numpy(self.handles[f"out{n}"], np.float32, [1, n])

    def clear_output(self, n: int) -> None:
        self.shm.set_shared_memory_region(self.handles[f"out{n}"], [np.zeros((1, n), dtype=np.float32)])

    def close(self) -> None:
        for handle in self.handles.values():
            self.shm.destroy_shared_memory_region(handle)


def shm_request(n: int) -> loadgen.Request:
    size = n * 4
    doc = {
        "inputs": [
            {
                "name": "x",
                "shape": [1, n],
                "datatype": "FP32",
                "parameters": {"shared_memory_region": f"in{n}", "shared_memory_byte_size": size},
            }
        ],
        "outputs": [{"name": "y", "parameters": {"shared_memory_region": f"out{n}", "shared_memory_byte_size": size}}],
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    path = f"/v2/models/{model(n)}/infer"
    return loadgen.Request("json", model(n), {}, ("y",), path, body, {"Content-Type": "application/json"})


def check_shm(endpoint: Endpoint, request: loadgen.Request, regions: Regions, n: int) -> None:
    import httpx

    regions.clear_output(n)
    reply = httpx.post(f"http://{endpoint.http}{request.path}", content=request.body, headers=request.headers)
    if reply.status_code != 200:
        raise RuntimeError(f"{endpoint.server}: shm request refused: {reply.status_code} {reply.text[:200]}")
    if not np.array_equal(regions.output(n), regions.x[n]):
        raise RuntimeError(f"{endpoint.server}: the output region does not hold x")


def measure(endpoint: Endpoint, request: loadgen.Request, c: int, args: argparse.Namespace) -> dict[str, Any]:
    loadgen.run_wrk(request, endpoint.http, c, args.warmup, args.loadgen_cpu)
    before = cpu_seconds(endpoint.pid)
    load = loadgen.run_wrk(request, endpoint.http, c, args.seconds, args.loadgen_cpu)
    cpu = cpu_seconds(endpoint.pid) - before
    done = load.requests - load.errors
    return {
        "requests": load.requests,
        "errors": load.errors,
        "rps": done / load.elapsed if load.elapsed > 0 else float("nan"),
        "p50_ms": load.p50_us / 1e3,
        "p99_ms": load.p99_us / 1e3,
        "server_cpu_us": cpu / done * 1e6 if done else float("nan"),
        "detail": load.detail or None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=["ferrobatch", "pytriton"], help=argparse.SUPPRESS)
    parser.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grpc-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--token-file", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="16384,262144,1048576", help="elements of x per request (float32)")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--servers", default="ferrobatch,pytriton")
    parser.add_argument("--pytriton-python", default=None, help=f"default: {PYTRITON_VENV}/bin/python")
    parser.add_argument("--server-cpu", default="0")
    parser.add_argument("--loadgen-cpu", default="1")
    parser.add_argument("--quick", action="store_true", help="1 run of 2 s")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.http_port, args.grpc_port, args.token_file, [int(n) for n in args.sizes.split(",")])
        return 0
    if args.quick:
        args.runs, args.seconds, args.warmup = 1, 2.0, 1.0
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
    sizes = [int(n) for n in args.sizes.split(",")]
    regions = Regions(sizes)
    requests: dict[tuple[int, str], loadgen.Request] = {}
    for n in sizes:
        requests[n, "binary"] = loadgen.make_request("binary", model(n), {"x": regions.x[n]}, ("y",))
        requests[n, "shm"] = shm_request(n)
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_system_shm-") as tmp:
            for run in range(args.runs):
                for server in servers:  # the servers take turns, run by run
                    with server_process(server, pythons[server], args.server_cpu, Path(tmp), run, sizes) as endpoint:
                        regions.register(endpoint)
                        for (n, mode), request in requests.items():
                            if mode == "binary":
                                loadgen.check(request, endpoint.http, "", {"y": regions.x[n]})
                            else:
                                check_shm(endpoint, request, regions, n)
                            row = {"server": server, "elements": n, "mode": mode, "run": run}
                            row.update(measure(endpoint, request, args.connections, args))
                            rows.append(row)
                            print(
                                f"run {run} {server:10} {n * 4 >> 10:6} KiB {mode:6} {row['rps']:8.0f}/s"
                                f"  p50 {row['p50_ms']:.2f} ms  p99 {row['p99_ms']:.2f} ms"
                                f"  {row['server_cpu_us']:.0f} us CPU each  errors {row['errors']}",
                                flush=True,
                            )
    finally:
        regions.close()
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w") as out:
        for row in rows:
            extra = {"connections": args.connections, "time": stamp, "host_cpus": os.cpu_count()}
            out.write(json.dumps({**row, **extra}) + "\n")
    print(f"\nmedians of {args.runs} run(s), C = {args.connections} (wrote {RESULTS})")
    print("| x | server | mode | req/s | p50 ms | p99 ms | µs server CPU each | shm / binary | ferrobatch / PyTriton |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    medians: dict[tuple[int, str, str], dict[str, float]] = {}
    for n in sizes:
        for server in servers:
            for mode in ("binary", "shm"):
                mine = [r for r in rows if (r["elements"], r["server"], r["mode"]) == (n, server, mode)]
                medians[n, server, mode] = {
                    k: statistics.median(r[k] for r in mine) for k in ("rps", "p50_ms", "p99_ms", "server_cpu_us")
                }
        for server in servers:
            for mode in ("binary", "shm"):
                m = medians[n, server, mode]
                vs_binary = f"{m['rps'] / medians[n, server, 'binary']['rps']:.2f} ×" if mode == "shm" else ""
                vs_pytriton = (
                    f"{m['rps'] / medians[n, 'pytriton', mode]['rps']:.2f} ×"
                    if server == "ferrobatch" and "pytriton" in servers
                    else ""
                )
                print(
                    f"| {n * 4 >> 10} KiB | {server} | {mode} | {m['rps']:,.0f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f}"
                    f" | {m['server_cpu_us']:.0f} | {vs_binary} | {vs_pytriton} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
