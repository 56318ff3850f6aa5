"""Optional inputs (``TensorSpec(optional=True)``): a request may leave them
out, in process and over HTTP (JSON, binary) and gRPC, native or Python
front-end; the
model gets zeros (empty rows for a variable-length input, empty strings for
BYTES) and, built ``with_requests``, the names each request left out
(``RequestInfo.absent``). A required input left out is still refused, and
so is a request of no input at all."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

INPUTS = [
    fb.TensorSpec("a", "float32", (2,)),
    fb.TensorSpec("w", "float32", (2,), optional=True),
    fb.TensorSpec("t", "float32", (-1,), ragged="pad", optional=True),
    fb.TensorSpec("tag", "bytes", (1,), optional=True),
]
OUTPUTS = [
    fb.TensorSpec("total", "float32", ()),
    fb.TensorSpec("absent", "int64", ()),
    fb.TensorSpec("tag_len", "int64", ()),
]


def model(batch: dict[str, Any], requests: list[fb.RequestInfo]) -> dict[str, Any]:
    """Per row: the sum of every input's values, the number of optional
    inputs its request left out (a bit each: w 1, t 2, tag 4), and its tag's length."""
    flags = {"w": 1, "t": 2, "tag": 4}
    absent = [sum(flags[n] for n in r.absent) for r in requests for _ in range(r.rows)]
    total = batch["a"].sum(1) + batch["w"].sum(1) + batch["t"].sum(1)
    tag_len = torch.tensor([len(row[0]) for row in batch["tag"]], dtype=torch.int64)
    return {"total": total, "absent": torch.tensor(absent, dtype=torch.int64), "tag_len": tag_len}


def make_server() -> fb.Server:
    return fb.Server(model, inputs=INPUTS, outputs=OUTPUTS, name="opt", with_requests=True, max_delay=0.002)


def test_in_process_callers_may_leave_optional_inputs_out() -> None:
    server = make_server()

    async def main() -> None:
        async with server:
            client = server.client()
            both = await asyncio.gather(
                client.infer({"a": torch.ones(2)}),
                client.infer({"a": torch.ones(2), "w": torch.full((2,), 3.0), "t": torch.ones(5), "tag": [b"xyz"]}),
            )
            assert [(float(r["total"]), int(r["absent"]), int(r["tag_len"])) for r in both] == [(2, 7, 0), (13, 0, 3)]
            batch = await client.infer_batch({"a": torch.ones(3, 2), "t": torch.ones(3, 4)})
            assert batch["absent"].tolist() == [5, 5, 5] and batch["total"].tolist() == [6, 6, 6]
            with pytest.raises(fb.InvalidInputError, match="input 'a': missing"):
                await client.infer({"w": torch.ones(2)})
            with pytest.raises(fb.InvalidInputError, match="input 'a': missing"):
                await client.infer({})
            out: list[Any] = []
            thread = threading.Thread(target=lambda: out.append(client.infer_sync({"a": torch.ones(2)})))
            thread.start()
            await asyncio.to_thread(thread.join)
            assert int(out[0]["absent"]) == 7
            stats = server.stats()
            assert stats["requests_succeeded"] == 4 and stats["requests_failed"]["invalid_input"] == 2

    asyncio.run(main())


def test_shared_memory_carries_a_request_without_its_optional_input() -> None:
    server = fb.Server(
        lambda batch: {"y": batch["a"].sum(1) + batch["w"].sum(1)},
        inputs=INPUTS[:2],
        outputs=[fb.TensorSpec("y", "float32", ())],
    )

    async def main() -> tuple[float, float]:
        async with server:
            server.share("optional-inputs-test")
            with fb.connect("optional-inputs-test") as client:
                a = torch.ones(INPUTS[0].shape)
                left_out = await client.infer({"a": a})
                given = await client.infer({"a": a, "w": torch.full(INPUTS[1].shape, 2.0)})
            return float(left_out["y"]), float(given["y"])

    left_out, given = asyncio.run(main())
    per_a = float(torch.ones(INPUTS[0].shape).sum())
    assert left_out == per_a, "zeros in the left-out input's place"
    assert given == per_a + 2.0 * float(torch.ones(INPUTS[1].shape).sum())


def test_outputs_cannot_be_optional() -> None:
    with pytest.raises(ValueError, match="outputs cannot be optional"):
        fb.Server(model, inputs=INPUTS, outputs=[fb.TensorSpec("y", "float32", (), optional=True)])


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_the_front_ends_take_requests_without_their_optional_inputs(frontend: str) -> None:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    a = np.ones((2, 2), dtype=np.float32)
    t = np.ones((2, 3), dtype=np.float32)
    with serve_in_thread([make_server()], config) as listening:
        http, grpc_address = f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"
        with httpclient.InferenceServerClient(http) as client:
            for binary in (False, True):
                given = httpclient.InferInput("a", [2, 2], "FP32")
                given.set_data_from_numpy(a, binary_data=binary)
                lengths = httpclient.InferInput("t", [2, 3], "FP32")
                lengths.set_data_from_numpy(t, binary_data=binary)
                only_a = client.infer("opt", [given])
                assert only_a.as_numpy("absent").tolist() == [7, 7] and only_a.as_numpy("total").tolist() == [2, 2]
                with_t = client.infer("opt", [given, lengths])
                assert with_t.as_numpy("absent").tolist() == [5, 5] and with_t.as_numpy("total").tolist() == [5, 5]
            config_json = client.get_model_config("opt")
            assert [i.get("optional", False) for i in config_json["input"]] == [False, True, True, True]
        missing = httpx.post(
            f"http://{http}/v2/models/opt/infer",
            json={"inputs": [{"name": "w", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
        )
        assert missing.status_code == 400 and "input 'a': missing" in missing.json()["error"]
        nothing = httpx.post(f"http://{http}/v2/models/opt/infer", json={"inputs": []})
        assert nothing.status_code == 400, nothing.text
        with grpcclient.InferenceServerClient(grpc_address) as gclient:
            given = grpcclient.InferInput("a", [2, 2], "FP32")
            given.set_data_from_numpy(a)
            tag = grpcclient.InferInput("tag", [2, 1], "BYTES")
            tag.set_data_from_numpy(np.array([[b"ab"], [b"abcd"]], dtype=object))
            got = gclient.infer("opt", [given, tag])
            assert got.as_numpy("absent").tolist() == [3, 3] and got.as_numpy("tag_len").tolist() == [2, 4]
            assert gclient.is_model_ready("opt")
            config_pb = gclient.get_model_config("opt", as_json=True)["config"]
            assert [i.get("optional", False) for i in config_pb["input"]] == [False, True, True, True]
            w_only = grpcclient.InferInput("w", [1, 2], "FP32")
            w_only.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
            with pytest.raises(InferenceServerException, match="input 'a': missing"):
                gclient.infer("opt", [w_only])


def test_an_optional_first_input_leaves_the_65th_alone() -> None:
    """A left-out input is one bit of 64: the inputs past them are never taken for it."""
    specs = [fb.TensorSpec("a0", "float32", (1,), optional=True)]
    specs += [fb.TensorSpec(f"x{i}", "float32", (1,)) for i in range(1, 65)]
    server = fb.Server(
        lambda batch: {"y": batch["x64"][:, 0] + batch["a0"][:, 0]},
        inputs=specs,
        outputs=[fb.TensorSpec("y", "float32", ())],
        name="wide",
    )

    async def main() -> float:
        async with server:
            given = {f"x{i}": torch.full((1,), float(i)) for i in range(1, 65)}
            return float((await server.client().infer(given))["y"])

    assert asyncio.run(main()) == 64.0
