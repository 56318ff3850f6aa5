"""``Server(default_timeout=)``: the timeout of a request that gives none, on
every way in (an event loop, a thread, shared memory, the native front-end),
and Triton's queue policy mapped onto it."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid

import httpx
import numpy as np
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def pairs_only(default_timeout: float | None = 0.2) -> fb.Server:
    """A lone request never runs (a batch needs two): it waits until its timeout."""
    return fb.Server(
        double,
        inputs=[X],
        outputs=[Y],
        name="m",
        max_batch_size=2,
        min_batch_size=2,
        max_delay=0.001,
        default_timeout=default_timeout,
    )


async def test_a_request_without_a_timeout_gets_the_default_and_its_own_wins() -> None:
    async with pairs_only() as server:
        client = server.client()
        started = time.monotonic()
        with pytest.raises(fb.DeadlineExceededError, match=r"0\.2s timeout"):
            await asyncio.wait_for(client.infer({"x": torch.ones(4)}), 10)
        assert 0.15 < time.monotonic() - started < 5
        started = time.monotonic()
        with pytest.raises(fb.DeadlineExceededError):
            await asyncio.wait_for(client.infer({"x": torch.ones(4)}, timeout=0.6), 10)
        assert time.monotonic() - started > 0.5, "a request's own timeout is kept"
        pair = await asyncio.gather(*(client.infer({"x": torch.full((4,), float(i))}) for i in range(2)))
        assert [float(p["y"][0]) for p in pair] == [0.0, 2.0]
        # From a thread, blocking: the same default.
        with pytest.raises(fb.DeadlineExceededError):
            await asyncio.to_thread(client.infer_sync, {"x": torch.ones(4)})
        stats = server.stats()
    assert stats["requests_failed"]["deadline_exceeded"] == 3 and stats["requests_succeeded"] == 2, stats


async def test_shared_memory_clients_arm_the_servers_default() -> None:
    async with pairs_only() as server:
        share = server.share(f"fbtest-default-timeout-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with fb.connect(share.name) as client:
            with pytest.raises(fb.DeadlineExceededError):
                await asyncio.wait_for(client.infer({"x": torch.ones(4)}), 10)
            with pytest.raises(fb.DeadlineExceededError):
                await asyncio.to_thread(client.infer_sync, {"x": torch.ones(4)})
        stats = server.stats()
    assert stats["requests_failed"]["deadline_exceeded"] == 2, stats


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_both_front_ends_answer_504_at_the_default(frontend: str) -> None:
    server = pairs_only()
    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend)
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer"
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1.0] * 4}]}
        started = time.monotonic()
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 504, response.text
        assert 0.15 < time.monotonic() - started < 5
        stats = server.stats()
    assert stats["requests_failed"]["deadline_exceeded"] == 1, stats


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, True, "1"])
def test_default_timeout_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="default_timeout"):
        fb.Server(double, inputs=[X], outputs=[Y], default_timeout=bad)  # type: ignore[arg-type]


def test_tritons_queue_policy_timeout_is_not_applied_to_whole_calls(caplog: pytest.LogCaptureFixture) -> None:
    # Triton's default timeout bounds queue time; ferrobatch's bound the whole
    # call: applied, it would cut running batches and streams off.
    from ferrobatch.triton import DynamicBatcher, ModelConfig, QueuePolicy, Tensor, TimeoutAction, Triton, TritonConfig

    tensors = ([Tensor(name="x", dtype=np.float32, shape=(4,))], [Tensor(name="y", dtype=np.float32, shape=(4,))])
    policy = QueuePolicy(timeout_action=TimeoutAction.REJECT, default_timeout_microseconds=250_000)
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))
    with caplog.at_level(logging.WARNING, logger="ferrobatch.triton"):
        triton.bind(
            "m", lambda rs: rs, *tensors, config=ModelConfig(batcher=DynamicBatcher(default_queue_policy=policy))
        )
    assert "default_timeout_microseconds is not kept" in caplog.text
    assert triton._servers[0].default_timeout is None  # what bind built
    bad = QueuePolicy(default_timeout_microseconds=-1)
    with pytest.raises(Exception, match="default_timeout_microseconds must be >= 0"):
        triton.bind(
            "bad", lambda rs: rs, *tensors, config=ModelConfig(batcher=DynamicBatcher(default_queue_policy=bad))
        )
