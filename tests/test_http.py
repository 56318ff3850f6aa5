"""The v2 REST API, driven by tritonclient (sync and aio) and by raw HTTP,
against servers served on 127.0.0.1 by the Starlette app under uvicorn and by
the aiohttp app."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from conftest import gevent_hub_freed
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

WIDTH = 4
X = fb.TensorSpec("x", "float32", (WIDTH,))
Y = fb.TensorSpec("y", "float32", (WIDTH,))
MAX_BATCH = 8
# Every v2 datatype but BF16 (tested with raw bytes: numpy has no bfloat16).
NUMPY_TYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
TORCH_NAMES = {
    "BOOL": "bool",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
    "BF16": "bfloat16",
}


# -- models -------------------------------------------------------------------------------


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """y = 2x: each row's output depends on that row only, so mix-ups show."""
    return {"y": inputs["x"] * 2}


def echo(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"out_" + name.removeprefix("in_"): t.clone() for name, t in inputs.items()}


def broken(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    raise RuntimeError("the model is broken")


class Gate:
    """A model that holds each batch until released: makes queues and deadlines
    observable without timing anything."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.entered.set()
        self.release.wait(30)
        return {"y": inputs["x"] * 2}


def make_servers() -> list[fb.Server]:
    """double (FP32 [4]), types (one input and output per datatype, [3]), broken."""
    return [
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, name="double"),
        fb.Server(
            echo,
            inputs=[fb.TensorSpec("in_" + dt, name, (3,)) for dt, name in TORCH_NAMES.items()],
            outputs=[fb.TensorSpec("out_" + dt, name, (3,)) for dt, name in TORCH_NAMES.items()],
            max_batch_size=MAX_BATCH,
            name="types",
        ),
        fb.Server(broken, inputs=[X], outputs=[Y], name="broken"),
    ]


def sample_values(datatype: str, rows: int = 2) -> np.ndarray:
    dtype = NUMPY_TYPES[datatype]
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]][:rows])
    base = np.arange(rows * 3, dtype=dtype).reshape(rows, 3)
    if datatype.startswith("FP"):
        return (base * 1.5 - 2).astype(dtype)
    # The type's extremes survive the trip (JSON included).
    return np.iinfo(dtype).max - base if datatype.startswith("UINT") else np.iinfo(dtype).min + base


# -- serving on 127.0.0.1 -----------------------------------------------------------------


@contextlib.contextmanager
def aiohttp_in_thread(servers: list[fb.Server]) -> Iterator[int]:
    """The aiohttp app on its own loop and thread; yields its port."""
    from aiohttp import web

    from ferrobatch.http import aiohttp_app

    port_box: list[int] = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def main() -> None:
        runner = web.AppRunner(aiohttp_app(servers))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_box.append(runner.addresses[0][1])
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the aiohttp app did not start"
    try:
        yield port_box[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@contextlib.contextmanager
def serving(kind: str, servers: list[fb.Server]) -> Iterator[str]:
    """Serves ``servers`` over HTTP with the app ``kind``; yields "127.0.0.1:port"."""
    if kind in ("native", "starlette"):
        # ferrobatch serve's two front-ends: Rust, or uvicorn with the Starlette app.
        frontend = "native" if kind == "native" else "python"
        config = ServeConfig(http_port=0, grpc_port=None, log_level="warning", frontend=frontend)
        with serve_in_thread(servers, config) as listening:
            yield f"127.0.0.1:{listening.http_port}"
    else:
        with aiohttp_in_thread(servers) as port:
            yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module", params=["native", "starlette", "aiohttp"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    with serving(request.param, make_servers()) as address:
        yield address


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{url}", timeout=30) as client:
        yield client


@pytest.fixture
def triton(url: str) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    yield client
    client.close()


def infer_body(
    inputs: list[dict[str, Any]], binary: Sequence[bytes] = (), **extra: Any
) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": inputs, **extra}).encode()
    if not binary:
        return header, {}
    return header + b"".join(binary), {"Inference-Header-Content-Length": str(len(header))}


def x_input(rows: int = 1, **fields: Any) -> dict[str, Any]:
    entry = {"name": "x", "datatype": "FP32", "shape": [rows, WIDTH]}
    entry.update(fields)
    return entry


# -- tritonclient: health, metadata, inference ------------------------------------------------


def test_health_and_metadata_with_tritonclient(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("double")
    assert triton.is_model_ready("double", "1")
    assert not triton.is_model_ready("nope")
    meta = triton.get_server_metadata()
    assert meta["name"] == "ferrobatch"
    assert meta["version"] == fb.__version__
    assert "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata("double")
    assert model["name"] == "double"
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH]}]
    assert model["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, WIDTH]}]
    assert triton.get_model_metadata("double", "1") == model
    config = triton.get_model_config("double")
    assert config["max_batch_size"] == MAX_BATCH
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [WIDTH]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_rows_with_tritonclient(triton: httpclient.InferenceServerClient, binary: bool) -> None:
    x = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
    tensor = httpclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("y", binary_data=binary)]
    result = triton.infer("double", [tensor], outputs=outputs, request_id="r-7")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    response = result.get_response()
    assert response["id"] == "r-7"
    assert response["model_name"] == "double"
    assert response["model_version"] == "1"
    assert ("parameters" in response["outputs"][0]) is binary


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_round_trips(triton: httpclient.InferenceServerClient, binary: bool) -> None:
    inputs, expected = [], {}
    for datatype in NUMPY_TYPES:
        values = sample_values(datatype)
        tensor = httpclient.InferInput("in_" + datatype, list(values.shape), datatype)
        tensor.set_data_from_numpy(values, binary_data=binary)
        inputs.append(tensor)
        expected["out_" + datatype] = values
    bf16 = torch.tensor([[1.5, -2.0, 0.25], [3.0, 0.0, -0.5]], dtype=torch.bfloat16)
    tensor = httpclient.InferInput("in_BF16", [2, 3], "BF16")
    tensor._raw_data = bf16.view(torch.int16).numpy().tobytes()  # version-independent BF16 bytes
    tensor._parameters["binary_data_size"] = len(tensor._raw_data)
    inputs.append(tensor)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in expected]
    result = triton.infer("types", inputs, outputs=outputs)
    for name, values in expected.items():
        got = result.as_numpy(name)
        assert got.dtype == values.dtype, name
        np.testing.assert_array_equal(got, values, err_msg=name)


def test_all_outputs_come_back_binary_by_default(triton: httpclient.InferenceServerClient) -> None:
    x = np.ones((1, WIDTH), np.float32)
    tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
    tensor.set_data_from_numpy(x)
    result = triton.infer("double", [tensor])  # no outputs named: binary_data_output
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 4 * WIDTH


async def test_aio_tritonclient_concurrent_callers_get_their_own_rows(url: str) -> None:
    client = aiohttpclient.InferenceServerClient(url)
    try:
        assert await client.is_server_ready()
        assert (await client.get_model_metadata("double"))["name"] == "double"

        async def call(i: int) -> None:
            x = np.full((1 + i % 3, WIDTH), float(i), np.float32)
            tensor = aiohttpclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=i % 2 == 0)
            result = await client.infer("double", [tensor])
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)

        await asyncio.gather(*(call(i) for i in range(64)))
    finally:
        await client.close()


# -- error statuses -------------------------------------------------------------------------


def status_of(call: Callable[[], Any]) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    status = info.value.status()
    assert status is not None
    return str(status)


def test_bad_requests_are_400_with_tritonclient(triton: httpclient.InferenceServerClient) -> None:
    def infer(model: str, name: str, shape: list[int], datatype: str = "FP32", version: str = "") -> None:
        tensor = httpclient.InferInput(name, shape, datatype)
        np_type = NUMPY_TYPES[datatype]
        tensor.set_data_from_numpy(np.zeros(shape, np_type))
        triton.infer(model, [tensor], model_version=version)

    assert status_of(lambda: infer("nope", "x", [1, WIDTH])) == "400"
    assert status_of(lambda: infer("double", "x", [1, WIDTH], version="2")) == "400"
    assert status_of(lambda: infer("double", "z", [1, WIDTH])) == "400"  # unknown input
    assert status_of(lambda: infer("double", "x", [1, WIDTH + 1])) == "400"  # wrong shape
    assert status_of(lambda: infer("double", "x", [WIDTH])) == "400"  # no batch dimension
    assert status_of(lambda: infer("double", "x", [1, WIDTH], "FP64")) == "400"  # wrong dtype
    assert status_of(lambda: infer("double", "x", [MAX_BATCH + 1, WIDTH])) == "400"  # too many rows
    assert status_of(lambda: triton.get_model_metadata("nope")) == "400"
    infer("double", "x", [MAX_BATCH, WIDTH], version="1")  # the largest request is fine


def test_model_failure_is_500(triton: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, WIDTH), np.float32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("broken", [tensor])
    assert info.value.status() == "500"
    # Its type and a request id; the text stays in the server's log.
    assert "RuntimeError" in info.value.message()
    assert "request id" in info.value.message()
    assert "the model is broken" not in info.value.message()


def test_malformed_bodies_are_400(http: httpx.Client) -> None:
    path = "/v2/models/double/infer"
    x = np.ones((1, WIDTH), np.float32).tobytes()

    def post(body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
        return http.post(path, content=body, headers=headers or {})

    cases = {
        "malformed JSON": post(b'{"inputs": [', {}),
        "not an object": post(b"[1, 2]"),
        "no inputs": post(b'{"inputs": []}'),
        "bad header length": post(b'{"inputs": []}', {"Inference-Header-Content-Length": "abc"}),
        "header length past the end": post(b"{}", {"Inference-Header-Content-Length": "99"}),
        "binary sizes short of the body": post(*infer_body([x_input(parameters={"binary_data_size": 16})], [x, x])),
        "binary sizes past the body": post(*infer_body([x_input(parameters={"binary_data_size": 32})], [x])),
        "binary size not the shape's": post(*infer_body([x_input(2, parameters={"binary_data_size": 16})], [x])),
        "binary data without its header": post(*infer_body([x_input(parameters={"binary_data_size": 16})])),
        "data and binary_data_size": post(
            *infer_body([x_input(data=[1] * 4, parameters={"binary_data_size": 16})], [x])
        ),
        "neither data nor binary": post(*infer_body([x_input()])),
        "too few values": post(*infer_body([x_input(data=[1, 2, 3])])),
        "not numbers": post(*infer_body([x_input(data=["a", "b", "c", "d"])])),
        "unknown datatype": post(*infer_body([x_input(datatype="FP8", data=[1] * 4)])),
        "BYTES": post(*infer_body([x_input(datatype="BYTES", data=["a"] * 4)])),
        "negative dimension": post(*infer_body([x_input(shape=[-1, WIDTH], data=[1] * 4)])),
        "input given twice": post(*infer_body([x_input(data=[1] * 4), x_input(data=[1] * 4)])),
        "unknown output": post(*infer_body([x_input(data=[1] * 4)], outputs=[{"name": "q"}])),
        "bad timeout": post(*infer_body([x_input(data=[1] * 4)], parameters={"timeout": "soon"})),
        "bad gzip": post(b"not gzip", {"Content-Encoding": "gzip"}),
    }
    for case, response in cases.items():
        assert response.status_code == 400, (case, response.text)
        assert response.headers["content-type"].startswith("application/json"), case
        assert set(response.json()) == {"error"}, case
        assert response.json()["error"], case


def test_bool_values_must_be_bools(http: httpx.Client) -> None:
    inputs = [
        {"name": "in_" + dt, "datatype": dt, "shape": [1, 3], "data": [1, 0, 1]} for dt in TORCH_NAMES if dt != "BF16"
    ]
    inputs.append({"name": "in_BF16", "datatype": "BF16", "shape": [1, 3], "data": [1, 0, 1]})
    body, headers = infer_body(inputs)
    assert http.post("/v2/models/types/infer", content=body, headers=headers).status_code == 400
    inputs[0]["data"] = [True, False, True]
    body, headers = infer_body(inputs)
    response = http.post("/v2/models/types/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text


def test_json_or_binary_is_decided_by_the_header_not_content_type(http: httpx.Client) -> None:
    path = "/v2/models/double/infer"
    body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
    response = http.post(path, content=body, headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]

    x = np.array([[1, 2, 3, 4]], np.float32)
    body, headers = infer_body(
        [x_input(parameters={"binary_data_size": x.nbytes})],
        [x.tobytes()],
        outputs=[{"name": "y", "parameters": {"binary_data": True}}],
    )
    response = http.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == x.nbytes
    np.testing.assert_array_equal(np.frombuffer(response.content[length:], np.float32), x.ravel() * 2)


def test_nested_json_data_and_request_level_binary_output(http: httpx.Client) -> None:
    body, headers = infer_body([x_input(2, data=[[1, 2, 3, 4], [5, 6, 7, 8]])], parameters={"binary_data_output": True})
    response = http.post("/v2/models/double/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    y = np.frombuffer(response.content[length:], np.float32).reshape(2, WIDTH)
    np.testing.assert_array_equal(y, np.arange(1, 9, dtype=np.float32).reshape(2, WIDTH) * 2)


def test_bf16_json_and_binary(http: httpx.Client) -> None:
    values = torch.tensor([[1.5, -2.0, 0.25]], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().tobytes()
    inputs: list[dict[str, Any]] = []
    blobs = []
    for dt in TORCH_NAMES:
        entry: dict[str, Any] = {"name": "in_" + dt, "datatype": dt, "shape": [1, 3]}
        if dt == "BF16":
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = [True, False, True] if dt == "BOOL" else [1, 2, 3]
        inputs.append(entry)
    outputs = [{"name": "out_BF16", "parameters": {"binary_data": True}}]
    body, headers = infer_body(inputs, blobs, outputs=outputs)
    response = http.post("/v2/models/types/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:length])
    assert [o["name"] for o in header["outputs"]] == ["out_BF16"]
    assert header["outputs"][0]["datatype"] == "BF16"
    assert response.content[length:] == raw

    inputs[-1] = {"name": "in_BF16", "datatype": "BF16", "shape": [1, 3], "data": [1.5, -2.0, 0.25]}
    outputs = [{"name": "out_BF16", "parameters": {"binary_data": False}}]
    body, headers = infer_body(inputs, outputs=outputs)
    response = http.post("/v2/models/types/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [1.5, -2.0, 0.25]


def test_gzip_and_deflate_requests(http: httpx.Client) -> None:
    import zlib

    body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
    for encoding, packed in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = http.post("/v2/models/double/infer", content=packed, headers={"Content-Encoding": encoding})
        assert response.status_code == 200, (encoding, response.text)
        assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]


def test_responses_are_coded_as_accept_encoding_asks(url: str, http: httpx.Client) -> None:
    """gzip when accepted, else deflate (zlib format), as Triton does; the
    binary header length stays the uncoded JSON's."""
    import zlib

    body, headers = infer_body([x_input(data=[1, 2, 3, 4])], [], outputs=[{"name": "y"}])
    cases = {"gzip": "gzip", "deflate": "deflate", "br, deflate;q=0.5": "deflate", "gzip;q=0, deflate": "deflate"}
    for accept, coding in cases.items():
        sent = urllib.request.Request(
            f"http://{url}/v2/models/double/infer", data=body, headers={**headers, "Accept-Encoding": accept}
        )
        with urllib.request.urlopen(sent, timeout=30) as answer:
            raw = answer.read()
            assert answer.headers["Content-Encoding"] == coding, accept
        plain = gzip.decompress(raw) if coding == "gzip" else zlib.decompress(raw)
        assert json.loads(plain)["outputs"][0]["data"] == [2, 4, 6, 8]
    plain_reply = http.post("/v2/models/double/infer", content=body, headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain_reply.headers
    client = httpclient.InferenceServerClient(url, network_timeout=30)
    try:
        for algorithm in ("gzip", "deflate"):
            tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
            tensor.set_data_from_numpy(np.arange(WIDTH, dtype=np.float32)[None], binary_data=True)
            result = client.infer("double", [tensor], response_compression_algorithm=algorithm)
            np.testing.assert_array_equal(result.as_numpy("y"), 2 * np.arange(WIDTH, dtype=np.float32)[None])
    finally:
        client.close()


def test_bad_requests_do_not_harm_good_ones(url: str) -> None:
    good_x = np.arange(WIDTH, dtype=np.float32)[None]

    @gevent_hub_freed()
    def good(i: int) -> np.ndarray:
        client = httpclient.InferenceServerClient(url, network_timeout=30)
        try:
            tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
            tensor.set_data_from_numpy(good_x + i)
            return client.infer("double", [tensor]).as_numpy("y")  # type: ignore[no-any-return]
        finally:
            client.close()

    def bad(i: int) -> int:
        with httpx.Client(base_url=f"http://{url}") as http:
            body = [b'{"inputs": [', *infer_body([x_input(data=[1, 2])])][i % 2]
            return http.post("/v2/models/double/infer", content=body).status_code

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(16)]
        bads = [pool.submit(bad, i) for i in range(16)]
        for i, future in enumerate(goods):
            np.testing.assert_array_equal(future.result(), (good_x + i) * 2)
        assert all(f.result() == 400 for f in bads)


# -- 503 and 504 -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["starlette", "aiohttp"])
def test_queue_full_is_503_and_deadline_is_504(kind: str) -> None:
    gate, slow = Gate(), Gate()
    servers = [
        fb.Server(gate, inputs=[X], outputs=[Y], max_batch_size=1, max_queue_size=1, name="gated"),
        fb.Server(slow, inputs=[X], outputs=[Y], max_batch_size=1, name="slow"),
    ]
    body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
    with serving(kind, servers) as url, ThreadPoolExecutor(4) as pool:
        gated = f"http://{url}/v2/models/gated/infer"
        first = pool.submit(httpx.post, gated, content=body, timeout=30)  # runs, held by the gate
        assert gate.entered.wait(30)
        queued = pool.submit(httpx.post, gated, content=body, timeout=30)  # fills the queue
        while servers[0].stats()["queue_depth"] < 1:
            threading.Event().wait(0.005)
        full = httpx.post(gated, content=body, timeout=30)
        assert full.status_code == 503, full.text
        assert "queue" in full.json()["error"]
        gate.release.set()
        assert first.result().status_code == 200
        assert queued.result().status_code == 200

        slow_path = f"http://{url}/v2/models/slow/infer"
        held = pool.submit(httpx.post, slow_path, content=body, timeout=30)
        assert slow.entered.wait(30)
        # Waits behind the held batch until its 50 ms deadline passes.
        late_body, _ = infer_body([x_input(data=[1, 2, 3, 4])], parameters={"timeout": 50_000})
        late = httpx.post(slow_path, content=late_body, timeout=30)
        assert late.status_code == 504, late.text
        assert "timeout" in late.json()["error"]
        slow.release.set()
        assert held.result().status_code == 200


@pytest.mark.parametrize("kind", ["starlette", "aiohttp"])
def test_servers_not_running_are_not_ready_and_refuse_with_503(kind: str) -> None:
    from aiohttp import web

    from ferrobatch.http import aiohttp_app, starlette_app

    idle = fb.Server(double, inputs=[X], outputs=[Y], name="idle")
    # manage_servers=False: the app leaves the server alone (never started here).
    if kind == "starlette":
        import uvicorn

        app: Any = starlette_app([idle], manage_servers=False)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        runner_factory: Callable[[], Any] = lambda: uvicorn.Server(config)  # noqa: E731
    else:
        app = aiohttp_app([idle], manage_servers=False)
        runner_factory = lambda: web.AppRunner(app)  # noqa: E731

    async def scenario() -> None:
        if kind == "starlette":
            server = runner_factory()
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
        else:
            runner = runner_factory()
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                assert (await http.get("/v2/health/live")).status_code == 200
                assert (await http.get("/v2/health/ready")).status_code == 503
                assert (await http.get("/v2/models/idle/ready")).status_code == 503
                assert (await http.get("/v2/models/idle")).status_code == 200
                body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
                response = await http.post("/v2/models/idle/infer", content=body)
                assert response.status_code == 503, response.text
                assert "not running" in response.json()["error"]
        finally:
            if kind == "starlette":
                server.should_exit = True
                await task
            else:
                await runner.cleanup()

    asyncio.run(scenario())


# -- embedding: lifespan and sub-app ---------------------------------------------------------


async def test_aiohttp_sub_app_starts_and_stops_the_servers() -> None:
    from aiohttp import web

    from ferrobatch.http import aiohttp_app

    server = fb.Server(double, inputs=[X], outputs=[Y], name="double")
    parent = web.Application()
    parent.add_subapp("/triton", aiohttp_app([server]))
    runner = web.AppRunner(parent)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        assert server.running
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/triton") as http:
            assert (await http.get("/v2/health/ready")).status_code == 200
            body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
            response = await http.post("/v2/models/double/infer", content=body)
            assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    finally:
        await runner.cleanup()
    assert not server.running


def test_two_servers_with_one_name_are_refused() -> None:
    from ferrobatch.http import starlette_app

    a = fb.Server(double, inputs=[X], outputs=[Y], name="same")
    b = fb.Server(double, inputs=[X], outputs=[Y], name="same")
    with pytest.raises(ValueError, match="unique"):
        starlette_app([a, b])


async def test_starlette_app_mounted_under_a_prefix() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from ferrobatch.http import starlette_app

    server = fb.Server(double, inputs=[X], outputs=[Y], name="double")
    app = Starlette(routes=[Mount("/triton", starlette_app(server, manage_servers=False))])
    body, _ = infer_body([x_input(data=[1, 2, 3, 4])])
    async with server, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/triton/v2/models/double/infer", content=body)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        assert (await http.get("/triton/v2/models/double")).json()["name"] == "double"
        assert (await http.post("/v2/models/double/infer", content=body)).status_code == 404
