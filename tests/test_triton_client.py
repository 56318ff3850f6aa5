"""ferrobatch.triton.client as PyTriton's clients behave: errors of a
server that is down, hung or missing the model; waiting for the model;
FuturesModelClient's queue, workers and close; the asyncio decoupled
client's per-response timeout and headers; URL and argument checks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import gevent_hub_freed, wait_until

from ferrobatch.triton import ModelConfig, Request, Tensor, Triton, TritonConfig, batch
from ferrobatch.triton.client import (
    AsyncioDecoupledModelClient,
    AsyncioModelClient,
    FuturesModelClient,
    ModelClient,
    PyTritonClientError,
    PyTritonClientInferenceServerError,
    PyTritonClientInvalidUrlError,
    PyTritonClientModelUnavailableError,
    PyTritonClientQueueFullError,
    PyTritonClientTimeoutError,
    PyTritonClientValueError,
)
from ferrobatch.triton.model_config.triton_model_config import TritonModelConfig

pytestmark = pytest.mark.timeout(60)

VECTOR = [Tensor(name="x", dtype=np.float32, shape=(-1,))], [Tensor(name="y", dtype=np.float32, shape=(-1,))]
ONE = [Tensor(name="x", dtype=np.float32, shape=(1,))], [Tensor(name="y", dtype=np.float32, shape=(1,))]


class Served:
    """A running Triton with the models these tests call, and what they record."""

    def __init__(self, triton: Triton) -> None:
        self.triton = triton
        self.pause_closed = threading.Event()  # the "pause" stream was closed before its end
        self.stream_parameters: list[dict[str, Any]] = []

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.triton.http_port}"

    @property
    def grpc(self) -> str:
        return f"grpc://127.0.0.1:{self.triton.grpc_port}"

    def url(self, scheme: str) -> str:
        return self.http if scheme == "http" else self.grpc


def bind_models(triton: Triton, served: Served) -> None:
    @batch
    def double(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2}

    @batch
    def slow(x: np.ndarray) -> dict[str, np.ndarray]:
        time.sleep(float(x.ravel()[0]))
        return {"y": x}

    @batch
    def picky(x: np.ndarray) -> dict[str, np.ndarray]:
        raise ValueError("unknown model variant requested")

    @batch
    def pause(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        finished = False
        try:
            yield {"y": x}
            time.sleep(float(x.ravel()[0]))  # longer than the client waits for a response
            for i in range(3):
                yield {"y": x + i}
            finished = True
        finally:
            if not finished:
                served.pause_closed.set()

    def echo(requests: list[Request]) -> Iterator[list[dict[str, np.ndarray]]]:
        served.stream_parameters.extend(dict(r.parameters) for r in requests)
        yield [{"y": r["x"]} for r in requests]

    batching = ModelConfig(max_batch_size=8)
    streaming = ModelConfig(max_batch_size=8, decoupled=True)
    triton.bind("double", double, *VECTOR, config=batching)
    triton.bind("slow", slow, *ONE, config=ModelConfig(max_batch_size=8))
    triton.bind("picky", picky, *ONE, config=batching)
    triton.bind("pause", pause, *ONE, config=streaming)
    triton.bind("echo", echo, *ONE, config=streaming)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    config = TritonConfig(
        http_port=0, grpc_port=0, allow_metrics=False, http_header_forward_pattern="x-.*",
        grpc_header_forward_pattern="x-.*",
    )  # fmt: skip
    with Triton(config=config) as triton:
        served = Served(triton)
        bind_models(triton, served)
        triton.run()
        yield served


@pytest.fixture(scope="module")
def double_config(served: Served) -> TritonModelConfig:
    with ModelClient(served.http, "double", init_timeout_s=10) as client:
        return client.model_config


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield listener.getsockname()[1]


def elapsed(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """What ``call`` raised (None if nothing), and how long it took."""
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


ROW = np.ones(2, np.float32)


# -- a server down: PyTriton's clients raise their timeout error -----------------------------------


def test_an_http_server_that_is_down_raises_the_clients_timeout_error(double_config: TritonModelConfig) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    known = {"model_config": double_config, "ensure_model_is_ready": False}
    with ModelClient(url, "double", **known) as client:  # type: ignore[arg-type]
        with pytest.raises(PyTritonClientTimeoutError, match="no answer from the server"):
            client.infer_sample(ROW)
    with FuturesModelClient(url, "double", max_workers=1, **known) as futures:  # type: ignore[arg-type]
        with pytest.raises(PyTritonClientTimeoutError):
            futures.infer_sample(ROW).result(10)

    async def asynchronously() -> None:
        async with AsyncioModelClient(url, "double", **known) as client:  # type: ignore[arg-type]
            await client.infer_sample(ROW)

    with pytest.raises(PyTritonClientTimeoutError):
        asyncio.run(asynchronously())


def test_a_server_stopped_after_the_config_was_read_raises_a_client_error() -> None:
    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)) as triton:
        triton.bind("double", batch(lambda x: {"y": x * 2}), *VECTOR, config=ModelConfig(max_batch_size=8))
        triton.run()
        http = ModelClient(f"http://127.0.0.1:{triton.http_port}", "double", inference_timeout_s=5)
        grpc = ModelClient(f"grpc://127.0.0.1:{triton.grpc_port}", "double", inference_timeout_s=5)
        for client in (http, grpc):
            client.infer_sample(ROW)
    with http, grpc:
        with pytest.raises(PyTritonClientTimeoutError):  # as PyTriton's: OSError becomes a timeout
            http.infer_sample(ROW)
        with pytest.raises(PyTritonClientError):  # UNAVAILABLE: the server's error, as PyTriton's
            grpc.infer_sample(ROW)


# -- waiting for the model -------------------------------------------------------------------------


def test_a_client_given_the_config_waits_for_the_model_before_its_first_inference(
    double_config: TritonModelConfig,
) -> None:
    http_port, grpc_port = closed_port(), closed_port()
    http, grpc = f"http://127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}"
    given = {"model_config": double_config, "init_timeout_s": 20}  # ensure_model_is_ready: True, the default

    @gevent_hub_freed()
    def sync(url: str) -> Any:
        with ModelClient(url, "double", **given) as client:  # type: ignore[arg-type]
            return client.infer_sample(ROW)["y"].tolist()

    def futures(url: str) -> Any:
        with FuturesModelClient(url, "double", max_workers=1, **given) as client:  # type: ignore[arg-type]
            return client.infer_sample(ROW).result(20)["y"].tolist()

    async def asynchronously(url: str) -> Any:
        async with AsyncioModelClient(url, "double", **given) as client:  # type: ignore[arg-type]
            return (await client.infer_sample(ROW))["y"].tolist()

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, allow_metrics=False)
    triton = Triton(config=config)
    triton.bind("double", batch(lambda x: {"y": x * 2}), *VECTOR, config=ModelConfig(max_batch_size=8))

    async def main() -> list[Any]:
        # The asyncio clients on this thread's loop: grpc.aio is not run on
        # several threads' loops in one process.
        loop = asyncio.get_running_loop()
        blocking = [loop.run_in_executor(None, call, url) for call in (sync, futures) for url in (http, grpc)]
        calls = [*blocking, asyncio.ensure_future(asynchronously(http)), asyncio.ensure_future(asynchronously(grpc))]
        await asyncio.sleep(0.5)  # every client has tried the server by now: nothing listens yet
        assert not any(call.done() for call in calls), [call.exception() for call in calls if call.done()]
        await asyncio.to_thread(triton.run)
        return await asyncio.wait_for(asyncio.gather(*calls), 20)

    with triton:
        assert asyncio.run(main()) == [[2.0, 2.0]] * 6


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_reading_the_config_waits_for_the_model_whatever_ensure_model_is_ready_says(
    served: Served, scheme: str
) -> None:
    for url in (served.url(scheme), f"{scheme}://127.0.0.1:{closed_port()}"):  # no such model; no server
        client = ModelClient(url, "nope", init_timeout_s=0.3, ensure_model_is_ready=False)
        with client, pytest.raises(PyTritonClientTimeoutError, match="not ready"):
            client.model_config  # noqa: B018
        with pytest.raises(PyTritonClientTimeoutError, match="not ready"):
            ModelClient(url, "nope", lazy_init=False, init_timeout_s=0.3, ensure_model_is_ready=False)

        async def asynchronously(url: str) -> None:
            async with AsyncioModelClient(url, "nope", init_timeout_s=0.3, ensure_model_is_ready=False) as client:
                await client.infer_sample(ROW)

        with pytest.raises(PyTritonClientTimeoutError, match="not ready"):
            asyncio.run(asynchronously(url))


def test_a_failed_config_read_raises_the_clients_errors(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    from tritonclient.utils import InferenceServerException

    def refused(*args: object, **kwargs: object) -> None:
        raise InferenceServerException("config store broken", status="StatusCode.INTERNAL")

    def reset(*args: object, **kwargs: object) -> None:
        raise ConnectionResetError("reset by peer")

    with ModelClient(served.grpc, "double", init_timeout_s=5) as client:
        monkeypatch.setattr(client._client, "get_model_config", refused)
        with pytest.raises(PyTritonClientInferenceServerError, match="config store broken"):
            client.model_config  # noqa: B018
        monkeypatch.setattr(client._client, "get_model_config", reset)
        with pytest.raises(PyTritonClientTimeoutError, match="reset by peer"):
            client.model_config  # noqa: B018


# -- init_timeout_s against a server that never answers --------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_init_timeout_bounds_the_wait_for_a_server_that_never_answers(hung_port: int, scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{hung_port}"
    error, took = elapsed(lambda: ModelClient(url, "m", lazy_init=False, init_timeout_s=0.5, inference_timeout_s=20))
    assert isinstance(error, PyTritonClientTimeoutError) and took < 3, (error, took)
    with ModelClient(url, "m", init_timeout_s=0.5, inference_timeout_s=20) as client:
        error, took = elapsed(lambda: client.wait_for_model(0.5))
    assert isinstance(error, PyTritonClientTimeoutError) and took < 3, (error, took)

    async def entered() -> None:
        async with AsyncioModelClient(url, "m", lazy_init=False, init_timeout_s=0.5, inference_timeout_s=20):
            pass

    async def waited() -> None:
        client = AsyncioModelClient(url, "m", init_timeout_s=0.5, inference_timeout_s=20)
        try:
            await client.wait_for_model(0.5)
        finally:
            await client.close()

    for attempt in (entered, waited):
        error, took = elapsed(lambda attempt=attempt: asyncio.run(asyncio.wait_for(attempt(), 30)))  # type: ignore[misc]
        assert isinstance(error, PyTritonClientTimeoutError) and took < 3, (attempt.__name__, error, took)


# -- FuturesModelClient ----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_futures_close_without_waiting_lets_every_submitted_call_finish(served: Served, scheme: str) -> None:
    client = FuturesModelClient(served.url(scheme), "slow", max_workers=2, init_timeout_s=10)
    client.infer_sample(np.float32([0])).result(10)  # the config read
    submitted = [client.infer_sample(np.float32([0.1])) for _ in range(6)]
    client.close(wait=False)
    assert not all(f.done() for f in submitted)  # close did not wait
    done, _ = concurrent.futures.wait(submitted, timeout=10)
    assert len(done) == 6
    assert [f.result()["y"].tolist() for f in submitted] == [[float(np.float32(0.1))]] * 6


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_futures_client_over_http_gives_back_its_file_descriptors(served: Served) -> None:
    def cycle() -> None:
        with FuturesModelClient(served.http, "double", max_workers=4, init_timeout_s=10) as client:
            for future in [client.infer_sample(ROW) for _ in range(8)]:
                future.result(10)

    cycle()  # what stays: imports, the main thread's own state
    before = open_fds()
    for _ in range(5):
        cycle()
    # Each worker thread's gevent hub held an epoll and an eventfd: 2 x 4 x 5 left if not freed.
    assert wait_until(lambda: open_fds() <= before + 2), (before, open_fds())
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "ferrobatch-client"])


def test_futures_client_arguments_are_checked_as_pytritons(served: Served) -> None:
    with FuturesModelClient(served.http, "double", max_workers=None, init_timeout_s=10) as unlimited:
        assert unlimited.infer_sample(ROW).result(10)["y"].tolist() == [2, 2]
    for bad in ({"max_workers": 0}, {"max_workers": -1}, {"max_queue_size": 0}):
        with pytest.raises(ValueError, match="must be greater than 0"):
            FuturesModelClient(served.http, "double", **bad)  # type: ignore[arg-type]
    with pytest.raises(PyTritonClientInvalidUrlError):
        FuturesModelClient("localhost:abc", "double")


@pytest.mark.parametrize("non_blocking", [True, False])
def test_a_full_futures_queue_refuses_the_call(served: Served, non_blocking: bool) -> None:
    # Waits for a model the server does not serve hold the one worker for their whole timeout
    # (unlike inferences, which inference_timeout_s, also the blocking put's wait, would end).
    client = FuturesModelClient(
        served.http, "nope", max_workers=1, max_queue_size=2, non_blocking=non_blocking, inference_timeout_s=0.3
    )
    try:
        busy = client.wait_for_model(1.0)
        assert wait_until(busy.running)  # the worker holds it: the queue is empty
        queued = [client.wait_for_model(0.1), client.wait_for_model(0.1)]
        error, took = elapsed(lambda: client.wait_for_model(0.1))
        assert isinstance(error, PyTritonClientQueueFullError), error
        assert took < 0.25 if non_blocking else 0.25 < took < 0.9, took  # blocking: waits inference_timeout_s
    finally:
        client.close()
    for future in (busy, *queued):  # every accepted call ran
        assert isinstance(future.exception(0), PyTritonClientTimeoutError)


# -- the asyncio decoupled client ------------------------------------------------------------------


async def test_the_asyncio_decoupled_client_times_out_waiting_for_a_response_and_cancels(served: Served) -> None:
    served.pause_closed.clear()
    got: list[list[float]] = []
    async with AsyncioDecoupledModelClient(served.grpc, "pause", inference_timeout_s=0.3, init_timeout_s=10) as c:
        start = time.monotonic()
        with pytest.raises(PyTritonClientTimeoutError, match=r"no response in 0\.3 s"):
            async for out in c.infer_sample(np.float32([1.0])):  # its second response comes after 1 s
                got.append(out["y"].tolist())
        took = time.monotonic() - start
    assert got == [[1.0]] and took < 0.9, (got, took)
    assert await asyncio.to_thread(served.pause_closed.wait, 5), "the request was cancelled"


async def test_the_asyncio_decoupled_client_sends_headers(served: Served) -> None:
    served.stream_parameters.clear()
    async with AsyncioDecoupledModelClient(served.grpc, "echo", init_timeout_s=10) as client:
        outs = [o["y"].tolist() async for o in client.infer_sample(np.float32([5]), headers={"x-trace": "t1"})]
    assert outs == [[5.0]]
    assert served.stream_parameters and served.stream_parameters[0].get("x-trace") == "t1", served.stream_parameters


# -- errors, URLs and arguments --------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_only_the_servers_unknown_model_answer_means_the_model_is_unavailable(
    served: Served, scheme: str, double_config: TritonModelConfig
) -> None:
    with ModelClient(served.url(scheme), "picky", init_timeout_s=10) as client:
        with pytest.raises(PyTritonClientInferenceServerError, match="unknown model variant requested"):
            client.infer_sample(np.float32([1]))
    # The server itself answers a model it does not serve (HTTP 400 / NOT_FOUND).
    unknown = ModelClient(served.url(scheme), "nope", model_config=double_config, ensure_model_is_ready=False)
    with unknown, pytest.raises(PyTritonClientModelUnavailableError, match="Request for unknown model"):
        unknown.infer_sample(ROW)


@pytest.mark.parametrize("url", ["localhost:abc", "http://localhost:99999", "grpc://", 8000, None])
def test_an_invalid_url_raises_the_invalid_url_error(url: Any) -> None:
    with pytest.raises(PyTritonClientInvalidUrlError):
        ModelClient(url, "m")
    with pytest.raises(PyTritonClientInvalidUrlError):
        AsyncioModelClient(url, "m")


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_arguments_are_checked_before_the_config_is_read(scheme: str) -> None:
    url = f"{scheme}://127.0.0.1:{closed_port()}"  # nothing listens: the config read would wait 20 s
    with ModelClient(url, "m", init_timeout_s=20) as client:
        for call in (
            lambda: client.infer_sample(),
            lambda: client.infer_batch(ROW, parameters={"p": 0.5}),
            lambda: client.infer_sample(ROW, headers={"h": 1.5}),  # type: ignore[dict-item]
            lambda: client.infer_sample(ROW, x=ROW),
        ):
            error, took = elapsed(call)
            assert isinstance(error, PyTritonClientValueError) and took < 1, (error, took)

    async def asynchronously() -> None:
        client = AsyncioModelClient(url, "m", init_timeout_s=20)
        try:
            await client.infer_sample(ROW, parameters={"p": 0.5})
        finally:
            await client.close()

    error, took = elapsed(lambda: asyncio.run(asynchronously()))
    assert isinstance(error, PyTritonClientValueError) and took < 1, (error, took)


async def test_an_asyncio_client_whose_entry_fails_closes_its_session() -> None:
    client = AsyncioModelClient(f"http://127.0.0.1:{closed_port()}", "m", lazy_init=False, init_timeout_s=0.2)
    with pytest.raises(PyTritonClientTimeoutError):
        async with client:
            pass
    assert client._client._stub.closed  # aiohttp's session


# -- ferrobatch.triton.client.utils: PyTriton's helpers ------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_the_utils_wait_for_a_server_and_a_model_and_read_its_config(served: Served, scheme: str) -> None:
    from ferrobatch.triton.client import utils

    client = utils.create_client_from_url(served.url(scheme), network_timeout_s=10)
    try:
        utils.wait_for_server_ready(client, timeout_s=10)
        utils.wait_for_model_ready(client, "double", timeout_s=10)
        config = utils.get_model_config(client, "double", timeout_s=10)
        assert config.model_name == "double" and [t.name for t in config.inputs or []] == ["x"]
        started = time.monotonic()
        with pytest.raises(PyTritonClientTimeoutError, match="nobody"):
            utils.wait_for_model_ready(client, "nobody", timeout_s=0.5)
        assert time.monotonic() - started < 5
    finally:
        client.close()
    with ModelClient(served.url(scheme), "double") as model_client:  # PyTriton's tests use its private name
        utils.wait_for_server_ready(model_client._general_client, timeout_s=10)


def test_the_utils_time_out_on_a_server_that_is_down_and_refuse_bad_urls() -> None:
    from ferrobatch.triton.client import utils

    client = utils.create_client_from_url(f"127.0.0.1:{closed_port()}", network_timeout_s=1)
    try:
        with pytest.raises(PyTritonClientTimeoutError):
            utils.wait_for_server_ready(client, timeout_s=0.5)
    finally:
        client.close()
    with pytest.raises(PyTritonClientInvalidUrlError):
        utils.create_client_from_url("ftp://somewhere")


def test_verbose_logs_are_warned_of_as_pytriton_does(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import re

    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False, log_verbose=1))
    triton.bind("double", lambda requests: [{"y": r["x"]} for r in requests], *VECTOR)
    with caplog.at_level(logging.WARNING, logger="ferrobatch.triton"), triton:
        triton.run()
    pattern = r"Triton Inference Server is running with enabled verbose logs.*It may affect inference performance."
    assert re.search(pattern, caplog.text), caplog.text


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_unicode_inputs_raise_what_pytriton_raises(served: Served, scheme: str) -> None:
    """PyTriton's clients raise RuntimeError; the client's own error type still catches it."""
    with ModelClient(served.url(scheme), "double", init_timeout_s=10) as client:
        for caught in (RuntimeError, PyTritonClientValueError):
            with pytest.raises(caught, match="Unicode inputs are not supported"):
                client.infer_batch(np.array([["a", "b"]]))


def test_the_access_token_headers_are_pytritons() -> None:
    from ferrobatch.triton.client.auth import create_auth_headers, extract_access_token_from_headers

    assert create_auth_headers("t", "HTTP") == {"triton-access-token": "t"}
    assert create_auth_headers("t", "grpc") == {"triton-grpc-protocol-triton-access-token": "t"}
    for token, protocol, error in ((None, "http", "cannot be None or empty"), ("t", "ws", "Invalid protocol 'ws'")):
        with pytest.raises(ValueError, match=error):
            create_auth_headers(token, protocol)
    assert extract_access_token_from_headers({"triton-grpc-protocol-triton-access-token": "g"}) == "g"
    assert extract_access_token_from_headers({"other": "x"}) is None
    with pytest.raises(ValueError, match="Conflicting"):
        extract_access_token_from_headers({"triton-access-token": "a", "triton-grpc-protocol-triton-access-token": "b"})
    with pytest.raises(ValueError, match="cannot be None or empty"):
        ModelClient("http://127.0.0.1:1", "m", access_token="", lazy_init=True)
    client = ModelClient("grpc://127.0.0.1:1", "m", access_token="t", lazy_init=True)
    assert ModelClient.from_existing_client(client)._requests.headers == client._requests.headers
