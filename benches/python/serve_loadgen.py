"""Native load generators for ``bench_serve.py --driver wrk``: wrk and h2load.

Each case posts one fixed request, built here once, over and over:

- ``json``: ``POST /v2/models/NAME/infer`` with a v2 JSON body (``data`` as a
  flat list of the float32 values, printed as Python prints them);
- ``binary``: the same with the binary tensor extension: a JSON header whose
  length is sent in ``Inference-Header-Content-Length``, then the raw
  little-endian bytes of ``x``; the output is asked for as binary too;
- ``grpc``: ``POST /inference.GRPCInferenceService/ModelInfer`` over h2c with
  ``content-type: application/grpc`` and ``te: trailers``: a length-prefixed
  ``ModelInferRequest`` with the tensor in ``raw_input_contents``.

wrk runs one thread and C connections, a Lua script supplying the body and
writing wrk's summary (requests, errors, latency percentiles) as JSON; h2load
runs one thread, C connections and one stream in flight per connection, with a
per-request log for the percentiles. The generator is pinned to one core with
``taskset``; nothing in Python is on the request path while it runs.

h2load cannot see a gRPC status (it travels in trailers, after an HTTP 200), so
each case is checked beforehand with one request of the same bytes answered and
compared with the model's output here, and a gRPC response shorter than that
checked one is counted as an error (an error reply carries no message).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Protocols of the wrk driver, in table order.
PROTOCOLS = ("json", "binary", "grpc")
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"


def tools_missing() -> list[str]:
    """The commands this driver needs that are not on PATH."""
    return [tool for tool in ("wrk", "h2load", "taskset") if shutil.which(tool) is None]


# -- the fixed requests --------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One protocol's fixed request for one model: what the generator posts."""

    protocol: str
    model: str
    x: np.ndarray  # float32[1, width]: the input it carries
    path: str
    body: bytes
    headers: dict[str, str]


def make_request(protocol: str, model: str, x: np.ndarray) -> Request:
    shape = list(x.shape)
    if protocol == "json":
        doc = {
            "inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": x.ravel().tolist()}],
            "outputs": [{"name": "y"}],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        return Request(protocol, model, x, f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
    if protocol == "binary":
        raw = np.ascontiguousarray(x, dtype="<f4").tobytes()
        header = {
            "inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": len(raw)}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        return Request(protocol, model, x, f"/v2/models/{model}/infer", head + raw, headers)
    if protocol == "grpc":
        from tritonclient.grpc import service_pb2 as pb

        message = pb.ModelInferRequest(model_name=model)
        tensor = message.inputs.add(name="x", datatype="FP32")
        tensor.shape.extend(shape)
        message.outputs.add(name="y")
        message.raw_input_contents.append(np.ascontiguousarray(x, dtype="<f4").tobytes())
        payload = message.SerializeToString()
        body = struct.pack(">BI", 0, len(payload)) + payload  # gRPC framing: not compressed, length
        headers = {"content-type": "application/grpc", "te": "trailers"}
        return Request(protocol, model, x, GRPC_METHOD, body, headers)
    raise ValueError(f"unknown protocol {protocol!r}")


def check(request: Request, http: str, grpc: str, expected: np.ndarray) -> int:
    """Sends ``request`` once; raises unless the server answers ``expected``
    (within float32 rounding). Returns the response's length in bytes (the
    body for HTTP, the framed message for gRPC)."""
    if request.protocol == "grpc":
        import grpc as grpclib
        from tritonclient.grpc import service_pb2 as pb

        with grpclib.insecure_channel(grpc) as channel:
            call = channel.unary_unary(GRPC_METHOD)  # bytes in, bytes out
            reply = call(request.body[5:], timeout=30)
        response = pb.ModelInferResponse.FromString(reply)
        y = np.frombuffer(response.raw_output_contents[0], dtype="<f4")
        length = 5 + len(reply)
    else:
        sent = urllib.request.Request(f"http://{http}{request.path}", data=request.body, headers=request.headers)
        with urllib.request.urlopen(sent, timeout=30) as answer:
            body = answer.read()
            header_length = answer.headers.get("Inference-Header-Content-Length")
        length = len(body)
        if header_length is None:
            doc = json.loads(body)
            y = np.asarray(doc["outputs"][0]["data"], dtype=np.float32)
        else:
            y = np.frombuffer(body[int(header_length) :], dtype="<f4")
    if y.size != expected.size or not np.allclose(y, expected.ravel(), rtol=1e-5, atol=1e-5):
        raise RuntimeError(f"{request.protocol} {request.model}: the server answered a wrong y: {y[:4]}...")
    return length


# -- the generators ------------------------------------------------------------------------------


@dataclass
class LoadResult:
    requests: int  # completed in the measured run (any status)
    errors: int  # failed: connect/read/write/timeout, non-2xx, short gRPC replies
    elapsed: float  # seconds the generator ran its load
    p50_us: float
    p99_us: float
    detail: str = ""  # the first lines of the generator's complaint, if any


_LUA = """\
wrk.method = "POST"
wrk.path = {path}
{headers}
local f = assert(io.open({body}, "rb"))
wrk.body = f:read("*a")
f:close()

done = function(summary, latency, requests)
  local e = summary.errors
  local out = assert(io.open({out}, "w"))
  out:write(string.format(
    '{{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d,'
      .. ' "p50_us": %d, "p99_us": %d}}',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
  out:close()
end
"""


def _lua_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lua one for this (ASCII) text


def run_wrk(request: Request, http: str, connections: int, seconds: float, cpu: str) -> LoadResult:
    """wrk on ``cpu``: one thread, ``connections`` connections, for ``seconds``."""
    with tempfile.TemporaryDirectory(prefix="bench_serve-wrk-") as tmp:
        body, out, script = Path(tmp, "body"), Path(tmp, "out.json"), Path(tmp, "post.lua")
        body.write_bytes(request.body)
        headers = "\n".join(f"wrk.headers[{_lua_string(k)}] = {_lua_string(v)}" for k, v in request.headers.items())
        script.write_text(
            _LUA.format(
                path=_lua_string(request.path), headers=headers, body=_lua_string(str(body)), out=_lua_string(str(out))
            )
        )
        cmd = [
            "taskset", "-c", cpu, "wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s",
            "--timeout", "10s", "-s", str(script), f"http://{http}{request.path}",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        stats = json.loads(out.read_text())
    errors = sum(stats[k] for k in ("connect", "read", "write", "status", "timeout"))
    detail = (
        "" if not errors else ", ".join(f"{k} {stats[k]}" for k in ("connect", "read", "write", "status", "timeout"))
    )
    return LoadResult(
        requests=stats["requests"],
        errors=errors,
        elapsed=stats["duration_us"] / 1e6,
        p50_us=float(stats["p50_us"]),
        p99_us=float(stats["p99_us"]),
        detail=detail,
    )


def _h2load_field(text: str, pattern: str) -> float:
    found = re.search(pattern, text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"h2load's output has no {pattern!r}:\n{text}")
    return float(found.group(1))


def run_h2load(
    request: Request, grpc: str, connections: int, seconds: float, cpu: str, reply_length: int
) -> LoadResult:
    """h2load on ``cpu``: one thread, ``connections`` h2c connections with one
    stream in flight each, for ``seconds``. ``reply_length``: the framed
    response of the checked request; shorter ones count as errors."""
    with tempfile.TemporaryDirectory(prefix="bench_serve-h2load-") as tmp:
        body, log = Path(tmp, "body"), Path(tmp, "log.tsv")
        body.write_bytes(request.body)
        cmd = [
            "taskset", "-c", cpu, "h2load", "-t1", f"-c{connections}", "-m1", f"-D{max(1, round(seconds))}",
            "-d", str(body), f"--log-file={log}",
        ]  # fmt: skip
        for name, value in request.headers.items():
            cmd += ["-H", f"{name}: {value}"]
        cmd.append(f"http://{grpc}{request.path}")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
        text = done.stdout
        if done.returncode != 0 or "requests:" not in text:
            raise RuntimeError(f"h2load failed ({done.returncode}): {done.stderr.strip() or text.strip()}")
        # finished in 5.00s, 1234.5 req/s, ...
        elapsed = _h2load_field(text, r"^finished in ([\d.]+)s")
        succeeded = int(_h2load_field(text, r"^requests: .* (\d+) succeeded"))
        done_requests = int(_h2load_field(text, r"^requests: .* (\d+) done"))
        # traffic: 1.23MB (1289600) total, 10.5KB (10756) headers (space savings 94.21%), 1.05MB (1101600) data
        data = re.search(r"^traffic: .*\((\d+)\) data", text, re.MULTILINE)
        data_bytes = int(data.group(1)) if data else None
        durations = []
        for line in log.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) >= 3 and fields[1] == "200":
                durations.append(float(fields[2]))
    short = 0
    if data_bytes is not None and reply_length > 0:
        short = max(0, succeeded - data_bytes // reply_length)
    errors = (done_requests - succeeded) + short
    latencies = np.asarray(durations) if durations else np.asarray([float("nan")])
    detail = ""
    if errors:
        detail = f"{done_requests - succeeded} failed, {short} replies shorter than the checked one"
    return LoadResult(
        requests=done_requests,
        errors=errors,
        elapsed=elapsed,
        p50_us=float(np.percentile(latencies, 50)),
        p99_us=float(np.percentile(latencies, 99)),
        detail=detail,
    )


# -- /proc ---------------------------------------------------------------------------------------


def cpu_busy(cpus: list[int]) -> dict[int, tuple[float, float]]:
    """(busy, total) clock ticks of each of ``cpus`` so far, from /proc/stat
    (busy: everything but idle and iowait; steal included)."""
    out: dict[int, tuple[float, float]] = {}
    if not os.path.exists("/proc/stat"):
        return out
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        cpu = int(name[3:])
        if cpu in cpus:
            ticks = [float(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
            out[cpu] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def busy_fraction(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], cpu: int) -> float:
    if cpu not in before or cpu not in after:
        return float("nan")
    busy = after[cpu][0] - before[cpu][0]
    total = after[cpu][1] - before[cpu][1]
    return busy / total if total > 0 else float("nan")
