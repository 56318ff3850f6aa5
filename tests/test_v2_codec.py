"""The v2 codec binding (``ferrobatch._core.V2Codec``): what the front-ends
rely on beyond the HTTP and gRPC suites: zero-copy inputs, limits checked
before allocating, shortest floats, outputs in any layout."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

import ferrobatch as fb
from ferrobatch._core import CodecError, GrpcInferRequest, V2Codec, grpc_response
from ferrobatch.http import starlette_app
from ferrobatch.http.protocol import ModelRepository, request_inputs

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))


def codec(max_elements: int = 1 << 20) -> V2Codec:
    outputs = [("y", "float32", torch.float32), ("b", "bfloat16", torch.bfloat16)]
    return V2Codec("m", outputs, max_body_size=1 << 20, max_elements=max_elements)


def body(inputs: list[dict[str, object]], **extra: object) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def test_json_inputs_decode_into_buffers_with_their_dtype_and_shape() -> None:
    request = codec().decode(body([{"name": "x", "datatype": "INT16", "shape": [2, 2], "data": [[1, -2], [3, 4]]}]))
    x = request.inputs["x"]
    assert (x.datatype, x.shape, x.nbytes) == ("INT16", (2, 2), 8)
    view = memoryview(x)
    assert (view.format, view.shape, view.readonly) == ("h", (2, 2), True)
    a, b = np.asarray(x), np.asarray(x)
    np.testing.assert_array_equal(a, [[1, -2], [3, 4]])
    assert a.ctypes.data == b.ctypes.data  # one buffer, no copy per view


def test_binary_inputs_are_views_of_the_body() -> None:
    x = np.arange(4, dtype=np.float32)
    header = body([{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}])
    raw = header + x.tobytes()
    request = codec().decode(raw, str(len(header)))
    decoded = np.asarray(request.inputs["x"])
    np.testing.assert_array_equal(decoded, x[None])
    assert np.shares_memory(decoded, np.frombuffer(raw, np.uint8))


def test_a_repeated_binary_header_is_remembered_and_each_body_read_as_its_own() -> None:
    """The Python front-end's codec keeps the native front-end's header memo:
    the same header again is not read, but the bytes after it are each
    request's own, and checked (a bad BOOL byte refused); refusals and JSON
    bodies are not kept."""
    c = codec()
    header = body(
        [
            {"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}},
            {"name": "b", "datatype": "BOOL", "shape": [2], "parameters": {"binary_data_size": 2}},
        ]
    )
    for turn in range(3):
        x = np.arange(4, dtype=np.float32) + turn
        request = c.decode(header + x.tobytes() + bytes([1, turn % 2]), str(len(header)))
        np.testing.assert_array_equal(np.asarray(request.inputs["x"]), x[None])
        np.testing.assert_array_equal(np.asarray(request.inputs["b"]), [True, bool(turn % 2)])
    assert c.remembered_headers() == 1
    with pytest.raises(CodecError, match="BOOL bytes must be 0 or 1"):
        c.decode(header + x.tobytes() + bytes([1, 2]), str(len(header)))
    with pytest.raises(CodecError):
        c.decode(header + x.tobytes(), str(len(header)))  # the BOOL bytes left out
    c.decode(body([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]))
    assert c.remembered_headers() == 1


def test_bf16_inputs_become_bfloat16_tensors() -> None:
    values = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    request = codec().decode(body([{"name": "x", "datatype": "BF16", "shape": [1, 2], "data": [1.5, -2.0]}]))
    assert request.has_bf16
    assert torch.equal(request_inputs(request)["x"], values)


def test_a_huge_declared_shape_is_refused_at_once() -> None:
    huge = body([{"name": "x", "datatype": "FP64", "shape": [1, 10**12], "data": [1]}])
    with pytest.raises(CodecError, match=r"shape \[1, 1000000000000\] is over the limit") as info:
        codec().decode(huge)
    assert info.value.status == 400
    with pytest.raises(CodecError, match="over the limit of 6 elements"):
        codec(max_elements=6).decode(body([{"name": "x", "datatype": "INT8", "shape": [7], "data": [0] * 7}]))


def test_errors_name_what_was_wrong() -> None:
    with pytest.raises(CodecError, match="input 'x': data is not valid UINT8: 256 is out of range"):
        codec().decode(body([{"name": "x", "datatype": "UINT8", "shape": [1], "data": [256]}]))
    with pytest.raises(CodecError, match="unknown output 'q' for model 'm'; outputs: y, b"):
        codec().decode(body([{"name": "x", "datatype": "UINT8", "shape": [1], "data": [1]}], outputs=[{"name": "q"}]))
    with pytest.raises(CodecError, match="input 'x': data is not valid INT8: 300 is out of range"):
        grpc_call("INT8", [1], ints=[300]).read(codec(), None, False)
    with pytest.raises(CodecError, match="needs 8 bytes, got 4"):
        grpc_call("FP32", [2], raw=b"\0" * 4).read(codec(), None, False)
    with pytest.raises(CodecError, match="over the limit"):
        grpc_call("FP32", [1, 10**12], raw=b"").read(codec(), None, False)


def grpc_call(datatype: str, shape: list[int], raw: bytes | None = None, ints: list[int] = ()) -> GrpcInferRequest:
    """A gRPC ModelInferRequest of one input ``x``, as its message arrives."""
    from ferrobatch.grpc import grpc_predict_v2_pb2 as pb

    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    else:
        tensor.contents.int_contents.extend(ints)
    return GrpcInferRequest(request.SerializeToString())


def test_grpc_requests_are_read_by_the_native_rules() -> None:
    from ferrobatch.grpc import grpc_predict_v2_pb2 as pb

    request = pb.ModelInferRequest(model_name="m", id="7")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.array([[1.5, -2.0]], dtype=np.float32).tobytes())
    request.outputs.add(name="b")
    request.parameters["priority"].int64_param = 2
    request.parameters["timeout"].int64_param = 250_000
    call = GrpcInferRequest(request.SerializeToString())
    assert (call.model_name, call.id, call.empty_final) == ("m", "7", False)
    inputs, outputs, priority, parameters, timeout, requested = call.read(codec(), 0.1, True)
    np.testing.assert_array_equal(np.asarray(inputs["x"]), [[1.5, -2.0]])
    assert (outputs, priority, timeout) == (["b"], 2, 0.1)  # the call's deadline is the sooner
    assert requested == 0b10  # output 1, "b"
    assert json.loads(parameters or "") == {"priority": 2, "timeout": 250_000}
    with pytest.raises(CodecError, match="not a ModelInferRequest") as info:
        GrpcInferRequest(b"\xff\xff\xff")
    assert info.value.status == 400
    answer = pb.ModelInferResponse.FromString(
        grpc_response(codec(), "m", "7", ["y"], {"y": torch.tensor([[1.0, 2.0]])})
    )
    assert (answer.id, answer.outputs[0].name, list(answer.outputs[0].shape)) == ("7", "y", [1, 2])
    assert np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).tolist() == [1.0, 2.0]


def test_encoded_floats_are_shortest_and_outputs_may_be_strided() -> None:
    c = codec()
    request = c.decode(body([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]))
    y = torch.tensor([[0.1, 1.0], [2.5, -3.0]]).t()  # transposed: not contiguous
    b = torch.tensor([[1.5, -2.0]], dtype=torch.float32)  # converted to the output's bfloat16
    payload, length = c.encode(request, {"y": y, "b": b})
    assert length is None
    document = json.loads(payload)
    assert b'"data":[0.1,2.5,1.0,-3.0]' in payload
    assert document["outputs"][1] == {"name": "b", "datatype": "BF16", "shape": [1, 2], "data": [1.5, -2.0]}

    binary = c.decode(
        body(
            [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}],
            outputs=[{"name": "y", "parameters": {"binary_data": True}}],
        )
    )
    payload, length = c.encode(binary, {"y": y, "b": b})
    assert length is not None
    header = json.loads(payload[:length])
    assert header["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [2, 2], "parameters": {"binary_data_size": 16}}
    ]
    np.testing.assert_array_equal(np.frombuffer(payload[length:], np.float32).reshape(2, 2), y.numpy())


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


async def test_max_elements_is_a_400_over_http() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=64, name="double")
    app = starlette_app(ModelRepository([server], max_elements=8), manage_servers=False)
    transport = httpx.ASGITransport(app=app)
    async with server, httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for rows, status in [(2, 200), (3, 400)]:
            data = [1.0] * (4 * rows)
            request = body([{"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": data}])
            response = await http.post("/v2/models/double/infer", content=request)
            assert response.status_code == status, response.text
        assert "over the limit of 8 elements" in response.json()["error"]
        huge = body([{"name": "x", "datatype": "FP32", "shape": [1, 10**12], "data": [1]}])
        response = await http.post("/v2/models/double/infer", content=huge)
        assert response.status_code == 400


def test_a_request_encoded_by_another_models_codec_is_an_error_not_a_panic() -> None:
    """Its outputs are told by index: one past the other codec's outputs is a
    CodecError (the front-ends always encode with the decoding codec)."""
    x = [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]
    request = codec().decode(body(x, outputs=[{"name": "b"}]))
    assert request.requested_outputs == 0b10
    narrow = V2Codec("n", [("y", "float32", torch.float32)], max_body_size=1 << 20, max_elements=1 << 20)
    assert request.output_names(narrow) == []
    with pytest.raises(CodecError, match="output 1 is not one of this model's outputs"):
        narrow.encode(request, {"y": torch.ones(1, 4)})
