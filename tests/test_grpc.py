"""The v2 GRPCInferenceService of the Python front-end (grpcio), driven by
tritonclient.grpc (sync and aio) and by the vendored stubs, against servers
served on 127.0.0.1 (test_native_grpc.py runs the fixture-based tests against
the native front-end too)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from test_http import (
    MAX_BATCH,
    NUMPY_TYPES,
    WIDTH,
    Gate,
    X,
    Y,
    double,
    make_servers,
    sample_values,
)
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
from ferrobatch.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from ferrobatch.serve import ServeConfig, serve_in_thread


@contextlib.contextmanager
def serving(servers: list[fb.Server]) -> Iterator[str]:
    config = ServeConfig(http_port=None, grpc_port=0, frontend="python", log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield f"127.0.0.1:{listening.grpc_port}"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(make_servers()) as address:
        yield address


@pytest.fixture
def triton(url: str) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url)
    yield client
    client.close()


@pytest.fixture
def stub(url: str) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def code_of(call: Callable[[], Any]) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value.status())


def x_tensor(rows: int = 1, value: float = 1.0, shape: list[int] | None = None) -> grpcclient.InferInput:
    shape = shape or [rows, WIDTH]
    tensor = grpcclient.InferInput("x", shape, "FP32")
    tensor.set_data_from_numpy(np.full(shape, value, np.float32))
    return tensor


# -- health, metadata, inference ---------------------------------------------------------------


def test_health_and_metadata(triton: grpcclient.InferenceServerClient) -> None:
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("double")
    assert triton.is_model_ready("double", "1")
    meta = triton.get_server_metadata(as_json=True)
    assert meta["name"] == "ferrobatch"
    assert meta["version"] == fb.__version__
    assert "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata("double", as_json=True)
    assert model["name"] == "double"
    assert model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", str(WIDTH)]}]
    assert model["outputs"] == [{"name": "y", "datatype": "FP32", "shape": ["-1", str(WIDTH)]}]


def test_infer_rows(triton: grpcclient.InferenceServerClient) -> None:
    x = np.arange(3 * WIDTH, dtype=np.float32).reshape(3, WIDTH)
    tensor = grpcclient.InferInput("x", [3, WIDTH], "FP32")
    tensor.set_data_from_numpy(x)
    result = triton.infer("double", [tensor], request_id="r-9")
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
    response = result.get_response(as_json=True)
    assert response["id"] == "r-9"
    assert response["model_name"] == "double"
    assert response["model_version"] == "1"


def test_every_datatype_round_trips_raw(triton: grpcclient.InferenceServerClient) -> None:
    inputs, expected = [], {}
    for datatype in NUMPY_TYPES:
        values = sample_values(datatype)
        tensor = grpcclient.InferInput("in_" + datatype, list(values.shape), datatype)
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
        expected["out_" + datatype] = values
    bf16 = torch.tensor([[1.5, -2.0, 0.25], [3.0, 0.0, -0.5]], dtype=torch.bfloat16)
    tensor = grpcclient.InferInput("in_BF16", [2, 3], "BF16")
    tensor._raw_content = bf16.view(torch.int16).numpy().tobytes()  # version-independent
    inputs.append(tensor)
    outputs = [grpcclient.InferRequestedOutput(name) for name in [*expected, "out_BF16"]]
    result = triton.infer("types", inputs, outputs=outputs)
    for name, values in expected.items():
        got = result.as_numpy(name)
        assert got.dtype == values.dtype, name
        np.testing.assert_array_equal(got, values, err_msg=name)
    response = result.get_response()
    index = [o.name for o in response.outputs].index("out_BF16")
    assert response.outputs[index].datatype == "BF16"
    assert response.raw_output_contents[index] == tensor._raw_content


def test_typed_contents_and_output_selection(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = pb.ModelInferRequest(model_name="double", id="typed")
    request.inputs.add(name="x", datatype="FP32", shape=[2, WIDTH]).contents.fp32_contents.extend(range(2 * WIDTH))
    request.outputs.add(name="y")
    response = stub.ModelInfer(request)
    assert response.id == "typed"
    assert [o.name for o in response.outputs] == ["y"]
    assert list(response.outputs[0].shape) == [2, WIDTH]
    y = np.frombuffer(response.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(y, np.arange(2 * WIDTH, dtype=np.float32) * 2)


async def test_a_servicer_registered_by_the_generated_code_answers_messages() -> None:
    """``add_to_server`` hands ModelInfer the message's bytes (read in Rust);
    a servicer registered with the generated function gets messages, and
    answers in kind."""
    from ferrobatch.grpc import InferenceServicer

    async with fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, name="double") as server:
        grpc_server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer([server]), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                request = pb.ModelInferRequest(model_name="double", id="msg")
                request.inputs.add(name="x", datatype="FP32", shape=[1, WIDTH]).contents.fp32_contents.extend(
                    [1.5] * WIDTH
                )
                response = await stub.ModelInfer(request)
                streamed = [r async for r in stub.ModelStreamInfer(iter([request]))]
                request.model_name = "nope"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ModelInfer(request)
        finally:
            await grpc_server.stop(None)
    assert response.id == "msg" and np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == [3.0] * WIDTH
    assert len(streamed) == 1 and streamed[0].infer_response.id == "msg" and not streamed[0].error_message
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_aio_concurrent_callers_get_their_own_rows(url: str) -> None:
    client = aiogrpcclient.InferenceServerClient(url)
    try:
        assert await client.is_server_ready()
        assert await client.is_model_ready("double")

        async def call(i: int) -> None:
            x = np.full((1 + i % 3, WIDTH), float(i), np.float32)
            tensor = aiogrpcclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = await client.infer("double", [tensor])
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)

        await asyncio.gather(*(call(i) for i in range(64)))
    finally:
        await client.close()


# -- error statuses --------------------------------------------------------------------------


def test_bad_requests_are_invalid_argument(
    triton: grpcclient.InferenceServerClient, stub: pb_grpc.GRPCInferenceServiceStub
) -> None:
    def infer(tensor: grpcclient.InferInput, model: str = "double", version: str = "") -> None:
        triton.infer(model, [tensor], model_version=version)

    assert code_of(lambda: infer(x_tensor(), "nope")) == "StatusCode.NOT_FOUND"
    assert code_of(lambda: infer(x_tensor(), version="2")) == "StatusCode.NOT_FOUND"
    assert code_of(lambda: triton.get_model_metadata("nope")) == "StatusCode.NOT_FOUND"
    assert code_of(lambda: triton.is_model_ready("nope")) == "StatusCode.NOT_FOUND"
    invalid = "StatusCode.INVALID_ARGUMENT"
    assert code_of(lambda: infer(x_tensor(shape=[1, WIDTH + 1]))) == invalid
    assert code_of(lambda: infer(x_tensor(shape=[WIDTH]))) == invalid
    assert code_of(lambda: infer(x_tensor(MAX_BATCH + 1))) == invalid
    wrong_name = grpcclient.InferInput("z", [1, WIDTH], "FP32")
    wrong_name.set_data_from_numpy(np.zeros((1, WIDTH), np.float32))
    assert code_of(lambda: infer(wrong_name)) == invalid
    wrong_type = grpcclient.InferInput("x", [1, WIDTH], "FP64")
    wrong_type.set_data_from_numpy(np.zeros((1, WIDTH), np.float64))
    assert code_of(lambda: infer(wrong_type)) == invalid
    unknown_output = [grpcclient.InferRequestedOutput("q")]
    assert code_of(lambda: triton.infer("double", [x_tensor()], outputs=unknown_output)) == invalid

    def raw(request: pb.ModelInferRequest) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request)
        return info.value.code()  # type: ignore[no-any-return]

    short = pb.ModelInferRequest(model_name="double")
    short.inputs.add(name="x", datatype="FP32", shape=[1, WIDTH])
    short.raw_input_contents.append(b"\0" * 12)
    assert raw(short) == grpc.StatusCode.INVALID_ARGUMENT
    counts = pb.ModelInferRequest(model_name="double")
    counts.inputs.add(name="x", datatype="FP32", shape=[1, WIDTH])
    counts.raw_input_contents.extend([b"\0" * 16, b"\0" * 16])
    assert raw(counts) == grpc.StatusCode.INVALID_ARGUMENT
    fp16_typed = pb.ModelInferRequest(model_name="types")
    fp16_typed.inputs.add(name="in_FP16", datatype="FP16", shape=[1, 3])
    assert raw(fp16_typed) == grpc.StatusCode.INVALID_ARGUMENT
    assert raw(pb.ModelInferRequest(model_name="double")) == grpc.StatusCode.INVALID_ARGUMENT


def test_model_failure_is_internal(triton: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        triton.infer("broken", [x_tensor()])
    assert info.value.status() == "StatusCode.INTERNAL"
    # Its type and a request id; the text stays in the server's log.
    assert "RuntimeError" in info.value.message()
    assert "request id" in info.value.message()
    assert "the model is broken" not in info.value.message()


def test_unimplemented_rpcs_say_so(triton: grpcclient.InferenceServerClient) -> None:
    # Triton's RPCs beyond those of tests/test_grpc_extensions.py,
    # test_log_settings.py, test_system_shared_memory.py and
    # test_model_control.py (CUDA shared memory's too) are not served.
    assert code_of(lambda: triton.get_trace_settings()) == "StatusCode.UNIMPLEMENTED"
    # Model control is served, off by default as in Triton.
    assert code_of(lambda: triton.load_model("double")) == "StatusCode.UNAVAILABLE"


def test_queue_full_is_unavailable_and_deadline_is_deadline_exceeded() -> None:
    gate, slow = Gate(), Gate()
    servers = [
        fb.Server(gate, inputs=[X], outputs=[Y], max_batch_size=1, max_queue_size=1, name="gated"),
        fb.Server(slow, inputs=[X], outputs=[Y], max_batch_size=1, name="slow"),
    ]
    with serving(servers) as url, ThreadPoolExecutor(4) as pool:
        client = grpcclient.InferenceServerClient(url)
        try:
            first = pool.submit(client.infer, "gated", [x_tensor()])
            assert gate.entered.wait(30)
            queued = pool.submit(client.infer, "gated", [x_tensor()])
            while servers[0].stats()["queue_depth"] < 1:
                threading.Event().wait(0.005)
            assert code_of(lambda: client.infer("gated", [x_tensor()])) == "StatusCode.UNAVAILABLE"
            gate.release.set()
            np.testing.assert_array_equal(first.result().as_numpy("y"), np.full((1, WIDTH), 2.0))
            queued.result()

            held = pool.submit(client.infer, "slow", [x_tensor()])
            assert slow.entered.wait(30)
            # 50 ms deadlines, as the timeout parameter and as the call's deadline.
            late = lambda: client.infer("slow", [x_tensor()], timeout=50_000)  # noqa: E731
            assert code_of(late) == "StatusCode.DEADLINE_EXCEEDED"
            late_call = lambda: client.infer("slow", [x_tensor()], client_timeout=0.05)  # noqa: E731
            assert code_of(late_call) == "StatusCode.DEADLINE_EXCEEDED"
            slow.release.set()
            held.result()
        finally:
            client.close()


def test_servers_not_running_are_not_ready_and_unavailable() -> None:
    from ferrobatch.grpc import grpc_server

    idle = fb.Server(double, inputs=[X], outputs=[Y], name="idle")

    async def scenario() -> None:
        server = grpc_server([idle], None)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = aiogrpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert await client.is_server_live()
            assert not await client.is_server_ready()
            assert not await client.is_model_ready("idle")
            with pytest.raises(InferenceServerException) as info:
                await client.infer("idle", [x_tensor()])
            assert info.value.status() == "StatusCode.UNAVAILABLE"
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_tritonclient_and_ferrobatch_grpc_share_a_process() -> None:
    # Both define inference.* messages; the vendored ones live in a private pool.
    from tritonclient.grpc import service_pb2

    ours = pb.ServerLiveResponse(live=True).SerializeToString()
    assert service_pb2.ServerLiveResponse.FromString(ours).live
    assert pb.ModelInferRequest.DESCRIPTOR.full_name == service_pb2.ModelInferRequest.DESCRIPTOR.full_name


def test_calls_still_waiting_at_shutdown_get_unavailable_not_cancelled() -> None:
    """The model holds its batch past the graceful timeout: the call in it and
    the calls queued behind it are answered UNAVAILABLE, none CANCELLED."""
    gate = Gate()
    server = fb.Server(gate, inputs=[X], outputs=[Y], max_batch_size=1, name="gated")
    config = ServeConfig(http_port=None, grpc_port=0, frontend="python", log_level="warning", graceful_timeout=1)
    with ThreadPoolExecutor(4) as pool:
        try:
            with serve_in_thread([server], config) as listening:
                url = f"127.0.0.1:{listening.grpc_port}"

                def call() -> str:
                    client = grpcclient.InferenceServerClient(url)
                    try:
                        client.infer("gated", [x_tensor()])
                        return "OK"
                    except InferenceServerException as exc:
                        return str(exc.status())
                    finally:
                        client.close()

                calls = [pool.submit(call)]
                assert gate.entered.wait(30)
                calls += [pool.submit(call) for _ in range(3)]
                while server.stats()["queue_depth"] < 3:
                    threading.Event().wait(0.005)
            # Leaving the block shut serve down, the model still held.
            statuses = [c.result(30) for c in calls]
        finally:
            gate.release.set()
    assert statuses == ["StatusCode.UNAVAILABLE"] * 4


def test_messages_over_the_body_limit_are_resource_exhausted() -> None:
    """``max_body_size`` is gRPC's receive limit, on the message as sent and
    after gzip: a compressed message that expands past it is refused too."""
    servers = [fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, name="double")]
    config = ServeConfig(http_port=None, grpc_port=0, frontend="python", log_level="warning", max_body_size=64 * 1024)
    with serve_in_thread(servers, config) as listening:
        url = f"127.0.0.1:{listening.grpc_port}"

        def request(rows: int) -> pb.ModelInferRequest:
            message = pb.ModelInferRequest(model_name="double")
            message.inputs.add(name="x", datatype="FP32", shape=[rows, WIDTH])
            message.raw_input_contents.append(bytes(rows * WIDTH * 4))
            return message

        with grpc.insecure_channel(url) as channel:
            infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
            assert infer(request(1)).outputs[0].shape == [1, WIDTH]
            with pytest.raises(grpc.RpcError) as info:
                infer(pb.ModelInferRequest(model_name="double", id="x" * 100_000))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Zeros: a few hundred bytes of gzip for 128 KiB of message.
            with pytest.raises(grpc.RpcError) as info:
                infer(request(8 * 1024), compression=grpc.Compression.Gzip)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- ModelStreamInfer: how a stream ends ------------------------------------------------------


def stream_request(model: str, rid: str) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model, id=rid)
    message.inputs.add(name="x", datatype="FP32", shape=[1, WIDTH])
    message.raw_input_contents.append(np.ones((1, WIDTH), np.float32).tobytes())
    return message


class OpenStream:
    """A raw ModelStreamInfer call whose requests are sent as put (bytes as
    they are) and whose side stays open until ``close``; its responses and
    how it ended are collected by a thread."""

    _CLOSE = b""

    def __init__(self, channel: grpc.Channel, timeout: float = 30) -> None:
        self._requests: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.responses: queue.SimpleQueue[pb.ModelStreamInferResponse] = queue.SimpleQueue()
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.done = threading.Event()
        method = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda message: message,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        self._call = method(self._sent(), timeout=timeout)
        threading.Thread(target=self._collect, daemon=True).start()

    def send(self, message: bytes | pb.ModelInferRequest) -> None:
        self._requests.put(message if isinstance(message, bytes) else message.SerializeToString())

    def next(self, timeout: float = 10) -> pb.ModelStreamInferResponse:
        return self.responses.get(timeout=timeout)

    def close(self) -> None:
        self._requests.put(self._CLOSE)

    def _sent(self) -> Iterator[bytes]:
        while (message := self._requests.get()) is not self._CLOSE:
            yield message

    def _collect(self) -> None:
        try:
            for response in self._call:
                self.responses.put(response)
            self.ended = (grpc.StatusCode.OK, "")
        except grpc.RpcError as exc:
            self.ended = (exc.code(), exc.details() or "")
        finally:
            self.done.set()


def test_open_streams_end_unavailable_at_shutdown_once_their_requests_are_answered() -> None:
    """An idle stream does not hold the shutdown up (it used to, graceful_timeout
    + 5 s): it ends UNAVAILABLE at once, as natively; a stream with a request in
    flight gets its answer first, then the same."""
    gate = Gate()
    servers = [
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=MAX_BATCH, name="double"),
        fb.Server(gate, inputs=[X], outputs=[Y], max_batch_size=1, name="gated"),
    ]
    config = ServeConfig(http_port=None, grpc_port=0, frontend="python", log_level="warning", graceful_timeout=3)
    streams: list[OpenStream] = []
    try:
        with contextlib.ExitStack() as stack:
            listening = stack.enter_context(serve_in_thread(servers, config))
            channel = grpc.insecure_channel(f"127.0.0.1:{listening.grpc_port}")
            idle, busy = OpenStream(channel), OpenStream(channel)
            streams += [idle, busy]
            idle.send(stream_request("double", "idle"))
            assert idle.next().infer_response.id == "idle"
            busy.send(stream_request("gated", "busy"))
            assert gate.entered.wait(10)
            # The gate opens once the shutdown has begun (well within graceful_timeout).
            threading.Timer(0.5, gate.release.set).start()
            began = time.monotonic()
            stack.close()  # serve shuts down
            took = time.monotonic() - began
        assert took < 2.5, f"the shutdown took {took:.2f} s"
        assert busy.next().infer_response.id == "busy"
        for stream in streams:
            assert stream.done.wait(10)
            assert stream.ended == (
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down: this stream takes no more requests",
            )
            assert stream.responses.empty()
        channel.close()
    finally:
        gate.release.set()
        for stream in streams:
            stream.close()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_an_undecodable_stream_message_ends_the_stream_invalid_argument(frontend: str) -> None:
    """Bytes that are not a ModelInferRequest end the stream INVALID_ARGUMENT
    on both front-ends: the responses already made are sent first, a request
    still running is cancelled, nothing after them is read."""
    release = threading.Event()

    def one_then_wait(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
        yield {"y": inputs["x"]}
        release.wait(30)
        yield {"y": inputs["x"] * 2}

    server = fb.Server(one_then_wait, inputs=[X], outputs=[Y], decoupled=True, name="slow")
    config = ServeConfig(http_port=None, grpc_port=0, frontend=frontend, log_level="warning")
    stream: OpenStream | None = None
    try:
        with (
            serve_in_thread([server], config) as listening,
            grpc.insecure_channel(f"127.0.0.1:{listening.grpc_port}") as channel,
        ):
            stream = OpenStream(channel)
            stream.send(stream_request("slow", "running"))
            first = stream.next()
            assert (first.error_message, first.infer_response.id) == ("", "running")
            stream.send(b"\xff\xff\xff garbage")
            stream.send(stream_request("slow", "never-read"))
            assert stream.done.wait(10)
            assert stream.ended == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "failed to decode Protobuf message: invalid wire type value: 7",
            )
            assert stream.responses.empty()
            release.set()
            deadline = time.monotonic() + 10
            while server.stats()["requests_failed"]["cancelled"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            stats = server.stats()
            assert stats["requests_failed"]["cancelled"] == 1
            assert stats["requests_succeeded"] == 0
    finally:
        release.set()
        if stream is not None:
            stream.close()
