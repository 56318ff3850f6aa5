"""The embedding examples: each app is started for real on 127.0.0.1 (its
lifespan or cleanup_ctx starts the ferrobatch server), called concurrently,
then shut down (which stops the server)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


@contextlib.contextmanager
def run_in_thread(app: Any, kind: str) -> Iterator[str]:
    """Runs ``app`` (ASGI under uvicorn, or aiohttp) on its own loop and
    thread; yields its base URL; shuts it down on exit."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()
    base: list[str] = []
    failure: list[BaseException] = []

    async def main() -> None:
        if kind == "asgi":
            import uvicorn

            config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
            server = uvicorn.Server(config)
            task = asyncio.create_task(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            base.append(f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}")
            ready.set()
            await stop.wait()
            server.should_exit = True
            await task
        else:
            from aiohttp import web

            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            base.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
            ready.set()
            await stop.wait()
            await runner.cleanup()

    def target() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert ready.wait(60)
    if failure:
        raise failure[0]
    try:
        yield base[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()
    if failure:
        raise failure[0]


def expected_probs(features: torch.Tensor) -> torch.Tensor:
    model = load("_model").make_server()._models[0]
    with torch.no_grad():
        result: torch.Tensor = model({"features": features[None]})["probs"][0]
    return result


@pytest.mark.parametrize(
    ("module", "kind", "v2_prefix"),
    [("starlette_app", "asgi", ""), ("fastapi_app", "asgi", None), ("aiohttp_app", "aiohttp", "/triton")],
)
def test_example_app_batches_its_own_route(module: str, kind: str, v2_prefix: str | None) -> None:
    example = load(module)
    app = example.make_app()
    features = [torch.linspace(-1, 1, 16) * (i + 1) for i in range(24)]

    async def call_all(base: str) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            responses = await asyncio.gather(*(http.post("/predict", json={"features": f.tolist()}) for f in features))
            for response in responses:
                assert response.status_code == 200, response.text
            bad = await http.post("/predict", json={"features": [1.0, 2.0]})
            assert bad.status_code in (400, 422)
            if v2_prefix is not None:
                meta = await http.get(f"{v2_prefix}/v2/models/scorer")
                assert meta.status_code == 200
                assert meta.json()["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 16]}]
                infer = await http.post(
                    f"{v2_prefix}/v2/models/scorer/infer",
                    json={
                        "inputs": [
                            {"name": "features", "datatype": "FP32", "shape": [1, 16], "data": features[0].tolist()}
                        ]
                    },
                )
                assert infer.status_code == 200, infer.text
                torch.testing.assert_close(
                    torch.tensor(infer.json()["outputs"][0]["data"]), expected_probs(features[0])
                )
            return [r.json() for r in responses]

    server = app[example.SERVER] if kind == "aiohttp" else app.state.server
    assert not server.running
    with run_in_thread(app, kind) as base:
        assert server.running  # started by the app's lifespan / cleanup_ctx
        results = asyncio.run(call_all(base))
    assert not server.running  # and stopped with it
    assert server.stats()["requests_succeeded"] >= len(features)
    for f, result in zip(features, results):
        probs = expected_probs(f)
        torch.testing.assert_close(torch.tensor(result["probs"]), probs)
        assert result["label"] == int(probs.argmax())


def test_torchrl_actors_example_runs_with_weight_updates() -> None:
    pytest.importorskip("tensordict")
    stats = load("torchrl_actors").run(actors=4, steps=50, updates=3)
    assert stats["steps"] == 200 == stats["requests"]
    assert stats["weight_updates"] == 3 == stats["policy_version"]


def test_pytriton_switch_example_serves_tritonclient() -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    example = load("pytriton_switch")
    from ferrobatch.triton import Triton, TritonConfig

    features = np.random.default_rng(0).random((3, 16), dtype=np.float32)
    with torch.inference_mode():
        expected = example.MODEL({"features": torch.from_numpy(features)})["probs"].numpy()
    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
        example.bind(triton)
        triton.run()
        http = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}", network_timeout=30)
        x = httpclient.InferInput("features", [3, 16], "FP32")
        x.set_data_from_numpy(features)
        np.testing.assert_allclose(http.infer("scorer", [x]).as_numpy("probs"), expected, rtol=1e-6)
        rpc = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.grpc_port}")
        x = grpcclient.InferInput("features", [1, 16], "FP32")
        x.set_data_from_numpy(features[1:2])
        np.testing.assert_allclose(rpc.infer("scorer", [x]).as_numpy("probs"), expected[1:2], rtol=1e-6)
        rpc.close()
        http.close()
    assert not triton.is_alive()


def test_token_stream_example_streams_words_to_concurrent_prompts() -> None:
    """examples/token_stream.py: each prompt gets WORDS events, the words the
    model chooses for it alone, while several prompts share batches."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from ferrobatch.serve import ServeConfig, serve_in_thread

    example = load("token_stream")
    prompts = [f"prompt {i}" for i in range(6)]

    def expected(prompt: str) -> list[str]:
        last = example.first_words(np.array([prompt.encode()], dtype=object))
        words = []
        with torch.inference_mode():
            for _ in range(example.WORDS):
                last = example.MODEL(last)
                words.append(example.VOCAB[int(last[0])])
        return words

    servers = example.make_servers()
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/toy_lm/generate_stream"

        def stream(prompt: str) -> list[str]:
            with httpx.stream("POST", url, json={"text_input": prompt}, timeout=30) as answer:
                assert answer.headers["content-type"].startswith("text/event-stream")
                lines = [line for line in answer.iter_lines() if line]
            return [json.loads(line.removeprefix("data: "))["text_output"] for line in lines]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(stream, prompts))
    assert got == [expected(p) for p in prompts]
    stats = servers[0].stats()
    assert stats["requests_succeeded"] == len(prompts)
