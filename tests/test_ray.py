"""ferrobatch.ray: Ray Serve replicas that batch, and a client that batches
before the hop. One local Ray cluster (127.0.0.1, 2 CPUs, no dashboard) for
the module; skipped where ray is not installed."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import ferrobatch as fb

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
cloudpickle = pytest.importorskip("ray.cloudpickle")

import ferrobatch.ray as fray  # noqa: E402 - after the skip
from ferrobatch.ray._autoscaling import CAPACITY, QUEUE_DEPTH  # noqa: E402
from ferrobatch.ray._deployment import FerrobatchReplica, capacity_warning  # noqa: E402

pytestmark = pytest.mark.ray

# The factories below run in the replicas, which cannot import this test
# module: they travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
# Replicas take no CPU from Ray's count: the 2 CPUs of the machine can then hold
# every replica of the module's deployments at once.
NO_CPU = {"num_cpus": 0}


def double(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = batch["x"]
    if bool(torch.isnan(x).any()):
        raise ValueError("NaN in the batch")
    return {"y": x * 2}


def make_double() -> fb.Server:
    return fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=16, max_delay=0.002, name="double")


def slow_double(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    time.sleep(0.2)
    return {"y": batch["x"] * 2}


def make_slow() -> fb.Server:
    return fb.Server(slow_double, inputs=[X], outputs=[Y], max_batch_size=8, max_delay=0.001, name="slow")


def make_queued() -> fb.Server:
    return fb.Server(slow_double, inputs=[X], outputs=[Y], max_batch_size=4, max_delay=0.001, name="queued")


def make_full() -> fb.Server:
    # Two requests wait at most: a handle call of eight overfills it.
    return fb.Server(slow_double, inputs=[X], outputs=[Y], max_batch_size=8, max_queue_size=2, name="full")


def row(i: float) -> np.ndarray:
    return np.full(4, i, np.float32)


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def v2_body(rows: list[list[float]]) -> bytes:
    flat = [v for r in rows for v in r]
    return json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(rows), 4], "data": flat}]}).encode()


# -- without a cluster ------------------------------------------------------------------


def ctx(depths: dict[str, float], capacities: dict[str, float], running: list[str], target: int = 1) -> Any:
    return SimpleNamespace(
        aggregated_metrics={QUEUE_DEPTH: depths, CAPACITY: capacities},
        running_replicas=running,
        current_num_replicas=len(running),
        target_num_replicas=target,
    )


def test_the_policy_asks_for_replicas_by_queue_depth_against_one_batch_per_instance() -> None:
    policy = fray.QueueDepthPolicy()
    # 128 and 64 waiting, capacity 64 each: three replicas' worth of full batches.
    assert policy(ctx({"a": 128, "b": 64}, {"a": 64, "b": 64}, ["a", "b"]))[0] == pytest.approx(3.0)
    # Nearly idle: less than one replica (Ray clamps to min_replicas).
    assert policy(ctx({"a": 8, "b": 0}, {"a": 64, "b": 64}, ["a", "b"]))[0] == pytest.approx(0.125)
    # An explicit target per replica.
    assert fray.QueueDepthPolicy(32)(ctx({"a": 128}, {"a": 64}, ["a"]))[0] == pytest.approx(4.0)
    # A replica that stopped no longer counts; no report yet keeps the target.
    assert policy(ctx({"a": 64, "gone": 640}, {"a": 64, "gone": 64}, ["a"]))[0] == pytest.approx(1.0)
    assert policy(ctx({}, {}, ["a"], target=3))[0] == 3
    with pytest.raises(ValueError, match="target_queue_depth"):
        fray.QueueDepthPolicy(0)


def test_without_ray_the_import_error_names_the_extra() -> None:
    code = "import sys; sys.modules['ray'] = None; import ferrobatch.ray"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "pip install 'ferrobatch[ray]'" in result.stderr


def test_deployment_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        fray.deployment(make_double, max_ongoing_requests=0)
    with pytest.raises(ValueError, match="not both"):
        fray.deployment(make_double, num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(ValueError, match="target_queue_depth"):
        fray.deployment(make_double, num_replicas="auto", target_queue_depth=-1)
    with pytest.raises(TypeError, match="make_server"):
        fray.deployment("not callable")  # type: ignore[arg-type]


def test_autoscaling_uses_the_queue_depth_policy_within_rays_bounds() -> None:
    def config(app: Any) -> Any:  # what Ray will deploy
        return app._bound_deployment._deployment_config

    auto = config(fray.deployment(make_double, num_replicas="auto", autoscaling_config={"max_replicas": 3}))
    assert (auto.autoscaling_config.min_replicas, auto.autoscaling_config.max_replicas) == (1, 3)
    assert auto.autoscaling_config.policy.policy_function == "ferrobatch.ray._autoscaling.QueueDepthPolicy"
    assert auto.max_ongoing_requests == fray.DEFAULT_MAX_ONGOING_REQUESTS
    assert config(fray.deployment(make_double, num_replicas="auto")).autoscaling_config.max_replicas == 100
    mine = {"policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}
    kept = config(fray.deployment(make_double, autoscaling_config={"max_replicas": 2, "policy": mine}))
    assert kept.autoscaling_config.policy.policy_function == mine["policy_function"]
    fixed = config(fray.deployment(make_double, num_replicas=3, max_ongoing_requests=256))
    assert (fixed.num_replicas, fixed.autoscaling_config, fixed.max_ongoing_requests) == (3, None, 256)


def test_a_max_ongoing_requests_below_a_full_batch_per_instance_is_warned_about() -> None:
    server = fb.Server([double, double], inputs=[X], outputs=[Y], max_batch_size=16)
    warning = capacity_warning(16, server)
    assert warning is not None and "16 x 2 = 32" in warning and "max_ongoing_requests=16" in warning
    assert capacity_warning(32, server) is None


async def test_a_replica_drains_what_it_accepted_when_ray_stops_it() -> None:
    """Ray calls the destructor once its own drain is done; requests still
    inside ferrobatch then run to the end instead of failing."""
    replica = FerrobatchReplica.__new__(FerrobatchReplica)
    with pytest.warns(RuntimeWarning, match="batches cannot fill"):
        await replica.__init__(make_slow, 4)
    calls = [asyncio.create_task(replica.infer({"x": row(i)})) for i in range(12)]
    await asyncio.sleep(0.05)  # the first batch runs, the rest wait
    stopping = replica.__del__()  # what Ray awaits
    assert stopping is not None
    await stopping
    assert replica.__del__() is None  # stopped: nothing left to await
    outs = await asyncio.gather(*calls)
    assert [float(o["y"][0]) for o in outs] == [2.0 * i for i in range(12)]
    with pytest.raises(fb.ServerClosedError):
        await replica.infer({"x": row(1)})
    with pytest.raises(RuntimeError, match="not running"):
        await replica.check_health()


# -- on a local cluster -----------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def cluster(ray_session: Any) -> Iterator[int]:
    """Serve on the run's Ray cluster, on 127.0.0.1; yields the HTTP proxy's port."""
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def double_app(cluster: int) -> Any:
    app = fray.deployment(make_double, name="double", ray_actor_options=NO_CPU, max_body_size=1 << 20)
    return serve.run(app, name="double", route_prefix="/")


@pytest.fixture(scope="module")
def slow_app(cluster: int) -> Any:
    # max_ongoing_requests below max_batch_size: the replica warns.
    app = fray.deployment(make_slow, name="slow", ray_actor_options=NO_CPU, max_ongoing_requests=4)
    return serve.run(app, name="slow", route_prefix="/slow")


async def test_handle_calls_are_batched_in_the_replica(double_app: Any) -> None:
    before = await double_app.stats.remote()
    outs = await asyncio.gather(*(double_app.infer.remote({"x": row(i)}) for i in range(200)))
    assert [o["y"].tolist() for o in outs] == [[2.0 * i] * 4 for i in range(200)]
    assert isinstance(outs[0]["y"], np.ndarray)
    after = await double_app.stats.remote()
    assert after["requests_succeeded"] - before["requests_succeeded"] == 200
    batches = after["batches"] - before["batches"]
    assert batches < 200, "200 concurrent handle calls ran as 200 batches"
    description = await double_app.describe.remote()
    assert description["inputs"] == [X] and description["max_batch_size"] == 16
    assert description["max_ongoing_requests"] == fray.DEFAULT_MAX_ONGOING_REQUESTS
    assert description["warnings"] == []


async def test_handle_errors_are_ferrobatchs_errors(double_app: Any) -> None:
    with pytest.raises(fb.InvalidInputError, match="x"):
        await double_app.infer.remote({"x": np.zeros(5, np.float32)})
    with pytest.raises(fb.ModelError):
        await double_app.infer.remote({"x": row(float("nan"))})
    out = await double_app.infer.remote({"x": row(3)})  # the replica is unharmed
    assert out["y"].tolist() == [6.0] * 4


def test_http_v2_infer_through_rays_proxy(cluster: int, double_app: Any) -> None:
    base = f"http://127.0.0.1:{cluster}"
    status, document = post(f"{base}/v2/models/double/infer", v2_body([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert status == 200, document
    assert document["model_name"] == "double"
    assert document["outputs"][0]["shape"] == [2, 4]
    assert document["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0]
    with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=30) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{base}/v2/models/double", timeout=30) as response:
        assert json.loads(response.read())["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
    status, document = post(f"{base}/v2/models/double/infer", v2_body([[1, 2, 3]]))
    assert status == 400 and "x" in document["error"]
    status, document = post(f"{base}/v2/models/nope/infer", v2_body([[1, 2, 3, 4]]))
    assert 400 <= status < 500 and "nope" in document["error"]
    status, document = post(f"{base}/v2/models/double/infer", b"{" + b" " * (2 << 20) + b"}")
    assert status == 413 and "limit" in document["error"]


async def test_the_client_batches_before_the_hop(double_app: Any) -> None:
    before = await double_app.stats.remote()
    async with fray.client(double_app, batches_in_flight=2) as client:
        outs = await asyncio.gather(*(client.infer({"x": row(i)}) for i in range(256)))
        assert [o["y"].tolist() for o in outs] == [[2.0 * i] * 4 for i in range(256)]
        assert isinstance(outs[0]["y"], torch.Tensor)
        calls = client.stats()["batches"]
        assert client.stats()["requests_succeeded"] == 256
        assert calls <= 256 // 4, f"{calls} handle calls for 256 requests"
        assert client.stats()["mean_batch_size"] <= 16  # never more than the replica's max_batch_size
    after = await double_app.stats.remote()
    # Plain rows of fixed shapes cross stacked, one request per handle call in the replica.
    assert after["requests_succeeded"] - before["requests_succeeded"] == calls
    assert after["rows"] - before["rows"] == 256


def test_the_clients_infer_sync_serves_threads(double_app: Any) -> None:
    client = fray.client(double_app)
    results: dict[int, list[float]] = {}

    def caller(k: int) -> None:
        for i in range(10):
            results[k * 10 + i] = client.infer_sync({"x": row(k * 10 + i)})["y"].tolist()

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert results == {i: [2.0 * i] * 4 for i in range(80)}
        assert client.stats()["batches"] < 80
    finally:
        client.close()
    with pytest.raises(fb.ServerClosedError):
        client.infer_sync({"x": row(1)})


def tokens_and_words(batch: dict[str, Any], requests: list[fb.RequestInfo]) -> dict[str, Any]:
    """Each row's tokens times its request's ``scale`` parameter (own length),
    its text split into words (own count), and the priority it waited at."""
    scale = torch.tensor([float(r.parameters.get("scale", 1)) for r in requests for _ in range(r.rows)])
    priority = torch.tensor([r.priority for r in requests for _ in range(r.rows)], dtype=torch.int64)
    words = [row[0].split() for row in batch["text"]]
    padded = np.full((len(words), max(len(w) for w in words)), b"", dtype=object)
    for i, w in enumerate(words):
        padded[i, : len(w)] = w
    return {
        "scaled": batch["tokens"] * scale[:, None],
        "scaled_lengths": batch["tokens_lengths"],
        "words": padded,
        "words_lengths": torch.tensor([len(w) for w in words], dtype=torch.int64),
        "priority": priority,
    }


def make_tokens() -> fb.Server:
    return fb.Server(
        tokens_and_words,
        inputs=[fb.TensorSpec("tokens", "float32", (-1,), ragged="pad"), fb.TensorSpec("text", "bytes", (1,))],
        outputs=[
            fb.TensorSpec("scaled", "float32", (-1,), ragged="pad", pad_value=-1),
            fb.TensorSpec("words", "bytes", (-1,), ragged="pad"),
            fb.TensorSpec("priority", "int64", ()),
        ],
        max_batch_size=16,
        max_delay=0.005,
        priority_levels=2,
        default_priority=2,
        with_requests=True,
        name="tokens",
    )


async def test_the_client_carries_bytes_lengths_priority_and_parameters(cluster: int) -> None:
    app = serve.run(
        fray.deployment(make_tokens, name="tokens", ray_actor_options=NO_CPU), name="tokens", route_prefix="/tokens"
    )
    texts = [b"a", b"b c", b"d e f", b"g h i j"]
    async with fray.client(app, max_delay=0.02) as client:
        singles = await asyncio.gather(
            *(
                client.infer(
                    {"tokens": torch.arange(1.0, n + 2), "text": np.array([texts[n]], dtype=object)},
                    parameters={"scale": n + 1},
                    priority=1 if n % 2 else None,
                )
                for n in range(4)
            )
        )
        pair = await client.infer_batch(
            {"tokens": torch.ones(2, 3), "text": np.array([[b"x y"], [b"z"]], dtype=object)},
            parameters={"scale": 5},
        )
        assert client.stats()["batches"] < 5, "the requests crossed in fewer handle calls"
    for n, out in enumerate(singles):
        assert out["scaled"].tolist() == [float(k * (n + 1)) for k in range(1, n + 2)], n
        assert out["words"].tolist() == texts[n].split(), n
        assert int(out["priority"]) == (1 if n % 2 else 2), n
    assert pair["scaled"].tolist() == [[5.0] * 3] * 2
    assert pair["words"].tolist() == [[b"x", b"y"], [b"z", b""]]
    assert pair["priority"].tolist() == [2, 2]


async def test_a_sample_the_replica_fails_fails_alone_across_the_hop(double_app: Any) -> None:
    async with fray.client(double_app, max_delay=0.05) as client:
        calls = [client.infer({"x": row(float("nan") if i == 5 else i)}) for i in range(16)]
        outs = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(outs[5], fb.ModelError)
    assert all(not isinstance(o, BaseException) and o["y"][0] == 2.0 * i for i, o in enumerate(outs) if i != 5)


async def test_a_request_the_replica_refuses_gets_its_error_once_and_is_not_sent_again(cluster: int) -> None:
    app = fray.deployment(make_full, name="full", ray_actor_options=NO_CPU)
    handle = serve.run(app, name="full", route_prefix=None)
    try:
        async with fray.client(handle, max_delay=0.05) as client:
            # Parameters keep each request an item of its own in the replica.
            calls = [client.infer({"x": row(i)}, parameters={"i": i}) for i in range(8)]
            outs = await asyncio.gather(*calls, return_exceptions=True)
            local = client.stats()
        replica = await handle.stats.remote()
    finally:
        serve.delete("full")
    refused = [i for i, o in enumerate(outs) if isinstance(o, fb.QueueFullError)]
    assert refused, outs
    for i, out in enumerate(outs):
        assert i in refused or out["y"].tolist() == [2.0 * i] * 4, (i, out)
    assert local["requests_failed"]["queue_full"] == len(refused)
    assert local["requests_failed"]["model_error"] == 0 and local["requests_succeeded"] == 8 - len(refused)
    assert local["retry_calls"] == 0 and local["batches"] == 1
    # The replica saw each request once: a refusal is not sent again.
    assert replica["requests_failed"]["queue_full"] == len(refused)
    assert replica["requests_succeeded"] == 8 - len(refused)


def test_http_routes_live_under_the_applications_route_prefix(cluster: int, slow_app: Any) -> None:
    base = f"http://127.0.0.1:{cluster}/slow"
    with urllib.request.urlopen(f"{base}/v2/health/ready", timeout=30) as response:
        assert response.status == 200
    with urllib.request.urlopen(f"{base}/v2/models/slow", timeout=30) as response:
        assert json.loads(response.read())["name"] == "slow"
    status, document = post(f"{base}/v2/models/slow/infer", v2_body([[1, 1, 1, 1]]))
    assert status == 200 and document["outputs"][0]["data"] == [2.0] * 4


async def test_the_client_keeps_timeouts_and_cancellation(slow_app: Any) -> None:
    description = await slow_app.describe.remote()
    assert any("batches cannot fill" in w for w in description["warnings"])
    async with fray.client(slow_app, batches_in_flight=1) as client:
        busy = asyncio.create_task(client.infer({"x": row(1)}))  # the one batch in flight: 0.2 s
        deadline = time.monotonic() + 10
        while client.stats()["batches"] < 1:  # the local worker took it and is waiting for the replica
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)
        with pytest.raises(fb.DeadlineExceededError):
            await client.infer({"x": row(2)}, timeout=0.05)
        assert not busy.done()  # the deadline did not wait for the call in flight
        cancelled = asyncio.create_task(client.infer({"x": row(3)}))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert (await busy)["y"].tolist() == [2.0] * 4
        stats = client.stats()
        assert stats["requests_failed"]["deadline_exceeded"] == 1
        assert stats["requests_failed"]["cancelled"] == 1
        assert stats["rows"] == 1  # neither went over the hop


@pytest.mark.filterwarnings("ignore:The `metrics_interval_s`:DeprecationWarning")
def test_replicas_scale_on_ferrobatchs_queue_depth(cluster: int) -> None:
    app = fray.deployment(
        make_queued,
        name="queued",
        ray_actor_options=NO_CPU,
        max_ongoing_requests=64,
        autoscaling_config={
            "min_replicas": 1,
            "max_replicas": 2,
            "upscale_delay_s": 0,
            "look_back_period_s": 1.0,
            # Replicas report every 0.5 s instead of 10 (Ray deprecates the field
            # for an environment variable it does not read yet).
            "metrics_interval_s": 0.5,
        },
    )
    handle = serve.run(app, name="queued", route_prefix=None)
    try:
        # 64 requests in a replica running batches of 4 every 0.2 s: its queue
        # holds about 60, 15 batches' worth; the policy asks for more replicas.
        responses = [handle.infer.remote({"x": row(i)}) for i in range(64)]
        deadline = time.monotonic() + 30
        replicas = 1
        while time.monotonic() < deadline:
            status = serve.status().applications["queued"].deployments["queued"]
            replicas = status.replica_states.get("RUNNING", 0)
            if replicas == 2:
                break
            time.sleep(0.2)
        assert replicas == 2, f"still {replicas} replica(s) after 30 s"
        assert [r.result(timeout_s=60)["y"][0] for r in responses] == [2.0 * i for i in range(64)]
        # Both replicas answer now (once the handle's router has heard of the new one).
        pids: set[int] = set()
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            pids.add(handle.describe.remote().result(timeout_s=30)["pid"])
        assert len(pids) == 2
    finally:
        serve.delete("queued")


def test_an_application_deleted_under_load_answers_what_its_replica_accepted(slow_app: Any) -> None:
    # slow_app's replica takes at most max_ongoing_requests=4 at once.
    responses = [slow_app.infer.remote({"x": row(i)}) for i in range(4)]
    time.sleep(0.1)
    serve.delete("slow")
    assert [r.result(timeout_s=30)["y"][0] for r in responses] == [0.0, 2.0, 4.0, 6.0]


def optional_offset(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    """y = 2x + w; per row, whether its request left w out (as the replica saw it)."""
    absent = [int("w" in r.absent) for r in requests for _ in range(r.rows)]
    return {"y": batch["x"] * 2 + batch["w"], "absent": torch.tensor(absent, dtype=torch.int64)}


def make_optional() -> fb.Server:
    return fb.Server(
        optional_offset,
        inputs=[X, fb.TensorSpec("w", "float32", (4,), optional=True)],
        outputs=[Y, fb.TensorSpec("absent", "int64", ())],
        max_batch_size=8,
        max_delay=0.005,
        with_requests=True,
        name="optional",
    )


def one_sample(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if inputs["x"].shape != (1, 4):  # in process, a batching=False model sees one request, one row
        raise ValueError(f"a batching=False model got {tuple(inputs['x'].shape)}")
    return {"y": inputs["x"] + 1}


def make_unbatched() -> fb.Server:
    return fb.Server(one_sample, inputs=[X], outputs=[Y], batching=False, name="unbatched")


async def test_the_client_carries_optional_inputs_and_models_without_batching(cluster: int) -> None:
    optional = serve.run(
        fray.deployment(make_optional, name="optional", ray_actor_options=NO_CPU),
        name="optional",
        route_prefix="/optional",
    )
    unbatched = serve.run(
        fray.deployment(make_unbatched, name="unbatched", ray_actor_options=NO_CPU),
        name="unbatched",
        route_prefix="/unbatched",
    )
    async with fray.client(optional, max_delay=0.02) as client:
        outs = await asyncio.gather(
            *(client.infer({"x": row(i), **({"w": row(10)} if i % 2 else {})}) for i in range(6))
        )
    for i, out in enumerate(outs):
        assert out["y"].tolist() == [2.0 * i + (10 if i % 2 else 0)] * 4, i
        assert int(out["absent"]) == (0 if i % 2 else 1), i  # the replica saw w left out, not zeros given
    async with fray.client(unbatched) as client:
        assert not client.description["batching"]
        outs = await asyncio.gather(*(client.infer({"x": row(i)}) for i in range(3)))
    assert [out["y"].tolist() for out in outs] == [[i + 1.0] * 4 for i in range(3)]


def steps(batch: dict[str, torch.Tensor]) -> Any:
    """A decoupled model: three responses, ``x + i``."""
    for i in range(3):
        yield {"y": batch["x"] + i}


def endless_steps(batch: dict[str, torch.Tensor]) -> Any:
    while True:
        time.sleep(0.005)
        yield {"y": batch["x"]}


def make_steps() -> fb.Server:
    return fb.Server(steps, inputs=[X], outputs=[Y], decoupled=True, max_delay=0.01, name="steps")


def make_endless() -> fb.Server:
    return fb.Server(endless_steps, inputs=[X], outputs=[Y], decoupled=True, name="endless")


async def test_the_client_streams_a_decoupled_deployment_and_leaving_cancels(cluster: int) -> None:
    app = serve.run(
        fray.deployment(make_steps, name="steps", ray_actor_options=NO_CPU), name="steps", route_prefix="/steps"
    )
    endless = serve.run(
        fray.deployment(make_endless, name="endless", ray_actor_options=NO_CPU),
        name="endless",
        route_prefix="/endless",
    )
    client = fray.client(app)

    async def one(k: int) -> list[list[float]]:
        return [out["y"].tolist() async for out in client.stream({"x": row(k)})]

    got = await asyncio.gather(*(one(k) for k in range(4)))
    assert got == [[[float(k + i)] * 4 for i in range(3)] for k in range(4)]
    pair = [out["y"].shape async for out in client.stream_batch({"x": torch.ones(2, 4)})]
    assert pair == [torch.Size([2, 4])] * 3
    stats = await app.stats.remote()
    assert stats["requests_succeeded"] == 5 and stats["batches"] < 5
    assert (await app.describe.remote())["decoupled"]
    seen = 0
    async for _ in fray.client(endless).stream({"x": row(1)}):
        seen += 1
        if seen == 3:
            break
    deadline = time.monotonic() + 20
    while (await endless.stats.remote())["requests_failed"]["cancelled"] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await endless.stats.remote())["requests_failed"]["cancelled"] == 1, "leaving early cancelled it"


def read_marker(value: float) -> str:
    """The file the test makes once it has read the response to ``value``."""
    return os.path.join(tempfile.gettempdir(), f"ferrobatch-test-diesmid-{int(value)}")


def dies_mid_stream(batch: dict[str, torch.Tensor]) -> Any:
    """One response, then, once the test has read it, its replica's process ends."""
    yield {"y": batch["x"]}
    marker = read_marker(float(batch["x"][0, 0]))
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    os._exit(17)


def make_dies_mid_stream() -> fb.Server:
    return fb.Server(dies_mid_stream, inputs=[X], outputs=[Y], decoupled=True, name="diesmid")


async def test_a_streams_deadline_dead_replica_and_closed_client_end_it_with_ferrobatchs_errors(cluster: int) -> None:
    """A stream's timeout bounds it while Ray still holds the call (the
    replica busy), a replica that dies mid-stream is a ModelError, and a
    closed client refuses to stream, as it refuses infer."""
    busy = serve.run(
        fray.deployment(make_endless, name="busy", ray_actor_options=NO_CPU, max_ongoing_requests=1),
        name="busy",
        route_prefix=None,
    )
    client = fray.client(busy)
    holder = client.stream({"x": row(1)})
    await holder.__anext__()  # the replica's one call is this endless stream
    began = time.monotonic()
    with pytest.raises(fb.DeadlineExceededError):
        async for _ in client.stream({"x": row(2)}, timeout=0.5):
            pass
    assert time.monotonic() - began < 5
    await holder.aclose()
    client.close()
    with pytest.raises(fb.ServerClosedError):
        async for _ in client.stream({"x": row(3)}):
            pass
    dying = serve.run(
        fray.deployment(make_dies_mid_stream, name="diesmid", ray_actor_options=NO_CPU),
        name="diesmid",
        route_prefix=None,
    )
    got = []
    value = float(random.randrange(1, 1 << 20))  # names its marker file: runs side by side do not meet
    with pytest.raises(fb.ModelError) as raised:
        async for out in fray.client(dying).stream({"x": row(value)}):
            got.append(out["y"].tolist())
            with open(read_marker(value), "w"):
                pass
    if os.path.exists(read_marker(value)):
        os.unlink(read_marker(value))
    assert got == [[value] * 4] and isinstance(raised.value.__cause__, ray.exceptions.RayError)
    serve.delete("busy")
    serve.delete("diesmid")


async def test_a_client_whose_deployment_is_gone_fails_its_first_request_in_time(cluster: int) -> None:
    """Its first request waits for the deployment to describe itself, within
    the request's timeout, and close() is not held up by that wait. Ray
    either keeps the call waiting (DeadlineExceededError) or, once its
    router has heard of the deletion, refuses it at once
    (DeploymentUnavailableError, told as ServerClosedError): which one
    depends on how far the deletion has spread."""
    app = serve.run(fray.deployment(make_double, name="gone", ray_actor_options=NO_CPU), name="gone", route_prefix=None)
    client = fray.client(app, call_timeout=1.0)
    serve.delete("gone")
    began = time.monotonic()
    with pytest.raises((fb.DeadlineExceededError, fb.ServerClosedError)):
        await client.infer({"x": row(1)}, timeout=0.5)
    assert time.monotonic() - began < 3
    closing = asyncio.get_running_loop().run_in_executor(None, client.close)
    await asyncio.wait_for(closing, 5)
    with pytest.raises(fb.ServerClosedError):
        await client.infer({"x": row(1)})


async def test_the_torchrl_mailbox_tells_a_sender_the_queue_is_full_and_keeps_answers_across_a_restart() -> None:
    """RayTransport's control channel, driven as its actor would be: a
    sender never waits inside it (a thousand waiting would leave the server
    no call to make room with), a closed one queues nothing, and the
    answers sent as it closed are still there once it opens again."""
    from ferrobatch.ray._mailbox import _Mailbox

    box = _Mailbox(1)
    assert await box.put("a", "first") is True
    assert await box.put("b", "second") is None  # full: send again later
    assert await box.take(10, 0.1) == [("a", "first")]
    assert await box.put("b", "second") is True
    left = await box.close()
    assert left == [("b", "second")]
    assert await box.put("c", "late") is False
    await box.answer("b", ("rid", False, "closed"))
    await box.reopen()
    assert await box.answers("b", 0.1) == [("rid", False, "closed")]
    assert await box.take(10, 0) == []


CALL = fb.TensorSpec("call", "int64", ())
#: Model calls made in this replica's process.
_CALLS = itertools.count()


def counted(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``y = 2x``, and which of the process's model calls computed it."""
    x = batch["x"]
    return {"y": x * 2, "call": torch.full((len(x),), next(_CALLS), dtype=torch.int64)}


def make_cached() -> fb.Server:
    return fb.Server(counted, inputs=[X], outputs=[Y, CALL], response_cache=1 << 20, name="cached")


async def test_the_replicas_response_cache_answers_repeated_inputs_across_the_hop(cluster: int) -> None:
    app = serve.run(
        fray.deployment(make_cached, name="cached", ray_actor_options=NO_CPU), name="cached", route_prefix="/cached"
    )
    async with fray.client(app) as client:
        first = await client.infer({"x": row(1)})
        again = await client.infer({"x": row(1)})
        other = await client.infer({"x": row(2)})
    assert again["y"].tolist() == first["y"].tolist() == [2.0] * 4
    assert int(again["call"]) == int(first["call"]), "the replica ran the model again"
    assert int(other["call"]) != int(first["call"]) and other["y"].tolist() == [4.0] * 4
