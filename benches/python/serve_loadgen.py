"""Native load generators for ``bench_serve.py --driver wrk``: wrk and h2load.

Each case posts one fixed request, built here once, over and over:

- ``json``: ``POST /v2/models/NAME/infer`` with a v2 JSON body (``data`` as a
  flat list of the float32 values, printed as Python prints them, or of
  strings for BYTES);
- ``binary``: the same with the binary tensor extension: a JSON header whose
  length is sent in ``Inference-Header-Content-Length``, then each input's
  raw bytes (little-endian float32, or 4-byte-length-prefixed BYTES
  elements); the outputs are asked for as binary too;
- ``grpc``: ``POST /inference.GRPCInferenceService/ModelInfer`` over h2c with
  ``content-type: application/grpc`` and ``te: trailers``: a length-prefixed
  ``ModelInferRequest`` with the tensors in ``raw_input_contents``.

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
from typing import Any

import numpy as np

#: Protocols of the wrk driver, in table order.
PROTOCOLS = ("json", "binary", "grpc")
#: Driven when asked for (``--protocols``), not by default: Triton's generate
#: extension (``POST .../generate``, each input by name as a flat array), and
#: its ``.../generate_stream`` (the same body, answered as Server-Sent Events,
#: one per response; wrk counts a stream when its last event came).
OPT_IN_PROTOCOLS = ("generate", "generate_stream")
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
    inputs: dict[str, np.ndarray]  # float32, or object arrays of bytes (BYTES), each [1, ...]
    outputs: tuple[str, ...]  # asked for by name, in this order
    path: str
    body: bytes
    headers: dict[str, str]


#: v2 datatypes of the arrays a request may carry, and their little-endian numpy dtypes.
_DATATYPES = {"float32": ("FP32", "<f4"), "float64": ("FP64", "<f8"), "object": ("BYTES", "")}


def _datatype(array: np.ndarray) -> str:
    return _DATATYPES[array.dtype.name][0]


def _raw(array: np.ndarray) -> bytes:
    """The binary extension's and gRPC raw contents' bytes: little-endian
    numbers, or each element 4-byte-length-prefixed (BYTES)."""
    if array.dtype == object:
        return b"".join(struct.pack("<I", len(e)) + e for e in array.ravel())
    return np.ascontiguousarray(array, dtype=_DATATYPES[array.dtype.name][1]).tobytes()


def _from_raw(datatype: str, raw: bytes) -> np.ndarray:
    if datatype != "BYTES":
        return np.frombuffer(raw, dtype="<f8" if datatype == "FP64" else "<f4")
    elements, at = [], 0
    while at < len(raw):
        (n,) = struct.unpack_from("<I", raw, at)
        elements.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    return np.asarray(elements, dtype=object)


def _json_data(array: np.ndarray) -> list[Any]:
    return [e.decode() for e in array.ravel()] if array.dtype == object else array.ravel().tolist()


def make_request(protocol: str, model: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> Request:
    path = f"/v2/models/{model}/infer"
    if protocol == "json":
        doc = {
            "inputs": [
                {"name": name, "shape": list(a.shape), "datatype": _datatype(a), "data": _json_data(a)}
                for name, a in inputs.items()
            ],
            "outputs": [{"name": name} for name in outputs],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        return Request(protocol, model, inputs, outputs, path, body, {"Content-Type": "application/json"})
    if protocol in OPT_IN_PROTOCOLS:  # Triton's generate extension: each input by name, a flat array
        body = json.dumps({name: _json_data(a) for name, a in inputs.items()}, separators=(",", ":")).encode()
        generate = f"/v2/models/{model}/{protocol}"
        return Request(protocol, model, inputs, outputs, generate, body, {"Content-Type": "application/json"})
    if protocol == "binary":
        raws = [_raw(a) for a in inputs.values()]
        header = {
            "inputs": [
                {
                    "name": name,
                    "shape": list(a.shape),
                    "datatype": _datatype(a),
                    "parameters": {"binary_data_size": len(raw)},
                }
                for (name, a), raw in zip(inputs.items(), raws)
            ],
            "outputs": [{"name": name, "parameters": {"binary_data": True}} for name in outputs],
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        return Request(protocol, model, inputs, outputs, path, head + b"".join(raws), headers)
    if protocol == "grpc":
        from tritonclient.grpc import service_pb2 as pb

        message = pb.ModelInferRequest(model_name=model)
        for name, a in inputs.items():
            tensor = message.inputs.add(name=name, datatype=_datatype(a))
            tensor.shape.extend(a.shape)
            message.raw_input_contents.append(_raw(a))
        for name in outputs:
            message.outputs.add(name=name)
        payload = message.SerializeToString()
        body = struct.pack(">BI", 0, len(payload)) + payload  # gRPC framing: not compressed, length
        headers = {"content-type": "application/grpc", "te": "trailers"}
        return Request(protocol, model, inputs, outputs, GRPC_METHOD, body, headers)
    raise ValueError(f"unknown protocol {protocol!r}")


def _answered(
    request: Request, http: str, grpc: str, grpc_root: Path | None = None
) -> tuple[dict[str, np.ndarray], int]:
    """Sends ``request`` once: its outputs by name (flat), and the response's
    length in bytes (the body for HTTP, the framed message for gRPC; over
    TLS when ``grpc_root``, the CA that signs the server's certificate)."""
    if request.protocol == "grpc":
        import grpc as grpclib
        from tritonclient.grpc import service_pb2 as pb

        if grpc_root is None:
            channel = grpclib.insecure_channel(grpc)
        else:
            channel = grpclib.secure_channel(grpc, grpclib.ssl_channel_credentials(grpc_root.read_bytes()))
        with channel:
            call = channel.unary_unary(GRPC_METHOD)  # bytes in, bytes out
            reply = call(request.body[5:], timeout=30)
        response = pb.ModelInferResponse.FromString(reply)
        raws = zip(response.outputs, response.raw_output_contents)
        return {o.name: _from_raw(o.datatype, raw) for o, raw in raws}, 5 + len(reply)
    sent = urllib.request.Request(f"http://{http}{request.path}", data=request.body, headers=request.headers)
    with urllib.request.urlopen(sent, timeout=30) as answer:
        body = answer.read()
        header_length = answer.headers.get("Inference-Header-Content-Length")
    got: dict[str, np.ndarray] = {}
    if request.protocol in OPT_IN_PROTOCOLS:  # each output by name: its one element, or a flat array
        # generate_stream: a "data: {...}" event per response, their elements in order.
        text = body.decode()
        answers = (
            [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e]
            if request.protocol == "generate_stream"
            else [json.loads(text)]
        )
        for name in request.outputs:
            value = [v for a in answers for v in (a[name] if isinstance(a[name], list) else [a[name]])]
            got[name] = (
                np.asarray([e.encode() for e in value], dtype=object)
                if isinstance(value[0], str)
                else (np.asarray(value, np.float32))
            )
        return got, len(body)
    if header_length is None:
        for o in json.loads(body)["outputs"]:
            data = o["data"]
            bytes_data = o["datatype"] == "BYTES"
            got[o["name"]] = (
                np.asarray([e.encode() for e in data], dtype=object) if bytes_data else np.asarray(data, np.float32)
            )
        return got, len(body)
    at = int(header_length)
    for o in json.loads(body[:at])["outputs"]:
        n = o["parameters"]["binary_data_size"]
        got[o["name"]] = _from_raw(o["datatype"], body[at : at + n])
        at += n
    return got, len(body)


def check(
    request: Request, http: str, grpc: str, expected: dict[str, np.ndarray], grpc_root: Path | None = None
) -> int:
    """Sends ``request`` once; raises unless the server answers ``expected``
    for every output (floats within float32 rounding, bytes exactly).
    Returns the response's length in bytes (the body for HTTP, the framed
    message for gRPC)."""
    got, length = _answered(request, http, grpc, grpc_root)
    for name, want in expected.items():
        y = got.get(name)
        if y is None or y.size != want.size:
            raise RuntimeError(f"{request.protocol} {request.model}: no '{name}' of {want.size} elements answered")
        if want.dtype == object:
            same = list(y.ravel()) == list(want.ravel())
        else:
            same = bool(np.allclose(y, want.ravel(), rtol=1e-5, atol=1e-5))
        if not same:
            raise RuntimeError(f"{request.protocol} {request.model}: the server answered a wrong '{name}': {y[:4]}...")
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


def cpu_list(spec: str) -> list[int]:
    """The cores of a ``taskset -c`` list: ``"1"``, ``"2-15"``, ``"0,2-3"``."""
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def run_wrk(request: Request, http: str, connections: int, seconds: float, cpu: str) -> LoadResult:
    """wrk on ``cpu`` (one thread per core of it, at most one per
    connection), ``connections`` connections, for ``seconds``."""
    threads = max(1, min(len(cpu_list(cpu)), connections))
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
            "taskset", "-c", cpu, "wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
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
    request: Request, grpc: str, connections: int, seconds: float, cpu: str, reply_length: int, tls: bool = False
) -> LoadResult:
    """h2load on ``cpu`` (a thread per core of it), ``connections`` h2c connections with one
    stream in flight each (``tls``: HTTP/2 over TLS), for ``seconds``. ``reply_length``: the framed
    response of the checked request; shorter ones count as errors."""
    with tempfile.TemporaryDirectory(prefix="bench_serve-h2load-") as tmp:
        body, log = Path(tmp, "body"), Path(tmp, "log.tsv")
        body.write_bytes(request.body)
        cmd = [
            "taskset", "-c", cpu, "h2load", f"-t{max(1, min(len(cpu_list(cpu)), connections))}",
            f"-c{connections}", "-m1", f"-D{max(1, round(seconds))}",
            "-d", str(body), f"--log-file={log}",
        ]  # fmt: skip
        for name, value in request.headers.items():
            cmd += ["-H", f"{name}: {value}"]
        cmd.append(f"{'https' if tls else 'http'}://{grpc}{request.path}")
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
