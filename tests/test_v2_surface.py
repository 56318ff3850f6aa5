"""The rarely-called v2 surface that every HTTP front-end answers with the
same Python handlers: Triton's statistics, the repository index, typed
/metrics with a batch-size histogram, 404 and 405 as JSON; driven by
tritonclient against the native front-end, the Python one (Starlette under
uvicorn) and the aiohttp app, and through ``Endpoint.dispatch`` alone."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from test_http import WIDTH, X, Y, aiohttp_in_thread, double
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.http._endpoint import ROUTES, Endpoint
from ferrobatch.serve import ServeConfig, serve_in_thread

MAX_BATCH = 8
#: Rows per request; sent one at a time, each request is a batch of its own.
ROWS = (1, 2, 2, 3, 5)


def make_servers() -> list[fb.Server]:
    return [
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, max_delay=0.001, name="double"),
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=4, name="idle"),
    ]


@contextlib.contextmanager
def front_end(kind: str, servers: list[fb.Server]) -> Iterator[str]:
    """Serves ``servers`` with front-end ``kind``; yields "127.0.0.1:port"."""
    if kind == "aiohttp":
        with aiohttp_in_thread(servers) as port:
            yield f"127.0.0.1:{port}"
        return
    config = ServeConfig(http_port=0, grpc_port=None, frontend=kind, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield f"127.0.0.1:{listening.http_port}"


@pytest.fixture(params=["native", "python", "aiohttp"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[list[fb.Server], str]]:
    servers = make_servers()
    with front_end(request.param, servers) as address:
        yield servers, address


def send(client: httpclient.InferenceServerClient, rows: int) -> None:
    tensor = httpclient.InferInput("x", [rows, WIDTH], "FP32")
    tensor.set_data_from_numpy(np.ones((rows, WIDTH), np.float32))
    result = client.infer("double", [tensor])
    np.testing.assert_array_equal(result.as_numpy("y"), np.full((rows, WIDTH), 2, np.float32))


def send_all(address: str) -> None:
    client = httpclient.InferenceServerClient(address, network_timeout=30)
    try:
        for rows in ROWS:
            send(client, rows)
        bad = httpclient.InferInput("x", [1, WIDTH + 1], "FP32")
        bad.set_data_from_numpy(np.zeros((1, WIDTH + 1), np.float32))
        with pytest.raises(InferenceServerException):
            client.infer("double", [bad])
    finally:
        client.close()


# -- statistics -------------------------------------------------------------------------------


def test_statistics_count_what_was_sent(served: tuple[list[fb.Server], str]) -> None:
    servers, address = served
    before_ms = time.time_ns() // 1_000_000
    send_all(address)
    after_ms = time.time_ns() // 1_000_000
    client = httpclient.InferenceServerClient(address, network_timeout=30)
    try:
        stats = client.get_inference_statistics("double")
        assert client.get_inference_statistics("double", "1") == stats
        everyone = client.get_inference_statistics("")
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_inference_statistics("nope")
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_inference_statistics("double", "2")
    finally:
        client.close()

    (model,) = stats["model_stats"]
    assert model["name"] == "double" and model["version"] == "1"
    assert before_ms <= model["last_inference"] <= after_ms
    assert model["inference_count"] == sum(ROWS)
    assert model["execution_count"] == len(ROWS)
    inference = model["inference_stats"]
    assert inference["success"]["count"] == len(ROWS) and inference["success"]["ns"] > 0
    assert inference["fail"]["count"] == 1  # the wrong shape
    assert inference["queue"]["count"] == len(ROWS)
    assert inference["compute_infer"]["count"] == len(ROWS) and inference["compute_infer"]["ns"] > 0
    for key in ("compute_input", "compute_output", "cache_hit", "cache_miss"):
        assert set(inference[key]) == {"count", "ns"}
    by_size = {b["batch_size"]: b for b in model["batch_stats"]}
    assert {size: b["compute_infer"]["count"] for size, b in by_size.items()} == {1: 1, 2: 2, 3: 1, 5: 1}
    assert all(b["compute_infer"]["ns"] > 0 for b in by_size.values())
    own = servers[0].stats()
    assert sum(b["compute_infer"]["ns"] for b in by_size.values()) == own["compute_ns"]

    assert [m["name"] for m in everyone["model_stats"]] == ["double", "idle"]
    idle = everyone["model_stats"][1]
    assert idle["last_inference"] == 0 and idle["execution_count"] == 0 and idle["batch_stats"] == []


def test_repository_index_lists_every_model_ready(served: tuple[list[fb.Server], str]) -> None:
    _, address = served
    client = httpclient.InferenceServerClient(address, network_timeout=30)
    try:
        index = client.get_model_repository_index()
    finally:
        client.close()
    assert index == [
        {"name": "double", "version": "1", "state": "READY", "reason": ""},
        {"name": "idle", "version": "1", "state": "READY", "reason": ""},
    ]


# -- /metrics ---------------------------------------------------------------------------------

COUNTERS = (
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "ferrobatch_retry_calls",
    "ferrobatch_isolated_failures",
    "ferrobatch_batches",
)


def types_of(text: str) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE ")}


def histogram(text: str, model: str) -> dict[str, float]:
    """``ferrobatch_batch_size`` of ``model``: {"1.0": ..., "+Inf": ..., "sum": ..., "count": ...}."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name != "ferrobatch_batch_size":
            continue
        assert family.type == "histogram"
        for sample in family.samples:
            if sample.labels["model"] != model:
                continue
            key = sample.labels.get("le") or sample.name.rpartition("_")[2]
            found[key] = sample.value
    return found


def test_metrics_are_typed_and_the_histogram_agrees_with_stats(served: tuple[list[fb.Server], str]) -> None:
    servers, address = served
    send_all(address)
    text = httpx.get(f"http://{address}/metrics").text
    types = types_of(text)
    assert {name: types.get(name) for name in COUNTERS} == dict.fromkeys(COUNTERS, "counter")
    assert types["nv_inference_pending_request_count"] == "gauge"
    assert types["ferrobatch_batch_size"] == "histogram"
    samples = [line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert not [name for name in samples if name.endswith("_total")]  # Triton's names, as they are
    assert 'nv_inference_count{model="double",version="1"} 13.0' in text

    stats = servers[0].stats()
    assert stats["batch_sizes"] == {1: 1, 2: 2, 3: 1, 5: 1}
    assert histogram(text, "double") == {
        "1.0": 1,
        "2.0": 3,
        "4.0": 4,
        "8.0": 5,
        "+Inf": 5,
        "sum": stats["rows"],
        "count": stats["batches"],
    }
    assert histogram(text, "idle") == {"1.0": 0, "2.0": 0, "4.0": 0, "+Inf": 0, "sum": 0, "count": 0}


# -- routing ----------------------------------------------------------------------------------


def test_unknown_routes_are_404_and_wrong_methods_405_as_json(served: tuple[list[fb.Server], str]) -> None:
    _, address = served
    with httpx.Client(base_url=f"http://{address}", timeout=30) as http:
        missing = http.get("/v2/nothing/here")
        assert missing.status_code == 404 and missing.json() == {"error": "Not Found"}
        for method, path in [
            ("POST", "/v2/models/stats"),
            ("GET", "/v2/repository/index"),
            ("GET", "/v2/models/double/infer"),
        ]:
            response = http.request(method, path)
            assert response.status_code == 405, (method, path, response.text)
            assert "Method Not Allowed" in response.json()["error"]
            assert response.headers["allow"]


async def test_dispatch_answers_every_route_without_a_framework() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, max_delay=0.001, name="double")
    endpoint = Endpoint([server])
    async with server:
        header = json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, WIDTH], "parameters": {"binary_data_size": 32}}]}
        ).encode()
        body = header + np.arange(8, dtype=np.float32).tobytes()
        # Header names in any case, a query string, a percent-encoded name.
        infer = await endpoint.dispatch(
            "POST",
            "/v2/models/%64ouble/versions/1/infer?x=1",
            {"Inference-Header-Content-Length": str(len(header))},
            body,
        )
        assert infer.status == 200, infer.body
        assert json.loads(infer.body)["outputs"][0]["data"] == [float(2 * i) for i in range(8)]

        answers = {
            ("GET", "/v2/health/live"): 200,
            ("GET", "/v2/health/ready"): 200,
            ("HEAD", "/v2/health/ready"): 200,
            ("GET", "/v2"): 200,
            ("GET", "/v2/models/stats"): 200,
            ("POST", "/v2/repository/index"): 200,
            ("GET", "/v2/models/double"): 200,
            ("GET", "/v2/models/double/ready"): 200,
            ("GET", "/v2/models/double/config"): 200,
            ("GET", "/v2/models/double/stats"): 200,
            ("GET", "/v2/models/double/versions/1/stats"): 200,
            ("GET", "/v2/models/double/versions/2/stats"): 400,
            ("GET", "/v2/models/nope/stats"): 400,
            ("GET", "/metrics"): 200,
            ("GET", "/v2/models/double/more/stats"): 404,
            ("DELETE", "/v2/models/double"): 405,
        }
        got = {key: (await endpoint.dispatch(*key, {}, b"")).status for key in answers}
        assert got == answers
        stats = json.loads((await endpoint.dispatch("GET", "/v2/models/double/stats", {}, b"")).body)
        assert stats["model_stats"][0]["batch_stats"][0]["batch_size"] == 2
        assert {(r.method, r.path) for r in endpoint.routes} == {(r.method, r.path) for r in ROUTES}
        without = Endpoint([server], metrics=False)
        assert (await without.dispatch("GET", "/metrics", {}, b"")).status == 404


async def test_starlette_app_in_process_index_and_stats_of_a_server_not_started() -> None:
    from ferrobatch.http import starlette_app

    running = fb.Server(double, inputs=[X], outputs=[Y], name="running")
    stopped = fb.Server(double, inputs=[X], outputs=[Y], name="stopped")
    app = starlette_app([running, stopped], manage_servers=False)
    transport = httpx.ASGITransport(app=app)
    async with running, httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        index = (await http.post("/v2/repository/index")).json()
        assert index == [
            {"name": "running", "version": "1", "state": "READY", "reason": ""},
            {"name": "stopped", "version": "1", "state": "UNAVAILABLE", "reason": "not running"},
        ]
        ready = await http.post("/v2/repository/index", content=b'{"ready": true}')
        assert [m["name"] for m in ready.json()] == ["running"]
        assert (await http.post("/v2/repository/index", content=b"[1")).status_code == 400
        stats = (await http.get("/v2/models/stopped/stats")).json()["model_stats"][0]
        assert stats["execution_count"] == 0 and stats["last_inference"] == 0 and stats["batch_stats"] == []
        unknown = await http.get("/v2/models/nope/versions/1/stats")
        assert unknown.status_code == 400
        assert unknown.json() == {"error": "Request for unknown model: 'nope' is not found"}


# -- requested outputs ------------------------------------------------------------------------

Z = fb.TensorSpec("z", "float32", (WIDTH,))


def telling(told: list[frozenset[str] | None], decoupled: bool = False) -> Any:
    """A model built with its requests: records what each request asked
    for; ``y = 2x``, ``z = 3x`` (once more, as a stream, when ``decoupled``)."""

    def outputs(inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        told.extend(r.requested_outputs for r in requests)
        return {"y": inputs["x"] * 2, "z": inputs["x"] * 3}

    def streamed(inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> Iterator[dict[str, torch.Tensor]]:
        yield outputs(inputs, requests)

    return streamed if decoupled else outputs


def ask(client: Any, module: Any, model: str, wanted: list[str]) -> Any:
    """One row of ones to ``model``, asking for ``wanted`` outputs (none: every one)."""
    given = module.InferInput("x", [1, WIDTH], "FP32")
    given.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
    return client.infer(model, [given], outputs=[module.InferRequestedOutput(n) for n in wanted] or None)


@pytest.mark.parametrize("kind", ["native", "python", "aiohttp"])
def test_a_model_built_with_its_requests_is_told_the_outputs_each_asked_for(kind: str) -> None:
    """RequestInfo.requested_outputs over HTTP and gRPC, on every front-end:
    the outputs a request named, or every one when it named none."""
    import queue

    import tritonclient.grpc as grpcclient

    told: list[frozenset[str] | None] = []
    streamed: list[frozenset[str] | None] = []
    servers = [
        fb.Server(telling(told), inputs=[X], outputs=[Y, Z], with_requests=True, name="told"),
        fb.Server(telling(streamed, True), inputs=[X], outputs=[Y, Z], with_requests=True, decoupled=True, name="s"),
    ]
    if kind == "aiohttp":
        with aiohttp_in_thread(servers) as port:
            http = httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=30)
            only_z = ask(http, httpclient, "told", ["z"])
            ask(http, httpclient, "told", [])
        assert only_z.as_numpy("z").tolist() == [[3.0] * WIDTH] and only_z.as_numpy("y") is None
        assert told == [frozenset({"z"}), frozenset({"y", "z"})]
        return
    config = ServeConfig(http_port=0, grpc_port=0, frontend=kind, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}", network_timeout=30)
        only_z = ask(http, httpclient, "told", ["z"])
        ask(http, httpclient, "told", [])
        with grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as grpc:
            assert ask(grpc, grpcclient, "told", ["y"]).as_numpy("z") is None
            ask(grpc, grpcclient, "told", [])
            answers: queue.Queue[Any] = queue.Queue()
            grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
            given = grpcclient.InferInput("x", [1, WIDTH], "FP32")
            given.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
            grpc.async_stream_infer("s", [given], outputs=[grpcclient.InferRequestedOutput("z")])
            result, error = answers.get(timeout=30)
            grpc.stop_stream()
        assert error is None and result.as_numpy("z").tolist() == [[3.0] * WIDTH]
    assert only_z.as_numpy("y") is None
    every = frozenset({"y", "z"})
    assert told == [frozenset({"z"}), every, frozenset({"y"}), every]
    assert streamed == [frozenset({"z"})]
