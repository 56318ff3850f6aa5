"""A model served without batching (``Server(batching=False)``, Triton's
``max_batch_size: 0``): each request runs alone, and over HTTP and gRPC its
tensors are one sample, shaped as declared, with no batch dimension."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_requests_and_responses_carry_one_sample_without_a_batch_dimension(frontend: str) -> None:
    calls: list[tuple[int, ...]] = []

    def double(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(tuple(batch["x"].shape))
        return {"y": batch["x"] * 2}

    server = fb.Server(
        double,
        inputs=[fb.TensorSpec("x", "float32", (3,))],
        outputs=[fb.TensorSpec("y", "float32", (3,))],
        batching=False,
        max_batch_size=64,  # without batching: one request per call whatever this says
        name="single",
    )
    assert server.max_batch_size == 1
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    with serve_in_thread([server], config) as listening:
        base = f"http://127.0.0.1:{listening.http_port}/v2/models/single"
        sample = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3], "data": [1, 2, 3]}]}
        answer = httpx.post(f"{base}/infer", json=sample)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["shape"] == [3] and answer.json()["outputs"][0]["data"] == [2, 4, 6]
        batched = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}
        refused = httpx.post(f"{base}/infer", json=batched)
        assert refused.status_code == 400 and "expected shape (3,), got (1, 3)" in refused.json()["error"]
        assert httpx.get(base).json()["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [3]}]
        model_config = httpx.get(f"{base}/config").json()
        assert model_config["max_batch_size"] == 0 and "dynamic_batching" not in model_config
        with grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as client:
            given = grpcclient.InferInput("x", [3], "FP32")
            given.set_data_from_numpy(np.float32([1, 1, 1]))
            got = client.infer("single", [given]).as_numpy("y")
            assert got.shape == (3,) and got.tolist() == [2, 2, 2]
    assert calls == [(1, 3), (1, 3)]  # each request alone
