"""ferrobatch.triton as a drop-in for PyTriton: async inference callables,
decoupled plain callables, PyTriton's output casts, grouping and wording,
and its clients' argument checks."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import wait_until

from ferrobatch import RequestInfo
from ferrobatch.triton import (
    ConstantPadder,
    DynamicBatcher,
    ModelConfig,
    PyTritonRuntimeError,
    PyTritonValidationError,
    Request,
    Tensor,
    Triton,
    TritonConfig,
    batch,
    first_value,
    group_by_values,
)
from ferrobatch.triton._binding import BoundModel, TritonContext, collect_outputs, model_config_of
from ferrobatch.triton.client import (
    AsyncioModelClient,
    DecoupledModelClient,
    ModelClient,
    PyTritonClientClosedError,
    PyTritonClientInferenceServerError,
    PyTritonClientValueError,
)

pytestmark = pytest.mark.timeout(60)

X = Tensor(name="x", dtype=np.float32, shape=(1,))
Y = Tensor(name="y", dtype=np.float32, shape=(1,))


def bound(infer: Any, **config: Any) -> BoundModel:
    described = model_config_of("m", 1, ModelConfig(max_batch_size=8, **config), [X], [Y], 1)
    return BoundModel(infer, described, TritonContext(), strict=True, on_unrecoverable=lambda e: None)


def column(*values: float) -> torch.Tensor:
    return torch.tensor([[v] for v in values], dtype=torch.float32)


def test_a_coroutine_callable_runs_on_one_loop_per_worker_thread_kept_across_batches() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return [{"y": r["x"] * 2} for r in requests]

    model = bound(infer)
    first = model({"x": column(1, 2)}, [RequestInfo(1), RequestInfo(1)])
    second = model({"x": column(3)}, [RequestInfo(1)])
    assert isinstance(first, dict) and isinstance(second, dict)
    np.testing.assert_array_equal(first["y"], [[2], [4]])
    np.testing.assert_array_equal(second["y"], [[6]])
    assert loops[0] is loops[1] and not loops[0].is_closed()
    other: list[dict[str, Any]] = []
    worker = threading.Thread(target=lambda: other.append(model({"x": column(5)}, [RequestInfo(1)])))  # type: ignore[arg-type]
    worker.start()
    worker.join(10)
    assert loops[2] is not loops[0]  # another worker thread: a loop of its own
    np.testing.assert_array_equal(other[0]["y"], [[10]])


def test_an_async_generator_streams_and_is_closed_when_the_stream_is_left() -> None:
    closed: list[bool] = []

    async def infer(requests: list[Request]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        try:
            for i in range(3):
                await asyncio.sleep(0)
                yield [{"y": r["x"] + i} for r in requests]
        finally:
            closed.append(True)

    stream = bound(infer, decoupled=True)({"x": column(1)}, [RequestInfo(1)])
    assert isinstance(stream, Iterator)
    assert [out["y"].tolist() for out in stream] == [[[1]], [[2]], [[3]]]
    left = bound(infer, decoupled=True)({"x": column(1)}, [RequestInfo(1)])
    assert isinstance(left, Iterator)
    next(left)
    left.close()  # as the executor does when every caller went away
    assert closed == [True, True]


def test_a_decoupled_plain_callable_gives_one_response() -> None:
    stream = bound(lambda requests: [{"y": r["x"] * 2} for r in requests], decoupled=True)(
        {"x": column(1, 2)}, [RequestInfo(2)]
    )
    assert isinstance(stream, Iterator)
    assert [out["y"].tolist() for out in stream] == [[[2], [4]]]


def test_batch_refuses_an_async_function_as_pytriton_cannot_run_it() -> None:
    async def double(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2}

    with pytest.raises(PyTritonValidationError, match="synchronously"):
        batch(double)([Request({"x": np.ones((1, 1), np.float32)})])


def test_async_and_plain_decoupled_callables_answer_tritonclient() -> None:
    async def coro(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        await asyncio.sleep(0.001)
        return [{"y": r["x"] * 2} for r in requests]

    async def agen(requests: list[Request]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        for i in range(3):
            await asyncio.sleep(0.001)
            yield [{"y": r["x"] + i} for r in requests]

    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)) as triton:
        triton.bind("coro", coro, [X], [Y], config=ModelConfig(max_batch_size=4))
        triton.bind("agen", agen, [X], [Y], config=ModelConfig(max_batch_size=4, decoupled=True))
        triton.bind("plain", lambda rs: [{"y": r["x"]} for r in rs], [X], [Y], config=ModelConfig(decoupled=True))
        triton.run()
        grpc = f"grpc://127.0.0.1:{triton.grpc_port}"
        with ModelClient(f"http://127.0.0.1:{triton.http_port}", "coro", init_timeout_s=10) as client:
            assert client.infer_sample(np.float32([3]))["y"].tolist() == [6]
        with DecoupledModelClient(grpc, "agen", init_timeout_s=10) as stream:
            assert [o["y"].tolist() for o in stream.infer_sample(np.float32([1]))] == [[1], [2], [3]]
        with DecoupledModelClient(grpc, "plain", init_timeout_s=10) as stream:
            assert [o["y"].tolist() for o in stream.infer_sample(np.float32([7]))] == [[7]]


def test_a_missing_output_says_what_pytriton_would_send() -> None:
    config = model_config_of("m", 1, ModelConfig(), [X], [Y, Tensor(name="z", dtype=np.float32, shape=(1,))], 1)
    with pytest.raises(PyTritonValidationError, match=r"no output 'z'.*PyTriton sends only"):
        collect_outputs([{"y": np.ones((1, 1), np.float32)}], [1], config, strict=False)


def test_group_by_values_groups_and_orders_as_pytriton() -> None:
    calls: list[list[float]] = []

    @batch
    @group_by_values("k")
    def infer(x: np.ndarray, k: np.ndarray) -> dict[str, np.ndarray]:
        calls.append(k.tolist())
        return {"y": x}

    def run(keys: list[float]) -> list[list[float]]:
        calls.clear()
        infer([Request({"x": np.zeros((len(keys), 1), np.float32), "k": np.array(keys)})])
        return calls

    assert run([256, 1, 256, 1]) == [[1, 1], [256, 256]]  # by value, not by bytes
    assert run([0.0, -0.0]) == [[0.0, -0.0]]
    assert [len(c) for c in run([np.nan, np.nan])] == [1, 1]


def test_decorator_errors_use_pytritons_words() -> None:
    @batch
    def wrong_rows(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": np.concatenate([x, x])}

    with pytest.raises(ValueError, match=r"different batch sizes: y: \(2, 1\)\. Expected batch size: 1\."):
        wrong_rows([Request({"x": np.ones((1, 1), np.float32)})])
    with pytest.raises(PyTritonRuntimeError, match="To proceed, either disable strict mode"):
        first_value("t")(lambda requests: requests)([Request({"t": np.array([[1.0], [2.0]])})])
    with pytest.raises(PyTritonRuntimeError, match="All input arrays for given input name must have the same dtype"):
        ConstantPadder()([{"y": np.ones((1, 1), np.int32)}, {"y": np.ones((1, 1), np.float32)}])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_model_client_checks_its_arguments_and_refuses_calls_after_close(scheme: str) -> None:
    config = model_config_of("m", 1, ModelConfig(max_batch_size=4), [X], [Y], 1)
    url = f"{scheme}://127.0.0.1:{closed_port()}"  # nothing listens: no check may reach a server
    client = ModelClient(url, "m", model_config=config, ensure_model_is_ready=False, inference_timeout_s=5)
    with pytest.raises(PyTritonClientValueError, match="Provide input data"):
        client.infer_sample()
    with pytest.raises(PyTritonClientValueError, match="string, integer or boolean"):
        client.infer_sample(np.float32([1]), parameters={"p": 1.5})
    twin = ModelClient.from_existing_client(client)
    assert (twin.url, twin.scheme, twin.model_name, twin.model_config) == (client.url, scheme, "m", config)
    client.close()
    with pytest.raises(PyTritonClientClosedError):
        client.infer_sample(np.float32([1]))
    twin.close()


def test_asyncio_model_client_from_existing_client_and_after_close() -> None:
    config = model_config_of("m", 1, ModelConfig(max_batch_size=4), [X], [Y], 1)

    async def main() -> None:
        client = AsyncioModelClient(f"http://127.0.0.1:{closed_port()}", "m", model_config=config, init_timeout_s=3)
        twin = AsyncioModelClient.from_existing_client(client)
        assert (twin.url, twin.model_name, await twin.model_config) == (client.url, "m", config)
        await twin.close()
        await client.close()
        with pytest.raises(PyTritonClientClosedError):
            await client.infer_sample(np.float32([1]))

    asyncio.run(main())


SAMPLE = [Tensor(name="x", dtype=np.float32, shape=(-1,))], [Tensor(name="y", dtype=np.float32, shape=(-1,))]


def test_a_decoupled_client_iterator_closed_unread_cancels_its_request_and_frees_the_client() -> None:
    running: set[float] = set()  # the first input of each request whose generator runs

    @batch
    def endless(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        key = float(x.ravel()[0])
        running.add(key)
        try:
            while True:
                time.sleep(0.005)
                yield {"y": x}
        finally:
            running.discard(key)

    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)) as triton:
        triton.bind("endless", endless, *SAMPLE, config=ModelConfig(max_batch_size=4, decoupled=True))
        triton.run()
        with DecoupledModelClient(f"grpc://127.0.0.1:{triton.grpc_port}", "endless", init_timeout_s=10) as client:
            client.infer_sample(np.float32([1])).close()  # closed before its first next()
            unread = client.infer_sample(np.float32([2]))
            del unread  # dropped before its first next(): the client stays busy, as PyTriton's
            with pytest.raises(PyTritonClientInferenceServerError, match="in progress"):
                client.infer_sample(np.float32([4]))
        with DecoupledModelClient(f"grpc://127.0.0.1:{triton.grpc_port}", "endless", init_timeout_s=10) as client:
            third = client.infer_sample(np.float32([3]))
            assert next(third)["y"].tolist() == [3]
            third.close()
            assert wait_until(lambda: not running), f"requests left running: {running}"


def test_a_decoupled_client_opens_a_new_stream_once_the_server_ended_its_own() -> None:
    grpc_port, http_port = closed_port(), closed_port()
    release = threading.Event()

    @batch
    def steps(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for i in range(3):
            if i > 0 and x.ravel()[0] < 0:  # a request left waiting, after its first response, while the server stops
                release.wait(10)
            yield {"y": x + i}

    def serve() -> Triton:
        triton = Triton(
            config=TritonConfig(
                grpc_port=grpc_port, http_port=http_port, grpc_address="127.0.0.1", http_address="127.0.0.1",
                allow_metrics=False, exit_timeout_secs=1,
            )
        )  # fmt: skip
        triton.bind("steps", steps, *SAMPLE, config=ModelConfig(max_batch_size=4, decoupled=True))
        triton.run()
        return triton

    def three(client: DecoupledModelClient, value: float) -> list[list[float]]:
        return [out["y"].tolist() for out in client.infer_sample(np.float32([value]))]

    client = DecoupledModelClient(f"grpc://127.0.0.1:{grpc_port}", "steps", init_timeout_s=10)
    try:
        first = serve()
        try:
            assert three(client, 1) == [[1], [2], [3]]
        finally:
            first.stop()  # ends the idle stream
        second = serve()
        stopping = threading.Thread(target=second.stop)
        try:
            assert three(client, 1) == [[1], [2], [3]]
            assert three(client, 4) == [[4], [5], [6]]
            waiting = client.infer_sample(np.float32([-1]))
            assert next(waiting)["y"].tolist() == [-1]
            stopping.start()
            with pytest.raises(PyTritonClientInferenceServerError, match="inference failed"):
                next(waiting)  # the call the stream ends under fails, and frees the client
        finally:
            release.set()
            if stopping.ident is None:
                second.stop()
            else:
                stopping.join(10)
        third = serve()
        try:
            assert three(client, 7) == [[7], [8], [9]]
        finally:
            third.stop()
    finally:
        client.close()


class CuttableProxy:
    """A TCP proxy to ``port`` whose connections ``cut()`` closes: a lost connection, the server still up."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            far = socket.create_connection(("127.0.0.1", self.target))
            self.open += [near, far]
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            end.close()

    def cut(self) -> None:
        for connection in self.open:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.open.clear()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_decoupled_call_whose_connection_is_lost_fails_and_the_next_opens_a_new_stream() -> None:
    release = threading.Event()

    @batch
    def steps(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for i in range(3):
            if x.ravel()[0] < 0 and i == 1:  # a request left waiting while its connection is cut
                release.wait(10)
            yield {"y": x + i}

    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)) as triton:
        triton.bind("steps", steps, *SAMPLE, config=ModelConfig(max_batch_size=4, decoupled=True))
        triton.run()
        proxy = CuttableProxy(triton.grpc_port)
        try:
            with DecoupledModelClient(f"grpc://127.0.0.1:{proxy.port}", "steps", init_timeout_s=10) as client:
                waiting = client.infer_sample(np.float32([-1]))
                assert next(waiting)["y"].tolist() == [-1]
                proxy.cut()
                with pytest.raises(PyTritonClientInferenceServerError, match="the stream to the server ended"):
                    next(waiting)
                release.set()
                assert [out["y"].tolist() for out in client.infer_sample(np.float32([1]))] == [[1], [2], [3]]
        finally:
            release.set()
            proxy.close()


def test_a_decoupled_batch_group_that_raises_fails_only_its_own_requests() -> None:
    """Requests of two shapes share a batch: the callable runs once per shape (as behind
    Triton's batcher); the group that raises fails alone, the other streams to its end."""
    import queue

    import tritonclient.grpc as grpcclient

    tokens = Tensor(name="a", dtype=np.float32, shape=(-1,))
    calls: list[tuple[int, ...]] = []

    @batch
    def steps(a: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        calls.append(a.shape)
        for i in range(3):
            if a.shape[1] == 2 and i == 1:
                raise RuntimeError("the group of length 2 fails at step 1")
            yield {"y": a + i}

    config = ModelConfig(max_batch_size=8, decoupled=True, batcher=DynamicBatcher(max_queue_delay_microseconds=300_000))
    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False)) as triton:
        triton.bind("steps", steps, [tokens], [Tensor(name="y", dtype=np.float32, shape=(-1,))], config=config)
        triton.run()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.grpc_port}")
        messages: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: messages.put((result, error)))
        for request_id, n in (("short", 2), ("long", 3)):
            given = grpcclient.InferInput("a", [1, n], "FP32")
            given.set_data_from_numpy(np.ones((1, n), np.float32))
            client.async_stream_infer("steps", [given], request_id=request_id, enable_empty_final_response=True)
        got: list[tuple[Any, Any]] = []
        while (
            sum(1 for _, error in got if error is not None)
            + sum(
                1
                for result, _ in got
                if result is not None and result.get_response().parameters["triton_final_response"].bool_param
            )
            < 2
        ):
            got.append(messages.get(timeout=20))
        client.stop_stream()
        stats = triton.servers[0].stats()
    assert sorted(calls) == [(1, 2), (1, 3)]
    long = [
        r.as_numpy("y").tolist()
        for r, e in got
        if e is None and r.get_response().id == "long" and r.as_numpy("y") is not None
    ]
    assert long == [[[1.0, 1.0, 1.0]], [[2.0, 2.0, 2.0]], [[3.0, 3.0, 3.0]]]
    errors = [str(e) for _, e in got if e is not None]
    assert len(errors) == 1 and "fails at step 1" in errors[0]
    assert stats["requests_succeeded"] == 1 and stats["requests_failed"]["model_error"] == 1


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_request_names_the_outputs_its_client_asked_for_and_may_leave_the_others_out(frontend: str) -> None:
    # PyTriton's Request.requested_output_names (Triton's requested outputs):
    # a callable may compute only those; the others are never sent.
    import httpx
    import tritonclient.http as httpclient

    seen: list[list[str] | None] = []

    def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            seen.append(request.requested_output_names)
            outputs = {"y": request["x"] * 2, "z": request["x"] * 3}
            responses.append({name: outputs[name] for name in request.requested_output_names})
        return responses

    z = Tensor(name="z", dtype=np.float32, shape=(1,))
    with Triton(config=TritonConfig(http_port=0, grpc_port=0, allow_metrics=False), frontend=frontend) as triton:
        triton.bind("pick", infer, [X], [Y, z], config=ModelConfig(max_batch_size=4))
        triton.run()
        client = httpclient.InferenceServerClient(f"127.0.0.1:{triton.http_port}")
        x = httpclient.InferInput("x", [1, 1], "FP32")
        x.set_data_from_numpy(np.float32([[2.0]]))
        only_z = client.infer("pick", [x], outputs=[httpclient.InferRequestedOutput("z")])
        assert only_z.as_numpy("z").tolist() == [[6.0]] and only_z.as_numpy("y") is None
        both = client.infer("pick", [x])
        assert both.as_numpy("y").tolist() == [[4.0]] and both.as_numpy("z").tolist() == [[6.0]]
        # JSON names its outputs the same way.
        body = {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}],
            "outputs": [{"name": "y"}],
        }
        answer = httpx.post(f"http://127.0.0.1:{triton.http_port}/v2/models/pick/infer", json=body, timeout=10).json()
        assert [o["name"] for o in answer["outputs"]] == ["y"]
    assert seen == [["z"], ["y", "z"], ["y"]]
