"""Priority levels (``Server(priority_levels=n)``) and request parameters
(``Server(with_requests=True)``): in process, over HTTP and over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import gevent_hub_freed
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

TAG = fb.TensorSpec("tag", "int64", ())
OUT = fb.TensorSpec("out", "int64", ())


class Gated:
    """A model that records the tags of each batch it runs; while ``gate`` is
    clear the first call blocks, so requests queue up behind it."""

    def __init__(self, delay: float = 0.0) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.order: list[int] = []
        self.delay = delay

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.entered.set()
        self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        tags = inputs["tag"]
        self.order.extend(int(t) for t in tags)
        return {"out": tags * 10}


def gated_server(model: Gated, **kwargs: Any) -> fb.Server:
    options: dict[str, Any] = {"max_batch_size": 1, "max_delay": 0.0, "priority_levels": 2, "name": "m"}
    return fb.Server(model, inputs=[TAG], outputs=[OUT], **{**options, **kwargs})


#: The ways in that take priority= and parameters= in process: the server's
#: own client, and a shared-memory client (here, of this process's server).
WAYS = ["in-process", "shared-memory"]


@contextlib.contextmanager
def client_of(server: fb.Server, way: str) -> Iterator[Any]:
    if way == "in-process":
        yield server.client()
        return
    name = f"fbtest-priorities-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with fb.connect(server.share(name).name) as client:
        yield client


@pytest.mark.parametrize("way", WAYS)
async def test_the_urgent_level_runs_first_fifo_within_a_level(way: str) -> None:
    model = Gated()
    server = gated_server(model, max_priority_wait=None)
    async with server:
        with client_of(server, way) as client:
            blocker = asyncio.ensure_future(client.infer({"tag": torch.tensor(0)}))
            await asyncio.to_thread(model.entered.wait, 10)
            calls = []
            for i in range(1, 7):
                # Odd tags are urgent (1), even ones the default level (2, the least urgent).
                priority = 1 if i % 2 else None
                calls.append(asyncio.ensure_future(client.infer({"tag": torch.tensor(i)}, priority=priority)))
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            assert server.stats()["queue_depth_by_priority"] == {1: 3, 2: 3}
            model.gate.set()
            results = await asyncio.gather(blocker, *calls)
    assert [int(r["out"]) for r in results] == [0, 10, 20, 30, 40, 50, 60]
    assert model.order == [0, 1, 3, 5, 2, 4, 6]


async def test_a_passed_over_request_goes_first_after_max_priority_wait() -> None:
    model = Gated(delay=0.005)
    model.gate.set()
    server = gated_server(model, max_priority_wait=0.1, max_queue_size=1000)
    async with server:
        client = server.client()
        stop = asyncio.Event()

        async def urgent_stream() -> int:
            done = 0
            while not stop.is_set():
                await client.infer({"tag": torch.tensor(1)}, priority=1)
                done += 1
            return done

        # Eight urgent callers keep level 1 busy for as long as the test runs.
        streams = [asyncio.ensure_future(urgent_stream()) for _ in range(8)]
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        low = await asyncio.wait_for(client.infer({"tag": torch.tensor(2)}, priority=2), 5)
        waited = time.perf_counter() - started
        stop.set()
        urgent = await asyncio.gather(*streams)
    assert int(low["out"]) == 20
    assert waited < 2.0, f"the low request waited {waited:.2f}s behind a busy urgent level"
    # At least one batch of urgent requests each for as long as it waited
    # (how many depends on the machine's speed, not on the rule).
    assert sum(urgent) > 8, "the urgent level kept the worker busy meanwhile"


@pytest.mark.parametrize("way", WAYS)
async def test_a_full_low_level_never_refuses_an_urgent_request(way: str) -> None:
    model = Gated()
    server = gated_server(model, max_queue_size=4, max_priority_wait=None)
    async with server:
        with client_of(server, way) as client:
            blocker = asyncio.ensure_future(client.infer({"tag": torch.tensor(0)}))
            await asyncio.to_thread(model.entered.wait, 10)
            lows = [asyncio.ensure_future(client.infer({"tag": torch.tensor(2)}, priority=2)) for _ in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(fb.QueueFullError):
                await client.infer({"tag": torch.tensor(2)}, priority=2)
            highs = [asyncio.ensure_future(client.infer({"tag": torch.tensor(1)}, priority=1)) for _ in range(2)]
            await asyncio.sleep(0)
            with pytest.raises(fb.QueueFullError):
                await client.infer({"tag": torch.tensor(1)}, priority=1)  # the whole queue is full now
            with pytest.raises(fb.InvalidInputError, match="between 1"):
                await client.infer({"tag": torch.tensor(1)}, priority=3)
            with pytest.raises(fb.InvalidInputError, match="priority"):
                await client.infer({"tag": torch.tensor(1)}, priority=-1)
            model.gate.set()
            await asyncio.gather(blocker, *lows, *highs)
            stats = server.stats()
    assert stats["requests_succeeded"] == 5
    assert stats["requests_failed"]["queue_full"] == 2
    # A shared client refuses a negative level itself, and the server counts it all the same.
    assert stats["requests_failed"]["invalid_input"] == 2


async def test_without_levels_a_priority_is_accepted_and_ignored() -> None:
    model = Gated()
    model.gate.set()
    server = fb.Server(model, inputs=[TAG], outputs=[OUT], max_batch_size=4)
    async with server:
        out = await server.client().infer({"tag": torch.tensor(3)}, priority=5)
        assert server.stats()["queue_depth_by_priority"] == {}
    assert int(out["out"]) == 30


def test_priority_options_are_checked() -> None:
    def make(**kw: Any) -> fb.Server:
        return fb.Server(Gated(), inputs=[TAG], outputs=[OUT], **kw)

    for bad in ({"priority_levels": 1}, {"priority_levels": 256}, {"priority_levels": -1}):
        with pytest.raises(ValueError, match="priority_levels"):
            make(**bad)
    with pytest.raises(ValueError, match="default_priority"):
        make(priority_levels=2, default_priority=3)
    with pytest.raises(ValueError, match="max_priority_wait"):
        make(priority_levels=2, max_priority_wait=-1)


class Recorder:
    """A ``with_requests`` model: records each batch's requests and answers
    each row with its request's ``scale`` parameter times the tag."""

    def __init__(self) -> None:
        self.batches: list[list[fb.RequestInfo]] = []

    def __call__(self, inputs: dict[str, torch.Tensor], requests: Sequence[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        self.batches.append(list(requests))
        assert sum(r.rows for r in requests) == inputs["tag"].shape[0] or not requests[0].parameters
        scales = torch.cat([torch.full((r.rows,), int(r.parameters.get("scale", 1))) for r in requests])
        scales = scales[: inputs["tag"].shape[0]]
        return {"out": inputs["tag"] * scales}


@pytest.mark.parametrize("way", WAYS)
async def test_parameters_reach_a_model_built_with_requests(way: str) -> None:
    model = Recorder()
    server = fb.Server(model, inputs=[TAG], outputs=[OUT], max_batch_size=16, max_delay=0.01, with_requests=True)
    async with server:
        with client_of(server, way) as client:
            results = await asyncio.gather(
                client.infer({"tag": torch.tensor(1)}, parameters={"scale": 3, "who": "a"}),
                client.infer({"tag": torch.tensor(2)}),
                client.infer_batch({"tag": torch.tensor([4, 5])}, parameters={"scale": 2}),
            )
            sync = await asyncio.to_thread(client.infer_sync, {"tag": torch.tensor(7)}, parameters={"scale": 5})
            with pytest.raises(fb.InvalidInputError, match="must be a bool, int, finite float or str"):
                await client.infer({"tag": torch.tensor(1)}, parameters={"bad": [1, 2]})
            if way == "shared-memory":
                with pytest.raises(fb.InvalidInputError, match="at most 256"):
                    await client.infer({"tag": torch.tensor(1)}, parameters={"long": "x" * 300})
    assert [int(results[0]["out"]), int(results[1]["out"])] == [3, 2]
    assert results[2]["out"].tolist() == [8, 10]
    assert int(sync["out"]) == 35
    seen = [r for batch in model.batches for r in batch]
    assert fb.RequestInfo(1, {"scale": 3, "who": "a"}) in seen
    assert fb.RequestInfo(2, {"scale": 2}) in seen
    assert any(r.rows == 1 and r.parameters == {} for r in seen)


@contextlib.contextmanager
def serving(server: fb.Server, frontend: str = "native", **overrides: Any) -> Iterator[tuple[int, int]]:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning", **overrides)
    with serve_in_thread([server], config) as listening:
        assert listening.http_port is not None and listening.grpc_port is not None
        yield listening.http_port, listening.grpc_port


def tag_body(tag: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": [{"name": "tag", "datatype": "INT64", "shape": [1], "data": [tag]}]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_the_priority_parameter_orders_requests_over_http_and_grpc(frontend: str) -> None:
    model = Gated()
    server = gated_server(model, max_priority_wait=None)
    with serving(server, frontend) as (http_port, grpc_port), ThreadPoolExecutor(8) as pool:
        url = f"http://127.0.0.1:{http_port}/v2/models/m/infer"
        blocker = pool.submit(httpx.post, url, json=tag_body(0), timeout=20)
        assert model.entered.wait(10)

        def via_grpc(tag: int, priority: int) -> Any:
            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as triton:
                tensor = grpcclient.InferInput("tag", [1], "INT64")
                tensor.set_data_from_numpy(np.array([tag], dtype=np.int64))
                return triton.infer("m", [tensor], priority=priority, client_timeout=20).as_numpy("out")

        @gevent_hub_freed()
        def via_http(tag: int, priority: int) -> Any:
            triton = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", connection_timeout=20)
            try:
                tensor = httpclient.InferInput("tag", [1], "INT64")
                tensor.set_data_from_numpy(np.array([tag], dtype=np.int64))
                return triton.infer("m", [tensor], priority=priority).as_numpy("out")
            finally:
                triton.close()

        calls = []
        for tag, priority, send in [(2, 2, via_http), (4, 2, via_grpc), (1, 1, via_http), (3, 1, via_grpc)]:
            calls.append(pool.submit(send, tag, priority))
            deadline = time.monotonic() + 10
            while server.stats()["queue_depth"] < len(calls) and time.monotonic() < deadline:
                time.sleep(0.005)
        bad = httpx.post(url, json=tag_body(1, {"priority": 3}), timeout=20)
        bad_type = httpx.post(url, json=tag_body(1, {"priority": "high"}), timeout=20)
        model.gate.set()
        results = [int(c.result(20)[0]) for c in calls]
        assert blocker.result(20).status_code == 200
    assert results == [20, 40, 10, 30]
    assert model.order == [0, 1, 3, 2, 4]
    assert bad.status_code == 400 and "between 1" in bad.json()["error"]
    assert bad_type.status_code == 400 and "priority" in bad_type.json()["error"]


def test_parameters_and_forwarded_headers_reach_the_model_natively() -> None:
    model = Recorder()
    server = fb.Server(model, inputs=[TAG], outputs=[OUT], name="m", max_batch_size=8, with_requests=True)
    patterns = {"http_header_forward_pattern": "^x-tenant", "grpc_header_forward_pattern": "^x-tenant"}
    with serving(server, **patterns) as (http_port, grpc_port):
        url = f"http://127.0.0.1:{http_port}/v2/models/m/infer"
        plain = httpx.post(url, json=tag_body(2, {"scale": 4, "note": "x"}), headers={"X-Tenant-Id": "acme"})
        shadowed = httpx.post(url, json=tag_body(3, {"x-tenant-id": "given"}), headers={"x-tenant-id": "header"})
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as triton:
            tensor = grpcclient.InferInput("tag", [1], "INT64")
            tensor.set_data_from_numpy(np.array([5], dtype=np.int64))
            reply = triton.infer(
                "m", [tensor], parameters={"scale": 3, "ratio": 0.5, "flag": True}, headers={"x-tenant-id": "grpc"}
            )
    assert plain.status_code == 200 and plain.json()["outputs"][0]["data"] == [8]
    assert shadowed.status_code == 200
    assert int(reply.as_numpy("out")[0]) == 15
    seen = [r.parameters for batch in model.batches for r in batch]
    assert {"scale": 4, "note": "x", "x-tenant-id": "acme"} in seen
    assert {"x-tenant-id": "given"} in seen, "a parameter of the request wins over a forwarded header"
    assert {"scale": 3, "ratio": 0.5, "flag": True, "x-tenant-id": "grpc"} in seen


def test_parameters_reach_the_model_through_the_python_front_end() -> None:
    model = Recorder()
    server = fb.Server(model, inputs=[TAG], outputs=[OUT], name="m", max_batch_size=8, with_requests=True)
    with serving(server, "python") as (http_port, grpc_port):
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v2/models/m/infer", json=tag_body(2, {"scale": 4}))
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as triton:
            tensor = grpcclient.InferInput("tag", [1], "INT64")
            tensor.set_data_from_numpy(np.array([5], dtype=np.int64))
            out = triton.infer("m", [tensor], parameters={"scale": 3}).as_numpy("out")
    assert reply.json()["outputs"][0]["data"] == [8]
    assert int(out[0]) == 15


def test_header_forwarding_is_checked() -> None:
    server = fb.Server(Recorder(), inputs=[TAG], outputs=[OUT], name="m", with_requests=True)
    with pytest.raises(ValueError, match="invalid header forward pattern"):
        with serving(server, http_header_forward_pattern="(unclosed"):
            pass
    with pytest.raises(ValueError, match="needs frontend='native'"):
        with serving(server, "python", http_header_forward_pattern="x-"):
            pass
    with pytest.raises(ValueError, match="cuda_graphs"):
        fb.Server(Recorder(), inputs=[TAG], outputs=[OUT], with_requests=True, cuda_graphs=True)


def test_a_bad_priority_over_grpc_is_invalid_argument() -> None:
    model = Gated()
    model.gate.set()
    server = gated_server(model)
    with serving(server) as (_, grpc_port), grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as triton:
        tensor = grpcclient.InferInput("tag", [1], "INT64")
        tensor.set_data_from_numpy(np.array([5], dtype=np.int64))
        with pytest.raises(InferenceServerException, match="between 1"):
            triton.infer("m", [tensor], priority=7)
        assert int(triton.infer("m", [tensor], priority=0).as_numpy("out")[0]) == 50


def test_parameters_are_encoded_as_json_whatever_their_subclasses_print() -> None:
    import json

    from ferrobatch._requests import encode_parameters

    class Loud(int):
        def __str__(self) -> str:
            return "not json"

        __repr__ = __str__

    parameters = {"n": Loud(3), "big": Loud(10**30), "ratio": 1.0, "flag": True, "s": 'é"x', "neg": -5}
    encoded = encode_parameters(parameters)
    assert encoded is not None
    decoded = json.loads(encoded)
    assert decoded == {"n": 3, "big": 10**30, "ratio": 1.0, "flag": True, "s": 'é"x', "neg": -5}
    assert type(decoded["ratio"]) is float and type(decoded["flag"]) is bool
