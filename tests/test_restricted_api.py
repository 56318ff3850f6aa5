"""Triton's access-restricted APIs (``--http-restricted-api``,
``--grpc-restricted-protocol``; PyTriton's ``TritonSecurityConfig``): a
request to a restricted API group without its header and value is refused,
403 over HTTP and UNAVAILABLE over gRPC, before it is read; with them it is
answered as ever; the groups not named stay open. On the native and the
Python front-ends."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import Listening, ServeConfig, serve_in_thread
from ferrobatch.triton import Tensor, Triton, TritonConfig
from ferrobatch.triton.client import ModelClient
from ferrobatch.triton.decorators import batch
from ferrobatch.triton.exceptions import PyTritonValidationError
from ferrobatch.triton.triton import DEFAULT_PROTECTED_ENDPOINTS, TRITON_ACCESS_HEADER, TritonSecurityConfig

pytestmark = pytest.mark.timeout(120)

WIDTH = 4
TOKEN = {"x-token": "s3cret"}
GRPC_TOKEN = {"triton-grpc-protocol-x-token": "s3cret"}
HTTP_REFUSAL = "This API is restricted, expecting header 'x-token'"
GRPC_REFUSAL = "This protocol is restricted, expecting header 'triton-grpc-protocol-x-token'"


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


@pytest.fixture(params=["native", "python"])
def restricted(request: pytest.FixtureRequest) -> Iterator[Listening]:
    server = fb.Server(
        double, inputs=[fb.TensorSpec("x", "float32", (WIDTH,))], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))],
        name="m", max_batch_size=8,
    )  # fmt: skip
    config = ServeConfig(
        http_port=0,
        grpc_port=0,
        frontend=request.param,
        log_level="warning",
        threads=1,
        http_restricted_api=("statistics,model-repository:x-token=s3cret", "inference:X-Token=s3cret"),
        grpc_restricted_protocol=("health,statistics,inference:x-token=s3cret",),
    )
    with serve_in_thread([server], config) as listening:
        yield listening


def infer_body() -> dict[str, object]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, WIDTH], "data": [1.0] * WIDTH}]}


def test_http_refuses_a_restricted_group_without_its_header(restricted: Listening) -> None:
    base = f"http://127.0.0.1:{restricted.http_port}"
    for method, path, body in (
        ("GET", "/v2/models/stats", None),
        ("GET", "/v2/models/m/stats", None),
        ("GET", "/v2/models/m/versions/1/stats", None),
        ("POST", "/v2/repository/index", {}),
        ("POST", "/v2/models/m/infer", infer_body()),
    ):
        for headers in ({}, {"x-token": "wrong"}, {"x-token": "S3CRET"}, {"other": "s3cret"}):
            refused = httpx.request(method, base + path, json=body, headers=headers)
            assert refused.status_code == 403, (path, headers, refused.text)
            named = "X-Token" if path.endswith("/infer") else "x-token"  # as the group spells it
            assert refused.json() == {"error": HTTP_REFUSAL.replace("x-token", named)}, path
        allowed = httpx.request(method, base + path, json=body, headers={"X-TOKEN": "s3cret"})  # any case of name
        assert allowed.status_code == 200, (path, allowed.text)
    answer = httpx.post(f"{base}/v2/models/m/infer", json=infer_body(), headers=TOKEN).json()
    assert answer["outputs"][0]["data"] == [2.0] * WIDTH
    # Groups not named stay open: health, metadata, the model's config, /metrics.
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/m/ready", "/v2", "/v2/models/m", "/metrics"):
        assert httpx.get(base + path).status_code == 200, path
    assert httpx.get(f"{base}/v2/models/m/config").status_code == 200


def test_grpc_refuses_a_restricted_group_without_its_metadata(restricted: Listening) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{restricted.grpc_port}")
    tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
    tensor.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
    try:
        calls = (
            lambda h: client.is_server_live(headers=h),
            lambda h: client.is_model_ready("m", headers=h),
            lambda h: client.get_inference_statistics("m", headers=h),
            lambda h: client.infer("m", [tensor], headers=h),
        )
        for call in calls:
            for headers in (None, {"triton-grpc-protocol-x-token": "wrong"}, {"x-token": "s3cret"}):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
                assert GRPC_REFUSAL in refused.value.message()
            assert call(GRPC_TOKEN) is not None
        assert client.infer("m", [tensor], headers=GRPC_TOKEN).as_numpy("y").tolist() == [[2.0] * WIDTH]
        # Not named for gRPC: metadata, the model's config, the repository index.
        assert client.get_server_metadata().name
        assert client.get_model_config("m").config.name == "m"
        assert [m.name for m in client.get_model_repository_index().models] == ["m"]
    finally:
        client.close()


def test_a_grpc_stream_of_a_restricted_group_ends_unavailable_without_its_metadata(restricted: Listening) -> None:
    tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
    tensor.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
    for headers, expect_refusal in ((None, True), (GRPC_TOKEN, False)):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{restricted.grpc_port}")
        results: list[object] = []
        try:
            client.start_stream(lambda result, error, seen=results: seen.append(error or result), headers=headers)
            try:
                client.async_stream_infer("m", [tensor])
            except InferenceServerException:  # the refusal may have ended the stream already
                assert expect_refusal
            client.stop_stream()  # waits for the stream's end
        finally:
            client.close()
        assert len(results) == 1, results
        (result,) = results
        if expect_refusal:
            assert isinstance(result, InferenceServerException) and GRPC_REFUSAL in result.message(), result
        else:
            assert result.as_numpy("y").tolist() == [[2.0] * WIDTH]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("http", "grpc", "error"),
    [
        (("bogus:k=v",), (), "unknown restricted api 'bogus'"),
        ((), ("statistics,nope:k=v",), "unknown restricted protocol 'nope'"),
        (("statistics:k=v", "trace,statistics:k2=v"), (), "'statistics' can not be specified in multiple"),
        (("statistics",), (), "--http-restricted-api"),
        (("statistics:k",), (), "--http-restricted-api"),
        (("statistics:=v",), (), "--http-restricted-api"),
        ((), (":k=v",), "--grpc-restricted-protocol"),
        ("statistics:k=v", (), "sequence of"),
    ],
)
def test_a_malformed_restriction_is_refused_before_anything_listens(http: object, grpc: object, error: str) -> None:
    config = ServeConfig(http_port=0, grpc_port=0, http_restricted_api=http, grpc_restricted_protocol=grpc)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=error), serve_in_thread([], config):
        pass


def test_a_value_holding_colons_and_equals_signs_is_the_whole_value() -> None:
    server = fb.Server(
        double, inputs=[fb.TensorSpec("x", "float32", (WIDTH,))], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))],
        name="m",
    )  # fmt: skip
    config = ServeConfig(http_port=0, grpc_port=None, http_restricted_api=("metadata:k=a:b=c",), log_level="warning")
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m"
        assert httpx.get(url, headers={"k": "a"}).status_code == 403
        assert httpx.get(url, headers={"k": "a:b=c"}).status_code == 200


def test_the_command_line_takes_restrictions_and_refuses_a_bad_one() -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "--demo", "--http-restricted-api", "stats:k=v"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown restricted api 'stats'" in bad.stderr, bad.stderr


# -- PyTriton's TritonSecurityConfig --------------------------------------------------------------


def bind_identity(triton: Triton) -> None:
    @batch
    def identity(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x}

    triton.bind(
        "identity", identity, inputs=[Tensor(name="x", dtype=np.float32, shape=(-1,))],
        outputs=[Tensor(name="y", dtype=np.float32, shape=(-1,))],
    )  # fmt: skip


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_triton_restricts_pytritons_default_groups_to_its_access_token(frontend: str) -> None:
    config = TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)
    with Triton(config=config, frontend=frontend) as triton:
        bind_identity(triton)
        triton.run()
        token = triton.get_access_token()
        assert len(token) >= 32
        base = f"http://127.0.0.1:{triton.http_port}"
        for path in ("/v2/models/stats", "/v2/models/identity/stats"):
            assert httpx.get(base + path).status_code == 403
            assert httpx.get(base + path, headers={TRITON_ACCESS_HEADER: token}).status_code == 200
        assert httpx.post(f"{base}/v2/repository/index", json={}).status_code == 403
        # Open by default: health, metadata, the model's config, inference.
        for path in ("/v2/health/ready", "/v2/models/identity", "/v2/models/identity/config"):
            assert httpx.get(base + path).status_code == 200, path
        with ModelClient(f"http://127.0.0.1:{triton.http_port}", "identity") as client:
            assert client.infer_sample(x=np.float32([1, 2]))["y"].tolist() == [1, 2]
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.grpc_port}")
        try:
            with pytest.raises(InferenceServerException, match="expecting header"):
                grpc.get_inference_statistics("identity")
            headers = {f"triton-grpc-protocol-{TRITON_ACCESS_HEADER}": token}
            assert grpc.get_inference_statistics("identity", headers=headers).model_stats[0].name == "identity"
        finally:
            grpc.close()


def test_triton_restricts_inference_to_clients_given_the_token() -> None:
    security = TritonSecurityConfig(access_token="tok", restricted_endpoints=["inference", "model-config"])
    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False), security_config=security) as triton:
        bind_identity(triton)
        triton.run()
        assert triton.get_access_token() == "tok"
        for url in (f"http://127.0.0.1:{triton.http_port}", f"grpc://127.0.0.1:{triton.grpc_port}"):
            with ModelClient(url, "identity", access_token="tok") as client:
                assert client.infer_sample(x=np.float32([3]))["y"].tolist() == [3]
        response = httpx.post(
            f"http://127.0.0.1:{triton.http_port}/v2/models/identity/infer",
            json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]},
        )
        assert response.status_code == 403
        # Unrestricted groups: statistics now answers without the token.
        assert httpx.get(f"http://127.0.0.1:{triton.http_port}/v2/models/stats").status_code == 200


def test_triton_security_config_as_pytritons() -> None:
    assert TritonSecurityConfig().restricted_endpoints == DEFAULT_PROTECTED_ENDPOINTS
    assert TritonSecurityConfig().access_token != TritonSecurityConfig().access_token  # made each time
    assert TritonSecurityConfig(restricted_endpoints=[]).access_token is None  # nothing to protect
    with pytest.raises(PyTritonValidationError, match="Invalid endpoint names: bogus"):
        TritonSecurityConfig(restricted_endpoints=["statistics", "bogus"])
    open_config = TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)
    with Triton(config=open_config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        bind_identity(triton)
        triton.run()
        assert httpx.get(f"http://127.0.0.1:{triton.http_port}/v2/models/stats").status_code == 200
    # TritonConfig's own restriction strings, when the security config restricts nothing.
    own = TritonConfig(http_port=0, allow_grpc=False, allow_metrics=False, http_restricted_api="metadata:k=v")
    with Triton(config=own, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        bind_identity(triton)
        triton.run()
        url = f"http://127.0.0.1:{triton.http_port}/v2/models/identity"
        assert httpx.get(url).status_code == 403 and httpx.get(url, headers={"k": "v"}).status_code == 200


def test_the_cloud_ports_keep_the_http_restrictions() -> None:
    """Vertex AI's and SageMaker's routes answer through the v2 handlers,
    and Triton's keep its ``--http-restricted-api`` there too."""
    from ferrobatch.serve import SageMaker, VertexAI

    server = fb.Server(
        double, inputs=[fb.TensorSpec("x", "float32", (WIDTH,))], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))],
        name="m",
    )  # fmt: skip
    config = ServeConfig(
        http_port=0,
        grpc_port=None,
        log_level="warning",
        vertex_ai=VertexAI(predict_route="/predict", health_route="/health", port=0),
        sagemaker=SageMaker(port=0),
        http_restricted_api=("inference,health:x-token=s3cret", "statistics:x-token=s3cret"),
    )
    with serve_in_thread([server], config) as listening:
        vertex = f"http://127.0.0.1:{listening.vertex_ai_port}"
        sagemaker = f"http://127.0.0.1:{listening.sagemaker_port}"
        redirect = {"x-vertex-ai-triton-redirect": "v2/models/stats"}
        for method, url, headers in (
            ("POST", f"{vertex}/predict", {}),
            ("GET", f"{vertex}/health", {}),
            ("POST", f"{vertex}/predict", redirect),
            ("POST", f"{sagemaker}/invocations", {}),
            ("GET", f"{sagemaker}/ping", {}),
        ):
            body = infer_body() if method == "POST" else None
            refused = httpx.request(method, url, json=body, headers=headers)
            assert refused.status_code == 403 and refused.json() == {"error": HTTP_REFUSAL}, (url, refused.text)
            allowed = httpx.request(method, url, json=body, headers={**headers, **TOKEN})
            assert allowed.status_code == 200, (url, allowed.text)
