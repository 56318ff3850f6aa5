"""Triton's classification extension on both front-ends, over HTTP (JSON and
binary outputs), gRPC and gRPC streams, driven by tritonclient's
``InferRequestedOutput(..., class_count=k)``: an output answered as the
BYTES tensor of its top ``k`` classes per batch entry, ``"<value>:<index>"``."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
#: One element past the most a batch entry may have to be ranked (Triton's bound).
WIDE = 1_000_001


def scores(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    return {"p": x, "ids": (x * 10).to(torch.int64), "flags": x > 0}


def twice(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """A decoupled model: its scores, then their negation."""
    yield scores(inputs)
    yield scores({"x": -inputs["x"]})


#: Labels for classes 0..2 of "p": class 3 has none (Triton then answers "<value>:<index>").
LABELS = ("zero", "one", "two")
OUTPUTS = [
    fb.TensorSpec("p", "float32", (4,), labels=LABELS),
    fb.TensorSpec("ids", "int64", (4,)),
    fb.TensorSpec("flags", "bool", (4,)),
]


class Served:
    def __init__(self, listening: Any) -> None:
        self.http_url = f"127.0.0.1:{listening.http_port}"
        self.grpc_url = f"127.0.0.1:{listening.grpc_port}"
        self.servers: dict[str, fb.Server] = {}


@pytest.fixture(scope="module", params=["native", "python"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    batched = fb.Server(scores, inputs=[X], outputs=OUTPUTS, max_batch_size=8, max_delay=0.001, name="scores")
    single = fb.Server(scores, inputs=[X], outputs=OUTPUTS, batching=False, name="single")
    streaming = fb.Server(twice, inputs=[X], outputs=OUTPUTS, decoupled=True, name="twice")
    wide = fb.Server(
        lambda b: {"w": torch.zeros(b["x"].shape[0], WIDE)},
        inputs=[X],
        outputs=[fb.TensorSpec("w", "float32", (WIDE,))],
        name="wide",
    )
    config = ServeConfig(http_port=0, grpc_port=0, frontend=request.param, log_level="warning")
    image = fb.Server(
        lambda b: {"probs": b["image"].mean(dim=(2, 3))},
        inputs=[fb.TensorSpec("image", "float32", (3, 8, 8), format="NCHW")],
        outputs=[fb.TensorSpec("probs", "float32", (3,), labels=("red", "green", "blue"))],
        name="image",
    )
    with serve_in_thread([batched, single, streaming, wide, image], config) as listening:
        served = Served(listening)
        served.servers = {"scores": batched, "single": single, "wide": wide}
        yield served


ROWS = np.array([[1.1, 3.3, 0.5, 2.4], [9.0, -1.0, 4.0, 4.0]], dtype=np.float32)
#: Triton's documented example (row 0), and a tie broken by index (row 1),
#: with their labels.
TOP2 = [["3.300000:1:one", "2.400000:3"], ["9.000000:0:zero", "4.000000:2:two"]]


def _classes(result: Any, name: str) -> Any:
    """The classes answered, as text (JSON gives str, binary data bytes)."""
    return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else v, otypes=[object])(
        result.as_numpy(name)
    ).tolist()


def _infer(module: Any, url: str, model: str, x: np.ndarray, outputs: list[Any]) -> Any:
    client = module.InferenceServerClient(url)
    try:
        inp = module.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return client.infer(model, [inp], outputs=outputs)
    finally:
        client.close()


def _http(served: Served, model: str, x: np.ndarray, outputs: list[Any]) -> httpclient.InferResult:
    return _infer(httpclient, served.http_url, model, x, outputs)


def _grpc(served: Served, model: str, x: np.ndarray, outputs: list[Any]) -> grpcclient.InferResult:
    return _infer(grpcclient, served.grpc_url, model, x, outputs)


def _output(result: Any, name: str) -> dict[str, Any]:
    output = result.get_output(name)
    if isinstance(output, dict):
        return output
    return {"datatype": output.datatype, "shape": list(output.shape)}


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_http_answers_each_row_with_its_top_classes(served: Served, binary: bool) -> None:
    outputs = [
        httpclient.InferRequestedOutput("p", binary_data=binary, class_count=2),
        httpclient.InferRequestedOutput("ids", binary_data=binary),
    ]
    before = served.servers["scores"].stats()["requests_succeeded"]
    result = _http(served, "scores", ROWS, outputs)
    assert served.servers["scores"].stats()["requests_succeeded"] == before + 1
    assert _output(result, "p")["datatype"] == "BYTES"
    assert _classes(result, "p") == TOP2
    # The other output is answered as the model gave it.
    assert result.as_numpy("ids").tolist() == (ROWS * 10).astype(np.int64).tolist()


def test_grpc_answers_each_row_with_its_top_classes(served: Served) -> None:
    outputs = [grpcclient.InferRequestedOutput("p", class_count=2), grpcclient.InferRequestedOutput("ids")]
    result = _grpc(served, "scores", ROWS, outputs)
    assert _output(result, "p") == {"datatype": "BYTES", "shape": [2, 2]}
    assert _classes(result, "p") == TOP2
    assert result.as_numpy("ids").tolist() == (ROWS * 10).astype(np.int64).tolist()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_integers_rank_as_integers_and_a_count_past_the_row_keeps_it_all(served: Served, protocol: str) -> None:
    x = ROWS[:1]
    if protocol == "http":
        result = _http(served, "scores", x, [httpclient.InferRequestedOutput("ids", class_count=10)])
    else:
        result = _grpc(served, "scores", x, [grpcclient.InferRequestedOutput("ids", class_count=10)])
    assert _classes(result, "ids") == [["33:1", "24:3", "11:0", "5:2"]]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_without_batching_the_whole_output_is_ranked(served: Served, protocol: str) -> None:
    x = ROWS[0]
    if protocol == "http":
        result = _http(served, "single", x, [httpclient.InferRequestedOutput("p", class_count=1)])
    else:
        result = _grpc(served, "single", x, [grpcclient.InferRequestedOutput("p", class_count=1)])
    assert _classes(result, "p") == ["3.300000:1:one"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_that_cannot_be_ranked_is_refused_before_the_model_runs(served: Served, protocol: str) -> None:
    server = served.servers["scores"]
    before = server.stats()
    with pytest.raises(InferenceServerException) as refused:
        if protocol == "http":
            _http(served, "scores", ROWS, [httpclient.InferRequestedOutput("flags", class_count=1)])
        else:
            _grpc(served, "scores", ROWS, [grpcclient.InferRequestedOutput("flags", class_count=1)])
    assert "class result not available for output due to unsupported type 'BOOL'" in str(refused.value)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    after = server.stats()
    # The model never ran; the refusal is no success.
    assert (after["batches"], after["requests_succeeded"]) == (before["batches"], before["requests_succeeded"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_output_too_large_to_rank_fails_after_the_model_ran_counted_as_the_clients(
    served: Served, protocol: str
) -> None:
    server = served.servers["wide"]
    before = server.stats()
    with pytest.raises(InferenceServerException) as refused:
        if protocol == "http":
            _http(served, "wide", ROWS[:1], [httpclient.InferRequestedOutput("w", class_count=5)])
        else:
            _grpc(served, "wide", ROWS[:1], [grpcclient.InferRequestedOutput("w", class_count=5)])
    assert "classification output tensor too large" in str(refused.value)
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    after = server.stats()
    assert after["batches"] == before["batches"] + 1
    assert after["requests_succeeded"] == before["requests_succeeded"]
    assert after["requests_failed"]["invalid_input"] == before["requests_failed"]["invalid_input"] + 1


def _streamed(served: Served, model: str, responses: int) -> list[Any]:
    answers: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        inp = grpcclient.InferInput("x", list(ROWS.shape), "FP32")
        inp.set_data_from_numpy(ROWS)
        outputs = [grpcclient.InferRequestedOutput("p", class_count=2)]
        client.async_stream_infer(model, [inp], outputs=outputs)
        got = [answers.get(timeout=10) for _ in range(responses)]
        client.stop_stream()
    finally:
        client.close()
    for answer in got:
        assert not isinstance(answer, InferenceServerException), answer
    return got


def test_a_grpc_stream_answers_with_classes_too(served: Served) -> None:
    (answer,) = _streamed(served, "scores", 1)
    assert _classes(answer, "p") == TOP2


def test_each_response_of_a_decoupled_model_is_answered_with_classes(served: Served) -> None:
    first, second = _streamed(served, "twice", 2)
    assert _classes(first, "p") == TOP2
    assert _classes(second, "p") == [["-0.500000:2:two", "-1.100000:0:zero"], ["1.000000:1:one", "-4.000000:2:two"]]


def test_server_metadata_announces_classification(served: Served) -> None:
    client = httpclient.InferenceServerClient(served.http_url)
    try:
        assert "classification" in client.get_server_metadata()["extensions"]
    finally:
        client.close()


def test_labels_belong_to_outputs_and_are_bounded() -> None:
    with pytest.raises(ValueError, match="inputs have no class labels"):
        fb.Server(scores, inputs=[fb.TensorSpec("x", "float32", (4,), labels=("a",))], outputs=OUTPUTS)
    with pytest.raises(ValueError, match="one line"):
        fb.TensorSpec("p", "float32", (4,), labels=("a\nb",))
    with pytest.raises(ValueError, match="strings"):
        fb.TensorSpec("p", "float32", (4,), labels=(1, 2))  # type: ignore[arg-type]
    assert fb.TensorSpec("p", "float32", (4,), labels=["a", "b"]).labels == ("a", "b")  # type: ignore[arg-type]


def test_an_image_inputs_format_is_in_the_model_config_as_image_clients_read_it(served: Served) -> None:
    http = httpclient.InferenceServerClient(served.http_url)
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    try:
        assert http.get_model_config("image")["input"][0]["format"] == "FORMAT_NCHW"
        assert "format" not in http.get_model_config("scores")["input"][0]
        config = grpc.get_model_config("image").config
        assert config.input[0].format == model_config_pb2.ModelInput.FORMAT_NCHW
    finally:
        http.close()
        grpc.close()


def test_formats_belong_to_image_inputs() -> None:
    with pytest.raises(ValueError, match="three dimensions"):
        fb.TensorSpec("image", "float32", (8, 8), format="NHWC")
    with pytest.raises(ValueError, match="'NCHW' or 'NHWC'"):
        fb.TensorSpec("image", "float32", (3, 8, 8), format="CHW")
    with pytest.raises(ValueError, match="outputs have no image format"):
        fb.Server(scores, inputs=[X], outputs=[fb.TensorSpec("p", "float32", (3, 2, 2), format="NCHW")])
