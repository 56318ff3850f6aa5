"""The response cache (``Server(response_cache=...)``): a request whose
inputs match a kept result's is answered with it and never runs; what is
kept, when it is dropped, and what ``stats()`` says. Every way in is
crossed in tests/test_matrix.py."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from conftest import gevent_hub_freed

import ferrobatch as fb

X = [fb.TensorSpec("x", "float32", (4,))]
Y = [fb.TensorSpec("y", "float32", (4,))]


class Counting:
    """y = scale * x, counting the rows it ran."""

    def __init__(self, scale: float = 2.0) -> None:
        self.scale = scale
        self.rows: list[float] = []

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.rows.extend(batch["x"][:, 0].tolist())
        return {"y": batch["x"] * self.scale}


class HoldsOnNine:
    """y = 2 * x; a batch with a nine in it holds its instance (``started``
    set) until ``release`` is set."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((batch["x"] == 9).any()):
            self.started.set()
            self.release.wait(30)
        return {"y": batch["x"] * 2}


def row(v: float) -> dict[str, torch.Tensor]:
    return {"x": torch.full((4,), float(v))}


async def test_a_hit_never_runs_and_stats_count_it() -> None:
    model = Counting()
    server = fb.Server(model, inputs=X, outputs=Y, response_cache=1 << 20, max_delay=0)
    async with server:
        client = server.client()
        first = await client.infer(row(1))
        again = await client.infer(row(1))
        other = await client.infer(row(2))
        many = await asyncio.gather(*(client.infer(row(i % 2 + 1)) for i in range(20)))
        stats = server.stats()
    assert model.rows == [1.0, 2.0]
    assert torch.equal(first["y"], again["y"]) and torch.equal(again["y"], torch.full((4,), 2.0))
    assert torch.equal(other["y"], torch.full((4,), 4.0))
    assert all(torch.equal(m["y"], torch.full((4,), 2.0 * (i % 2 + 1))) for i, m in enumerate(many))
    assert (stats["cache_hits"], stats["cache_misses"]) == (21, 2)
    assert stats["requests_succeeded"] == 23, "hits are answered requests"
    assert (stats["batches"], stats["rows"]) == (2, 2), "hits are in no batch"
    kept = server.response_cache
    assert kept is not None and kept.stats()["entries"] == 2


async def test_without_a_cache_every_request_runs() -> None:
    model = Counting()
    async with fb.Server(model, inputs=X, outputs=Y) as server:
        for _ in range(3):
            await server.client().infer(row(1))
        assert server.stats()["cache_hits"] == 0
    assert model.rows == [1.0] * 3


async def test_one_cache_serves_two_models_each_its_own_results() -> None:
    shared = fb.ResponseCache(1 << 20)
    double, triple = Counting(2.0), Counting(3.0)
    a = fb.Server(double, inputs=X, outputs=Y, name="a", response_cache=shared)
    b = fb.Server(triple, inputs=X, outputs=Y, name="b", response_cache=shared)
    async with a, b:
        for _ in range(2):
            assert (await a.client().infer(row(1)))["y"][0] == 2.0
            assert (await b.client().infer(row(1)))["y"][0] == 3.0
    assert double.rows == [1.0] and triple.rows == [1.0]
    assert shared.stats()["entries"] == 2


async def test_the_cache_stays_within_its_bytes_and_drops_the_least_recently_used() -> None:
    model = Counting()
    server = fb.Server(model, inputs=X, outputs=Y, response_cache=1000, max_delay=0)
    kept = server.response_cache
    assert kept is not None
    async with server:
        client = server.client()
        for v in range(10):
            await client.infer(row(v))
            stats = kept.stats()
            assert stats["bytes"] <= stats["max_bytes"] == 1000
        assert 0 < kept.stats()["entries"] < 10 and kept.stats()["evictions"] > 0
        ran = len(model.rows)
        await client.infer(row(9))  # the most recent: kept
        assert len(model.rows) == ran
        await client.infer(row(0))  # the least recent: dropped, runs again
        assert model.rows[ran:] == [0.0]


async def test_a_result_larger_than_the_cache_is_not_kept() -> None:
    model = Counting()
    server = fb.Server(model, inputs=X, outputs=Y, response_cache=64)
    async with server:
        for _ in range(2):
            await server.client().infer(row(1))
    assert model.rows == [1.0, 1.0]
    assert server.response_cache is not None and server.response_cache.stats()["too_large"] == 2


async def test_a_weight_update_drops_the_results_of_the_old_weights() -> None:
    linear = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.eye_(linear.weight)
    calls: list[int] = []

    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(len(batch["x"]))
        return {"y": linear(batch["x"])}

    server = fb.Server(model, inputs=X, outputs=Y, response_cache=1 << 20)
    async with server:
        client = server.client()
        assert (await client.infer(row(1)))["y"].tolist() == [1.0] * 4
        assert (await client.infer(row(1)))["y"].tolist() == [1.0] * 4
        assert len(calls) == 1
        await server.update_weights(lambda _: linear.weight.data.mul_(2))
        assert (await client.infer(row(1)))["y"].tolist() == [2.0] * 4, "an old result answered"
        assert len(calls) == 2
        assert (await client.infer(row(1)))["y"].tolist() == [2.0] * 4
        assert len(calls) == 2, "the new weights' result is kept"


async def test_failures_are_not_kept() -> None:
    calls: list[int] = []

    def flaky(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(len(batch["x"]))
        if len(calls) == 1:
            raise RuntimeError("first call fails")
        return {"y": batch["x"]}

    async with fb.Server(flaky, inputs=X, outputs=Y, response_cache=1 << 20) as server:
        with pytest.raises(fb.ModelError):
            await server.client().infer(row(1))
        for _ in range(2):
            assert (await server.client().infer(row(1)))["y"].tolist() == [1.0] * 4
    assert len(calls) == 2


async def test_parameters_are_part_of_the_key_for_a_model_that_reads_them() -> None:
    seen: list[Any] = []

    def model(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        seen.extend(r.parameters.get("k") for r in requests)
        return {"y": batch["x"]}

    server = fb.Server(model, inputs=X, outputs=Y, with_requests=True, response_cache=1 << 20)
    async with server:
        client = server.client()
        for k in ("a", "a", "b", None, None):
            await client.infer(row(1), parameters=None if k is None else {"k": k})
    assert seen == ["a", "b", None]


async def test_kept_results_outlive_a_restart() -> None:
    model = Counting()
    server = fb.Server(model, inputs=X, outputs=Y, response_cache=1 << 20)
    async with server:
        await server.client().infer(row(1))
    async with server:
        assert (await server.client().infer(row(1)))["y"][0] == 2.0
        assert server.stats()["cache_hits"] == 1
    assert model.rows == [1.0]


def test_bad_settings_are_refused() -> None:
    for bad in (0, -1, True, 1.5, "1MB"):
        with pytest.raises(ValueError, match="response_cache"):
            fb.Server(Counting(), inputs=X, outputs=Y, response_cache=bad)  # type: ignore[arg-type]
    for bad_size in (0, -1, True, 1.5, 2**64):
        with pytest.raises(ValueError, match="max_bytes"):
            fb.ResponseCache(bad_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decoupled"):
        fb.Server(Counting(), inputs=X, outputs=Y, response_cache=1 << 20, decoupled=True)


def test_pytritons_response_cache_with_the_local_cache_of_triton_config(caplog: pytest.LogCaptureFixture) -> None:
    """``ModelConfig(response_cache=True)`` with ``TritonConfig(cache_config=
    ["local,size=N"])``: every such model keeps results in the one cache;
    without a cache configured it is served uncached, with a warning; a
    cache other than Triton's local one, or no size, is refused."""
    import logging

    import numpy as np

    from ferrobatch.triton import ModelConfig, Tensor, Triton, TritonConfig
    from ferrobatch.triton.client import ModelClient
    from ferrobatch.triton.exceptions import PyTritonValidationError

    calls: list[int] = []

    def add_one(requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        calls.append(len(requests))
        return [{"y": r["x"] + 1} for r in requests]

    tensors = ([Tensor(name="x", dtype=np.float32, shape=(-1,))], [Tensor(name="y", dtype=np.float32, shape=(-1,))])
    config = TritonConfig(http_port=0, grpc_port=0, metrics_port=0, cache_config=[f"local,size={1 << 20}"])
    with Triton(config=config) as triton:
        triton.bind("a", add_one, *tensors, config=ModelConfig(max_batch_size=16, response_cache=True))
        triton.bind("b", add_one, *tensors, config=ModelConfig(max_batch_size=16, response_cache=True))
        triton.bind("plain", add_one, *tensors, config=ModelConfig(max_batch_size=16))
        a, b, plain = triton.servers
        assert a.response_cache is b.response_cache is not None and plain.response_cache is None
        triton.run()
        batch = np.ones((16, 3), np.float32)
        for url in (f"http://127.0.0.1:{triton.http_port}", f"grpc://127.0.0.1:{triton.grpc_port}"):
            with ModelClient(url, "a") as client:
                for _ in range(3):
                    np.testing.assert_array_equal(client.infer_batch(batch)["y"], batch + 1)
        with ModelClient(f"http://127.0.0.1:{triton.http_port}", "plain") as client:
            for _ in range(2):
                client.infer_batch(batch)
        assert calls == [1, 1, 1], calls  # "a" once (then 5 hits), "plain" twice
        assert a.stats()["cache_hits"] == 5 and a.stats()["cache_misses"] == 1

    uncached = Triton(config=TritonConfig(http_port=0, grpc_port=0))
    with caplog.at_level(logging.WARNING, logger="ferrobatch.triton"):
        uncached.bind("c", add_one, *tensors, config=ModelConfig(response_cache=True))
    assert "response_cache=True needs a cache" in caplog.text
    assert uncached.servers[0].response_cache is None
    # As the environment splits it: ["local", "size=N"].
    split = Triton(config=TritonConfig(http_port=0, grpc_port=0, cache_config=["local", "size=4096"]))
    split.bind("d", add_one, *tensors, config=ModelConfig(response_cache=True))
    assert split.servers[0].response_cache is not None and split.servers[0].response_cache.max_bytes == 4096
    for bad in (["redis,host=x"], ["local"], ["local,size=0"], ["local,size=big"]):
        with pytest.raises(PyTritonValidationError, match="cache_config"):
            Triton(config=TritonConfig(http_port=0, grpc_port=0, cache_config=bad))


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_statistics_and_metrics_count_hits_as_triton_does(frontend: str) -> None:
    """Over HTTP: the statistics extension's ``cache_hit``/``cache_miss``
    counts, hits in ``success`` but not in ``queue`` or ``compute_infer``;
    ``nv_cache_num_hits_per_model`` and ``..._misses_...`` in ``/metrics``."""
    import re
    import urllib.request

    import numpy as np
    import tritonclient.http as httpclient

    from ferrobatch.serve import ServeConfig, serve_in_thread

    server = fb.Server(Counting(), inputs=X, outputs=Y, name="m", response_cache=1 << 20)
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")  # type: ignore[arg-type]
    with serve_in_thread([server], config) as served:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}")
        tensor = httpclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        for _ in range(3):
            assert client.infer("m", [tensor]).as_numpy("y").tolist() == [[2.0] * 4]
        (stats,) = client.get_inference_statistics("m")["model_stats"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/metrics", timeout=10).read().decode()
        client.close()
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 3
    assert inference["cache_hit"]["count"] == 2 and inference["cache_miss"]["count"] == 1
    assert inference["queue"]["count"] == inference["compute_infer"]["count"] == 1
    assert stats["inference_count"] == stats["execution_count"] == 1
    hits = re.search(r'nv_cache_num_hits_per_model\{model="m",version="1"\} (\S+)', text)
    misses = re.search(r'nv_cache_num_misses_per_model\{model="m",version="1"\} (\S+)', text)
    assert hits and float(hits.group(1)) == 2 and misses and float(misses.group(1)) == 1, text


@pytest.mark.parametrize("kind", ["fixed", "ragged"])
async def test_a_small_cache_turning_over_under_two_instances_never_stalls(kind: str) -> None:
    """Two instances keep results into a cache that evicts on every insert
    while the event loop reads its stats: each value is dropped outside the
    cache's lock (a Python object's drop may wait for the GIL, and a thread
    holding the GIL may wait for the lock)."""

    def fixed(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": batch["x"] * 2}

    def ragged(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        x = batch["x"]
        return {"y": x * 2, "z": x[:, :2].clone(), "z_lengths": torch.full((len(x),), 2)}

    outputs = [*Y, fb.TensorSpec("z", "float32", (-1,), ragged="pad")] if kind == "ragged" else Y
    model = fixed if kind == "fixed" else ragged
    server = fb.Server([model, model], inputs=X, outputs=outputs, response_cache=4096, max_delay=0)
    cache = server.response_cache
    assert cache is not None
    async with server:
        client = server.client()

        async def caller(i: int) -> None:
            for n in range(300):
                out = await client.infer(row(i * 1000 + n))
                assert out["y"][0] == 2.0 * (i * 1000 + n)
                cache.stats()

        await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(16))), 60)
    assert cache.stats()["evictions"] > 0 and cache.stats()["bytes"] <= 4096


async def test_a_caller_writing_into_its_answer_changes_no_kept_result() -> None:
    """Every output kind, variable-length ones included (a row of which is
    a view): what a hit's caller gets shares no memory with the cache."""

    def model(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        x = batch["x"]
        return {"y": x * 2, "z": x[:, :3].clone(), "z_lengths": torch.full((len(x),), 3)}

    outputs = [*Y, fb.TensorSpec("z", "float32", (-1,), ragged="pad")]
    async with fb.Server(model, inputs=X, outputs=outputs, response_cache=1 << 20) as server:
        client = server.client()
        for _ in range(3):  # a miss, then hits: each caller writes into what it got
            got = await client.infer(row(1))
            assert got["y"].tolist() == [2.0] * 4 and got["z"].tolist() == [1.0] * 3
            got["y"] += 100
            got["z"] += 100
        assert server.stats()["cache_hits"] == 2


async def test_a_model_told_the_priority_keeps_a_result_per_level() -> None:
    def model(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        levels = torch.tensor([float(r.priority) for r in requests for _ in range(r.rows)])
        return {"y": batch["x"] * levels[:, None]}

    server = fb.Server(
        model, inputs=X, outputs=Y, with_requests=True, priority_levels=3, response_cache=1 << 20, max_delay=0
    )
    async with server:
        client = server.client()
        for level in (1, 3, 2, 1, 3):
            assert (await client.infer(row(1), priority=level))["y"][0] == float(level)
        assert (server.stats()["cache_hits"], server.stats()["cache_misses"]) == (2, 3)


async def test_a_hit_is_answered_while_every_instance_runs_a_batch() -> None:
    """Once every instance has been busy a while, a request found in the
    cache is answered as it comes (as Triton's), not when an instance is
    next free (here the only one is held): from the event loop, a thread
    and a shared-memory client."""
    model = HoldsOnNine()
    started, release = model.started, model.release

    server = fb.Server(model, inputs=X, outputs=Y, response_cache=1 << 20, max_delay=0)
    async with server:
        client = server.client()
        await client.infer(row(1))  # kept
        held = asyncio.create_task(client.infer(row(9)))
        try:
            assert await asyncio.to_thread(started.wait, 10)
            await asyncio.sleep(0.05)  # the instance busy past HIT_WAIT_FOR_BUSY (10 ms)
            hit = await asyncio.wait_for(client.infer(row(1)), 5)
            hit_sync = await asyncio.wait_for(asyncio.to_thread(client.infer_sync, row(1)), 5)
            with fb.connect(server.share(f"busy-hit-{id(server)}").name) as shared:
                hit_shared = await asyncio.wait_for(shared.infer(row(1)), 5)
            assert not held.done(), "the instance's batch ended first"
        finally:
            release.set()
        assert (await held)["y"][0] == 18.0
        stats = server.stats()
    assert hit["y"].tolist() == hit_sync["y"].tolist() == hit_shared["y"].tolist() == [2.0] * 4
    assert (stats["cache_hits"], stats["cache_misses"], stats["requests_succeeded"]) == (3, 2, 5)


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_hit_over_http_and_grpc_is_answered_while_the_instance_runs(frontend: str) -> None:
    """The front-ends' requests found as they come, while the only instance
    is held inside a batch, are answered at once (over HTTP and gRPC)."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from ferrobatch.serve import ServeConfig, serve_in_thread

    model = HoldsOnNine()
    started, release = model.started, model.release

    def request(module: Any, value: float) -> Any:
        tensor = module.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
        return [tensor]

    server = fb.Server(model, inputs=X, outputs=Y, name="m", response_cache=1 << 20, max_delay=0)
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")  # type: ignore[arg-type]
    with serve_in_thread([server], config) as served:
        http = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}", network_timeout=10)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
        assert http.infer("m", request(httpclient, 1)).as_numpy("y").tolist() == [[2.0] * 4]  # kept
        answers: list[Any] = []

        @gevent_hub_freed()
        def hold() -> None:  # a client of its own: tritonclient's HTTP client keeps to one thread
            holder = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}", network_timeout=60)
            try:
                answers.append(holder.infer("m", request(httpclient, 9)).as_numpy("y").tolist())
            finally:
                holder.close()

        held = threading.Thread(target=hold)
        held.start()
        try:
            assert started.wait(10)
            time.sleep(0.05)  # the instance busy past HIT_WAIT_FOR_BUSY (10 ms)
            over_http = httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}", network_timeout=5)
            assert over_http.infer("m", request(httpclient, 1)).as_numpy("y").tolist() == [[2.0] * 4]
            got = grpc.infer("m", request(grpcclient, 1), client_timeout=5).as_numpy("y")
            assert got.tolist() == [[2.0] * 4]
            assert held.is_alive(), "the instance's batch ended first"
            over_http.close()
        finally:
            release.set()
            held.join(30)
        http.close()
        grpc.close()
    assert answers == [[[18.0] * 4]]
    stats = server.stats()
    assert (stats["cache_hits"], stats["cache_misses"], stats["requests_succeeded"]) == (2, 2, 4)
