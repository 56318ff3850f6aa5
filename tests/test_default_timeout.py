"""``Server(default_timeout=)``: the timeout of a request that gives none, on
every way in (an event loop, a thread, shared memory, the native front-end);
``Server(queue_timeout=)``, and Triton's queue policy mapped onto it."""

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
from conftest import gevent_hub_freed, wait_until

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
        # The client's withdrawal reaches the server through the shared
        # memory it polls: counted a moment after the client saw it.
        deadline = time.monotonic() + 10
        while server.stats()["requests_failed"]["deadline_exceeded"] < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
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


def test_tritons_queue_policy_timeout_becomes_the_queue_timeout(caplog: pytest.LogCaptureFixture) -> None:
    """REJECT with a default timeout: a request waiting longer to be taken
    fails (504) and never runs, while the one taken in time runs on past
    it. DELAY is not kept (a warning)."""
    import threading

    from ferrobatch.triton import DynamicBatcher, ModelConfig, QueuePolicy, Tensor, TimeoutAction, Triton, TritonConfig
    from ferrobatch.triton.client import ModelClient
    from ferrobatch.triton.client.exceptions import PyTritonClientError

    ran: list[float] = []
    release = threading.Event()

    def slow(requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        ran.extend(float(r["x"][0, 0]) for r in requests)
        release.wait(30)  # held until the second request outstayed the queue
        return [{"y": r["x"]} for r in requests]

    tensors = ([Tensor(name="x", dtype=np.float32, shape=(4,))], [Tensor(name="y", dtype=np.float32, shape=(4,))])
    policy = QueuePolicy(timeout_action=TimeoutAction.REJECT, default_timeout_microseconds=100_000)
    config = ModelConfig(max_batch_size=1, batcher=DynamicBatcher(default_queue_policy=policy))
    with Triton(config=TritonConfig(http_port=0, grpc_port=0, metrics_port=0)) as triton:
        triton.bind("m", slow, *tensors, config=config)
        assert triton.servers[0].queue_timeout == 0.1
        triton.run()
        url = f"http://127.0.0.1:{triton.http_port}"
        answers: dict[float, object] = {}

        @gevent_hub_freed()
        def call(value: float) -> None:
            with ModelClient(url, "m") as client:
                try:
                    answers[value] = client.infer_batch(np.full((1, 4), value, np.float32))["y"][0, 0]
                except PyTritonClientError as exc:
                    answers[value] = exc

        first = threading.Thread(target=call, args=(1.0,))
        first.start()
        assert wait_until(lambda: ran == [1.0])  # the first runs; the second waits behind it
        second = threading.Thread(target=call, args=(2.0,))
        second.start()
        assert wait_until(lambda: triton.servers[0].stats()["queue_depth"] == 1)
        time.sleep(0.2)  # twice its queue timeout
        release.set()
        first.join(30)
        second.join(30)
        assert answers[1.0] == 1.0 and ran == [1.0], (answers, ran)
        assert "queue timeout" in str(answers[2.0]), answers
        stats = triton.servers[0].stats()
        assert stats["requests_failed"]["deadline_exceeded"] == 1 and stats["requests_succeeded"] == 1, stats

    delay = QueuePolicy(timeout_action=TimeoutAction.DELAY, default_timeout_microseconds=250_000)
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))
    with caplog.at_level(logging.WARNING, logger="ferrobatch.triton"):
        triton.bind(
            "d", lambda rs: rs, *tensors, config=ModelConfig(batcher=DynamicBatcher(default_queue_policy=delay))
        )
    assert "timeout_action=DELAY is not supported" in caplog.text
    assert triton.servers[0].queue_timeout is None and triton.servers[0].default_timeout is None
    bad = QueuePolicy(default_timeout_microseconds=-1)
    with pytest.raises(Exception, match="default_timeout_microseconds must be >= 0"):
        triton.bind(
            "bad", lambda rs: rs, *tensors, config=ModelConfig(batcher=DynamicBatcher(default_queue_policy=bad))
        )


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, True, "1"])
def test_queue_timeout_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="queue_timeout"):
        fb.Server(double, inputs=[X], outputs=[Y], queue_timeout=bad)  # type: ignore[arg-type]


async def test_queue_timeout_answers_each_caller_once_and_stats_say_so() -> None:
    """Eight callers on one instance taking 0.2 s a batch of 2: those still
    queued after 0.1 s fail at once when the instance is free, never run;
    ``stats()`` counts what they saw."""

    def slow_double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.2)
        return double(inputs)

    server = fb.Server(slow_double, inputs=[X], outputs=[Y], max_batch_size=2, max_delay=0.0, queue_timeout=0.1)
    async with server:
        client = server.client()
        calls = [client.infer({"x": torch.full((4,), float(i))}) for i in range(8)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
        stats = server.stats()
    ok = [o for o in outcomes if isinstance(o, dict)]
    late = [o for o in outcomes if isinstance(o, fb.DeadlineExceededError)]
    assert len(ok) + len(late) == 8, outcomes
    assert 1 <= len(ok) <= 4 and late, outcomes  # the first batch runs; those behind it wait too long
    assert all("queue timeout" in str(e) for e in late)
    assert stats["requests_succeeded"] == len(ok), stats
    assert stats["requests_failed"]["deadline_exceeded"] == len(late), stats
    assert stats["rows"] == len(ok), stats  # only those run were in a batch


async def test_queue_timeout_answers_while_a_batch_fills_and_for_every_caller_kind() -> None:
    """Below min_batch_size, with a request coming every 0.15 s, the batch
    keeps filling for as long as they come: each request past its 0.2 s is
    answered then, not when the trickle stops; a thread's request too."""
    server = fb.Server(double, inputs=[X], outputs=[Y], min_batch_size=4, max_delay=10.0, queue_timeout=0.2)
    async with server:
        client = server.client()
        started = time.monotonic()
        answered: list[float] = []
        first = asyncio.ensure_future(client.infer({"x": torch.ones(4)}))
        first.add_done_callback(lambda _: answered.append(time.monotonic() - started))
        trickle = []
        while time.monotonic() - started < 1.2:
            await asyncio.sleep(0.15)
            trickle.append(asyncio.ensure_future(client.infer({"x": torch.ones(4)})))
        outcomes = await asyncio.gather(first, *trickle, return_exceptions=True)
        assert answered and answered[0] < 0.8, answered  # the trickle ran 1.2 s
        assert isinstance(outcomes[0], fb.DeadlineExceededError), outcomes[0]
        began = time.monotonic()
        with pytest.raises(fb.DeadlineExceededError, match="queue timeout"):
            await asyncio.to_thread(client.infer_sync, {"x": torch.ones(4)})
        assert time.monotonic() - began < 5
        stats = server.stats()
    ran = sum(isinstance(o, dict) for o in outcomes)
    assert stats["requests_succeeded"] == ran, stats
    assert stats["requests_failed"]["deadline_exceeded"] == len(outcomes) - ran + 1, stats
    assert stats["queue_depth"] == 0, stats
