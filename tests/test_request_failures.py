"""A model that forwards requests (``ferrobatch.ray``'s client, or any model
calling another server) passes its downstream's errors on: a request
refused downstream gets that error's class, alone, counted under its
outcome, on every way in; and a refusal is never retried."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
TOKENS = fb.TensorSpec("tokens", "int64", (-1,), ragged="pad")
COUNT = fb.TensorSpec("count", "int64", ())

# A request's own failure, by the first element of its first row.
REFUSALS: dict[int, BaseException] = {
    -1: fb.QueueFullError("downstream queue full"),
    -2: fb.ModelError("model 'm': downstream model raised ValueError"),
    -3: fb.DeadlineExceededError("downstream deadline passed"),
    -4: fb.InvalidInputError("downstream refused input 'x'"),
}
SEEN = {
    fb.QueueFullError: "queue_full",
    fb.ModelError: "model_error",
    fb.DeadlineExceededError: "deadline_exceeded",
    fb.InvalidInputError: "invalid_input",
}


def forward(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    """y = 2x for each request; a request whose first value is a key of
    REFUSALS fails with that error, through ``RequestsFailed`` (the rest of
    the call is answered). A top-level function: a process instance's."""
    x = batch["x"]
    errors: dict[int, BaseException] = {}
    row = 0
    for i, request in enumerate(requests):
        error = REFUSALS.get(int(x[row, 0]))
        if error is not None:
            errors[i] = error
        row += request.rows
    if errors:
        raise fb.RequestsFailed({"y": x * 2}, errors)
    return {"y": x * 2}


class Forwarding:
    """:func:`forward`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        with self.lock:
            self.calls += 1
        return forward(batch, requests)


def value(i: int) -> float:
    return float(-(i % 5)) if i % 5 else float(i)


def check(results: list[Any], stats: dict[str, Any]) -> None:
    seen: Counter[str] = Counter()
    for i, result in enumerate(results):
        refusal = REFUSALS.get(int(value(i)))
        if refusal is None:
            assert not isinstance(result, BaseException), (i, result)
            assert result["y"].tolist() == [2 * value(i)] * 4, i
            seen["succeeded"] += 1
        else:
            assert type(result) is type(refusal), (i, result)  # a fresh error of its class
            assert str(result) == str(refusal)
            seen[SEEN[type(refusal)]] += 1
    assert Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]}) == seen + Counter(
        {k: 0 for k in stats["requests_failed"]}
    )


@pytest.mark.parametrize(
    ("instance_kind", "isolate_failures"), [("thread", True), ("thread", False), ("process", True)]
)
async def test_each_request_gets_its_own_error_in_one_call(instance_kind: str, isolate_failures: bool) -> None:
    server = fb.Server(
        forward, inputs=[X], outputs=[Y], name="m", with_requests=True, max_batch_size=20, min_batch_size=20,
        isolate_failures=isolate_failures, instance_kind=instance_kind,  # type: ignore[arg-type]
    )  # fmt: skip
    async with server:
        client = server.client()
        results = await asyncio.gather(
            *(client.infer({"x": torch.full((4,), value(i))}) for i in range(20)), return_exceptions=True
        )
        stats = server.stats()
    check(results, stats)
    assert (stats["batches"], stats["retry_calls"]) == (1, 0)  # one call, nothing retried


async def test_threads_get_their_own_errors_too() -> None:
    model = Forwarding()
    # Threads' batches go when every calling thread waits: however they group, each gets its own.
    server = fb.Server(model, inputs=[X], outputs=[Y], name="m", with_requests=True, max_batch_size=10, max_delay=0.05)
    async with server:
        client = server.client()

        def call(i: int) -> Any:
            try:
                return client.infer_sync({"x": torch.full((4,), value(i))})
            except fb.FerrobatchError as exc:
                return exc

        with ThreadPoolExecutor(10) as pool:
            results = await asyncio.to_thread(lambda: list(pool.map(call, range(10))))
        stats = server.stats()
    check(results, stats)


def lengths(batch: dict[str, Any], requests: list[fb.RequestInfo]) -> dict[str, Any]:
    """Each row's token count; a row whose first token is negative is refused downstream."""
    tokens, counts = batch["tokens"], batch["tokens_lengths"]
    errors = {i: fb.QueueFullError("downstream queue full") for i in range(len(requests)) if int(tokens[i, 0]) < 0}
    outputs = {"count": counts.clone()}
    if errors:
        raise fb.RequestsFailed(outputs, errors)
    return outputs


async def test_variable_length_models_pass_errors_on_alone() -> None:
    server = fb.Server(
        lengths, inputs=[TOKENS], outputs=[COUNT], with_requests=True, max_batch_size=8, min_batch_size=8
    )
    async with server:
        client = server.client()
        rows = [torch.arange(1, n + 2) * (-1 if n == 3 else 1) for n in range(8)]
        results = await asyncio.gather(*(client.infer({"tokens": r}) for r in rows), return_exceptions=True)
        stats = server.stats()
    for n, result in enumerate(results):
        if n == 3:
            assert isinstance(result, fb.QueueFullError)
        else:
            assert int(result["count"]) == n + 1, n
    assert stats["requests_failed"]["queue_full"] == 1 and stats["requests_succeeded"] == 7


async def test_a_downstream_refusal_of_a_whole_batch_is_passed_on_and_not_retried() -> None:
    calls = Counter[str]()

    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls["n"] += 1
        raise fb.QueueFullError("the downstream server's queue is full")

    server = fb.Server(model, inputs=[X], outputs=[Y], max_batch_size=8, min_batch_size=8, isolate_failures=True)
    async with server:
        client = server.client()
        results = await asyncio.gather(*(client.infer({"x": torch.ones(4)}) for _ in range(8)), return_exceptions=True)
        stats = server.stats()
    assert all(isinstance(r, fb.QueueFullError) for r in results), results
    assert isinstance(results[0].__cause__, fb.QueueFullError)  # the model's own, for its traceback
    assert len({id(r) for r in results}) == 8  # each caller its own instance
    assert calls["n"] == 1, "a refusal was retried"
    assert stats["requests_failed"]["queue_full"] == 8 and stats["requests_failed"]["model_error"] == 0


def test_native_clients_get_the_status_of_a_passed_on_error() -> None:
    model = Forwarding()
    server = fb.Server(
        model, inputs=[X], outputs=[Y], name="m", with_requests=True, max_batch_size=10, min_batch_size=10
    )
    config = ServeConfig(http_port=0, grpc_port=None, frontend="native")
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/m/infer"

        def post(i: int) -> httpx.Response:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value(i)] * 4}]}
            return httpx.post(url, json=body, timeout=30)

        with ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(post, range(10)))
        stats = server.stats()
    expected = {None: 200, -1: 503, -2: 500, -3: 504, -4: 400}
    statuses = [r.status_code for r in responses]
    assert statuses == [expected[int(value(i)) if int(value(i)) < 0 else None] for i in range(10)], statuses
    assert responses[1].json()["error"] == "downstream queue full"
    assert stats["requests_failed"]["queue_full"] == 2 and stats["requests_failed"]["invalid_input"] == 2
    assert stats["requests_failed"]["deadline_exceeded"] == 2 and stats["requests_failed"]["model_error"] == 2
    assert stats["requests_succeeded"] == 2


async def test_shared_memory_clients_get_the_class_of_a_passed_on_error() -> None:
    model = Forwarding()
    server = fb.Server(
        model, inputs=[X], outputs=[Y], name="m", with_requests=True, max_batch_size=10, min_batch_size=10
    )
    async with server:
        share = server.share(f"fbtest-forward-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with fb.connect(share.name) as client:
            results = await asyncio.gather(
                *(client.infer({"x": torch.full((4,), value(i))}) for i in range(10)), return_exceptions=True
            )
        stats = server.stats()
    check(results, stats)


async def test_a_decoupled_model_fails_some_streams_and_ends_the_others() -> None:
    def steps(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> Any:
        for i in range(2):
            yield {"y": batch["x"] + i}
        raise fb.RequestsFailed(None, {1: fb.QueueFullError("downstream queue full")})

    server = fb.Server(
        steps, inputs=[X], outputs=[Y], name="m", decoupled=True, with_requests=True, max_batch_size=2, min_batch_size=2
    )

    async def read(client: fb.Client, value: float) -> tuple[list[float], BaseException | None]:
        seen: list[float] = []
        try:
            async for out in client.stream({"x": torch.full((4,), value)}):
                seen.append(float(out["y"][0]))
        except fb.FerrobatchError as exc:
            return seen, exc
        return seen, None

    async with server:
        client = server.client()
        (first, first_error), (second, second_error) = await asyncio.gather(read(client, 0.0), read(client, 10.0))
        stats = server.stats()
    assert (first, first_error) == ([0.0, 1.0], None)
    assert second == [10.0, 11.0] and isinstance(second_error, fb.QueueFullError)
    assert stats["requests_succeeded"] == 1 and stats["requests_failed"]["queue_full"] == 1


async def test_a_model_naming_requests_it_was_not_given_fails_its_call() -> None:
    def confused(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        raise fb.RequestsFailed({"y": batch["x"]}, {len(requests): fb.QueueFullError("no such request")})

    server = fb.Server(confused, inputs=[X], outputs=[Y], name="m", with_requests=True, isolate_failures=False)
    async with server:
        with pytest.raises(fb.ModelError, match="failed requests \\[1\\] of 1"):
            await server.client().infer({"x": torch.ones(4)})
