"""Decoupled models (``Server(decoupled=True)``, Triton's decoupled mode): a
generator model streams its responses over gRPC ``ModelStreamInfer``, each
caller getting its own rows of every item as it is made, the last one
flagged as Triton flags it; a caller that goes away stops the model; every
request resolves once, and ``stats()`` says what the callers saw."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread
from ferrobatch.triton import Triton, TritonConfig
from ferrobatch.triton.client import (
    AsyncioDecoupledModelClient,
    DecoupledModelClient,
    ModelClient,
    PyTritonClientInferenceServerError,
    PyTritonClientValueError,
)
from ferrobatch.triton.decorators import batch
from ferrobatch.triton.model_config import ModelConfig, Tensor

CONFIG = ServeConfig(http_port=0, grpc_port=0, log_level="warning")
X = fb.TensorSpec("x", "float32", (3,))
Y = fb.TensorSpec("y", "float32", (3,))


def counting(steps: int, closed: list[int] | None = None, fail_at: int | None = None) -> Any:
    """A decoupled model yielding ``x * i`` for i in 0..steps, raising at
    step ``fail_at``; records in ``closed`` the step a GeneratorExit came at."""

    def model(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        i = 0
        try:
            for i in range(steps):
                if i == fail_at:
                    raise RuntimeError(f"failed at step {i}")
                yield {"y": inputs["x"] * i}
        except GeneratorExit:
            if closed is not None:
                closed.append(i)
            raise

    return model


class Stream:
    """One ModelStreamInfer call through tritonclient, its messages queued;
    as a context manager, closed on the way out if it was not (cancelling
    what it waits for), so that a failing test leaves no stream thread."""

    def __init__(self, port: int, reading: threading.Event | None = None) -> None:
        """``reading``: the client reads the stream only once it is set."""
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.closed = False
        self._reading = reading
        self.messages: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()

        def received(result: Any, error: Any) -> None:
            if reading is not None:
                reading.wait(60)
            self.messages.put((result, error))

        self.client.start_stream(callback=received)

    def send(self, model: str, x: np.ndarray, request_id: str, final: bool = True) -> None:
        given = grpcclient.InferInput("x", list(x.shape), "FP32")
        given.set_data_from_numpy(x)
        self.client.async_stream_infer(model, [given], request_id=request_id, enable_empty_final_response=final)

    def next(self, timeout: float = 10.0) -> tuple[Any, Any]:
        return self.messages.get(timeout=timeout)

    def close(self, cancel: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *_: object) -> None:
        if not self.closed and self._reading is not None:
            self._reading.set()  # else the stream's reader would wait for it
        self.close(cancel=True)


def is_final(result: Any) -> bool:
    return bool(result.get_response().parameters["triton_final_response"].bool_param)


def failures(server: fb.Server) -> dict[str, int]:
    return {k: v for k, v in server.stats()["requests_failed"].items() if v}


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_each_caller_gets_its_rows_of_every_item_then_the_final_flag(frontend: str) -> None:
    server = fb.Server(counting(4), inputs=[X], outputs=[Y], decoupled=True, max_delay=0.02, name="count")
    with (
        serve_in_thread([server], replace(CONFIG, frontend=frontend)) as listening,
        Stream(listening.grpc_port) as stream,
    ):
        for k in range(3):  # in one batch (20 ms window): each its own rows
            stream.send("count", np.full((1, 3), k + 1, np.float32), request_id=f"r{k}")
        got: dict[str, list[Any]] = {f"r{k}": [] for k in range(3)}
        finals = 0
        while finals < 3:
            result, error = stream.next()
            assert error is None, error
            rid = result.get_response().id
            if is_final(result):
                finals += 1
                assert result.get_response().outputs == [], "the final response is empty"
                got[rid].append("end")
            else:
                got[rid].append(result.as_numpy("y").tolist())
        stream.close()
        for k in range(3):
            assert got[f"r{k}"] == [[[float((k + 1) * i)] * 3] for i in range(4)] + ["end"]
        stats = server.stats()
        assert stats["requests_succeeded"] == 3 and not failures(server)
        assert stats["batches"] < 3, "the three requests were batched"


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_without_the_final_flag_only_the_responses_come_and_a_plain_model_answers_once(frontend: str) -> None:
    plain = fb.Server(lambda b: {"y": b["x"] + 1}, inputs=[X], outputs=[Y], name="plain")
    streaming = fb.Server(counting(2), inputs=[X], outputs=[Y], decoupled=True, name="count")
    with (
        serve_in_thread([plain, streaming], replace(CONFIG, frontend=frontend)) as listening,
        Stream(listening.grpc_port) as stream,
    ):
        stream.send("count", np.ones((1, 3), np.float32), "a", final=False)
        firsts = [stream.next()[0] for _ in range(2)]
        assert [is_final(r) for r in firsts] == [False, False]
        stream.send("plain", np.ones((1, 3), np.float32), "b", final=False)
        result, error = stream.next()
        assert error is None and result.get_response().id == "b" and is_final(result)
        assert result.as_numpy("y").tolist() == [[2.0, 2.0, 2.0]]
        with pytest.raises(queue.Empty):
            stream.next(timeout=0.3)  # nothing flags the end of "a": none was asked for
        stream.close()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_caller_that_goes_away_stops_the_model_and_is_counted_cancelled(frontend: str) -> None:
    closed: list[int] = []

    def slow(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for item in counting(100_000, closed)(inputs):
            time.sleep(0.001)
            yield item

    server = fb.Server(slow, inputs=[X], outputs=[Y], decoupled=True, name="endless")
    with (
        serve_in_thread([server], replace(CONFIG, frontend=frontend)) as listening,
        Stream(listening.grpc_port) as stream,
    ):
        stream.send("endless", np.ones((1, 3), np.float32), "a")
        for _ in range(3):
            assert stream.next()[1] is None
        stream.close(cancel=True)
        deadline = time.monotonic() + 10
        while not closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed and closed[0] < 100_000 - 1, "the generator was closed at its yield"
        while server.stats()["requests_failed"]["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert failures(server) == {"cancelled": 1} and server.stats()["requests_succeeded"] == 0
        # The worker is free again: the next stream is answered.
        with Stream(listening.grpc_port) as again:
            again.send("endless", np.ones((1, 3), np.float32), "b")
            assert again.next()[1] is None
            again.close(cancel=True)


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_model_that_fails_mid_stream_fails_its_requests_after_what_was_sent(frontend: str) -> None:
    server = fb.Server(counting(5, fail_at=2), inputs=[X], outputs=[Y], decoupled=True, name="flaky")
    with (
        serve_in_thread([server], replace(CONFIG, frontend=frontend)) as listening,
        Stream(listening.grpc_port) as stream,
    ):
        stream.send("flaky", np.ones((1, 3), np.float32), "a")
        messages = [stream.next() for _ in range(3)]
        assert [e is None for _, e in messages] == [True, True, False]
        error = messages[2][1]
        assert isinstance(error, InferenceServerException) and "model 'flaky'" in error.message()
        stream.send("flaky", np.ones((1, 3), np.float32), "b")  # the stream goes on
        assert stream.next()[1] is None
        stream.close(cancel=True)
    assert server.stats()["requests_failed"]["model_error"] >= 1


def test_a_response_of_the_wrong_shape_fails_that_request_once() -> None:
    def bad(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, Any]]:
        yield {"y": inputs["x"]}
        yield {"y": inputs["x"][:, :2]}  # not the declared (3,)

    server = fb.Server(bad, inputs=[X], outputs=[Y], decoupled=True, name="bad")
    with serve_in_thread([server], CONFIG) as listening, Stream(listening.grpc_port) as stream:
        stream.send("bad", np.ones((1, 3), np.float32), "a")
        assert stream.next()[1] is None
        _, error = stream.next()
        assert error is not None and "model 'bad' failed" in error.message()
        with pytest.raises(queue.Empty):
            stream.next(timeout=0.3)  # nothing after its failure
        stream.close()
    assert failures(server) == {"model_error": 1} and server.stats()["requests_succeeded"] == 0


def test_the_ways_that_answer_once_refuse_a_decoupled_model_with_a_clear_error() -> None:
    server = fb.Server(counting(2), inputs=[X], outputs=[Y], decoupled=True, name="count")
    with serve_in_thread([server], CONFIG) as listening:
        base = f"http://127.0.0.1:{listening.http_port}/v2/models/count"
        sample = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
        answer = httpx.post(f"{base}/infer", json=sample)
        assert answer.status_code == 400 and "decoupled" in answer.json()["error"]
        assert httpx.get(f"{base}/config").json()["model_transaction_policy"] == {"decoupled": True}
        with grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as client:
            given = grpcclient.InferInput("x", [1, 3], "FP32")
            given.set_data_from_numpy(np.ones((1, 3), np.float32))
            with pytest.raises(InferenceServerException, match="ModelStreamInfer"):
                client.infer("count", [given])
            config = client.get_model_config("count", as_json=True)["config"]
            assert config["model_transaction_policy"] == {"decoupled": True}
            assert client.is_model_ready("count")
        with pytest.raises(fb.InvalidInputError, match="decoupled"):
            server.client().infer_sync({"x": torch.ones(3)})
        with pytest.raises(ValueError, match="decoupled"):
            server.share("fb-test-decoupled")
    assert failures(server) == {"invalid_input": 3}


def test_a_decoupled_model_must_return_an_iterable() -> None:
    server = fb.Server(lambda b: {"y": b["x"]}, inputs=[X], outputs=[Y], decoupled=True, name="dict")
    with contextlib.ExitStack() as cleanup:
        with serve_in_thread([server], CONFIG) as listening:
            stream = cleanup.enter_context(Stream(listening.grpc_port))  # closed at the test's end
            stream.send("dict", np.ones((1, 3), np.float32), "a")
            _, error = stream.next()
            assert error is not None and "model 'dict' failed" in error.message()
            # Left open: stopping the front-end ends the stream, without waiting for the client.
            started = time.monotonic()
        assert time.monotonic() - started < 5
        assert failures(server) == {"model_error": 1}


def test_what_a_decoupled_server_refuses_at_construction() -> None:
    with pytest.raises(ValueError, match="invariance_sample_rate"):
        fb.Server(counting(1), inputs=[X], outputs=[Y], decoupled=True, invariance_sample_rate=0.5)
    with pytest.raises(ValueError, match="decoupled"):
        fb.Server(counting(1), inputs=[X], outputs=[Y], decoupled=True, compile=True)
    assert not fb.Server(counting(1), inputs=[X], outputs=[Y], decoupled=True).isolate_failures


# -- PyTriton's API ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton() -> Iterator[tuple[Triton, list[str]]]:
    events: list[str] = []

    @batch
    def tokens(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        try:
            for i in range(3):
                yield {"y": x + i}
        except GeneratorExit:
            events.append("closed")
            raise

    @batch
    def endless(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        try:
            while True:
                time.sleep(0.001)
                yield {"y": x}
        except GeneratorExit:
            events.append("endless closed")
            raise

    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as server:
        vector = [Tensor(name="x", dtype=np.float32, shape=(-1,))], [Tensor(name="y", dtype=np.float32, shape=(-1,))]
        server.bind("tokens", tokens, *vector, config=ModelConfig(max_batch_size=8, decoupled=True))
        server.bind("endless", endless, *vector, config=ModelConfig(max_batch_size=8, decoupled=True))
        server.bind("plain", lambda requests: [{"y": r["x"]} for r in requests], *vector)
        server.run()
        yield server, events


def test_decoupled_model_client_iterates_the_responses(triton: tuple[Triton, list[str]]) -> None:
    server, _ = triton
    with DecoupledModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "tokens") as client:
        assert client.model_config.decoupled
        samples = [out["y"].tolist() for out in client.infer_sample(np.float32([1, 2]))]
        assert samples == [[1, 2], [2, 3], [3, 4]]
        batches = [out["y"].tolist() for out in client.infer_batch(np.float32([[0], [10]]))]
        assert batches == [[[0], [10]], [[1], [11]], [[2], [12]]]


def test_decoupled_model_client_left_early_cancels_and_stays_usable(triton: tuple[Triton, list[str]]) -> None:
    server, events = triton
    with DecoupledModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "endless") as client:
        responses = client.infer_sample(np.float32([5]))
        assert [next(responses)["y"].tolist() for _ in range(3)] == [[5.0]] * 3
        with pytest.raises(PyTritonClientInferenceServerError, match="already in progress"):
            client.infer_sample(np.float32([5]))
        responses.close()  # left early
        deadline = time.monotonic() + 10
        while "endless closed" not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "endless closed" in events
        again = client.infer_sample(np.float32([7]))
        assert next(again)["y"].tolist() == [7.0]
        again.close()


def test_decoupled_model_client_refuses_http_coupled_models_and_headers(triton: tuple[Triton, list[str]]) -> None:
    server, _ = triton
    with pytest.raises(PyTritonClientValueError, match="grpc"):
        DecoupledModelClient(f"http://127.0.0.1:{server.http_port}", "tokens")
    with DecoupledModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "plain") as client:
        with pytest.raises(PyTritonClientInferenceServerError, match="coupled"):
            client.infer_sample(np.float32([1]))
    with DecoupledModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "tokens") as client:
        with pytest.raises(PyTritonClientValueError, match="headers"):
            client.infer_sample(np.float32([1]), headers={"a": "b"})
    with ModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "tokens") as plain:
        with pytest.raises(PyTritonClientInferenceServerError, match="decoupled"):
            plain.infer_sample(np.float32([1]))


def test_many_threads_stream_at_once_each_its_own_rows(triton: tuple[Triton, list[str]]) -> None:
    server, _ = triton
    got: dict[int, list[list[float]]] = {}

    def one(k: int) -> None:
        with DecoupledModelClient(f"grpc://127.0.0.1:{server.grpc_port}", "tokens") as client:
            got[k] = [out["y"].tolist() for out in client.infer_sample(np.float32([k, -k]))]

    threads = [threading.Thread(target=one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == {k: [[float(k + i), float(i - k)] for i in range(3)] for k in range(8)}


def test_asyncio_decoupled_model_client_iterates_and_cancels(triton: tuple[Triton, list[str]]) -> None:
    server, events = triton

    async def main() -> tuple[list[list[float]], list[list[float]]]:
        url = f"grpc://127.0.0.1:{server.grpc_port}"
        async with AsyncioDecoupledModelClient(url, "tokens") as client:
            got = [out["y"].tolist() async for out in client.infer_sample(np.float32([1, 2]))]
            endless = AsyncioDecoupledModelClient(url, "endless")
            firsts = []
            async for out in endless.infer_batch(np.float32([[3]])):
                firsts.append(out["y"].tolist())
                if len(firsts) == 2:
                    break
            await endless.close()
            return got, firsts

    events.clear()
    got, firsts = asyncio.run(main())
    assert got == [[1, 2], [2, 3], [3, 4]] and firsts == [[[3.0]], [[3.0]]]
    deadline = time.monotonic() + 10
    while "endless closed" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "endless closed" in events, "leaving the stream cancelled the request"


def test_a_stream_past_its_deadline_fails_once_and_stops_the_model() -> None:
    closed: list[int] = []

    def slow(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for item in counting(100_000, closed)(inputs):
            time.sleep(0.01)
            yield item

    server = fb.Server(slow, inputs=[X], outputs=[Y], decoupled=True, name="slow")
    with (
        serve_in_thread([server], CONFIG) as listening,
        grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as client,
    ):
        messages: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: messages.put((result, error)))
        given = grpcclient.InferInput("x", [1, 3], "FP32")
        given.set_data_from_numpy(np.ones((1, 3), np.float32))
        client.async_stream_infer("slow", [given], request_id="a", timeout=200_000)  # 0.2 s, in microseconds
        error = None
        responses = 0
        while error is None:
            _, error = messages.get(timeout=10)
            responses += error is None
        assert "timeout" in error.message() and 0 < responses < 100
        deadline = time.monotonic() + 10
        while not closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed, "nobody listens: the generator was closed"
        client.stop_stream()
    assert failures(server) == {"deadline_exceeded": 1} and server.stats()["requests_succeeded"] == 0


def test_a_full_queue_refuses_a_streamed_request_on_the_stream() -> None:
    started, gate = threading.Event(), threading.Event()

    def held(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        started.set()
        gate.wait(10)
        yield {"y": inputs["x"]}

    server = fb.Server(held, inputs=[X], outputs=[Y], decoupled=True, max_queue_size=1, max_batch_size=1, name="held")
    with serve_in_thread([server], CONFIG) as listening, Stream(listening.grpc_port) as stream:
        stream.send("held", np.ones((1, 3), np.float32), "0")
        assert started.wait(10)
        for k in range(1, 4):  # one waits, the rest find the queue full
            stream.send("held", np.ones((1, 3), np.float32), str(k))
        refused = [stream.next() for _ in range(2)]
        assert all(e is not None and "queue" in e.message().lower() for _, e in refused)
        gate.set()
        answered = [stream.next() for _ in range(4)]  # two responses, two final flags
        assert all(e is None for _, e in answered)
        stream.close()
    assert failures(server) == {"queue_full": 2} and server.stats()["requests_succeeded"] == 2


# -- in process: client.stream ----------------------------------------------------------------


def test_in_process_streams_each_get_their_rows_of_every_response() -> None:
    server = fb.Server(counting(4), inputs=[X], outputs=[Y], decoupled=True, max_delay=0.02, name="count")

    async def main() -> tuple[list[list[list[float]]], list[tuple[int, ...]]]:
        async with server:
            client = server.client()

            async def one(k: int) -> list[list[float]]:
                return [out["y"].tolist() async for out in client.stream({"x": torch.full((3,), float(k))})]

            rows = await asyncio.gather(*(one(k) for k in range(3)))
            shapes = [tuple(out["y"].shape) async for out in client.stream_batch({"x": torch.ones(2, 3)})]
            return list(rows), shapes

    rows, shapes = asyncio.run(main())
    assert rows == [[[float(k * i)] * 3 for i in range(4)] for k in range(3)]
    assert shapes == [(2, 3)] * 4
    stats = server.stats()
    assert stats["requests_succeeded"] == 4 and not failures(server)
    assert stats["batches"] <= 3, "the three streams shared a batch"


def test_an_in_process_stream_left_early_is_cancelled_and_stops_the_model() -> None:
    closed: list[int] = []

    def slow(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for item in counting(100_000, closed)(inputs):
            time.sleep(0.001)
            yield item

    server = fb.Server(slow, inputs=[X], outputs=[Y], decoupled=True, name="endless")

    async def main() -> int:
        async with server:
            seen = 0
            async for _ in server.client().stream({"x": torch.ones(3)}):
                seen += 1
                if seen == 3:
                    break
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return seen

    assert asyncio.run(main()) == 3
    assert closed and closed[0] < 100_000 - 1
    assert failures(server) == {"cancelled": 1} and server.stats()["requests_succeeded"] == 0


def test_a_stream_left_before_its_end_is_cancelled_even_if_the_model_finished() -> None:
    """Its caller did not see the stream end: counted cancelled, whether or
    not the model's generator was done meanwhile (here it was: all three
    responses were waiting when the caller left after the first)."""
    server = fb.Server(counting(3), inputs=[X], outputs=[Y], decoupled=True, name="short")

    async def main() -> None:
        async with server:
            stream = server.client().stream({"x": torch.ones(3)})
            await anext(stream)
            deadline = time.monotonic() + 10
            while server.stats()["requests_succeeded"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the model's stream ends meanwhile
            await stream.aclose()

    asyncio.run(main())
    assert failures(server) == {"cancelled": 1} and server.stats()["requests_succeeded"] == 0


def test_an_in_process_stream_ends_with_the_models_error_after_its_responses() -> None:
    server = fb.Server(counting(5, fail_at=2), inputs=[X], outputs=[Y], decoupled=True, name="flaky")

    async def main() -> tuple[list[list[float]], BaseException | None]:
        async with server:
            got: list[list[float]] = []
            try:
                async for out in server.client().stream({"x": torch.ones(3)}):
                    got.append(out["y"].tolist())
            except fb.ModelError as exc:
                return got, exc
            return got, None

    got, error = asyncio.run(main())
    assert got == [[0.0] * 3, [1.0] * 3]
    assert error is not None and isinstance(error.__cause__, RuntimeError) and "step 2" in str(error.__cause__)
    assert failures(server) == {"model_error": 1}


def test_each_in_process_response_is_its_own_copy() -> None:
    def reusing(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        buffer = inputs["x"].clone()
        for _ in range(3):
            buffer += 1  # the same tensor, changed in place, yielded again
            yield {"y": buffer}

    server = fb.Server(reusing, inputs=[X], outputs=[Y], decoupled=True, name="reusing")

    async def main() -> list[list[float]]:
        async with server:
            return [out["y"].tolist() async for out in server.client().stream({"x": torch.zeros(3)})]

    assert asyncio.run(main()) == [[1.0] * 3, [2.0] * 3, [3.0] * 3]


def test_infer_on_a_streaming_model_and_stream_on_another_are_refused() -> None:
    streaming = fb.Server(counting(2), inputs=[X], outputs=[Y], decoupled=True, name="streaming")
    plain = fb.Server(lambda b: {"y": b["x"]}, inputs=[X], outputs=[Y], name="plain")

    async def main() -> None:
        async with streaming, plain:
            with pytest.raises(fb.InvalidInputError, match=r"client\.stream"):
                await streaming.client().infer({"x": torch.ones(3)})
            with pytest.raises(fb.InvalidInputError, match="not decoupled"):
                async for _ in plain.client().stream({"x": torch.ones(3)}):
                    pass

    asyncio.run(main())
    assert failures(streaming) == {"invalid_input": 1} and failures(plain) == {"invalid_input": 1}


def test_a_thread_streams_with_stream_sync_and_leaving_early_cancels() -> None:
    closed: list[int] = []

    def slow(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for item in counting(100_000, closed)(inputs):
            time.sleep(0.001)
            yield item

    short = fb.Server(counting(3), inputs=[X], outputs=[Y], decoupled=True, name="short")
    endless = fb.Server(slow, inputs=[X], outputs=[Y], decoupled=True, name="endless")
    flaky = fb.Server(counting(5, fail_at=1), inputs=[X], outputs=[Y], decoupled=True, name="flaky")
    with short.run_in_background(), endless.run_in_background(), flaky.run_in_background():
        got = [out["y"].tolist() for out in short.client().stream_sync({"x": torch.ones(3)})]
        assert got == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
        responses = endless.client().stream_sync({"x": torch.ones(3)})
        assert [next(responses)["y"].tolist() for _ in range(2)] == [[0.0] * 3, [1.0] * 3]
        responses.close()  # left early
        deadline = time.monotonic() + 10
        while not closed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert closed, "the model was stopped"
        with pytest.raises(fb.ModelError):
            list(flaky.client().stream_sync({"x": torch.ones(3)}))
    assert short.stats()["requests_succeeded"] == 1
    assert failures(endless) == {"cancelled": 1} and failures(flaky) == {"model_error": 1}


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_one_stream_holds_at_most_1024_requests_unanswered(frontend: str) -> None:
    gate = threading.Event()

    def held(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        gate.wait(30)
        yield {"y": inputs["x"]}

    server = fb.Server(held, inputs=[X], outputs=[Y], decoupled=True, max_batch_size=1, name="held")
    with (
        serve_in_thread([server], replace(CONFIG, frontend=frontend)) as listening,
        Stream(listening.grpc_port) as stream,
    ):
        for k in range(1100):
            stream.send("held", np.ones((1, 3), np.float32), str(k), final=False)
        deadline = time.monotonic() + 10
        while server.stats()["queue_depth"] < 1023 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert server.stats()["queue_depth"] == 1023, "1024 read: one running, the rest queued"
        gate.set()
        for _ in range(1100):
            assert stream.next()[1] is None
        stream.close()
    assert server.stats()["requests_succeeded"] == 1100


def test_an_in_process_reader_that_falls_behind_is_cut_off_and_others_in_its_batch_go_on() -> None:
    # Each response is 12 bytes: a reader may leave 100 unread (100 ms of the model's).
    server = fb.Server(paced(400), inputs=[X], outputs=[Y], decoupled=True, max_delay=0.05, max_stream_backlog=1200)

    async def main() -> tuple[int, BaseException | None, int]:
        async with server:
            client = server.client()

            async def slow() -> tuple[int, BaseException | None]:
                seen = 0
                deadline = time.monotonic() + 10
                try:
                    async for _ in client.stream({"x": torch.ones(3)}):
                        seen += 1
                        while seen == 1 and time.monotonic() < deadline:
                            if server.stats()["requests_failed"]["queue_full"]:
                                break
                            await asyncio.sleep(0.01)  # stops reading until it is cut off
                except fb.FerrobatchError as exc:
                    return seen, exc
                return seen, None

            async def fast() -> int:
                return len([out async for out in client.stream({"x": torch.ones(3)})])

            (seen, error), read = await asyncio.gather(slow(), fast())
            return seen, error, read

    seen, error, read = asyncio.run(main())
    assert isinstance(error, fb.StreamBacklogError) and isinstance(error, fb.QueueFullError)
    assert "max_stream_backlog (1200)" in str(error)
    assert seen == 1 + 100, "what was held before the bound is still read, then the error"
    assert read == 400, "the other stream of the batch got every response"
    assert failures(server) == {"queue_full": 1} and server.stats()["requests_succeeded"] == 1


def paced(steps: int) -> Any:
    """``counting(steps)``, one response a millisecond: a reader that reads keeps up."""

    def model(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        for item in counting(steps)(inputs):
            time.sleep(0.001)
            yield item

    return model


def test_a_thread_reader_that_falls_behind_is_cut_off_too() -> None:
    server = fb.Server(paced(400), inputs=[X], outputs=[Y], decoupled=True, max_stream_backlog=1200)
    with server.run_in_background():
        responses = server.client().stream_sync({"x": torch.ones(3)})
        seen = [next(responses)]
        deadline = time.monotonic() + 10
        while not server.stats()["requests_failed"]["queue_full"] and time.monotonic() < deadline:
            time.sleep(0.01)  # this thread stops reading; what was handed to it counts
        with pytest.raises(fb.StreamBacklogError):
            seen.extend(responses)
    assert len(seen) <= 1 + 100, "at most the bound's 100 responses were held for it"
    assert failures(server) == {"queue_full": 1}


def test_a_response_counts_its_tensors_and_bytes_elements() -> None:
    from ferrobatch.client import response_bytes

    words = np.array([b"abc", b"de"], dtype=object)
    assert response_bytes({"y": torch.zeros(4, dtype=torch.float64), "w": words, "b": b"xyz"}) == 32 + 5 + 3


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_grpc_client_that_stops_reading_costs_at_most_the_streams_backlog(frontend: str) -> None:
    closed: list[int] = []
    big = fb.TensorSpec("x", "float32", (16384,))  # 64 KiB per response
    server = fb.Server(
        counting(1000, closed), inputs=[big], outputs=[replace(big, name="y")], decoupled=True, name="big"
    )
    short = fb.Server(counting(3), inputs=[X], outputs=[Y], decoupled=True, name="short")
    reading = threading.Event()
    config = replace(CONFIG, frontend=frontend, max_stream_backlog=1 << 20)
    with serve_in_thread([server, short], config) as listening, Stream(listening.grpc_port, reading) as stream:
        stream.send("big", np.ones((1, 16384), np.float32), "a")
        deadline = time.monotonic() + 30
        while not server.stats()["requests_failed"]["queue_full"] and time.monotonic() < deadline:
            time.sleep(0.02)
        reading.set()
        messages = []
        while not messages or messages[-1][1] is None:
            messages.append(stream.next())
        error = messages[-1][1]
        assert isinstance(error, InferenceServerException) and "max_stream_backlog" in error.message()
        assert len(messages) - 1 < 1000 // 2, "most responses were never made"
        stream.send("short", np.ones((1, 3), np.float32), "b")  # the stream goes on
        answered = [stream.next() for _ in range(4)]
        assert all(e is None for _, e in answered) and is_final(answered[-1][0])
        stream.close()
    assert closed and closed[0] < 999, "the model stopped making what no one would read"
    assert failures(server) == {"queue_full": 1} and server.stats()["requests_succeeded"] == 0
    assert short.stats()["requests_succeeded"] == 1


def test_a_stream_bound_below_one_byte_is_refused_where_it_is_given() -> None:
    server = fb.Server(counting(2), inputs=[X], outputs=[Y], decoupled=True)
    with pytest.raises(ValueError, match="max_stream_backlog must be an int >= 1"):
        fb.Server(counting(2), inputs=[X], outputs=[Y], decoupled=True, max_stream_backlog=0)
    with pytest.raises(ValueError, match="max_stream_backlog must be an int from 1"):
        with serve_in_thread([server], replace(CONFIG, max_stream_backlog=-1)):
            pass
