"""A model added while serving (``Listening.add``; PyTriton's ``bind`` after
``run``): served by the listeners already open (HTTP, gRPC, metrics, shared
memory), on the native and the Python front-ends; unknown until then; stopped
with the others; refused cleanly when it cannot be served."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
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
from ferrobatch.serve import Listening, ServeConfig, serve, serve_in_thread
from ferrobatch.triton import ModelConfig, Request, Tensor, Triton, TritonConfig
from ferrobatch.triton.exceptions import PyTritonInvalidOperationError
from ferrobatch.triton.model_config.common import ModelWarmup, WarmupInput

pytestmark = pytest.mark.timeout(120)

WIDTH = 4
SPEC = [fb.TensorSpec("x", "float32", (WIDTH,))]
OUT = [fb.TensorSpec("y", "float32", (WIDTH,))]


def times(k: float) -> Any:
    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"] * k}

    return model


def make(name: str, k: float, **kwargs: Any) -> fb.Server:
    return fb.Server(times(k), inputs=SPEC, outputs=OUT, max_batch_size=8, name=name, **kwargs)


def infer_over(client: Any, port: int, model: str, rows: int) -> np.ndarray:
    """``rows`` rows of ones to ``model`` with tritonclient's ``client``
    module (``tritonclient.http`` or ``tritonclient.grpc``); its ``y``."""
    connection = client.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        tensor = client.InferInput("x", [rows, WIDTH], "FP32")
        tensor.set_data_from_numpy(np.ones((rows, WIDTH), np.float32))
        return connection.infer(model, [tensor]).as_numpy("y")  # type: ignore[no-any-return]
    finally:
        connection.close()


@gevent_hub_freed()  # called from asyncio.to_thread too
def http_infer(port: int, model: str, rows: int = 2) -> np.ndarray:
    return infer_over(httpclient, port, model, rows)


def grpc_infer(port: int, model: str, rows: int = 1) -> np.ndarray:
    return infer_over(grpcclient, port, model, rows)


@pytest.fixture(params=["native", "python"])
def serving(request: pytest.FixtureRequest) -> Iterator[tuple[Listening, list[fb.Server]]]:
    servers = [make("first", 2.0)]
    config = ServeConfig(http_port=0, grpc_port=0, frontend=request.param, log_level="warning", threads=1)
    with serve_in_thread(servers, config) as listening:
        yield listening, servers


def test_a_model_added_while_serving_is_served_over_http_grpc_and_metrics(
    serving: tuple[Listening, list[fb.Server]],
) -> None:
    listening, _ = serving
    http, grpc = listening.http_port, listening.grpc_port
    assert http is not None and grpc is not None
    # Before: unknown, as Triton before a model is loaded.
    with pytest.raises(InferenceServerException, match="unknown model"):
        http_infer(http, "late")
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    try:
        with pytest.raises(InferenceServerException, match="unknown model"):
            grpc_client.get_model_metadata("late")
        late = make("late", 3.0)
        listening.add_blocking(late)
        assert late.running and listening.models == ["first", "late"]
        np.testing.assert_array_equal(http_infer(http, "late"), np.full((2, WIDTH), 3, np.float32))
        np.testing.assert_array_equal(grpc_infer(grpc, "late"), np.full((1, WIDTH), 3, np.float32))
        np.testing.assert_array_equal(http_infer(http, "first"), np.full((2, WIDTH), 2, np.float32))
        # The metadata the native gRPC listener answers from its catalog, readiness, the index.
        metadata = grpc_client.get_model_metadata("late", as_json=True)
        assert [t["name"] for t in metadata["inputs"]] == ["x"] and metadata["inputs"][0]["shape"] == ["-1", "4"]
        assert grpc_client.is_model_ready("late") and grpc_client.is_server_ready()
        index = {m["name"]: m["state"] for m in grpc_client.get_model_repository_index(as_json=True)["models"]}
        assert index == {"first": "READY", "late": "READY"}
    finally:
        grpc_client.close()
    assert httpx.get(f"http://127.0.0.1:{http}/v2/models/late/ready").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{http}/v2/health/ready").status_code == 200
    scraped = httpx.get(f"http://127.0.0.1:{http}/metrics").text
    assert 'nv_inference_request_success{model="late",version="1"} 2.0' in scraped
    assert late.stats()["requests_succeeded"] == 2


def test_adding_a_served_name_or_a_model_that_fails_to_start_harms_nothing(
    serving: tuple[Listening, list[fb.Server]],
) -> None:
    listening, _ = serving
    http = listening.http_port
    assert http is not None
    with pytest.raises(ValueError, match="served already"):
        listening.add_blocking(make("first", 5.0))

    def broken(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("cannot warm up")

    failing = fb.Server(broken, inputs=SPEC, outputs=OUT, max_batch_size=8, name="broken", warmup=True)
    with pytest.raises(Exception, match="cannot warm up"):
        listening.add_blocking(failing)
    assert listening.models == ["first"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        http_infer(http, "broken")
    np.testing.assert_array_equal(http_infer(http, "first"), np.full((2, WIDTH), 2, np.float32))
    assert httpx.get(f"http://127.0.0.1:{http}/v2/health/ready").status_code == 200


@contextlib.asynccontextmanager
async def serving_here(server: fb.Server) -> AsyncIterator[tuple[Listening, asyncio.Event]]:
    """``serve([server])`` on this loop (HTTP only); yields its Listening and
    its stop event; sets it and waits for the shutdown on the way out."""
    got: asyncio.Future[Listening] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning", threads=1)
    task = asyncio.create_task(serve([server], config, on_ready=got.set_result, stop=stop))
    try:
        yield await got, stop
    finally:
        stop.set()
        await task


def test_add_on_serves_own_loop_is_awaited_and_add_blocking_there_is_refused() -> None:
    async def main() -> None:
        late = make("late", 3.0)
        async with serving_here(make("first", 2.0)) as (listening, _):
            with pytest.raises(RuntimeError, match="await add"):
                listening.add_blocking(late)
            await listening.add(late)
            assert listening.http_port is not None
            out = await asyncio.to_thread(http_infer, listening.http_port, "late")
            np.testing.assert_array_equal(out, np.full((2, WIDTH), 3, np.float32))
        assert not late.running  # stopped with the others
        with pytest.raises(fb.ServerClosedError):
            await listening.add(make("later", 4.0))

    asyncio.run(main())


def test_a_model_still_warming_up_when_shutdown_begins_is_not_added_and_not_left_running() -> None:
    warming = threading.Event()
    release = threading.Event()

    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        warming.set()
        release.wait(10)
        return {"y": inputs["x"]}

    async def main() -> None:
        late = fb.Server(slow, inputs=SPEC, outputs=OUT, max_batch_size=8, name="late", warmup=True)
        async with serving_here(make("first", 2.0)) as (listening, stop):
            adding = asyncio.create_task(listening.add(late))
            await asyncio.to_thread(warming.wait, 10)
            stop.set()  # shutdown begins during its warm-up
            release.set()
            with pytest.raises(fb.ServerClosedError, match="shutting down"):
                await adding
        assert not late.running and listening.models == ["first"]

    asyncio.run(main())


def test_a_model_added_while_serving_is_shared_as_share_dot_name() -> None:
    share = f"fbtest-add-{os.getpid()}"
    config = ServeConfig(http_port=0, grpc_port=None, share=share, log_level="warning", threads=1)
    with serve_in_thread([make("first", 2.0)], config) as listening:
        listening.add_blocking(make("late", 3.0))
        with fb.connect(f"{share}.late") as client:
            out = client.infer_sync({"x": torch.ones(WIDTH)})
        torch.testing.assert_close(out["y"], torch.full((WIDTH,), 3.0))


# -- PyTriton's bind after run ---------------------------------------------------------------------

X = Tensor(name="x", dtype=np.float32, shape=(WIDTH,))
Y = Tensor(name="y", dtype=np.float32, shape=(WIDTH,))


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_pytritons_bind_after_run_serves_the_model_once_bind_returns(frontend: str) -> None:
    warmed: list[str] = []

    def plus(k: float, tag: str) -> Any:
        def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
            warmed.append(tag)
            return [{"y": r["x"] + k} for r in requests]

        return infer

    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0), frontend=frontend)
    triton.bind("first", plus(1.0, "first"), inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with triton:
        triton.run()
        http, grpc = triton.http_port, triton.grpc_port
        assert http is not None and grpc is not None
        warmup = ModelWarmup(
            "w", batch_size=2, inputs={"x": WarmupInput(np.float32, (WIDTH,), zero_data=True)}, count=1
        )
        triton.bind(
            "late",
            plus(10.0, "late"),
            inputs=[X],
            outputs=[Y],
            config=ModelConfig(max_batch_size=8, model_warmup=[warmup]),
        )
        assert warmed == ["late"]  # warmed up before bind returned
        np.testing.assert_array_equal(http_infer(http, "late"), np.full((2, WIDTH), 11, np.float32))
        np.testing.assert_array_equal(grpc_infer(grpc, "late"), np.full((1, WIDTH), 11, np.float32))
        np.testing.assert_array_equal(http_infer(http, "first"), np.full((2, WIDTH), 2, np.float32))
        assert [s.name for s in triton.servers] == ["first", "late"]
        with pytest.raises(PyTritonInvalidOperationError, match="already bound"):
            triton.bind("late", plus(0.0, "again"), inputs=[X], outputs=[Y])
        late = triton.servers[1]
    assert not triton.is_alive() and not late.running


def test_pytritons_bind_while_serve_blocks_in_another_thread() -> None:
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"] * 4} for r in requests]

    triton = Triton(config=TritonConfig(http_port=0, allow_grpc=False))
    triton.bind("first", infer, inputs=[X], outputs=[Y])
    serving = threading.Thread(target=triton.serve)
    serving.start()
    try:
        for _ in range(3000):
            if triton.is_alive():
                break
            threading.Event().wait(0.01)
        triton.bind("late", infer, inputs=[X], outputs=[Y])
        assert triton.http_port is not None
        np.testing.assert_array_equal(http_infer(triton.http_port, "late"), np.full((2, WIDTH), 4, np.float32))
    finally:
        assert triton.stop() is True
        serving.join(30)
    assert not serving.is_alive()


def test_pytritons_bind_while_run_is_starting_waits_for_the_listeners(monkeypatch: pytest.MonkeyPatch) -> None:
    import ferrobatch.triton.triton as triton_module

    gate = threading.Event()
    real_serve = triton_module.serve

    async def held_serve(*args: Any, **kwargs: Any) -> None:
        await asyncio.to_thread(gate.wait, 30)  # run() has started; its listeners are not open yet
        await real_serve(*args, **kwargs)

    monkeypatch.setattr(triton_module, "serve", held_serve)

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"] * 5} for r in requests]

    triton = Triton(config=TritonConfig(http_port=0, allow_grpc=False))
    triton.bind("first", infer, inputs=[X], outputs=[Y])
    failures: list[BaseException] = []

    def guarded(work: Any) -> Any:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)

        return run

    runner = threading.Thread(target=guarded(triton.run))
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while triton._phase != "running" and time.monotonic() < deadline:
            time.sleep(0.01)
        binder = threading.Thread(target=guarded(lambda: triton.bind("late", infer, inputs=[X], outputs=[Y])))
        binder.start()
        binder.join(0.3)
        assert binder.is_alive() and not failures  # waiting for the listeners, not refused
        gate.set()
        runner.join(30)
        binder.join(30)
        assert not failures, failures
        assert triton.http_port is not None
        np.testing.assert_array_equal(http_infer(triton.http_port, "late"), np.full((2, WIDTH), 5, np.float32))
    finally:
        gate.set()
        triton.stop()
        runner.join(30)
