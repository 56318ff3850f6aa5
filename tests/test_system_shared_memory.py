"""Triton's system shared-memory extension (``--allow-client-shm``):
tritonclient registers POSIX shared-memory regions over HTTP or gRPC, names
them in infer requests for inputs and outputs, and reads the outputs from
them, on the native and the Python front-ends; every mistake is a 4xx /
INVALID_ARGUMENT that harms nothing else; off by default (501 /
UNIMPLEMENTED), as in Triton."""

from __future__ import annotations

import argparse
import os
import queue
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import wait_until
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

import ferrobatch as fb
from ferrobatch.serve import Listening, ServeConfig, add_arguments, serve_in_thread

pytestmark = pytest.mark.timeout(60)

X = fb.TensorSpec("x", "float32", (4,))
K = fb.TensorSpec("k", "int32", ())
Y = fb.TensorSpec("y", "float32", (4,))
Z = fb.TensorSpec("z", "int32", (4,))
TEXT = fb.TensorSpec("text", "bytes", (1,))
UPPER = fb.TensorSpec("upper", "bytes", (1,))


def scale(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    y = inputs["x"] * inputs["k"][:, None]
    return {"y": y, "z": y.to(torch.int32)}


def shout(batch: dict[str, Any]) -> dict[str, Any]:
    return {"upper": np.array([[t.upper()] for t in batch["text"][:, 0]], dtype=object)}


def shouting(batch: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A decoupled ``shout``: one response per request."""
    yield shout(batch)


def servers() -> list[fb.Server]:
    return [
        fb.Server(scale, inputs=[X, K], outputs=[Y, Z], name="scale", max_batch_size=8, max_delay=0.002),
        fb.Server(shout, inputs=[TEXT], outputs=[UPPER], name="shout", max_batch_size=8),
        fb.Server(shouting, inputs=[TEXT], outputs=[UPPER], name="shouts", max_batch_size=8, decoupled=True),
    ]


def serving(frontend: str, **options: Any) -> Any:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning", threads=1, **options)
    return serve_in_thread(servers(), config)


@pytest.fixture(params=["native", "python"])
def served(request: pytest.FixtureRequest) -> Iterator[Listening]:
    with serving(request.param, allow_client_shm=True) as listening:
        yield listening


class Regions:
    """Shared-memory objects made for one test, destroyed after it."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, size: int) -> tuple[str, Any]:
        key = f"/fb-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region(key[1:], key, size)
        self.handles.append(handle)
        return key, handle

    def close(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.close()


def clients(listening: Listening) -> list[Any]:
    return [
        httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}"),
        grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}"),
    ]


def module_of(client: Any) -> Any:
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def statuses(client: Any, name: str = "") -> dict[str, tuple[str, int, int]]:
    """The regions the server lists, by name: ``(key, offset, byte_size)``."""
    if isinstance(client, httpclient.InferenceServerClient):
        return {
            r["name"]: (r["key"], r["offset"], r["byte_size"]) for r in client.get_system_shared_memory_status(name)
        }
    listed = client.get_system_shared_memory_status(name, as_json=True).get("regions", {})
    return {n: (r["key"], int(r.get("offset", 0)), int(r["byte_size"])) for n, r in listed.items()}


def scale_request(module: Any, rows: int, x_region: str, out_region: str, *, x_offset: int = 0) -> tuple[Any, Any]:
    """Inputs ``x`` from ``x_region`` and ``k`` in the request (twos);
    outputs ``y`` into ``out_region`` and ``z`` into its second half."""
    x = module.InferInput("x", [rows, 4], "FP32")
    x.set_shared_memory(x_region, rows * 16, offset=x_offset)
    k = module.InferInput("k", [rows], "INT32")
    k.set_data_from_numpy(np.full(rows, 2, dtype=np.int32))
    y = module.InferRequestedOutput("y")
    y.set_shared_memory(out_region, rows * 16)
    z = module.InferRequestedOutput("z")
    z.set_shared_memory(out_region, rows * 16, offset=512)
    return [x, k], [y, z]


def test_inputs_and_outputs_travel_through_regions(served: Listening, regions: Regions) -> None:
    rows = 3
    data = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4) + 0.5
    in_key, in_handle = regions.make(4096)
    out_key, out_handle = regions.make(1024)
    shm.set_shared_memory_region(in_handle, [data], offset=64)
    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("input", in_key, 4096)
            client.register_system_shared_memory("output", out_key, 1024)
            assert statuses(client) == {"input": (in_key, 0, 4096), "output": (out_key, 0, 1024)}
            assert statuses(client, "output") == {"output": (out_key, 0, 1024)}
            inputs, outputs = scale_request(module, rows, "input", "output", x_offset=64)
            result = client.infer("scale", inputs, outputs=outputs)
            # Triton's reply: the outputs' names, datatypes and shapes, their bytes in the region.
            # Triton's reply: the outputs' names, datatypes and shapes, their bytes in the region.
            response = result.get_response(as_json=True) if module is grpcclient else result.get_response()
            described = {o["name"]: o for o in response["outputs"]}
            assert [int(d) for d in described["y"]["shape"]] == [rows, 4]
            assert described["z"]["datatype"] == "INT32"
            assert "data" not in described["y"] and "parameters" not in described["y"]
            y = shm.get_contents_as_numpy(out_handle, np.float32, [rows, 4])
            z = shm.get_contents_as_numpy(out_handle, np.int32, [rows, 4], offset=512)
            np.testing.assert_array_equal(y, data * 2)
            np.testing.assert_array_equal(z, (data * 2).astype(np.int32))
            # The region is read at each request: new bytes, new answer.
            shm.set_shared_memory_region(in_handle, [data * 10], offset=64)
            client.infer("scale", inputs, outputs=outputs)
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [rows, 4]), data * 20)
            shm.set_shared_memory_region(in_handle, [data], offset=64)
            client.unregister_system_shared_memory("input")
            assert statuses(client) == {"output": (out_key, 0, 1024)}
            with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'input'"):
                client.infer("scale", inputs, outputs=outputs)
            client.unregister_system_shared_memory()
            assert statuses(client) == {}
        finally:
            client.close()


def test_outputs_in_the_response_and_in_a_region_mix(served: Listening, regions: Regions) -> None:
    """``y`` in a region, ``z`` in the response: each where it was asked."""
    data = np.ones((2, 4), dtype=np.float32)
    out_key, out_handle = regions.make(64)
    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("out", out_key, 64)
            x = module.InferInput("x", [2, 4], "FP32")
            x.set_data_from_numpy(data)
            k = module.InferInput("k", [2], "INT32")
            k.set_data_from_numpy(np.array([3, 4], dtype=np.int32))
            y = module.InferRequestedOutput("y")
            y.set_shared_memory("out", 32)
            z = module.InferRequestedOutput("z")
            result = client.infer("scale", [x, k], outputs=[y, z])
            np.testing.assert_array_equal(result.as_numpy("z"), [[3] * 4, [4] * 4])
            np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [2, 4]), [[3] * 4, [4] * 4])
            client.unregister_system_shared_memory("out")
        finally:
            client.close()


def test_the_grpc_stream_reads_and_writes_regions_too(served: Listening, regions: Regions) -> None:
    import queue

    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    in_key, in_handle = regions.make(64)
    out_key, out_handle = regions.make(1024)
    shm.set_shared_memory_region(in_handle, [data])
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    answers: queue.Queue[Any] = queue.Queue()
    try:
        client.register_system_shared_memory("input", in_key, 64)
        client.register_system_shared_memory("output", out_key, 1024)
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        inputs, outputs = scale_request(grpcclient, 2, "input", "output")
        client.async_stream_infer("scale", inputs, outputs=outputs)
        answer = answers.get(timeout=30)
        assert not isinstance(answer, InferenceServerException), answer
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [2, 4]), data * 2)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.int32, [2, 4], offset=512), data * 2)
        inputs, outputs = scale_request(grpcclient, 2, "input", "nowhere")
        client.async_stream_infer("scale", inputs, outputs=outputs)
        refused = answers.get(timeout=30)
        assert isinstance(refused, InferenceServerException) and "Unable to find shared memory region" in str(refused)
    finally:
        client.stop_stream()
        client.close()


def test_one_output_in_a_region_and_another_as_classes(served: Listening, regions: Regions) -> None:
    """An output is never both; two outputs of one request may be one each
    (every way a request is answered: HTTP, gRPC, a gRPC stream)."""
    import queue

    data = np.array([[1, 5, 3, 2], [4, 0, 9, 7]], dtype=np.float32)
    in_key, in_handle = regions.make(64)
    out_key, out_handle = regions.make(1024)
    shm.set_shared_memory_region(in_handle, [data])

    def check(answer: Any) -> None:
        assert not isinstance(answer, InferenceServerException), answer
        classes = [[c.decode() if isinstance(c, bytes) else c for c in row] for row in answer.as_numpy("z")]
        assert classes == [["10:1", "6:2"], ["18:2", "14:3"]]
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [2, 4]), data * 2)
        shm.set_shared_memory_region(out_handle, [np.zeros((2, 4), np.float32)])

    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("input", in_key, 64)
            client.register_system_shared_memory("output", out_key, 1024)
            inputs, (y, _) = scale_request(module, 2, "input", "output")
            z = module.InferRequestedOutput("z", class_count=2)
            check(client.infer("scale", inputs, outputs=[y, z]))
            if module is grpcclient:
                streamed: queue.Queue[Any] = queue.Queue()
                client.start_stream(callback=lambda result, error, answers=streamed: answers.put(error or result))
                client.async_stream_infer("scale", inputs, outputs=[y, z])
                check(streamed.get(timeout=30))
                client.stop_stream()
        finally:
            client.unregister_system_shared_memory()
            client.close()


def test_bytes_tensors_travel_through_regions(served: Listening, regions: Regions) -> None:
    texts = np.array([[b"hello"], [b"shared memory"]], dtype=object)
    serialized = serialize_byte_tensor(texts)
    wire = serialized.item()
    in_key, in_handle = regions.make(len(wire))
    out_key, out_handle = regions.make(256)
    shm.set_shared_memory_region(in_handle, [serialized])
    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("text", in_key, len(wire))
            client.register_system_shared_memory("upper", out_key, 256)
            text = module.InferInput("text", [2, 1], "BYTES")
            text.set_shared_memory("text", len(wire))
            upper = module.InferRequestedOutput("upper")
            upper.set_shared_memory("upper", 256)
            client.infer("shout", [text], outputs=[upper])
            got = shm.get_contents_as_numpy(out_handle, np.object_, [2, 1])
            assert got.tolist() == [[b"HELLO"], [b"SHARED MEMORY"]]
            client.unregister_system_shared_memory()
        finally:
            client.close()


def test_a_bytes_output_too_large_for_its_region_fails_and_is_counted_as_the_clients(
    served: Listening, regions: Regions
) -> None:
    """Only the model's answer says a BYTES output's size: the 400 comes
    after the model ran, and every front-end counts the request as the
    caller saw it (an invalid input, not a success)."""
    texts = np.array([[b"a long enough text"]], dtype=object)
    out_key, _ = regions.make(64)
    server_stats = f"http://127.0.0.1:{served.http_port}/v2/models/shout/stats"
    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("upper", out_key, 64)
            text = module.InferInput("text", [1, 1], "BYTES")
            text.set_data_from_numpy(texts)
            upper = module.InferRequestedOutput("upper")
            upper.set_shared_memory("upper", 8)
            with pytest.raises(InferenceServerException, match="should be at least 22 bytes to hold the results"):
                client.infer("shout", [text], outputs=[upper])
            client.unregister_system_shared_memory()
        finally:
            client.close()
    stats = httpx.get(server_stats).json()["model_stats"][0]["inference_stats"]
    assert (stats["success"]["count"], stats["fail"]["count"]) == (0, 2)


def test_a_streamed_bytes_output_too_large_for_its_region_fails_and_is_counted_as_the_clients(
    served: Listening, regions: Regions
) -> None:
    """As above, for a decoupled model's response on a gRPC stream: the
    stream carries the error, and the request counts as an invalid input."""
    texts = np.array([[b"a long enough text"]], dtype=object)
    out_key, _ = regions.make(64)
    messages: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}")
    try:
        client.register_system_shared_memory("upper", out_key, 64)
        client.start_stream(callback=lambda result, error: messages.put((result, error)))
        text = grpcclient.InferInput("text", [1, 1], "BYTES")
        text.set_data_from_numpy(texts)
        upper = grpcclient.InferRequestedOutput("upper")
        upper.set_shared_memory("upper", 8)
        client.async_stream_infer("shouts", [text], outputs=[upper], request_id="a")
        result, error = messages.get(timeout=30)
        assert result is None
        assert "should be at least 22 bytes to hold the results" in str(error)
        client.stop_stream()
        client.unregister_system_shared_memory()
    finally:
        client.close()
    server_stats = f"http://127.0.0.1:{served.http_port}/v2/models/shouts/stats"

    def counted() -> tuple[int, int]:
        stats = httpx.get(server_stats).json()["model_stats"][0]["inference_stats"]
        return stats["success"]["count"], stats["fail"]["count"]

    assert wait_until(lambda: counted() == (0, 1), timeout_s=10), counted()


def test_mistakes_are_refused_and_harm_nothing_else(served: Listening, regions: Regions) -> None:
    key, handle = regions.make(256)
    data = np.ones((1, 4), dtype=np.float32)
    shm.set_shared_memory_region(handle, [data])
    for client in clients(served):
        module = module_of(client)
        try:
            client.register_system_shared_memory("r", key, 128, offset=64)
            refusals: list[tuple[str, tuple[Any, ...], str]] = [
                ("register_system_shared_memory", ("r", key, 16), "'r' already in manager"),
                ("register_system_shared_memory", ("s", key, 257), "past the 256 bytes"),
                ("register_system_shared_memory", ("s", "/no-such-object", 8), "unable to open"),
                ("register_system_shared_memory", ("s", "/../etc/passwd", 8), "not a shared-memory object"),
                ("register_system_shared_memory", ("s", "/ferrobatch.m", 8), "ferrobatch's own segments"),
                ("get_system_shared_memory_status", ("s",), "Unable to find system shared memory region"),
            ]
            for method, args, message in refusals:
                with pytest.raises(InferenceServerException, match=message):
                    getattr(client, method)(*args)
            # Past the region (offset + size), the wrong size for the shape, too small for an output.
            for x_offset, x_size, y_size, message in [
                (120, 16, 16, "Invalid offset \\+ byte size"),
                (0, 12, 16, "needs 16 bytes, got 12"),
                (0, 16, 8, "should be at least 16 bytes to hold the results"),
            ]:
                x = module.InferInput("x", [1, 4], "FP32")
                x.set_shared_memory("r", x_size, offset=x_offset)
                k = module.InferInput("k", [1], "INT32")
                k.set_data_from_numpy(np.ones(1, dtype=np.int32))
                y = module.InferRequestedOutput("y")
                y.set_shared_memory("r", y_size, offset=32)
                with pytest.raises(InferenceServerException, match=message):
                    client.infer("scale", [x, k], outputs=[y])
            # Nothing else was harmed: the same request, right, is answered.
            x = module.InferInput("x", [1, 4], "FP32")
            x.set_shared_memory("r", 16)
            k = module.InferInput("k", [1], "INT32")
            k.set_data_from_numpy(np.ones(1, dtype=np.int32))
            y = module.InferRequestedOutput("y")
            y.set_shared_memory("r", 16, offset=32)
            client.infer("scale", [x, k], outputs=[y])
            assert statuses(client) == {"r": (key, 64, 128)}
            client.unregister_system_shared_memory()
        finally:
            client.close()
    assert shm.get_contents_as_numpy(handle, np.float32, [1, 4], offset=96).tolist() == [[0.0] * 4]  # 64 + 32
    stats = httpx.get(f"http://127.0.0.1:{served.http_port}/v2/models/scale/stats").json()
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 2


def test_http_calls_say_what_is_wrong(served: Listening, regions: Regions) -> None:
    key, _ = regions.make(64)
    base = f"http://127.0.0.1:{served.http_port}/v2/systemsharedmemory"
    cases: list[tuple[str, Any, int, str]] = [
        ("/region/r/register", {"offset": 0, "byte_size": 8}, 400, "has no 'key' field"),
        ("/region/r/register", {"key": key}, 400, "has no 'byte_size' field"),
        ("/region/r/register", {"key": key, "byte_size": -1}, 400, "'byte_size' must be an unsigned integer"),
        ("/region/r/register", {"key": key, "byte_size": 8, "offset": True}, 400, "'offset' must be"),
        ("/region/r/register", [key], 400, "a JSON object"),
        ("/register", {"key": key, "byte_size": 8}, 400, "'region name' is necessary"),
    ]
    for path, body, status, message in cases:
        reply = httpx.post(base + path, json=body)
        assert (reply.status_code, message in reply.json()["error"]) == (status, True), (path, reply.text)
    assert httpx.get(base + "/status").json() == []
    assert httpx.post(base + "/region/r/register", json={"key": key, "byte_size": 8}).status_code == 200
    assert httpx.get(base + "/region/r/status").json() == [{"name": "r", "key": key, "offset": 0, "byte_size": 8}]
    assert httpx.post(base + "/region/never/unregister").status_code == 200  # as in Triton
    assert httpx.post(base + "/unregister").status_code == 200
    assert httpx.get(base + "/region/r/status").status_code == 404


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_off_by_default_as_in_triton(frontend: str, regions: Regions) -> None:
    key, _ = regions.make(64)
    with serving(frontend) as listening:
        assert "system_shared_memory" in httpx.get(f"http://127.0.0.1:{listening.http_port}/v2").json()["extensions"]
        for client in clients(listening):
            module = module_of(client)
            try:
                with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as refused:
                    client.register_system_shared_memory("r", key, 64)
                assert refused.value.status() in ("501", "StatusCode.UNIMPLEMENTED")
                assert statuses(client) == {}
                inputs, outputs = scale_request(module, 1, "r", "r")
                with pytest.raises(InferenceServerException, match="shared_memory_region"):
                    client.infer("scale", inputs, outputs=outputs)
            finally:
                client.close()


def test_cuda_shared_memory_is_answered_as_triton_without_gpus_answers_it(served: Listening) -> None:
    # Clients unregister CUDA regions before they start (Triton's examples do): nothing to do;
    # none is ever listed, and registering one is the client's 400.
    for client in clients(served):
        try:
            client.unregister_cuda_shared_memory()
            client.unregister_cuda_shared_memory("r")
            status = client.get_cuda_shared_memory_status()
            assert (status if isinstance(status, list) else list(status.regions)) == []
            with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'r'") as e:
                client.get_cuda_shared_memory_status("r")
            assert e.value.status() in ("404", "StatusCode.NOT_FOUND")
            with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported") as e:
                client.register_cuda_shared_memory("r", b"\0" * 64, 0, 64)
            assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        finally:
            client.close()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_cuda_shared_memory_is_off_by_default_too(frontend: str) -> None:
    with serving(frontend) as listening:
        for client in clients(listening):
            try:
                with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as e:
                    client.unregister_cuda_shared_memory()
                assert e.value.status() in ("501", "StatusCode.UNIMPLEMENTED")
                with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as e:
                    client.register_cuda_shared_memory("r", b"", 0, 8)
                assert e.value.status() in ("501", "StatusCode.UNIMPLEMENTED")
            finally:
                client.close()


def test_the_shared_memory_api_group_can_be_restricted(regions: Regions) -> None:
    key, _ = regions.make(64)
    with serving("native", allow_client_shm=True, http_restricted_api=("shared-memory:token=s3cret",)) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/systemsharedmemory/region/r/register"
        assert httpx.post(url, json={"key": key, "byte_size": 8}).status_code == 403
        assert httpx.post(url, json={"key": key, "byte_size": 8}, headers={"token": "s3cret"}).status_code == 200


def test_the_cli_flag_takes_tritons_spellings() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, allowed in [([], False), (["--allow-client-shm"], True), (["--allow-client-shm=true"], True)]:
        assert parser.parse_args(["--demo", *argv]).allow_client_shm is allowed
    assert parser.parse_args(["--demo", "--allow-client-shm", "false"]).allow_client_shm is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo", "--allow-client-shm=maybe"])
