"""BYTES tensors end to end: in process (bytes, str, lists, numpy object
arrays), and over HTTP JSON, the binary extension and gRPC with the real
tritonclient, on both front-ends; bad BYTES data is a 400 /
INVALID_ARGUMENT naming the input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

TEXT = fb.TensorSpec("text", "bytes", (1,))
PAIR = fb.TensorSpec("pair", np.bytes_, (2,))
UPPER = fb.TensorSpec("upper", object, (1,))
JOINED = fb.TensorSpec("joined", "bytes", (1,))
LENGTH = fb.TensorSpec("length", "int64", ())

seen_shapes: list[tuple[int, ...]] = []


def shout(batch: dict[str, Any]) -> dict[str, Any]:
    """Upper-cases each text; joins each pair; counts bytes. Checks it was
    given numpy object arrays of bytes, one row per request."""
    text, pair = batch["text"], batch["pair"]
    assert isinstance(text, np.ndarray) and text.dtype == object, text
    assert all(isinstance(t, bytes) for t in text.flat)
    seen_shapes.append(text.shape)
    upper = np.array([[t.upper()] for t in text[:, 0]], dtype=object)
    joined = [[b"+".join(p)] for p in pair]  # a list of lists of bytes is fine too
    return {"upper": upper, "joined": joined, "length": torch.tensor([len(t) for t in text[:, 0]])}


def make_server(**kwargs: Any) -> fb.Server:
    return fb.Server(
        shout, inputs=[TEXT, PAIR], outputs=[UPPER, JOINED, LENGTH], name="shout", max_delay=0.005, **kwargs
    )


def test_bytes_spec_spellings() -> None:
    for dtype in ("bytes", bytes, np.bytes_, object, np.dtype(object), np.dtype("S4"), "BYTES"):
        assert fb.TensorSpec("t", dtype, (1,)).dtype == "bytes"
    with pytest.raises(TypeError, match="no torch dtype"):
        _ = TEXT.torch_dtype


def test_each_caller_gets_its_own_row_in_process() -> None:
    seen_shapes.clear()
    words = ["ab", b"xyz", "h\u00e9llo", np.array([b"q"], dtype=object), [b""], np.array(["s"])]
    server = make_server()

    async def main() -> list[dict[str, Any]]:
        async with server:
            client = server.client()
            pairs = [[b"a", w if isinstance(w, (bytes, str)) else b"-"] for w in words]
            return await asyncio.gather(*(client.infer({"text": w, "pair": p}) for w, p in zip(words, pairs)))

    outs = asyncio.run(main())
    expected = [b"AB", b"XYZ", "h\u00e9llo".encode().upper(), b"Q", b"", b"S"]
    for out, want, word in zip(outs, expected, words):
        assert isinstance(out["upper"], np.ndarray) and out["upper"].dtype == object
        assert out["upper"].tolist() == [want]
        assert out["length"].item() == len(want)
        second = word if isinstance(word, bytes) else word.encode() if isinstance(word, str) else b"-"
        assert out["joined"].tolist() == [b"a+" + second]
    assert max(s[0] for s in seen_shapes) > 1, "requests were batched together"


def test_infer_batch_keeps_the_batch_dimension_and_threads_get_rows() -> None:
    server = make_server()

    async def batch() -> Any:
        async with server:
            pair = np.array([[b"1", b"2"], [b"3", b"4"]])  # numpy's fixed-width bytes
            return await server.client().infer_batch({"text": [[b"a"], ["bb"]], "pair": pair})

    out = asyncio.run(batch())
    assert out["upper"].tolist() == [[b"A"], [b"BB"]]
    assert out["joined"].tolist() == [[b"1+2"], [b"3+4"]]
    assert out["length"].tolist() == [1, 2]
    server = make_server()
    with server.run_in_background():
        out = server.client().infer_sync({"text": "from a thread", "pair": ["x", "y"]})
    assert out["upper"].tolist() == [b"FROM A THREAD"]


def test_bad_bytes_inputs_are_refused_naming_the_input() -> None:
    server = make_server()

    async def main() -> list[str]:
        errors = []
        async with server:
            client = server.client()
            for text in (5, [b"a", b"b"], [1], torch.zeros(1)):
                with pytest.raises(fb.InvalidInputError) as info:
                    await client.infer({"text": text, "pair": [b"a", b"b"]})
                errors.append(str(info.value))
            # A request over the per-element limit (16 MiB) is refused before it is copied.
            with pytest.raises(fb.InvalidInputError, match="over the limit"):
                await client.infer({"text": [b"x" * (16 << 20 | 1)], "pair": [b"a", b"b"]})
            # The server is unharmed.
            assert (await client.infer({"text": "ok", "pair": ["a", "b"]}))["upper"].tolist() == [b"OK"]
        return errors

    errors = asyncio.run(main())
    assert all(e.startswith("input 'text'") for e in errors), errors
    assert "bytes or str" in errors[2]


def test_model_returning_bad_bytes_is_a_model_error() -> None:
    def bad(batch: dict[str, Any]) -> dict[str, Any]:
        return {"upper": np.array([[1]] * len(batch["text"]), dtype=object), "joined": batch["pair"][:, :1],
                "length": torch.zeros(len(batch["text"]), dtype=torch.int64)}  # fmt: skip

    server = fb.Server(bad, inputs=[TEXT, PAIR], outputs=[UPPER, JOINED, LENGTH])

    async def main() -> None:
        async with server:
            with pytest.raises(fb.ModelError, match="bytes or str"):
                await server.client().infer({"text": "a", "pair": ["a", "b"]})

    asyncio.run(main())


@contextlib.contextmanager
def serving(frontend: str) -> Iterator[tuple[str, str]]:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    with serve_in_thread([make_server()], config) as listening:
        yield f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"


@pytest.fixture(params=["native", "python"], scope="module")
def addresses(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with serving(request.param) as addresses:
        yield addresses


def _http_inputs(binary: bool) -> list[httpclient.InferInput]:
    text = httpclient.InferInput("text", [2, 1], "BYTES")
    text.set_data_from_numpy(np.array([["h\u00e9llo"], ["abc"]], dtype=object), binary_data=binary)
    pair = httpclient.InferInput("pair", [2, 2], "BYTES")
    pair.set_data_from_numpy(np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object), binary_data=binary)
    return [text, pair]


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_http_sends_and_receives_bytes(addresses: tuple[str, str], binary: bool) -> None:
    http, _ = addresses
    client = httpclient.InferenceServerClient(http)
    try:
        meta = client.get_model_metadata("shout")
        assert {t["name"]: t["datatype"] for t in meta["inputs"]} == {"text": "BYTES", "pair": "BYTES"}
        outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("upper", "joined", "length")]
        result = client.infer("shout", _http_inputs(binary), outputs=outputs)
    finally:
        client.close()
    upper = result.as_numpy("upper")
    assert upper.shape == (2, 1)
    # Binary outputs come back as bytes; JSON ones as UTF-8 strings (as Triton sends them).
    want = [["H\u00e9LLO".encode()], [b"ABC"]] if binary else [["H\u00e9LLO"], ["ABC"]]
    assert "h\u00e9llo".encode().upper() == "H\u00e9LLO".encode()
    assert upper.tolist() == want
    joined = result.as_numpy("joined").tolist()
    assert joined == ([[b"a+b"], [b"c+d"]] if binary else [["a+b"], ["c+d"]])
    assert result.as_numpy("length").tolist() == [6, 3]


@pytest.mark.parametrize("raw", [False, True])
def test_tritonclient_grpc_sends_and_receives_bytes(addresses: tuple[str, str], raw: bool) -> None:
    _, address = addresses
    client = grpcclient.InferenceServerClient(address)
    try:
        text = grpcclient.InferInput("text", [2, 1], "BYTES")
        pair = grpcclient.InferInput("pair", [2, 2], "BYTES")
        text_data = np.array([[b"\xffbin"], ["abc"]], dtype=object)
        pair_data = np.array([[b"a", b"b"], [b"c", b"d"]], dtype=object)
        # tritonclient sends raw_input_contents (4-byte length prefixes);
        # typed bytes_contents go by hand.
        text.set_data_from_numpy(text_data)
        pair.set_data_from_numpy(pair_data)
        inputs = [text, pair]
        if raw:
            got = client.infer("shout", inputs)
            result = {n: got.as_numpy(n) for n in ("upper", "joined", "length")}
        else:
            result = _infer_typed(address, {"text": text_data, "pair": pair_data})
    finally:
        client.close()
    assert result["upper"].tolist() == [[b"\xffBIN"], [b"ABC"]]
    assert result["joined"].tolist() == [[b"a+b"], [b"c+d"]]
    assert result["length"].tolist() == [4, 3]


def _infer_typed(address: str, inputs: dict[str, np.ndarray]) -> Any:
    """A ModelInfer with BYTES in ``bytes_contents`` (tritonclient always
    sends raw contents), answered with raw outputs, deserialized here."""
    import grpc

    from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
    from ferrobatch.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="shout")
    for name, array in inputs.items():
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=list(array.shape))
        tensor.contents.bytes_contents.extend([e if isinstance(e, bytes) else str(e).encode() for e in array.flat])
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    out: dict[str, Any] = {}
    for tensor, data in zip(response.outputs, response.raw_output_contents):
        if tensor.datatype == "BYTES":
            out[tensor.name] = np.array(_deserialize(data), dtype=object).reshape(list(tensor.shape))
        else:
            out[tensor.name] = np.frombuffer(data, dtype=np.int64).reshape(list(tensor.shape))
    return out


def _deserialize(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def _bad_bodies() -> dict[str, tuple[bytes, dict[str, str]]]:
    def json_body(text: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        pair = {"name": "pair", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}
        return json.dumps({"inputs": [text, pair]}).encode(), {}

    def binary_body(blob: bytes, shape: list[int]) -> tuple[bytes, dict[str, str]]:
        header = json.dumps({"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": shape, "parameters": {"binary_data_size": len(blob)}},
            {"name": "pair", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]},
        ]}).encode()  # fmt: skip
        return header + blob, {"Inference-Header-Content-Length": str(len(header))}

    return {
        "numbers": json_body({"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": [1]}),
        "too few": json_body({"name": "text", "datatype": "BYTES", "shape": [1, 1], "data": []}),
        "truncated length": binary_body(b"\x05\x00", [1, 1]),
        "length past the data": binary_body(b"\x05\x00\x00\x00ab", [1, 1]),
        "more elements than the shape": binary_body(b"\x01\x00\x00\x00a\x01\x00\x00\x00b", [1, 1]),
        "huge length": binary_body(b"\xff\xff\xff\xffab", [1, 1]),
    }


def test_bad_bytes_over_http_is_400_naming_the_input(addresses: tuple[str, str]) -> None:
    http, _ = addresses
    with httpx.Client(base_url=f"http://{http}", timeout=30) as client:
        for case, (body, headers) in _bad_bodies().items():
            response = client.post("/v2/models/shout/infer", content=body, headers=headers)
            assert response.status_code == 400, (case, response.text)
            message = response.json()["error"]
            assert "'text'" in message, (case, message)
        ok = client.post("/v2/models/shout/infer", content=_bad_bodies()["numbers"][0].replace(b"[1]}", b'["x"]}'))
        assert ok.status_code == 200, ok.text


def test_bad_bytes_over_grpc_is_invalid_argument(addresses: tuple[str, str]) -> None:
    _, address = addresses
    import grpc

    from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
    from ferrobatch.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

    request = pb.ModelInferRequest(model_name="shout")
    request.inputs.add(name="text", datatype="BYTES", shape=[1, 1])
    request.inputs.add(name="pair", datatype="BYTES", shape=[1, 2])
    request.raw_input_contents.extend([b"\x09\x00\x00\x00ab", b"\x01\x00\x00\x00a\x01\x00\x00\x00b"])
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'text'" in (info.value.details() or "")
    # tritonclient sees the same.
    client = grpcclient.InferenceServerClient(address)
    try:
        text = grpcclient.InferInput("text", [1, 1], "FP32")
        text.set_data_from_numpy(np.zeros((1, 1), np.float32))
        pair = grpcclient.InferInput("pair", [1, 2], "BYTES")
        pair.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=object))
        with pytest.raises(InferenceServerException, match="'text'"):
            client.infer("shout", [text, pair])
    finally:
        client.close()


def test_request_parameters_reach_a_bytes_model_in_process_and_over_http() -> None:
    """``with_requests=True`` with BYTES inputs (PyTriton's binding needs both):
    each request's parameters reach the model beside its rows."""
    seen: list[list[Any]] = []

    def model(batch: dict[str, Any], requests: list[fb.RequestInfo]) -> dict[str, Any]:
        seen.append([(r.rows, dict(r.parameters)) for r in requests])
        tags = [str(r.parameters.get("tag", "")).encode() for r in requests for _ in range(r.rows)]
        return {
            "upper": np.array([[t.upper() + b"/" + tag] for t, tag in zip(batch["text"][:, 0], tags)], dtype=object)
        }

    def make() -> fb.Server:
        return fb.Server(model, inputs=[TEXT], outputs=[UPPER], name="tagged", max_delay=0.005, with_requests=True)

    server = make()

    async def main() -> list[Any]:
        async with server:
            client = server.client()
            return await asyncio.gather(
                client.infer({"text": "a"}, parameters={"tag": "x"}),
                client.infer({"text": "b"}, parameters={"tag": "y"}),
            )

    outs = asyncio.run(main())
    assert [o["upper"].tolist() for o in outs] == [[b"A/x"], [b"B/y"]]
    config = ServeConfig(http_port=0, grpc_port=0, frontend="native", log_level="warning")
    with serve_in_thread([make()], config) as listening:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}")
        try:
            text = httpclient.InferInput("text", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"c"]], dtype=object))
            result = client.infer("tagged", [text], parameters={"tag": "z"})
        finally:
            client.close()
    assert result.as_numpy("upper").tolist() == [[b"C/z"]]  # binary output: tritonclient asks for it


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_bytes_sent_to_a_number_input_name_both_dtypes_on_every_front_end(frontend: str) -> None:
    ids = fb.TensorSpec("ids", "int64", (2,))
    server = fb.Server(
        lambda b: {"y": b["ids"] * 2}, inputs=[ids], outputs=[fb.TensorSpec("y", "int64", (2,))], name="m"
    )
    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend, log_level="warning")
    body = {"inputs": [{"name": "ids", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}]}
    with serve_in_thread([server], config) as listening:
        response = httpx.post(f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer", json=body, timeout=10)
    assert response.status_code == 400
    assert "input 'ids': expected dtype int64, got bytes" in response.json()["error"], response.text
