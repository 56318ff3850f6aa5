"""gRPC response compression (Triton's
``--grpc-infer-response-compression-level``, ``ServeConfig(
grpc_infer_response_compression_level=)``, ``TritonConfig``'s field of the
same name) on both front-ends: the coding a call gets among those it
accepts, read off the wire (``grpc-encoding`` and the message's flag), and
tritonclient's results unchanged."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from test_native_grpc import INFER, frame, h2_call

import ferrobatch as fb
from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
from ferrobatch.serve import Listening, ServeConfig, check_config, serve_in_thread
from ferrobatch.triton import TritonConfig
from ferrobatch.triton.triton import serve_config

pytestmark = pytest.mark.timeout(60)

WIDTH = 1024
X = fb.TensorSpec("x", "float32", (WIDTH,))
Y = fb.TensorSpec("y", "float32", (WIDTH,))


def _zeros_like(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": torch.zeros_like(inputs["x"])}  # compresses well: the coding shows in the size


@pytest.fixture(scope="module", params=["native", "python"])
def frontend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _served(frontend: str, level: str) -> Iterator[Listening]:
    server = fb.Server(_zeros_like, inputs=[X], outputs=[Y], name="m")
    config = ServeConfig(
        http_port=None, grpc_port=0, frontend=frontend, threads=1, grpc_infer_response_compression_level=level
    )
    with serve_in_thread([server], config) as listening:
        yield listening


def _call(port: int, accept: str | None) -> tuple[dict[str, str], bytes]:
    """One ModelInfer call over a raw HTTP/2 connection: the response's
    headers and trailers, and its body (the prefixed message) as sent."""
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, WIDTH])
    request.raw_input_contents.append(np.ones((1, WIDTH), np.float32).tobytes())
    body = bytearray()
    accepts = {} if accept is None else {"grpc_accept_encoding": accept}
    headers = h2_call(f"127.0.0.1:{port}", INFER, frame(request.SerializeToString()), received_body=body, **accepts)
    assert headers.get("grpc-status") == "0", headers
    return headers, bytes(body)


def _output(headers: dict[str, str], body: bytes) -> tuple[str | None, np.ndarray]:
    """The coding the message was sent with (None: as it is) and its output."""
    flag, length = body[0], int.from_bytes(body[1:5], "big")
    message = body[5 : 5 + length]
    coding = headers.get("grpc-encoding")
    if flag:
        message = gzip.decompress(message) if coding == "gzip" else zlib.decompress(message)
    response = pb.ModelInferResponse.FromString(message)
    return (coding if flag else None), np.frombuffer(response.raw_output_contents[0], np.float32)


@pytest.mark.parametrize(
    ("level", "accept", "coding"),
    [
        ("low", "identity,deflate,gzip", "gzip"),  # grpcio's own list
        ("medium", "identity,deflate,gzip", "deflate"),
        ("high", "identity,gzip,deflate", "deflate"),
        ("high", "identity,gzip", "gzip"),  # the one it accepts
        ("low", "identity,deflate", "deflate"),
        ("low", "identity", None),  # accepts neither
        ("low", None, None),
        ("none", "identity,deflate,gzip", None),
    ],
)
def test_a_response_gets_the_levels_coding_among_those_the_call_accepts(
    frontend: str, level: str, accept: str | None, coding: str | None
) -> None:
    for listening in _served(frontend, level):
        assert listening.grpc_port is not None
        headers, body = _call(listening.grpc_port, accept)
        sent, y = _output(headers, body)
        assert sent == coding, headers
        np.testing.assert_array_equal(y, np.zeros(WIDTH, np.float32))
        if coding is not None:  # 4 KiB of zeros, compressed
            assert len(body) < 200, len(body)


def test_tritonclient_reads_compressed_responses(frontend: str) -> None:
    for listening in _served(frontend, "high"):
        with grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as client:
            x = grpcclient.InferInput("x", [1, WIDTH], "FP32")
            x.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
            out = client.infer("m", [x]).as_numpy("y")
            np.testing.assert_array_equal(out, np.zeros((1, WIDTH), np.float32))
            assert client.get_model_metadata("m", as_json=True)["name"] == "m"  # tonic's (native) RPCs too


def test_tritonconfig_and_bad_levels() -> None:
    served = serve_config(
        TritonConfig(grpc_infer_response_compression_level="medium"), expose_errors=False, frontend="native"
    )
    assert served.grpc_infer_response_compression_level == "medium"
    assert (
        serve_config(TritonConfig(), expose_errors=False, frontend="native").grpc_infer_response_compression_level
        == "none"
    )
    with pytest.raises(ValueError, match="grpc_infer_response_compression_level must be one of 'none', 'low'"):
        check_config(ServeConfig(grpc_infer_response_compression_level="max"))
