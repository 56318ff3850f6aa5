"""Cloud platforms' prediction endpoints. Vertex AI's (``ServeConfig(vertex_ai=)``;
PyTriton's ``TritonConfig(allow_vertex_ai=True)``): the health and predict
routes, the binary content type, the redirect header, refusals, start-up
checks, and PyTriton's Vertex AI example's requests answered as Triton
answers them. SageMaker's (``ServeConfig(sagemaker=)``, ``allow_sagemaker``):
``/ping``, ``/invocations`` in JSON and binary, its variables."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import Listening, SageMaker, ServeConfig, StartupError, VertexAI, serve_in_thread
from ferrobatch.triton import ModelConfig, Tensor, Triton, TritonConfig, batch
from ferrobatch.triton.exceptions import PyTritonValidationError

pytestmark = pytest.mark.timeout(60)

SPEC = [fb.TensorSpec("x", "float32", (4,))]
OUT = [fb.TensorSpec("y", "float32", (4,))]


def times(k: float) -> Any:
    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"] * k}

    return model


def make(name: str, k: float) -> fb.Server:
    return fb.Server(times(k), inputs=SPEC, outputs=OUT, max_batch_size=8, name=name)


def request(values: list[float]) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": values}]}


@pytest.fixture(params=["native", "python"])
def vertex(request: pytest.FixtureRequest) -> Iterator[tuple[Listening, str]]:
    routes = VertexAI(predict_route="/predict", health_route="/health(z)?", port=0, default_model="double")
    config = ServeConfig(
        http_port=0, grpc_port=None, frontend=request.param, vertex_ai=routes, log_level="warning", threads=1
    )
    with serve_in_thread([make("double", 2.0), make("triple", 3.0)], config) as listening:
        assert listening.vertex_ai_port is not None
        yield listening, f"http://127.0.0.1:{listening.vertex_ai_port}"


def test_the_predict_route_infers_the_default_model_and_the_health_route_is_readiness(
    vertex: tuple[Listening, str],
) -> None:
    _, url = vertex
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200  # a regular expression, matched whole
    answer = httpx.post(f"{url}/predict", json=request([1, 2, 3, 4]))
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert answer.json()["model_name"] == "double"
    # Binary: the JSON part's length in Vertex AI's content type.
    header = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    content_type = f"application/vnd.vertex-ai-triton.binary+json;json-header-size={len(header)}"
    body = header + struct.pack("<4f", 1, 1, 1, 1)
    answer = httpx.post(f"{url}/predict", content=body, headers={"content-type": content_type})
    assert answer.status_code == 200, answer.text
    length = int(answer.headers["inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(answer.content[length:], np.float32), [2, 2, 2, 2])


def test_the_redirect_header_answers_another_v2_path(vertex: tuple[Listening, str]) -> None:
    _, url = vertex

    def redirected(path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{url}/predict", headers={"X-Vertex-Ai-Triton-Redirect": path}, **kwargs)

    answer = redirected("v2/models/triple/infer", json=request([1, 1, 1, 1]))
    assert answer.json()["outputs"][0]["data"] == [3.0, 3.0, 3.0, 3.0]
    assert redirected("v2/models/triple").json()["name"] == "triple"  # metadata: read with GET
    assert redirected("v2/health/live").status_code == 200
    assert redirected("v2/models/triple/ready").status_code == 200
    assert "nv_inference_request_success" in redirected("metrics").text
    assert redirected("v2/models/nope/infer", json=request([1, 1, 1, 1])).status_code == 400


def test_other_paths_and_methods_are_refused(vertex: tuple[Listening, str]) -> None:
    listening, url = vertex
    assert httpx.get(f"{url}/v2/health/ready").status_code == 400  # not one of its two routes
    assert httpx.get(f"{url}/predict").status_code == 405
    bad_type = "application/vnd.vertex-ai-triton.binary+json;json-header-size=x"
    assert httpx.post(f"{url}/predict", content=b"{}", headers={"content-type": bad_type}).status_code == 400
    assert httpx.post(f"{url}/predict", content=b"not json").status_code == 400
    # The main HTTP port is not touched by it.
    assert httpx.get(f"http://127.0.0.1:{listening.http_port}/v2/health/ready").status_code == 200


def test_start_up_refuses_what_it_cannot_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    two = VertexAI(predict_route="/p", health_route="/h", port=0)
    config = ServeConfig(http_port=0, grpc_port=None, vertex_ai=two, log_level="warning", threads=1)
    with (
        pytest.raises(StartupError, match="name the default one"),
        serve_in_thread([make("a", 1), make("b", 2)], config),
    ):
        pass
    config.vertex_ai = VertexAI(predict_route="/p", health_route="/h", port=0, default_model="c")
    with pytest.raises(StartupError, match="'c' is not served"), serve_in_thread([make("a", 1)], config):
        pass
    config.vertex_ai = VertexAI(predict_route="(", health_route="/h", port=0)
    with pytest.raises(StartupError, match="not a regular expression"), serve_in_thread([make("a", 1)], config):
        pass
    monkeypatch.delenv("AIP_PREDICT_ROUTE", raising=False)
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/h")
    with pytest.raises(ValueError, match="AIP_PREDICT_ROUTE is not defined"):
        VertexAI.from_env()
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/p")
    monkeypatch.setenv("AIP_HTTP_PORT", "8123")
    assert VertexAI.from_env() == VertexAI("/p", "/h", 8123, None)


@batch
def add_sub(**inputs: np.ndarray) -> dict[str, np.ndarray]:
    a, b = inputs.values()
    return {"add": a + b, "sub": a - b}


def test_pytritons_vertex_ai_example_is_answered_as_triton_answers_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTriton's ``add_sub_vertex_ai``: its routes from the environment, its
    request body, and the output text its test looks for."""
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/v2/models/AddSub/infer")
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/v2/health/ready")
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_vertex_ai=True, vertex_ai_port=0))
    triton.bind(
        "AddSub",
        add_sub,
        inputs=[Tensor(dtype=np.float32, shape=(-1,)), Tensor(dtype=np.float32, shape=(-1,))],
        outputs=[Tensor(name="add", dtype=np.float32, shape=(-1,)), Tensor(name="sub", dtype=np.float32, shape=(-1,))],
        config=ModelConfig(max_batch_size=128),
        strict=True,
    )
    with triton:
        triton.run()
        assert triton.vertex_ai_port is not None
        url = f"http://127.0.0.1:{triton.vertex_ai_port}"
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        data = [[1, 2, 3, 4]]
        body = {
            "id": "0",
            "inputs": [
                {"name": name, "shape": [1, 4], "datatype": "FP32", "parameters": {}, "data": data}
                for name in ("INPUT_1", "INPUT_2")
            ],
        }
        text = httpx.post(f"{url}/v2/models/AddSub/infer", json=body).text
        assert '{"name":"add","datatype":"FP32","shape":[1,4],"data":[2.0,4.0,6.0,8.0]}' in text
        assert '{"name":"sub","datatype":"FP32","shape":[1,4],"data":[0.0,0.0,0.0,0.0]}' in text
    monkeypatch.delenv("AIP_HEALTH_ROUTE")
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_vertex_ai=True, vertex_ai_port=0))
    triton.bind(
        "AddSub",
        add_sub,
        inputs=[Tensor(dtype=np.float32, shape=(-1,))],
        outputs=[Tensor(name="add", dtype=np.float32, shape=(-1,))],
    )
    with pytest.raises(PyTritonValidationError, match="AIP_HEALTH_ROUTE"):
        triton.run()


# -- SageMaker ---------------------------------------------------------------------------------------


def binary_request() -> tuple[bytes, int]:
    header = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + struct.pack("<4f", 1, 2, 3, 4), len(header)


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_sagemaker_pings_and_invokes_its_model_in_json_and_binary(frontend: str) -> None:
    config = ServeConfig(
        http_port=0,
        grpc_port=None,
        frontend=frontend,
        sagemaker=SageMaker(port=0),
        log_level="warning",
        threads=1,
    )
    with serve_in_thread([make("double", 2.0)], config) as listening:
        assert listening.sagemaker_port is not None
        url = f"http://127.0.0.1:{listening.sagemaker_port}"
        assert httpx.get(f"{url}/ping").status_code == 200
        answer = httpx.post(f"{url}/invocations", json=request([1, 2, 3, 4]))
        assert answer.status_code == 200 and answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
        assert answer.headers["content-type"].startswith("application/json")
        body, length = binary_request()
        binary = f"application/vnd.sagemaker-triton.binary+json;json-header-size={length}"
        answer = httpx.post(f"{url}/invocations", content=body, headers={"content-type": binary})
        assert answer.status_code == 200, answer.text
        # The answer's JSON length is in its content type, as Triton's SageMaker endpoint says it.
        prefix = "application/vnd.sagemaker-triton.binary+json;json-header-size="
        assert answer.headers["content-type"].startswith(prefix)
        told = int(answer.headers["content-type"][len(prefix) :])
        np.testing.assert_array_equal(np.frombuffer(answer.content[told:], np.float32), [2, 4, 6, 8])
        assert "inference-header-content-length" not in answer.headers
        assert httpx.get(f"{url}/invocations").status_code == 405
        assert httpx.post(f"{url}/models/double/invoke", json=request([1, 1, 1, 1])).status_code == 400
        assert httpx.post(f"{url}/invocations", headers={"X-Vertex-Ai-Triton-Redirect": "metrics"}).status_code == 400


def test_sagemakers_variables_name_its_model_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "triple")
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "8123")
    assert SageMaker.from_env() == SageMaker(8123, "triple")
    monkeypatch.setenv("SAGEMAKER_TRITON_INFERENCE_TYPE", "generate_stream")
    assert SageMaker.from_env() == SageMaker(8123, "triple", "generate_stream")
    monkeypatch.setenv("SAGEMAKER_TRITON_INFERENCE_TYPE", "predict")
    with pytest.raises(ValueError, match="one of infer, generate, generate_stream, got 'predict'"):
        SageMaker.from_env()
    monkeypatch.delenv("SAGEMAKER_TRITON_INFERENCE_TYPE")
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_sagemaker=True, sagemaker_port=0))
    x, y = Tensor(name="x", dtype=np.float32, shape=(4,)), Tensor(name="y", dtype=np.float32, shape=(4,))

    @batch
    def triple(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 3}

    @batch
    def double(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2}

    triton.bind("double", double, inputs=[x], outputs=[y])
    triton.bind("triple", triple, inputs=[x], outputs=[y])
    with triton:
        triton.run()
        answer = httpx.post(f"http://127.0.0.1:{triton.sagemaker_port}/invocations", json=request([1, 1, 1, 1]))
        assert answer.json()["model_name"] == "triple" and answer.json()["outputs"][0]["data"] == [3.0] * 4
    monkeypatch.delenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME")
    config = ServeConfig(http_port=0, grpc_port=None, sagemaker=SageMaker.from_env(0), log_level="warning", threads=1)
    with pytest.raises(StartupError, match="SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"):
        with serve_in_thread([make("a", 1), make("b", 2)], config):
            pass


def words(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for word in inputs["text_input"][0][0].split():
        yield {"text_output": np.array([[word]], dtype=object)}


@pytest.mark.parametrize("frontend", ["native", "python"])
@pytest.mark.parametrize("kind", ["generate", "generate_stream"])
def test_sagemaker_invocations_answer_as_triton_generate_routes(frontend: str, kind: str) -> None:
    """``SAGEMAKER_TRITON_INFERENCE_TYPE=generate`` / ``generate_stream``: a
    generate request in, its JSON answer or its events out."""
    server = fb.Server(
        words,
        inputs=[fb.TensorSpec("text_input", "bytes", (1,))],
        outputs=[fb.TensorSpec("text_output", "bytes", (1,))],
        name="words",
        decoupled=True,
    )
    config = ServeConfig(
        http_port=0,
        grpc_port=None,
        frontend=frontend,
        sagemaker=SageMaker(port=0, inference_type=kind),
        log_level="warning",
        threads=1,
    )
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.sagemaker_port}/invocations"
        if kind == "generate":
            answer = httpx.post(url, json={"text_input": "one"})
            assert answer.status_code == 200, answer.text
            assert answer.json() == {"model_name": "words", "model_version": "1", "text_output": "one"}
            refused = httpx.post(url, json={"text": "one"})
            assert refused.status_code == 400 and "names none of the model's inputs" in refused.json()["error"]
        else:
            with httpx.stream("POST", url, json={"text_input": "a b c"}) as answer:
                assert answer.headers["content-type"] == "text/event-stream; charset=utf-8"
                sent = [json.loads(line.removeprefix("data: ")) for line in answer.iter_lines() if line]
            assert [e["text_output"] for e in sent] == ["a", "b", "c"]
    assert server.stats()["requests_succeeded"] == 1


def test_sagemakers_inference_type_is_checked() -> None:
    with pytest.raises(ValueError, match="inference type"):
        SageMaker(inference_type="infer_stream")
