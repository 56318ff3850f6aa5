"""The native gRPC front-end (``ServeConfig(frontend="native")``, the default
of ``ferrobatch serve``): the v2 ``GRPCInferenceService`` answered in Rust,
every call answered and counted once, as the Python servicer answers it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import test_grpc
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from test_http import make_servers
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
from ferrobatch.grpc import grpc_predict_v2_pb2_grpc as pb_grpc
from ferrobatch.http.protocol import EXTENSIONS
from ferrobatch.serve import Listening, ServeConfig, StartupError, serve, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
N = fb.TensorSpec("n", "int64", ())


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    return {"y": x * 2, "n": (x > 0).sum(dim=1)}


def poisoned(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    if bool((x < 0).any()):
        raise ValueError("secret path /srv/model: negative input")
    return double(inputs)


def native(**overrides: Any) -> ServeConfig:
    return ServeConfig(**{"http_port": None, "grpc_port": 0, "frontend": "native", "log_level": "warning", **overrides})


@contextlib.contextmanager
def serving(servers: list[fb.Server], **overrides: Any) -> Iterator[str]:
    with serve_in_thread(servers, native(**overrides)) as listening:
        yield f"127.0.0.1:{listening.grpc_port}"


@pytest.fixture
def served() -> Iterator[tuple[fb.Server, str]]:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=16, max_delay=0.002)
    with serving([server]) as address:
        yield server, address


@contextlib.contextmanager
def client(address: str) -> Iterator[grpcclient.InferenceServerClient]:
    triton = grpcclient.InferenceServerClient(address)
    try:
        yield triton
    finally:
        triton.close()


def x_input(x: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x.astype(np.float32))
    return tensor


def raw_request(x: np.ndarray, model: str = "m", **fields: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, **fields)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    return request


def outcomes(server: fb.Server) -> Counter[str]:
    stats = server.stats()
    return Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]})


def failure(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error: Any = info.value
    return error.code(), error.details()


# -- the Python servicer's conformance tests, against the native front-end ----------


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """Overrides test_grpc's: the same models, served natively."""
    with serving(make_servers()) as address:
        yield address


triton = test_grpc.triton
stub = test_grpc.stub

test_conformance_health_and_metadata = test_grpc.test_health_and_metadata
test_conformance_infer_rows = test_grpc.test_infer_rows
test_conformance_every_datatype_round_trips_raw = test_grpc.test_every_datatype_round_trips_raw
test_conformance_typed_contents_and_output_selection = test_grpc.test_typed_contents_and_output_selection
test_conformance_aio_concurrent_callers = test_grpc.test_aio_concurrent_callers_get_their_own_rows
test_conformance_bad_requests_are_invalid_argument = test_grpc.test_bad_requests_are_invalid_argument
test_conformance_model_failure_is_internal = test_grpc.test_model_failure_is_internal
test_conformance_unimplemented_rpcs_say_so = test_grpc.test_unimplemented_rpcs_say_so


# -- inference ----------------------------------------------------------------------


def test_raw_infer_gives_each_caller_its_rows_and_echoes_the_id(served: tuple[fb.Server, str]) -> None:
    server, address = served
    x = np.array([[1, -2, 3, 0.5], [0, 0, 0, 1]], np.float32)
    with client(address) as triton:
        result = triton.infer("m", [x_input(x)], request_id="r-7")
        np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
        np.testing.assert_array_equal(result.as_numpy("n"), [3, 1])
        response = result.get_response()
        assert (response.id, response.model_name, response.model_version) == ("r-7", "m", "1")
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
            ("y", "FP32", [2, 4]),
            ("n", "INT64", [2]),
        ]
        # One output asked for.
        result = triton.infer("m", [x_input(x[:1])], outputs=[grpcclient.InferRequestedOutput("n")])
        assert [o.name for o in result.get_response().outputs] == ["n"]
        assert result.as_numpy("n").tolist() == [3]
    assert outcomes(server)["succeeded"] == 2


def test_typed_contents_are_decoded_natively(served: tuple[fb.Server, str]) -> None:
    _, address = served
    request = pb.ModelInferRequest(model_name="m", id="typed")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    tensor.contents.fp32_contents.extend(range(-3, 9))
    request.outputs.add(name="y")
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["y"]
    assert list(response.outputs[0].shape) == [3, 4]
    y = np.frombuffer(response.raw_output_contents[0], np.float32)
    np.testing.assert_array_equal(y, np.arange(-3, 9, dtype=np.float32) * 2)


async def test_aio_callers_at_once_share_batches(served: tuple[fb.Server, str]) -> None:
    server, address = served
    triton = aiogrpcclient.InferenceServerClient(address)
    try:

        async def call(i: int) -> None:
            x = np.full((1 + i % 3, 4), float(i), np.float32)
            tensor = aiogrpcclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = await triton.infer("m", [tensor], request_id=str(i))
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)
            assert result.get_response().id == str(i)

        await asyncio.gather(*(call(i) for i in range(48)))
    finally:
        await triton.close()
    stats = server.stats()
    assert stats["requests_succeeded"] == 48
    assert stats["batches"] < 48  # callers at once were batched together


def test_both_listeners_share_one_native_front_end() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    with serve_in_thread([server], native(http_port=0)) as listening:
        assert listening.http_port not in (None, 0) and listening.grpc_port not in (None, 0)
        assert listening.http_port != listening.grpc_port
        with client(f"127.0.0.1:{listening.grpc_port}") as triton:
            assert triton.infer("m", [x_input(np.ones((1, 4)))]).as_numpy("n").tolist() == [4]
        body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,1,1,1]}]}'
        response = httpx.post(f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer", content=body)
        assert response.status_code == 200
    assert outcomes(server)["succeeded"] == 2


def test_listening_reports_the_bound_grpc_port_only() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    with serve_in_thread([server], native()) as listening:
        assert isinstance(listening, Listening)
        assert listening.http_port is None and listening.grpc_port not in (None, 0)


# -- health and metadata ------------------------------------------------------------


def test_health_and_metadata_come_from_the_repositorys_documents(served: tuple[fb.Server, str]) -> None:
    _, address = served
    with client(address) as triton:
        assert triton.is_server_live() and triton.is_server_ready()
        assert triton.is_model_ready("m") and triton.is_model_ready("m", "1")
        meta = triton.get_server_metadata(as_json=True)
        assert meta == {
            "name": "ferrobatch",
            "version": fb.__version__,
            "extensions": list(EXTENSIONS),
        }
        model = triton.get_model_metadata("m", as_json=True)
        assert model == {
            "name": "m",
            "versions": ["1"],
            "platform": "pytorch",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}],
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": ["-1", "4"]},
                {"name": "n", "datatype": "INT64", "shape": ["-1"]},
            ],
        }
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert failure(lambda: stub.ModelReady(pb.ModelReadyRequest(name="nope"))) == (
            grpc.StatusCode.NOT_FOUND,
            "Request for unknown model: 'nope' is not found",
        )
        assert failure(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="m", version="2"))) == (
            grpc.StatusCode.NOT_FOUND,
            "Request for unknown model: 'm' version 2 is not found",
        )


def test_a_model_warming_up_is_known_but_not_ready_and_unavailable() -> None:
    gate = threading.Event()
    warming = threading.Event()

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        warming.set()
        gate.wait(30)
        return double(inputs)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = fb.Server(model, inputs=[X], outputs=[Y, N], name="w", warmup=True)
    address = f"127.0.0.1:{port}"
    serving_cm = serve_in_thread([server], native(grpc_port=port))
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(serving_cm.__enter__)  # returns once the model is ready
        try:
            assert warming.wait(30)
            with client(address) as triton, grpc.insecure_channel(address) as channel:
                assert triton.is_server_live()
                assert not triton.is_server_ready()
                assert not triton.is_model_ready("w")
                assert triton.get_model_metadata("w", as_json=True)["name"] == "w"
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                code, details = failure(lambda: stub.ModelInfer(raw_request(np.ones((1, 4)), "w")))
                assert (code, details) == (
                    grpc.StatusCode.UNAVAILABLE,
                    "Request for unknown model: 'w' has no available versions",
                )
                unknown = pb.ModelReadyRequest(name="x")
                assert failure(lambda: stub.ModelReady(unknown))[0] == grpc.StatusCode.NOT_FOUND
        finally:
            gate.set()
            listening = started.result(60)
    try:
        assert listening.grpc_port == port
        with client(address) as triton:
            assert triton.is_server_ready() and triton.is_model_ready("w")
            assert triton.infer("w", [x_input(np.ones((1, 4)))]).as_numpy("n").tolist() == [4]
    finally:
        serving_cm.__exit__(None, None, None)


# -- errors -------------------------------------------------------------------------


def test_bad_requests_are_invalid_argument_naming_the_problem_and_harm_nothing(
    served: tuple[fb.Server, str],
) -> None:
    server, address = served
    with grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        assert failure(lambda: infer(raw_request(np.ones((1, 4)), "nope"))) == (
            grpc.StatusCode.NOT_FOUND,
            "Request for unknown model: 'nope' is not found",
        )
        cases = {
            "input 'x': expected shape (n, 4), got (1, 3)": raw_request(np.ones((1, 3))),
            "exceeds max_batch_size (16)": raw_request(np.ones((17, 4))),
            "input 'x': FP32 shape [1, 4] needs 16 bytes, got 12": pb.ModelInferRequest(
                model_name="m",
                inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])],
                raw_input_contents=[bytes(12)],
            ),
            "unknown output 'q' for model 'm'; outputs: y, n": raw_request(
                np.ones((1, 4)), outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="q")]
            ),
            "parameter 'timeout' must be an int64 of microseconds >= 0": raw_request(
                np.ones((1, 4)), parameters={"timeout": pb.InferParameter(string_param="1")}
            ),
            "the request has no inputs": pb.ModelInferRequest(model_name="m"),
        }
        for text, request in cases.items():
            code, details = failure(lambda: infer(request))  # noqa: B023 - called at once
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (text, details)
            assert text in details, (text, details)
        wrong_type = pb.ModelInferRequest(model_name="m")
        wrong_type.inputs.add(name="x", datatype="INT32", shape=[1, 4]).contents.int_contents.extend([1, 2, 3, 4])
        assert failure(lambda: infer(wrong_type)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "input 'x': expected dtype float32, got int32",
        )
        assert len(infer(raw_request(np.ones((1, 4)))).outputs) == 2
    # Only the requests that reached the model's inputs are counted.
    seen = outcomes(server)
    assert seen["succeeded"] == 1 and seen["invalid_input"] == 3, seen


def test_a_message_over_the_limit_is_resource_exhausted_sent_or_inflated() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=8192)
    with serving([server], max_body_size=64 * 1024) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        assert list(infer(raw_request(np.ones((8, 4)))).outputs[0].shape) == [8, 4]
        code, details = failure(lambda: infer(raw_request(np.ones((8192, 4)))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit of 65536 bytes" in details
        # Zeros: a few hundred bytes of gzip for 128 KiB of message.
        zeros = raw_request(np.zeros((8192, 4)))
        code, _ = failure(lambda: infer(zeros, compression=grpc.Compression.Gzip))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Still serving, and gzip within the limit is accepted.
        assert len(infer(raw_request(np.ones((2, 4))), compression=grpc.Compression.Gzip).outputs) == 2
    assert outcomes(server)["succeeded"] == 2


def test_a_failing_request_fails_alone_and_the_client_does_not_see_the_models_text() -> None:
    plugged = Held()

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((inputs["x"] == 99).any()):
            return plugged(inputs)  # holds the first batch: the next twelve queue
        return poisoned(inputs)

    server = fb.Server(model, inputs=[X], outputs=[Y, N], name="p", max_batch_size=32, max_delay=0)
    with serving([server]) as address, client(address) as triton:

        def call(i: int) -> str:
            try:
                triton.infer("p", [x_input(np.full((1, 4), -1.0 if i == 5 else float(i)))])
                return "OK"
            except InferenceServerException as exc:
                return f"{exc.status()} {exc.message()}"

        with ThreadPoolExecutor(13) as pool:
            plug = pool.submit(triton.infer, "p", [x_input(np.full((1, 4), 99.0))])
            assert plugged.entered.wait(30)
            calls = [pool.submit(call, i) for i in range(12)]
            while server.stats()["queue_depth"] < 12:
                time.sleep(0.005)
            plugged.release.set()  # the twelve go as one batch, the bad one isolated
            results = [c.result(30) for c in calls]
            plug.result(30)
    assert [r == "OK" for r in results] == [i != 5 for i in range(12)], results
    assert results[5].startswith("StatusCode.INTERNAL model 'p' failed: ValueError (request id")
    assert "secret" not in results[5]
    seen = outcomes(server)
    assert seen["succeeded"] == 12 and seen["model_error"] == 1
    assert server.stats()["batches"] == 2


# -- deadlines and cancellation ------------------------------------------------------


class Held:
    """A model whose first batch waits for ``release``: the next requests queue."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.entered.set()
        self.release.wait(30)
        return double(inputs)


def test_the_timeout_parameter_and_the_calls_deadline_are_deadline_exceeded_counted_once() -> None:
    held = Held()
    server = fb.Server(held, inputs=[X], outputs=[Y, N], name="s", max_batch_size=1, max_delay=0)
    with serving([server]) as address, client(address) as triton, ThreadPoolExecutor(1) as pool:
        first = pool.submit(triton.infer, "s", [x_input(np.ones((1, 4)))])
        assert held.entered.wait(30)
        # Queued behind the held batch: each expires there.
        with pytest.raises(InferenceServerException) as info:
            triton.infer("s", [x_input(np.ones((1, 4)))], timeout=50_000)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert "exceeded its 0.05s timeout" in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            triton.infer("s", [x_input(np.ones((1, 4)))], client_timeout=0.1)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        deadline = time.monotonic() + 5
        while outcomes(server)["deadline_exceeded"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.release.set()
        first.result(30)
    seen = outcomes(server)
    assert seen["deadline_exceeded"] == 2 and seen["succeeded"] == 1 and seen["cancelled"] == 0, seen
    assert server.stats()["batches"] == 1  # the expired requests never ran


def test_a_cancelled_call_withdraws_its_queued_request() -> None:
    held = Held()
    server = fb.Server(held, inputs=[X], outputs=[Y, N], name="g", max_batch_size=1, max_delay=0)
    with serving([server]) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        first = infer.future(raw_request(np.ones((1, 4)), "g"))
        assert held.entered.wait(30)
        queued = infer.future(raw_request(np.full((1, 4), 5.0), "g"))
        while server.stats()["queue_depth"] < 1:
            time.sleep(0.005)
        assert queued.cancel()
        deadline = time.monotonic() + 5
        while outcomes(server)["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.release.set()
        assert list(first.result(30).outputs[0].shape) == [1, 4]
    seen = outcomes(server)
    assert seen["cancelled"] == 1 and seen["succeeded"] == 1, seen
    assert server.stats()["batches"] == 1  # the cancelled request never ran


def test_a_cancelled_call_withdraws_its_request_to_a_bytes_model() -> None:
    """A BYTES model's ModelInfer: a cancelled call withdraws its queued
    request too."""
    from test_native_http import HeldBytes, T

    held = HeldBytes()
    server = fb.Server(held, inputs=[T], outputs=[T], name="b", max_batch_size=1, max_delay=0)

    def request() -> pb.ModelInferRequest:
        message = pb.ModelInferRequest(model_name="b")
        message.inputs.add(name="t", datatype="BYTES", shape=[1, 1])
        message.raw_input_contents.append(len(b"hi").to_bytes(4, "little") + b"hi")
        return message

    with serving([server]) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        first = infer.future(request())
        assert held.entered.wait(30)
        queued = [infer.future(request()) for _ in range(3)]
        deadline = time.monotonic() + 10
        while server.stats()["queue_depth"] < len(queued) and time.monotonic() < deadline:
            time.sleep(0.005)
        for call in queued:
            assert call.cancel()
        while outcomes(server)["cancelled"] < len(queued) and time.monotonic() < deadline:
            time.sleep(0.01)
        held.release.set()
        assert first.result(30).raw_output_contents
    seen = outcomes(server)
    assert seen["cancelled"] == len(queued) and seen["succeeded"] == 1, seen
    assert server.stats()["batches"] == 1  # the cancelled requests never ran


def test_calls_still_waiting_at_shutdown_get_unavailable_not_cancelled() -> None:
    held = Held()
    server = fb.Server(held, inputs=[X], outputs=[Y, N], name="h", max_batch_size=1, max_delay=0)
    with ThreadPoolExecutor(4) as pool:
        try:
            with serving([server], graceful_timeout=1) as address:

                def call() -> str:
                    with client(address) as triton:
                        try:
                            triton.infer("h", [x_input(np.ones((1, 4)))])
                            return "OK"
                        except InferenceServerException as exc:
                            return str(exc.status())

                calls = [pool.submit(call)]
                assert held.entered.wait(30)
                calls += [pool.submit(call) for _ in range(3)]
                while server.stats()["queue_depth"] < 3:
                    time.sleep(0.005)
            statuses = [c.result(30) for c in calls]
        finally:
            held.release.set()
    assert statuses == ["StatusCode.UNAVAILABLE"] * 4
    assert outcomes(server)["server_closed"] == 4


# -- accounting and parity ----------------------------------------------------------


def test_stats_equal_what_the_callers_saw_under_concurrent_load() -> None:
    server = fb.Server(poisoned, inputs=[X], outputs=[Y, N], name="c", max_batch_size=8, max_delay=0.001)
    with serving([server]) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer

        def call(i: int) -> grpc.StatusCode:
            if i % 10 == 3:
                request = raw_request(np.array([[-1, 1, 1, 1]]), "c")
            elif i % 10 == 7:
                request = raw_request(np.ones((1, 2)), "c")
            else:
                request = raw_request(np.full((1 + i % 2, 4), float(i)), "c")
            try:
                infer(request, timeout=30)
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]

        with ThreadPoolExecutor(16) as pool:
            statuses = Counter(pool.map(call, range(200)))
    seen = outcomes(server)
    # Two bad requests in one batch may exhaust the retry budget and fail a
    # few innocent neighbours: whatever the callers saw, stats() saw the same.
    assert statuses[grpc.StatusCode.INVALID_ARGUMENT] == 20 and statuses[grpc.StatusCode.INTERNAL] >= 20
    assert sum(statuses.values()) == 200
    assert (seen["succeeded"], seen["model_error"], seen["invalid_input"]) == (
        statuses[grpc.StatusCode.OK],
        statuses[grpc.StatusCode.INTERNAL],
        20,
    )
    assert sum(seen.values()) == 200


def test_a_grpc_port_in_use_fails_before_warm_up() -> None:
    warmed: list[bool] = []

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        warmed.append(True)
        return double(inputs)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = fb.Server(model, inputs=[X], outputs=[Y, N], name="w", warmup=True)
        with pytest.raises(StartupError, match=f"gRPC: cannot listen on 127.0.0.1:{port}"):
            with serve_in_thread([server], native(http_port=0, grpc_port=port)):
                pass
    assert warmed == []


def test_both_front_ends_give_the_same_model_infer_responses() -> None:
    requests = [raw_request(np.array([[1.5, -2, 0, 1e-8], [3, 3, 3, 3]]), id="q")]
    typed = pb.ModelInferRequest(model_name="m", id="t")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([1, 2, 3, 4])
    typed.outputs.add(name="n")
    requests.append(typed)
    refused = [
        raw_request(np.ones((1, 3))),
        raw_request(np.ones((1, 4)), "nope"),
        raw_request(np.ones((1, 4)), model_version="2"),
        raw_request(np.ones((1, 4)), outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="q")]),
        pb.ModelInferRequest(model_name="m", inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP16")]),
        pb.ModelInferRequest(model_name="m", raw_input_contents=[b"x"]),
    ]
    replies: dict[str, list[object]] = {}
    for frontend in ("native", "python"):
        server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
        with serving([server], frontend=frontend) as address, grpc.insecure_channel(address) as channel:
            rpc = pb_grpc.GRPCInferenceServiceStub(channel)
            replies[frontend] = [
                *(rpc.ModelInfer(r) for r in requests),
                *(failure(partial(rpc.ModelInfer, r)) for r in refused),
                rpc.ModelMetadata(pb.ModelMetadataRequest(name="m")),
                rpc.ServerMetadata(pb.ServerMetadataRequest()),
                rpc.ServerReady(pb.ServerReadyRequest()),
                rpc.ModelReady(pb.ModelReadyRequest(name="m", version="1")),
            ]
    assert replies["native"] == replies["python"]


def test_models_with_bytes_or_variable_length_tensors_are_ready_over_native_grpc() -> None:
    # PyTriton's ModelClient waits for ModelReady: it said false for these.
    text = fb.Server(
        lambda d: {"n": torch.tensor([len(t[0]) for t in d["text"]], dtype=torch.int64)},
        inputs=[fb.TensorSpec("text", "bytes", (1,))],
        outputs=[fb.TensorSpec("n", "int64", ())],
        name="text",
    )
    tokens = fb.Server(
        lambda d: {"t": d["tokens"] + 1},
        inputs=[fb.TensorSpec("tokens", "int64", (-1,), ragged="pad")],
        outputs=[fb.TensorSpec("t", "int64", (-1,), ragged="pad")],
        name="tokens",
    )
    with serving([text, tokens]) as address, client(address) as triton:
        assert triton.is_model_ready("text") and triton.is_model_ready("tokens", "1")
        for name, version in (("tokens", "2"), ("nobody", "")):
            with pytest.raises(InferenceServerException, match="unknown model"):
                triton.is_model_ready(name, version)


# -- the gRPC protocol, as sent on the wire -------------------------------------------


def frame(message: bytes, compressed: bool = False) -> bytes:
    """One length-prefixed gRPC message."""
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


def h2_call(
    address: str,
    path: str,
    body: bytes,
    content_type: str = "application/grpc",
    received_body: bytearray | None = None,
    **headers: str,
) -> dict[str, str]:
    """One HTTP/2 request to the gRPC port, as given: the response's headers
    and trailers (``:status``, ``grpc-status``, ``grpc-message``); its body,
    as sent, into ``received_body`` when given."""
    import h2.config
    import h2.connection
    import h2.events

    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24})
    sent = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", address)]
    sent += [
        ("content-type", content_type),
        ("te", "trailers"),
        *((k.replace("_", "-"), v) for k, v in headers.items()),
    ]
    conn.send_headers(1, sent)
    received: dict[str, str] = {}
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(conn.data_to_send())
        pending = memoryview(body)
        ended = False
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            while pending and conn.local_flow_control_window(1) > 0:
                size = min(len(pending), conn.local_flow_control_window(1), conn.max_outbound_frame_size)
                conn.send_data(1, bytes(pending[:size]), end_stream=size == len(pending))
                pending = pending[size:]
            if not body:
                conn.end_stream(1)
                body = b"-"  # ended once
            sock.sendall(conn.data_to_send())
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    received.update(dict(event.headers))
                if isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                    if received_body is not None:
                        received_body += event.data
                if isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    ended = True
            sock.sendall(conn.data_to_send())
    if "grpc-message" in received:
        received["grpc-message"] = urllib.parse.unquote(received["grpc-message"])
    return received


INFER = "/inference.GRPCInferenceService/ModelInfer"


INVALID_ARGUMENT = str(grpc.StatusCode.INVALID_ARGUMENT.value[0])


def test_a_unary_call_with_two_messages_is_refused_and_runs_nothing(served: tuple[fb.Server, str]) -> None:
    server, address = served
    message = raw_request(np.ones((1, 4))).SerializeToString()
    answer = h2_call(address, INFER, frame(message) + frame(message))
    assert answer["grpc-status"] == INVALID_ARGUMENT, answer
    assert "one request message" in answer["grpc-message"]
    once = h2_call(address, INFER, frame(message))
    assert once["grpc-status"] == "0", once
    assert outcomes(server) == Counter({"succeeded": 1})


def test_a_unary_call_whose_message_never_came_whole_is_answered() -> None:
    """INVALID_ARGUMENT at once: no message before the end of stream, or one
    cut short (grpcio, under the Python front-end, holds such a call until
    the client gives up)."""
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    with serving([server]) as address:
        message = raw_request(np.ones((1, 4))).SerializeToString()
        for body in [b"", frame(message)[:-3], frame(b"")[:3]]:
            started = time.monotonic()
            answer = h2_call(address, INFER, body)
            assert answer.get("grpc-status") == INVALID_ARGUMENT, (body, answer)
            assert "incomplete" in answer["grpc-message"], (body, answer)
            assert time.monotonic() - started < 5, body
        assert h2_call(address, INFER, frame(message))["grpc-status"] == "0"
    assert outcomes(server) == Counter({"succeeded": 1})


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_calls_past_max_streams_on_one_connection_wait_their_turn(frontend: str) -> None:
    """Never refused (grpcio's own limit answers REFUSED_STREAM, UNAVAILABLE)."""
    import tritonclient.grpc.aio as aioclient

    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=4)

    async def calls(address: str) -> list[object]:
        client = aioclient.InferenceServerClient(address)
        try:
            await client.is_server_ready()  # connected before the burst

            async def one(i: int) -> object:
                x = aioclient.InferInput("x", [1, 4], "FP32")
                x.set_data_from_numpy(np.full((1, 4), float(i), np.float32))
                return (await client.infer("m", [x])).as_numpy("y")[0, 0]

            return await asyncio.gather(*(one(i) for i in range(32)), return_exceptions=True)
        finally:
            await client.close()

    with serving([server], frontend=frontend, max_streams=8) as address:
        got = asyncio.run(calls(address))
    assert got == [2.0 * i for i in range(32)], got


def test_malformed_messages_are_the_clients_mistake_not_the_servers(served: tuple[fb.Server, str]) -> None:
    """INVALID_ARGUMENT, never INTERNAL: for ModelInfer (read by the
    front-end) and for the RPCs tonic reads, unary or streamed."""
    server, address = served
    message = raw_request(np.ones((1, 4))).SerializeToString()
    metadata = "/inference.GRPCInferenceService/ModelMetadata"
    stream = "/inference.GRPCInferenceService/ModelStreamInfer"
    cases = {
        (INFER, frame(b"\xff\xff\xff")): "not a ModelInferRequest",
        (INFER, frame(message)[:-3]): "incomplete",
        (INFER, frame(message, compressed=True)): "compressed-flag",
        (metadata, frame(b"\xff\xff\xff")): "failed to decode",
        (stream, frame(b"\xff\xff\xff")): "failed to decode",
    }
    for (path, body), words in cases.items():
        answer = h2_call(address, path, body)
        assert answer["grpc-status"] == INVALID_ARGUMENT, (path, body, answer)
        assert words in answer["grpc-message"], (path, body, answer)
    assert h2_call(address, INFER, frame(message))["grpc-status"] == "0"
    assert outcomes(server) == Counter({"succeeded": 1})


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_both_front_ends_call_a_malformed_message_the_clients_mistake(frontend: str) -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=16, max_delay=0.002)
    with serving([server], frontend=frontend) as address:
        for path in (INFER, "/inference.GRPCInferenceService/ModelMetadata"):
            answer = h2_call(address, path, frame(b"\xff\xff\xff"))
            assert answer["grpc-status"] == INVALID_ARGUMENT, (frontend, path, answer)
        assert h2_call(address, INFER, frame(raw_request(np.ones((1, 4))).SerializeToString()))["grpc-status"] == "0"


def test_an_output_asked_for_twice_is_refused(served: tuple[fb.Server, str]) -> None:
    """Each entry of ``outputs`` is sent in full: repeats would make a
    small request's reply as large as the client likes."""
    server, address = served
    request = raw_request(np.ones((1, 4)))
    request.outputs.add(name="y")
    request.outputs.add(name="n")
    request.outputs.add(name="y")
    with grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        with pytest.raises(grpc.RpcError) as refused:
            infer(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == "output 'y' is asked for twice"
        del request.outputs[2]
        answer = infer(request, timeout=30)
    assert [o.name for o in answer.outputs] == ["y", "n"]
    assert outcomes(server)["succeeded"] == 1


def test_grpc_replies_carry_no_date_header(served: tuple[fb.Server, str]) -> None:
    """gRPC's own servers send no ``Date``; the native front-end's gRPC port
    does not either (one header less to encode per call), answered or refused."""
    _, address = served
    message = raw_request(np.ones((1, 4))).SerializeToString()
    for path, body in ((INFER, frame(message)), ("/inference.GRPCInferenceService/ServerLive", frame(b""))):
        answer = h2_call(address, path, body)
        assert answer["grpc-status"] == "0" and answer[":status"] == "200", answer
        assert "date" not in answer, answer
    refused = h2_call(address, INFER, frame(message), content_type="text/plain")
    assert refused[":status"] == "415" and "date" not in refused, refused


@pytest.mark.parametrize("path", [INFER, "/inference.GRPCInferenceService/ServerLive"])
def test_a_message_encoding_other_than_gzip_or_deflate_is_refused_as_unimplemented(
    served: tuple[fb.Server, str], path: str
) -> None:
    """ModelInfer (answered without tonic) refuses an encoding it cannot read
    as tonic refuses it for the other RPCs: UNIMPLEMENTED, naming those it reads."""
    server, address = served
    message = raw_request(np.ones((1, 4))).SerializeToString() if path == INFER else b""
    answer = h2_call(address, path, frame(message), grpc_encoding="snappy")
    assert answer["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0]), answer
    assert "`snappy` which isn't supported" in answer["grpc-message"]
    assert answer["grpc-accept-encoding"] == "gzip,deflate,identity"
    for accepted in ("identity", "GZIP", "deflate"):
        assert h2_call(address, path, frame(message), grpc_encoding=accepted)["grpc-status"] == "0"
    assert outcomes(server) == (Counter({"succeeded": 3}) if path == INFER else Counter())


@pytest.mark.parametrize("frontend", ["native", "python"])
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_calls_and_streams(frontend: str, algorithm: str) -> None:
    """tritonclient offers gzip and deflate, and Triton reads both."""
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    with serving([server], frontend=frontend) as address, client(address) as triton:
        answer = triton.infer("m", [x_input(x)], compression_algorithm=algorithm)
        assert np.array_equal(answer.as_numpy("y"), x * 2)
        streamed: queue.SimpleQueue[Any] = queue.SimpleQueue()
        triton.start_stream(
            callback=lambda result, error: streamed.put((result, error)), compression_algorithm=algorithm
        )
        triton.async_stream_infer("m", [x_input(x + 1)])
        result, error = streamed.get(timeout=30)
        triton.stop_stream()
    assert error is None, error
    assert np.array_equal(result.as_numpy("y"), (x + 1) * 2)
    assert outcomes(server) == Counter({"succeeded": 2})


@pytest.mark.parametrize("content_type", ["application/json", "application/grpcx", "text/plain", ""])
def test_a_request_that_is_not_grpc_is_refused_with_415(served: tuple[fb.Server, str], content_type: str) -> None:
    server, address = served
    message = raw_request(np.ones((1, 4))).SerializeToString()
    answer = h2_call(address, INFER, frame(message), content_type=content_type)
    assert answer[":status"] == "415", answer
    for accepted in ("application/grpc+proto", "application/grpc;charset=utf-8"):
        assert h2_call(address, INFER, frame(message), content_type=accepted)["grpc-status"] == "0"
    assert outcomes(server) == Counter({"succeeded": 2})


def test_gzip_messages_are_inflated_off_the_runtime_thread() -> None:
    """A stream of small gzip messages that inflate to 48 MB each (sent by
    another process): health checks on the same runtime are not held up
    meanwhile."""
    import statistics
    import subprocess
    import sys

    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m", max_batch_size=16, max_delay=0.002)
    with serve_in_thread([server], native(http_port=0)) as listening:
        address = f"127.0.0.1:{listening.grpc_port}"
        sender = subprocess.Popen(
            [sys.executable, "-c", BOMBS, address, "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(Path(__file__).parent),
        )
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        assert sender.stdout is not None
        stdout = sender.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        waits = []
        try:
            first = lines.get(timeout=60)  # bombs are arriving
            with httpx.Client(base_url=f"http://127.0.0.1:{listening.http_port}", timeout=10) as health:
                for _ in range(60):
                    began = time.perf_counter()
                    assert health.get("/v2/health/live").status_code == 200
                    waits.append(time.perf_counter() - began)
                    time.sleep(0.02)
            assert sender.wait(60) == 0
        finally:
            if sender.poll() is None:
                sender.kill()
                sender.wait(30)
    out = [first]
    while not lines.empty():
        out.append(lines.get())
    # Inflated, then refused for its shape: the bomb is not what the model takes.
    # (Two at least: one before the checks began, more during them; a busy
    # two-core machine inflates about one a second.)
    assert len(out) >= 2 and {line.strip() for line in out} == {str(grpc.StatusCode.INVALID_ARGUMENT.value[0])}, out
    # Inflating on the runtime's thread, every check waits for a bomb (30 ms
    # and more); off it, most answer at once (some wait to be scheduled: the
    # machine may have two cores, busy inflating).
    p25, p50, _ = statistics.quantiles(waits, n=4)
    assert p25 < 0.005, f"health p25 {p25 * 1e3:.1f} ms, p50 {p50 * 1e3:.1f} ms"


#: Sends gzip ModelInfer messages inflating to 48 MB to argv[1] for argv[2]
#: seconds; prints each call's grpc-status.
BOMBS = """
import gzip, sys, time
from test_native_grpc import INFER, frame, h2_call, pb
bomb = pb.ModelInferRequest(model_name="m")
bomb.inputs.add(name="x", datatype="FP32", shape=[1, 4])
bomb.raw_input_contents.append(bytes(48 << 20))
body = frame(gzip.compress(bomb.SerializeToString(), 9), compressed=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    print(h2_call(sys.argv[1], INFER, body, grpc_encoding="gzip").get("grpc-status"), flush=True)
"""


def test_echoed_names_are_clipped_so_the_status_is_the_real_one(served: tuple[fb.Server, str]) -> None:
    """A model, version or input name of 20 KB is echoed clipped: the call
    gets its own status, not RESOURCE_EXHAUSTED for an oversized message."""
    _, address = served
    huge = "n" * 20_000
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        x = np.ones((1, 4))
        for request, code in [
            (raw_request(x, model=huge), grpc.StatusCode.NOT_FOUND),
            (raw_request(x, model_version=huge), grpc.StatusCode.NOT_FOUND),
            (raw_request(x, model="m", id="a"), None),
        ]:
            if code is None:
                request.inputs[0].name = huge
                code = grpc.StatusCode.INVALID_ARGUMENT
            got, message = failure(lambda request=request: stub.ModelInfer(request, timeout=10))
            assert got == code, (got, message[:200])
            assert "nnn..." in message and len(message) < 300, message[:300]
        got, message = failure(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name=huge), timeout=10))
        assert got == grpc.StatusCode.NOT_FOUND and len(message) < 300


def test_datatype_and_shape_are_checked_against_the_model_before_contents_are_converted(
    served: tuple[fb.Server, str],
) -> None:
    """Typed contents of the wrong datatype or shape are refused naming the
    input, expected and actual, before they are converted (too many values
    would be the converter's complaint)."""
    server, address = served
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for datatype, shape, field, expected in [
            ("FP64", [1, 4], "fp64_contents", "input 'x': expected dtype float32, got float64"),
            ("FP32", [1, 5], "fp32_contents", "input 'x': expected shape (n, 4), got (1, 5)"),
        ]:
            request = pb.ModelInferRequest(model_name="m")
            tensor = request.inputs.add(name="x", datatype=datatype, shape=shape)
            getattr(tensor.contents, field).extend([1.0] * 100)
            code, message = failure(lambda request=request: stub.ModelInfer(request, timeout=10))
            assert (code, message) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
    assert outcomes(server)["invalid_input"] == 2


def test_echoed_names_are_clipped_for_bytes_models() -> None:
    """The same for a BYTES model's ModelInfer."""
    from test_native_http import HeldBytes, T

    held = HeldBytes()
    held.release.set()
    server = fb.Server(held, inputs=[T], outputs=[T], name="b", max_batch_size=1, max_delay=0)
    huge = "n" * 20_000
    with serving([server]) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        request = pb.ModelInferRequest(model_name="b", model_version=huge)
        request.inputs.add(name=huge, datatype="BYTES", shape=[1, 1])
        got, message = failure(lambda: infer(request, timeout=10))
        assert got == grpc.StatusCode.NOT_FOUND and "nnn..." in message and len(message) < 300, message[:300]
        request.model_version = ""
        request.inputs[0].contents.bytes_contents.append(b"hi")
        request.outputs.add(name=huge)
        got, message = failure(lambda: infer(request, timeout=10))
        assert got == grpc.StatusCode.INVALID_ARGUMENT and "nnn..." in message and len(message) < 300, message[:300]


STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def slow_double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    time.sleep(0.5)
    return double(inputs)


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_call_over_the_metadata_limit_fails_alone(frontend: str) -> None:
    """RESOURCE_EXHAUSTED for that call, as gRPC's own servers answer: not
    a 431 the client cannot map, nor a GOAWAY that fails every call of the
    channel (tritonclient sends all its calls over one)."""
    server = fb.Server(slow_double, inputs=[X], outputs=[Y, N], name="m", max_delay=0)
    with serving([server], frontend=frontend) as address, grpc.insecure_channel(address) as channel:
        infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer
        running = infer.future(raw_request(np.ones((1, 4))), timeout=30)
        time.sleep(0.1)
        for size in (20_000, 200_000):
            with pytest.raises(grpc.RpcError) as refused:
                infer(raw_request(np.ones((1, 4))), metadata=[("big", "v" * size)], timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (size, refused.value)
            assert "metadata size exceeds" in str(refused.value.details())
        assert running.result().outputs[0].name == "y"
        infer(raw_request(np.ones((1, 4))), metadata=[("small", "v" * 1000)], timeout=30)
    assert outcomes(server) == Counter({"succeeded": 2})


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_stream_message_over_the_limit_is_resource_exhausted(frontend: str) -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    big = raw_request(np.ones((1, 4)), id="x" * 3000).SerializeToString()
    with serving([server], frontend=frontend, max_body_size=2000) as address, grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(STREAM)(iter([big]), timeout=30)
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


def test_a_stream_open_when_the_server_stops_ends_unavailable() -> None:
    """What was in flight is answered; a request sent once the stop has begun
    (readiness already says not ready) is answered if it is read before
    the streams stop being read, else never read: either way the stream
    must not end OK as if every request were answered."""
    server = fb.Server(slow_double, inputs=[X], outputs=[Y, N], name="m", max_delay=0)
    stopping = threading.Event()
    address: list[str] = []

    def stopped_readiness() -> bool:
        with grpc.insecure_channel(address[0]) as probe:
            try:
                return not pb_grpc.GRPCInferenceServiceStub(probe).ServerReady(pb.ServerReadyRequest(), timeout=5).ready
            except grpc.RpcError:
                return True  # no longer answering at all

    def requests() -> Iterator[bytes]:
        yield raw_request(np.ones((1, 4)), id="first").SerializeToString()
        stopping.wait(30)
        deadline = time.monotonic() + 30
        while not stopped_readiness() and time.monotonic() < deadline:  # the stop has begun
            time.sleep(0.02)
        yield raw_request(np.ones((1, 4)), id="late").SerializeToString()
        time.sleep(5)

    ready: queue.SimpleQueue[Listening] = queue.SimpleQueue()
    stop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        stop_box.append((asyncio.get_running_loop(), stop))
        await serve([server], native(graceful_timeout=10), on_ready=ready.put, stop=stop)

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    listening = ready.get(timeout=60)
    address.append(f"127.0.0.1:{listening.grpc_port}")
    channel = grpc.insecure_channel(address[0])
    call = channel.stream_stream(STREAM)(requests(), timeout=30)
    answered = []
    with pytest.raises(grpc.RpcError) as ended:
        for message in call:
            answered.append(pb.ModelStreamInferResponse.FromString(message).infer_response.id)
            if not stopping.is_set():
                stopping.set()
                loop, stop = stop_box[0]
                loop.call_soon_threadsafe(stop.set)
    channel.close()
    thread.join(30)
    assert answered in (["first"], ["first", "late"])
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
    assert "shutting down" in str(ended.value.details())


WIDE = fb.TensorSpec("w", "float32", (65536,))


def widen(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"w": inputs["x"][:, :1].expand(-1, 65536).contiguous()}


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_stream_whose_client_does_not_read_is_sent_no_more(frontend: str) -> None:
    """A model of one response per request: its responses are made before
    their size is known, so the stream holds them (past max_stream_backlog
    too) but reads no more requests until the client reads: what the server
    holds stays bounded, and every request is answered once it does."""
    server = fb.Server(widen, inputs=[X], outputs=[WIDE], name="wide", max_batch_size=8)
    sent = 100  # 256 KiB responses: 25 MiB if all were made

    def requests() -> Iterator[bytes]:
        for i in range(sent):  # a client that keeps sending, 1 s for all
            yield raw_request(np.ones((1, 4)), model="wide", id=str(i)).SerializeToString()
            time.sleep(0.01)

    with serving([server], frontend=frontend, max_stream_backlog=1 << 20) as address:
        channel = grpc.insecure_channel(address)
        call = channel.stream_stream(STREAM)(requests(), timeout=60)
        time.sleep(2.0)  # the client reads nothing meanwhile
        made = server.stats()["requests_succeeded"]
        assert made < sent // 2, made
        ids = {pb.ModelStreamInferResponse.FromString(m).infer_response.id for m in itertools.islice(call, sent)}
        call.cancel()
        channel.close()
    assert ids == {str(i) for i in range(sent)}
    assert server.stats()["requests_succeeded"] == sent


def test_the_python_front_end_counts_a_streams_deadline_as_the_native_one() -> None:
    """The stream call's deadline bounds each of its requests on both
    front-ends: a request it cuts short is deadline_exceeded, not cancelled."""
    counted = {}
    for frontend in ("native", "python"):
        server = fb.Server(slow_double, inputs=[X], outputs=[Y, N], name="m", max_delay=0)
        with serving([server], frontend=frontend) as address, grpc.insecure_channel(address) as channel:
            call = channel.stream_stream(STREAM)(iter([raw_request(np.ones((1, 4))).SerializeToString()]), timeout=0.2)
            # The stream may end DEADLINE_EXCEEDED, or carry the request's
            # error and end first: either way the request was cut short.
            with contextlib.suppress(grpc.RpcError):
                list(call)
            deadline = time.monotonic() + 10
            while sum(outcomes(server).values()) == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        counted[frontend] = outcomes(server)
    assert counted["native"] == counted["python"] == Counter({"deadline_exceeded": 1}), counted


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_tensor_naming_a_shared_memory_region_is_refused_not_answered_in_the_response(frontend: str) -> None:
    """Clients' shared memory is off (the default, as in Triton): a client of
    it would read its output region, not the response, so answering is wrong."""
    import tritonclient.http as httpclient

    server = fb.Server(double, inputs=[X], outputs=[Y, N], name="m")
    config = native(http_port=0, frontend=frontend)
    with serve_in_thread([server], config) as listening:
        grpc_url, http_url = f"127.0.0.1:{listening.grpc_port}", f"127.0.0.1:{listening.http_port}"
        for lib, url in ((grpcclient, grpc_url), (httpclient, http_url)):
            triton = lib.InferenceServerClient(url)
            for shared in ("input", "output"):
                tensor = lib.InferInput("x", [1, 4], "FP32")
                output = lib.InferRequestedOutput("y")
                if shared == "input":
                    tensor.set_shared_memory("region", 16)
                else:
                    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
                    output.set_shared_memory("region", 16)
                with pytest.raises(InferenceServerException, match="shared memory") as refused:
                    triton.infer("m", [tensor], outputs=[output])
                assert f"{shared} '" in str(refused.value), refused.value
                assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), refused.value.status()
            triton.close()
    assert server.stats()["requests_succeeded"] == 0


@pytest.mark.parametrize("frontend", ["native", "python"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_a_streams_requests_reach_the_model_in_the_order_it_sent_them(frontend: str, decoupled: bool) -> None:
    """As a sequence's requests must: each stream's are queued in order, however fast they come."""
    seen: dict[int, list[int]] = {}
    lock = threading.Lock()

    def record(inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        with lock:
            for r, step in zip(requests, inputs["step"][:, 0].tolist()):
                seen.setdefault(int(r.parameters["sequence_id"]), []).append(step)
        return {"echo": inputs["step"]}

    def record_streamed(inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> Iterator[Any]:
        yield record(inputs, requests)

    step = fb.TensorSpec("step", "int32", (1,))
    server = fb.Server(
        record_streamed if decoupled else record,
        inputs=[step],
        outputs=[replace(step, name="echo")],
        name="ordered",
        with_requests=True,
        decoupled=decoupled,
        max_batch_size=8,
        max_delay=0.001,
    )
    streams, steps = 4, 200
    config = native(frontend=frontend, threads=2) if frontend == "native" else native(frontend="python")
    with serve_in_thread([server], config) as listening:
        clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") for _ in range(streams)]
        answers: queue.Queue[Any] = queue.Queue()
        try:
            for c in clients:
                c.start_stream(callback=lambda result, error: answers.put(error or result))
            for n in range(steps):  # the streams' requests interleaved, sent back to back
                for sequence, c in enumerate(clients, start=1):
                    value = grpcclient.InferInput("step", [1, 1], "INT32")
                    value.set_data_from_numpy(np.array([[n]], np.int32))
                    c.async_stream_infer("ordered", [value], sequence_id=sequence, sequence_start=n == 0)
            got = [answers.get(timeout=30) for _ in range(streams * steps)]
        finally:
            for c in clients:
                c.stop_stream()
                c.close()
    assert not [g for g in got if isinstance(g, InferenceServerException)]
    assert seen == {sequence: list(range(steps)) for sequence in range(1, streams + 1)}
