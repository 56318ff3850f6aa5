"""Triton's model control (``--model-control-mode=explicit``): tritonclient
unloads a model and loads it again over HTTP and gRPC, on the native and
the Python front-ends. An unloaded model is known but refused ("has no
available versions", 503 / UNAVAILABLE), not ready, and leaves the server
ready; the requests it accepted before are answered; a load waits for its
warm-up; ``--load-model`` starts some models only. Off by default, as in
Triton. With them, Triton's ``--exit-on-error=false`` (a model that fails
to start is left unloaded, the others serve) and ``--strict-readiness``."""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import gevent_hub_freed, wait_until
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch._variable import DEFAULT_ELEMENTS_PER_ROW
from ferrobatch.serve import Listening, ServeConfig, add_arguments, check_config, serve_in_thread

pytestmark = pytest.mark.timeout(90)

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
NO_VERSIONS = "Request for unknown model: '{}' has no available versions"
NOT_ALLOWED = "explicit model load / unload is not allowed if polling is enabled"


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def triple(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 3}


def models(**first: Any) -> list[fb.Server]:
    return [
        fb.Server(first.pop("fn", double), inputs=[X], outputs=[Y], name="a", **{"max_batch_size": 8, **first}),
        fb.Server(triple, inputs=[X], outputs=[Y], name="b", max_batch_size=8),
    ]


def serving(frontend: str, servers: list[fb.Server] | None = None, **options: Any) -> Any:
    options.setdefault("model_control_mode", "explicit")
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning", threads=1, **options)
    return serve_in_thread(servers or models(), config)


@pytest.fixture(params=["native", "python"])
def frontend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def clients(listening: Listening) -> list[Any]:
    return [
        httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}"),
        grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}"),
    ]


def infer(client: Any, model: str, value: float = 1.0) -> np.ndarray:
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    x = module.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), value, dtype=np.float32))
    out: np.ndarray = client.infer(model, [x]).as_numpy("y")
    return out


def refusal(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def index(client: Any) -> dict[str, tuple[str, str]]:
    """``{name: (state, reason)}`` from the repository index."""
    if isinstance(client, httpclient.InferenceServerClient):
        listed = client.get_model_repository_index()
    else:
        listed = client.get_model_repository_index(as_json=True).get("models", [])
    return {m["name"]: (m.get("state", ""), m.get("reason", "")) for m in listed}


def succeeded(server: fb.Server) -> int:
    return int(server.stats()["requests_succeeded"])


def test_a_model_unloaded_is_refused_and_loaded_again_serves(frontend: str) -> None:
    servers = models()
    with serving(frontend, servers) as listening:
        for client in clients(listening):
            assert infer(client, "a")[0, 0] == 2.0
            client.unload_model("a")
            assert not client.is_model_ready("a")
            assert client.is_model_ready("b")
            assert client.is_server_ready()  # an unloaded model does not count, as in Triton
            error = refusal(lambda c=client: infer(c, "a"))
            assert NO_VERSIONS.format("a") in str(error)
            assert error.status() in ("503", "StatusCode.UNAVAILABLE")
            assert infer(client, "b")[0, 0] == 3.0  # the others serve on
            assert index(client)["a"] == ("UNAVAILABLE", "unloaded")
            client.unload_model("a")  # again: nothing happens, as in Triton
            client.load_model("a")  # waits for the unload's stop, then the warm-up
            assert client.is_model_ready("a")
            assert index(client)["a"] == ("READY", "")
            assert infer(client, "a", 5.0)[0, 0] == 10.0
            client.load_model("a")  # loaded already: left as it is
            assert infer(client, "a")[0, 0] == 2.0
        # Statistics carry on across runs and count what the callers saw: 3
        # answers per protocol, the refusals never reached the model.
        a, b = servers
        assert succeeded(a) == 6 and succeeded(b) == 2
    assert not a.running and not b.running  # the server a load started is stopped on the way out


def test_an_unload_lets_the_requests_it_accepted_finish(frontend: str) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        assert release.wait(30)
        return {"y": inputs["x"] * 2}

    servers = models(fn=slow, max_delay=0.0)
    with serving(frontend, servers) as listening:
        # A client per thread, made and closed on it: tritonclient's HTTP client holds one connection.
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}")
        answers: list[Any] = []

        @gevent_hub_freed()
        def first() -> None:
            own = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}", network_timeout=60)
            try:
                answers.append(infer(own, "a", 4.0))
            finally:
                own.close()

        caller = threading.Thread(target=first)
        caller.start()
        assert entered.wait(30)
        started = time.monotonic()
        client.unload_model("a")  # returns at once, as Triton's: the stop waits for the batch
        assert time.monotonic() - started < 5
        assert not client.is_model_ready("a")
        assert NO_VERSIONS.format("a") in str(refusal(lambda: infer(client, "a")))
        release.set()
        caller.join(30)
        assert answers and answers[0][0, 0] == 8.0
        assert wait_until(lambda: not servers[0].running, timeout_s=30)
        assert succeeded(servers[0]) == 1


def test_a_shutdown_does_not_wait_past_its_grace_for_an_unload(frontend: str) -> None:
    entered, release = threading.Event(), threading.Event()

    def stuck(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        release.wait(60)
        return {"y": inputs["x"] * 2}

    servers = models(fn=stuck, max_delay=0.0, max_batch_size=1)
    answers: list[Any] = []

    @gevent_hub_freed()
    def call(listening: Listening) -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}", network_timeout=60)
        try:
            answers.append(infer(client, "a"))
        except InferenceServerException as exc:
            answers.append(exc)
        finally:
            client.close()

    try:
        with serving(frontend, servers, graceful_timeout=1.0) as listening:
            callers = [threading.Thread(target=call, args=(listening,)) for _ in range(2)]
            for caller in callers:
                caller.start()
            assert entered.wait(30)
            assert wait_until(lambda: servers[0].stats()["queue_depth"] >= 1)
            httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}").unload_model("a")
            leaving = time.monotonic()
        # The unload's stop waited for the stuck batch; the shutdown's grace cut it short.
        assert time.monotonic() - leaving < 15
        for caller in callers:
            caller.join(30)
        refused = [a for a in answers if isinstance(a, InferenceServerException)]
        assert len(answers) == 2 and len(refused) >= 1
        assert all("stopped before the request was answered" in str(e) for e in refused)
    finally:
        release.set()


def test_model_control_is_off_by_default(frontend: str) -> None:
    with serving(frontend, model_control_mode="none") as listening:
        for client in clients(listening):
            for call in (client.load_model, client.unload_model):
                error = refusal(lambda call=call: call("a"))
                assert NOT_ALLOWED in str(error)
                assert error.status() in ("503", "StatusCode.UNAVAILABLE")
            assert infer(client, "a")[0, 0] == 2.0
        url = f"http://127.0.0.1:{listening.http_port}/v2/repository/models/a/unload"
        assert httpx.post(url).status_code == 503


def test_what_cannot_be_loaded_is_refused_in_tritons_words(frontend: str) -> None:
    with serving(frontend) as listening:
        for client in clients(listening):
            error = refusal(lambda c=client: c.load_model("nope"))
            assert "failed to load 'nope', failed to poll from model repository" in str(error)
            assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            client.unload_model("nope")  # unknown: nothing happens, as in Triton
            error = refusal(lambda c=client: c.load_model("a", files={"file:1/model.pt": b"weights"}))
            assert "cannot replace their files (file:1/model.pt)" in str(error)
            assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            assert infer(client, "a")[0, 0] == 2.0  # refused loads harm nothing
        base = f"http://127.0.0.1:{listening.http_port}/v2/repository/models/a"
        for body in (b"[]", b'{"parameters": 3}', b"{"):
            assert httpx.post(f"{base}/load", content=body).status_code == 400
        assert httpx.post(f"{base}/unload", json={"parameters": {"unload_dependents": True}}).status_code == 200
        assert httpx.post(f"{base}/load", json={}).status_code == 200


def config_of(client: Any, model: str) -> dict[str, Any]:
    if isinstance(client, httpclient.InferenceServerClient):
        config: dict[str, Any] = client.get_model_config(model)
        return config
    return dict(client.get_model_config(model, as_json=True)["config"])


def infer_rows(client: Any, model: str, rows: int) -> np.ndarray:
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    x = module.InferInput("x", [rows, 4], "FP32")
    x.set_data_from_numpy(np.ones((rows, 4), dtype=np.float32))
    out: np.ndarray = client.infer(model, [x]).as_numpy("y")
    return out


def test_a_load_with_a_new_configuration_restarts_the_model_with_its_batching(frontend: str) -> None:
    """Triton's configuration override: ``max_batch_size`` and
    ``dynamic_batching`` change what the model runs with, not only what its
    configuration says; a bad override is refused and harms nothing."""
    servers = models()
    with serving(frontend, servers) as listening:
        for client, size in zip(clients(listening), (16, 4), strict=True):
            override = {
                "max_batch_size": str(size),  # int64 as protobuf's JSON writes it
                "dynamicBatching": {"maxQueueDelayMicroseconds": "2000", "preferred_batch_size": [2, size]},
            }
            client.load_model("a", config=json.dumps(override))
            assert client.is_model_ready("a")
            config = config_of(client, "a")
            assert config["max_batch_size"] == size
            assert [int(n) for n in config["dynamic_batching"]["preferred_batch_size"]] == [2, size]
            assert int(config["dynamic_batching"]["max_queue_delay_microseconds"]) == 2000
            a = servers[0]
            assert (a.max_batch_size, a.max_delay, a.preferred_batch_sizes) == (size, 0.002, (2, size))
            # The running batcher takes the new bound: more rows than it is a 400.
            assert infer_rows(client, "a", size).shape == (size, 4)
            error = refusal(lambda c=client, n=size + 1: infer_rows(c, "a", n))
            assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT"), error
            assert config_of(client, "b")["max_batch_size"] == 8  # the other model as it was
            refused = {
                '"parameters": {"config": {{"max_batch_size": "16"}}}': "not valid JSON",
                "[16]": "must be a JSON object",
                '{"instance_group": [{"count": 2}]}': "ferrobatch cannot change instance_group on a load",
                '{"name": "b"}': "cannot rename the model",
                '{"max_batch_size": 0}': "batching cannot be turned on or off",
                '{"max_batch_size": "x"}': "'max_batch_size' must be an integer",
                '{"dynamic_batching": {"preferred_batch_size": [99]}}': "preferred_batch_sizes must be in 1..",
                '{"max_batch_size": "--5"}': "'max_batch_size' must be an integer",
                '{"max_batch_size": "' + "9" * 5000 + '"}': "'max_batch_size' must be an integer",
                '{"instance_group": ' + "[" * 100_000 + "]" * 100_000 + "}": "nested too deeply",
                '{"instance_group": ' + "[" * 990 + "]" * 990 + "}": "nested too deeply",
            }
            for text, words in refused.items():
                error = refusal(lambda c=client, t=text: c.load_model("a", config=t))
                assert "failed to load 'a'" in str(error) and words in str(error), error
                assert error.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            assert config_of(client, "a")["max_batch_size"] == size  # refused loads changed nothing
            assert infer(client, "a")[0, 0] == 2.0
            # A configuration read back, changed and sent whole: what it does not change must match.
            whole = config_of(client, "a")
            whole["max_batch_size"] = 2 * size
            whole["dynamic_batching"]["preferred_batch_size"] = []
            client.load_model("a", config=json.dumps(whole))
            assert config_of(client, "a")["max_batch_size"] == 2 * size
            whole["input"][0]["dims"] = [5]
            error = refusal(lambda c=client, w=whole: c.load_model("a", config=json.dumps(w)))
            assert "ferrobatch cannot change input on a load" in str(error), error
            assert infer(client, "a")[0, 0] == 2.0
        # The same configuration again changes nothing: left as it is, as any load of a loaded model.
        http = clients(listening)[0]
        http.load_model("a", config='{"max_batch_size": 8}')
        assert infer(http, "a")[0, 0] == 2.0
        # Each request counted once across the restarts: 3 per protocol and the last; the
        # refusals never reached the model.
        assert succeeded(servers[0]) == 3 + 3 + 1


def test_loads_with_configurations_at_once_are_each_read_against_the_one_before() -> None:
    """Two loads whose configurations conflict, sent at once: each is checked
    against what the one before it left (a 400 if it no longer fits), never
    a 500 from checking against what was there before both. (httpx from the
    threads: tritonclient's HTTP client runs gevent, one hub per thread.)"""
    with serving("native") as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/repository/models/a/load"
        wider = json.dumps({"max_batch_size": 16, "dynamic_batching": {"preferred_batch_size": [16]}})
        narrower = json.dumps({"max_batch_size": 4})
        reset = json.dumps({"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": []}})
        with httpx.Client(timeout=60) as http:
            for _ in range(3):
                with ThreadPoolExecutor(2) as pool:
                    loads = pool.map(lambda c: http.post(url, json={"parameters": {"config": c}}), (wider, narrower))
                    statuses = sorted(r.status_code for r in loads)
                assert statuses in ([200, 200], [200, 400]), statuses
                assert http.post(url, json={"parameters": {"config": reset}}).status_code == 200
                answer = http.post(
                    f"http://127.0.0.1:{listening.http_port}/v2/models/a/infer",
                    json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]},
                )
                assert answer.json()["outputs"][0]["data"] == [2.0] * 4


def test_reconfigure_changes_a_stopped_servers_batching_and_refuses_a_running_one() -> None:
    rows: list[int] = []

    def recorded(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows.append(int(inputs["x"].shape[0]))
        return double(inputs)

    server = fb.Server(recorded, inputs=[X], outputs=[Y], name="a", max_batch_size=8, max_delay="auto")
    server.reconfigure(max_batch_size=32, preferred_batch_sizes=[32, 4, 4])
    assert (server.max_batch_size, server.preferred_batch_sizes, server.adaptive_delay) == (32, (4, 32), True)
    assert server.buckets[-1] == 32 and 4 in server.buckets
    server.reconfigure(max_delay=0.003)  # a fixed window: the adaptive one ends
    assert (server.max_delay, server.adaptive_delay) == (0.003, False)
    with pytest.raises(ValueError, match=r"preferred_batch_sizes must be in 1..16, got \[32\]"):
        server.reconfigure(max_batch_size=16)
    with pytest.raises(ValueError, match="max_delay must be >= 0"):
        server.reconfigure(max_delay=-1.0)
    assert (server.max_batch_size, server.max_delay) == (32, 0.003)  # a refusal changes nothing
    with server.run_in_background():
        with pytest.raises(RuntimeError, match="stop it before reconfiguring it"):
            server.reconfigure(max_batch_size=4)
        server.reconfigure(max_batch_size=4, preferred_batch_sizes=(), check_only=True)  # checks only
        assert server.max_batch_size == 32
    server.reconfigure(max_batch_size=4, max_delay=0.05, preferred_batch_sizes=())
    with server.run_in_background():
        rows.clear()  # the warm-up's
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda _: server.client().infer_sync({"x": torch.ones(4)}), range(32)))
        assert all(a["y"].tolist() == [2.0] * 4 for a in answers)
        assert sum(rows) == 32 and max(rows) == 4  # batches of the new bound, full within the window
    # A variable-length input's element budget follows max_batch_size, unless it was given.
    ragged = fb.TensorSpec("x", "float32", (-1,), ragged="jagged")
    follows = fb.Server(
        double, inputs=[ragged], outputs=[fb.TensorSpec("y", "float32", (-1,), ragged="jagged")], max_batch_size=8
    )
    follows.reconfigure(max_batch_size=2)
    assert follows.max_batch_elements == 2 * DEFAULT_ELEMENTS_PER_ROW
    kept = fb.Server(
        double,
        inputs=[ragged],
        outputs=[fb.TensorSpec("y", "float32", (-1,), ragged="jagged")],
        max_batch_size=8,
        max_batch_elements=99,
    )
    kept.reconfigure(max_batch_size=2)
    assert kept.max_batch_elements == 99
    alone = fb.Server(double, inputs=[X], outputs=[Y], batching=False)
    with pytest.raises(ValueError, match="served without batching"):
        alone.reconfigure(max_batch_size=4)


def test_a_failed_warm_up_fails_the_load_and_leaves_the_model_unloaded(frontend: str) -> None:
    broken = [False]

    def fragile(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if broken[0]:
            raise RuntimeError("weights missing")
        return {"y": inputs["x"] * 2}

    with serving(frontend, models(fn=fragile, warmup=True)) as listening:
        for client in clients(listening):
            client.unload_model("a")
            broken[0] = True
            error = refusal(lambda c=client: c.load_model("a"))
            assert "load failed for model 'a': version 1 is at UNAVAILABLE state" in str(error)
            assert "weights missing" not in str(error)  # the model's words stay in the log (expose_errors)
            assert not client.is_model_ready("a")
            assert NO_VERSIONS.format("a") in str(refusal(lambda c=client: infer(c, "a")))
            broken[0] = False
            client.load_model("a")
            assert infer(client, "a")[0, 0] == 2.0


def test_load_model_starts_only_the_models_it_names(frontend: str) -> None:
    servers = models()
    with serving(frontend, servers, load_models=["a"]) as listening:
        assert not servers[1].running
        for client in clients(listening):
            assert client.is_server_ready()
            assert not client.is_model_ready("b")
            assert index(client)["b"] == ("UNAVAILABLE", "unloaded")
            meta = client.get_model_metadata("b")
            assert (meta["name"] if isinstance(meta, dict) else meta.name) == "b"  # known
            assert NO_VERSIONS.format("b") in str(refusal(lambda c=client: infer(c, "b")))
        http, grpc_client = clients(listening)
        http.load_model("b")  # never served before: served from now on
        assert infer(http, "b")[0, 0] == 3.0
        assert infer(grpc_client, "b")[0, 0] == 3.0
        assert succeeded(servers[1]) == 2
    assert not servers[1].running  # a load started it: the shutdown stops it


def test_the_config_and_cli_follow_tritons_rules() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--demo", "--model-control-mode", "explicit", "--load-model", "a", "--load-model=b"])
    assert (args.model_control_mode, args.load_models) == ("explicit", ["a", "b"])
    assert parser.parse_args(["--demo"]).model_control_mode == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo", "--model-control-mode", "poll"])
    for config, message in [
        (ServeConfig(load_models=["a"]), "requires model_control_mode='explicit'"),
        (ServeConfig(model_control_mode="explicit", load_models=["*", "a"]), "must be the only name"),
        (ServeConfig(model_control_mode="explicit", load_models="a"), "a sequence of model names"),
        (ServeConfig(model_control_mode="poll"), "model_control_mode must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_config(config)
    check_config(ServeConfig(model_control_mode="explicit", load_models=["*"]))


def test_an_unknown_model_to_load_at_start_is_a_start_up_error() -> None:
    config = ServeConfig(http_port=0, grpc_port=None, model_control_mode="explicit", load_models=["zzz"])
    with pytest.raises(Exception, match="--load-model: no model named 'zzz'"):
        with serve_in_thread(models(), config):
            pass


def test_the_repository_refuses_a_mode_it_does_not_know() -> None:
    from ferrobatch.http.protocol import ModelRepository

    with pytest.raises(ValueError, match="model_control_mode"):
        ModelRepository(models(), model_control_mode="poll")


def test_pytritons_model_client_unloads_and_loads_a_bound_model() -> None:
    """PyTriton runs Triton in explicit mode: ``ModelClient.unload_model()``
    and ``load_model()`` work against ``ferrobatch.triton`` as there (behind
    the access token that guards the model-repository API by default)."""
    from ferrobatch.triton import Triton, TritonConfig
    from ferrobatch.triton.client import ModelClient
    from ferrobatch.triton.decorators import batch
    from ferrobatch.triton.model_config import ModelConfig, Tensor

    @batch
    def double_np(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2}

    tensors = [Tensor(name="x", dtype=np.float32, shape=(4,))], [Tensor(name="y", dtype=np.float32, shape=(4,))]
    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
        triton.bind("double", double_np, *tensors, config=ModelConfig(max_batch_size=8))
        triton.run()
        checker = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}")
        for url in (f"http://127.0.0.1:{triton.http_port}", f"grpc://127.0.0.1:{triton.grpc_port}"):
            with ModelClient(url, "double", access_token=triton.get_access_token()) as client:
                assert client.infer_sample(np.ones(4, dtype=np.float32))["y"].tolist() == [2.0] * 4
                client.unload_model()
                assert NO_VERSIONS.format("double") in str(refusal(lambda: infer(checker, "double")))
                assert not checker.is_model_ready("double")
                client.load_model()
                assert checker.is_model_ready("double")
                assert client.infer_sample(np.ones(4, dtype=np.float32))["y"].tolist() == [2.0] * 4


#: An app's requests in turn and what each must answer: ``(method, path, body, status, text in it)``.
APP_STEPS: list[tuple[str, str, Any, int, str]] = [
    ("POST", "/v2/repository/models/a/unload", None, 200, ""),
    (
        "POST",
        "/v2/models/a/infer",
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]},
        503,
        NO_VERSIONS.format("a"),
    ),
    ("GET", "/v2/health/ready", None, 200, ""),
    ("POST", "/v2/repository/models/a/load", None, 200, ""),
    (
        "POST",
        "/v2/models/a/infer",
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]},
        200,
        '"data":[2.0,2.0,2.0,2.0]',
    ),
]


def said(text: str, body: str) -> bool:
    """Whether ``body`` says ``text`` (JSON's spacing aside)."""
    return text in body or text in body.replace(" ", "")


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")  # a newer starlette's advice
def test_a_starlette_app_given_an_explicit_repository_unloads_and_loads() -> None:
    """An app made with ``ModelRepository(model_control_mode="explicit")``:
    its lifespan starts the servers, a client unloads and loads one, and the
    lifespan's end stops every server, the one a load started included."""
    from starlette.testclient import TestClient

    from ferrobatch.http import starlette_app
    from ferrobatch.http.protocol import ModelRepository

    servers = models()
    with TestClient(starlette_app(ModelRepository(servers, model_control_mode="explicit"))) as http:
        for method, path, body, status, text in APP_STEPS:
            answer = http.request(method, path, json=body)
            assert (answer.status_code, said(text, answer.text)) == (status, True), answer.text
    assert not any(s.running for s in servers)


async def test_an_aiohttp_app_given_an_explicit_repository_unloads_and_loads() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from ferrobatch.http import aiohttp_app
    from ferrobatch.http.protocol import ModelRepository

    servers = models()
    async with TestClient(TestServer(aiohttp_app(ModelRepository(servers, model_control_mode="explicit")))) as http:
        for method, path, body, status, text in APP_STEPS:
            async with http.request(method, path, json=body) as answer:
                got = await answer.text()
                assert (answer.status, said(text, got)) == (status, True), got
    assert not any(s.running for s in servers)


def failing_at_start() -> tuple[list[fb.Server], list[bool]]:
    """Models ``a`` (its warm-up fails while ``broken[0]``) and ``b``."""
    broken = [True]

    def fragile(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if broken[0]:
            raise RuntimeError("weights missing")
        return {"y": inputs["x"] * 2}

    return models(fn=fragile, warmup=True), broken


def test_with_exit_on_error_off_a_model_that_fails_to_start_is_left_unloaded(frontend: str) -> None:
    servers, broken = failing_at_start()
    with serving(frontend, servers, exit_on_error=False) as listening:
        assert not servers[0].running and servers[1].running
        for client in clients(listening):
            assert not client.is_server_ready()  # strict readiness: a model failed, as in Triton
            assert not client.is_model_ready("a")
            state, reason = index(client)["a"]
            assert state == "UNAVAILABLE" and reason.startswith("failed to start: model 'a' failed: RuntimeError")
            assert "weights missing" not in reason  # the model's words stay in the log (expose_errors)
            assert NO_VERSIONS.format("a") in str(refusal(lambda c=client: infer(c, "a")))
            assert infer(client, "b")[0, 0] == 3.0
        http, grpc_client = clients(listening)
        broken[0] = False
        http.load_model("a")  # explicit mode: tried again
        for client in (http, grpc_client):
            assert client.is_server_ready() and client.is_model_ready("a")
            assert infer(client, "a")[0, 0] == 2.0
    assert not servers[0].running


def test_unloading_a_model_that_failed_to_start_makes_the_server_ready(frontend: str) -> None:
    servers, _ = failing_at_start()
    with serving(frontend, servers, exit_on_error=False) as listening:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}")
        assert not client.is_server_ready()
        client.unload_model("a")  # as Triton's: the failure is forgotten, the model stays unloaded
        assert client.is_server_ready()
        assert index(client)["a"] == ("UNAVAILABLE", "unloaded")


def test_without_strict_readiness_the_server_is_ready_whatever_its_models(frontend: str) -> None:
    servers, _ = failing_at_start()
    with serving(frontend, servers, exit_on_error=False, strict_readiness=False) as listening:
        for client in clients(listening):
            assert client.is_server_ready()
            assert not client.is_model_ready("a")
            assert infer(client, "b")[0, 0] == 3.0


def test_with_exit_on_error_on_a_model_that_fails_to_start_stops_the_start() -> None:
    servers, _ = failing_at_start()
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    with pytest.raises(fb.ModelError), serve_in_thread(servers, config):
        pass
    assert not any(s.running for s in servers)


def test_the_readiness_flags_take_tritons_spellings() -> None:
    from ferrobatch.triton import TritonConfig
    from ferrobatch.triton.triton import serve_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args(["--demo"])
    assert (defaults.exit_on_error, defaults.strict_readiness) == (True, True)
    given = parser.parse_args(["--demo", "--exit-on-error=false", "--strict-readiness", "false"])
    assert (given.exit_on_error, given.strict_readiness) == (False, False)
    assert parser.parse_args(["--demo", "--strict-readiness"]).strict_readiness is True
    made = serve_config(TritonConfig(strict_readiness=False), expose_errors=False, frontend="native")
    assert (made.strict_readiness, made.model_control_mode) == (False, "explicit")
    assert serve_config(TritonConfig(), expose_errors=False, frontend="native").strict_readiness is True


def test_a_model_loaded_again_is_shared_again() -> None:
    """``--share``: a run's shares end with it; a model unloaded and loaded
    again is shared again under its name, and one left unloaded at start is
    shared once loaded."""
    import os

    share = f"fbtest-control-{os.getpid()}"
    with serving("native", models(), share=share, load_models=["a"]) as listening:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}")
        client.unload_model("a")
        client.load_model("a")
        client.load_model("b")
        for name, k in (("a", 2.0), ("b", 3.0)):
            with fb.connect(f"{share}.{name}") as shared:
                out = shared.infer_sync({"x": torch.ones(4)})
            torch.testing.assert_close(out["y"], torch.full((4,), k))


def test_requests_during_unloads_and_loads_each_resolve_once_and_are_counted(frontend: str) -> None:
    """Callers keep inferring while the model is unloaded and loaded again,
    and loaded with a new configuration, again and again: every request gets
    its row or a 503 / UNAVAILABLE refusal (never a 500, never lost), and the
    successes are what ``stats()`` counts."""
    servers = models(max_delay=0.001)
    outcomes: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    with serving(frontend, servers) as listening:

        @gevent_hub_freed()
        def call(make: Any) -> None:
            client = make()
            try:
                for i in range(20_000):  # bounded; until the cycles below are over
                    if done.is_set():
                        break
                    try:
                        got = infer(client, "a", float(i))[0, 0]
                        outcome = "ok" if got == 2.0 * i else f"wrong {got}"
                    except InferenceServerException as exc:
                        status = str(exc.status())
                        outcome = "refused" if status in ("503", "StatusCode.UNAVAILABLE") else f"{status}: {exc}"
                    with lock:
                        outcomes.append(outcome)
            finally:
                client.close()

        makers = [
            lambda: httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}"),
            lambda: grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}"),
        ]
        callers = [threading.Thread(target=call, args=(m,)) for m in makers * 2]
        for caller in callers:
            caller.start()
        control = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}")
        for cycle in range(5):
            time.sleep(0.05)
            control.unload_model("a")
            time.sleep(0.05)
            control.load_model("a")
            time.sleep(0.05)
            # A new configuration while it serves: taken out of service, restarted with it.
            control.load_model("a", config=json.dumps({"max_batch_size": 4 + cycle % 2 * 12}))
        done.set()
        for caller in callers:
            caller.join(60)
        assert not any(c.is_alive() for c in callers)
        unexpected = sorted({o for o in outcomes if o not in ("ok", "refused")})
        assert not unexpected, unexpected
        assert "ok" in outcomes and "refused" in outcomes, (outcomes.count("ok"), outcomes.count("refused"))
        assert wait_until(lambda: succeeded(servers[0]) == outcomes.count("ok"))
