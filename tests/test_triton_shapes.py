"""``ferrobatch.triton`` with ``(-1,)`` tensors under concurrent requests of
different lengths: as behind Triton's batcher, a ``@batch`` callable never
gets requests of different shapes in one call (it concatenates them), while
ferrobatch still gathers them into one batch; a callable whose outermost
decorator is ``@batch`` gets a batch of one shape whole."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import gevent_hub_freed

from ferrobatch.triton import Triton, TritonConfig
from ferrobatch.triton._binding import BoundModel, TritonContext, model_config_of
from ferrobatch.triton.client import ModelClient
from ferrobatch.triton.decorators import batch, group_by_keys
from ferrobatch.triton.model_config import DynamicBatcher, ModelConfig, Tensor

A = Tensor(name="a", dtype=np.float32, shape=(-1,))
Y = Tensor(name="y", dtype=np.float32, shape=(-1,))
#: A window wide enough for the concurrent requests below to share a batch.
GATHER = ModelConfig(max_batch_size=8, batcher=DynamicBatcher(max_queue_delay_microseconds=200_000))


def test_requests_of_different_lengths_share_a_batch_and_each_call_gets_one_shape() -> None:
    calls: list[tuple[int, ...]] = []

    @batch
    def double(a: np.ndarray) -> dict[str, np.ndarray]:
        calls.append(a.shape)
        return {"y": a * 2}

    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
        triton.bind("double", double, [A], [Y], config=GATHER)
        triton.run()
        got: dict[int, Any] = {}

        @gevent_hub_freed()
        def call(n: int) -> None:
            with ModelClient(f"127.0.0.1:{triton.http_port}", "double") as client:
                got[n] = client.infer_sample(np.arange(n, dtype=np.float32))["y"].tolist()

        threads = [threading.Thread(target=call, args=(n,)) for n in (3, 5, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert got == {3: [0.0, 2.0, 4.0], 5: [0.0, 2.0, 4.0, 6.0, 8.0]}
        assert triton.servers[0].stats()["batches"] == 1, "one batch"
    assert sorted(calls) == [(1, 5), (2, 3)], "one call per shape"


def test_a_decoupled_batch_of_different_lengths_streams_each_its_own() -> None:
    @batch
    def steps(a: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for i in range(3):
            yield {"y": a + i}

    config = ModelConfig(max_batch_size=8, decoupled=True, batcher=GATHER.batcher)
    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
        triton.bind("steps", steps, [A], [Y], config=config)
        triton.run()
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.grpc_port}")
        messages: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        client.start_stream(callback=lambda result, error: messages.put((result, error)))
        for k, n in enumerate((2, 3, 2)):
            given = grpcclient.InferInput("a", [1, n], "FP32")
            given.set_data_from_numpy(np.full((1, n), k, np.float32))
            client.async_stream_infer("steps", [given], request_id=str(k), enable_empty_final_response=True)
        got: dict[str, list[Any]] = {}
        finals = 0
        while finals < 3:
            result, error = messages.get(timeout=10)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
            else:
                got.setdefault(response.id, []).append(result.as_numpy("y")[0].tolist())
        client.stop_stream()
        assert triton.servers[0].stats()["batches"] == 1
    assert got == {str(k): [[float(k + i)] * n for i in range(3)] for k, n in enumerate((2, 3, 2))}


def test_only_an_outermost_batch_decorator_is_called_on_the_whole_batch() -> None:
    @batch
    def plain(a: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": a}

    @group_by_keys
    @batch
    def grouped(a: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": a}

    config = model_config_of("m", 1, ModelConfig(max_batch_size=8), [A], [Y], 1)

    def bound(f: Any) -> BoundModel:
        return BoundModel(f, config, TritonContext(), strict=True, on_unrecoverable=lambda e: None)

    assert bound(plain)._whole_batch is not None
    assert bound(grouped)._whole_batch is None
    unbatched = model_config_of("m", 1, ModelConfig(batching=False), [A], [Y], 1)
    assert (
        BoundModel(plain, unbatched, TritonContext(), strict=True, on_unrecoverable=lambda e: None)._whole_batch is None
    )


def test_remote_triton_is_refused_with_what_to_do_instead() -> None:
    from ferrobatch.triton import RemoteTriton
    from ferrobatch.triton.exceptions import PyTritonValidationError

    with pytest.raises(PyTritonValidationError, match="instance_kind='process'"):
        RemoteTriton("grpc://localhost:8001")


def test_a_long_variable_length_request_is_served_as_pytriton_serves_it() -> None:
    """A ``(-1,)`` input takes as many elements as PyTriton's users send in
    one request (16 s of 16 kHz audio here), past ``max_batch_size * 1024``;
    the batch's budget stays bounded (4 MiB of float32 at least)."""

    @batch
    def double(a: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": a * 2}

    audio = np.linspace(-1, 1, 16 * 16_000, dtype=np.float32)
    with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
        triton.bind("double", double, [A], [Y], config=ModelConfig(max_batch_size=16))
        triton.run()
        for url in (f"127.0.0.1:{triton.http_port}", f"grpc://127.0.0.1:{triton.grpc_port}"):
            with ModelClient(url, "double") as client:
                np.testing.assert_array_equal(client.infer_sample(audio)["y"], audio * 2)
        assert triton.servers[0].max_batch_elements == 1 << 20
