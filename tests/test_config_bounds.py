"""Every number a user configures is checked, and bounded, before anything is
started or allocated: a typed error naming the setting, what it must be and
what it was; never a thread count attempted, a queue or staging slot sized
past memory, a Rust panic, or a port silently taken modulo 65536."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, check_config, serve_in_thread
from ferrobatch.triton import DynamicBatcher, ModelConfig, QueuePolicy, Tensor, Triton, TritonConfig

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
CONFIG = ServeConfig(http_port=0, grpc_port=0)


def echo(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"]}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("threads", 10**9, "threads must be an int from 1 to 1024"),
        ("threads", 0, "threads must be an int from 1 to 1024"),
        ("threads", 1.5, "threads must be an int from 1 to 1024"),
        ("max_connections", 2**63, "max_connections must be an int from 1 to 1048576"),
        ("max_connections", 0, "max_connections must be an int from 1"),
        ("max_streams", 0, "max_streams must be an int from 1"),
        ("max_body_size", 0, "max_body_size must be an int from 1"),
        ("max_decompressed_size", -1, "max_decompressed_size must be an int from 1"),
        ("http_port", 70000, "http_port must be an int from 0 to 65535"),
        ("grpc_port", -1, "grpc_port must be an int from 0 to 65535"),
        ("metrics_port", 65536, "metrics_port must be an int from 0 to 65535"),
        ("header_timeout", 0, "header_timeout must be > 0"),
        ("body_timeout", float("nan"), "body_timeout must be > 0"),
        ("idle_timeout", 1e300, "idle_timeout must be > 0 and at most 1e+09 seconds"),
        ("keepalive_interval", -1, "keepalive_interval must be >= 0"),
        ("graceful_timeout", float("inf"), "graceful_timeout must be >= 0"),
        ("drain_delay", float("nan"), "drain_delay must be >= 0"),
        ("switch_interval", float("nan"), "switch_interval must be > 0 and at most 1 second"),
        ("switch_interval", 0, "switch_interval must be > 0"),
    ],
)
def test_serve_config_numbers_are_bounded(field: str, value: object, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        check_config(replace(CONFIG, **{field: value}))
    assert repr(value) in str(refused.value)


def test_a_refused_config_starts_nothing() -> None:
    threads = threading.active_count()
    server = fb.Server(echo, inputs=[X], outputs=[Y])
    for frontend in ("native", "python"):
        with pytest.raises(ValueError, match="grpc_port must be"):
            with serve_in_thread([server], replace(CONFIG, frontend=frontend, grpc_port=70000)):
                pass
    assert not server.running and threading.active_count() == threads


def test_the_cli_refuses_a_bad_number_before_loading_the_models() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "no_such_module:servers", "--threads", "1000000000"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 2, done
    assert "threads must be an int from 1 to 1024 or None, got 1000000000" in done.stderr, done.stderr
    assert "no_such_module" not in done.stderr
    threads = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "--demo", "--threads", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert threads.returncode == 2 and "expected a whole number, got 'abc'" in threads.stderr, threads.stderr


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"max_batch_size": 2**28}, "max_batch_size must be an int from 1 to 1048576"),
        ({"max_batch_size": True}, "max_batch_size must be an int"),
        ({"max_queue_size": 2**40}, "max_queue_size must be an int from 1 to 1048576"),
        ({"max_queue_size": 2**63}, "max_queue_size must be an int from 1 to 1048576"),
        ({"max_delay": True}, "max_delay must be >= 0 seconds"),
        ({"preferred_batch_sizes": [2.5]}, "preferred_batch_sizes must be in 1..64"),
        ({"min_batch_size": True}, "min_batch_size must be in 1..64"),
        ({"cpu_affinity": [{0.5}]}, "cpu_affinity must be sets of core numbers"),
        ({"cpu_affinity": [["01"]]}, "cpu_affinity must be sets of core numbers"),
    ],
)
def test_server_sizes_are_bounded_at_construction(settings: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        fb.Server(echo, inputs=[X], outputs=[Y], **settings)  # type: ignore[arg-type]


def test_tensor_shapes_are_bounded() -> None:
    for shape in [(2**62,), (2**31, 2**31, 4)]:
        with pytest.raises(ValueError, match="elements per row, over 1099511627776"):
            fb.TensorSpec("x", "float32", shape)
    with pytest.raises(ValueError, match="max_batch_elements must be an int from 1 to 4294967296"):
        fb.Server(
            echo, inputs=[fb.TensorSpec("x", "float32", (-1,), ragged="pad")], outputs=[Y], max_batch_elements=2**40
        )


@pytest.mark.parametrize(
    ("dtype", "pad_value", "words"),
    [
        ("uint8", -1, "torch.uint8 holds 0 to 255"),
        ("int8", 1000, "torch.int8 holds -128 to 127"),
        ("int64", 0.5, "whole numbers only"),
        ("int64", float("nan"), "whole numbers only"),
        ("int64", 2**63, "holds -9223372036854775808 to 9223372036854775807"),
        ("bool", 2, "0 and 1 only"),
        ("float16", 1e6, "at most 65504"),
        ("bytes", 5, "pads with b''"),
    ],
)
def test_a_pad_value_the_dtype_cannot_hold_is_refused(dtype: str, pad_value: float, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        fb.TensorSpec("t", dtype, (-1,), ragged="pad", pad_value=pad_value)


def test_pad_values_the_dtype_holds_are_taken() -> None:
    for dtype, pad_value in [("uint8", 255), ("int64", -1), ("bool", True), ("float16", float("-inf"))]:
        assert fb.TensorSpec("t", dtype, (-1,), ragged="pad", pad_value=pad_value).pad_value == pad_value
    assert np.isnan(fb.TensorSpec("t", "float32", (-1,), ragged="pad", pad_value=float("nan")).pad_value)


def test_staging_larger_than_the_machine_is_refused_before_it_is_allocated() -> None:
    """Each setting is in bounds; together they would need terabytes."""
    wide = fb.TensorSpec("x", "float32", (1 << 30,))
    server = fb.Server(echo, inputs=[wide], outputs=[fb.TensorSpec("y", "float32", (1 << 30,))], max_batch_size=1024)

    async def start() -> str:
        with pytest.raises(ValueError, match="staging slots of") as refused:
            await server.start()
        return str(refused.value)

    assert "more than this machine's memory" in asyncio.run(start())
    assert not server.running
    small = fb.Server(echo, inputs=[X], outputs=[Y])

    async def serve_one() -> list[float]:
        async with small:
            return (await small.client().infer({"x": torch.ones(4)}))["y"].tolist()  # type: ignore[no-any-return]

    assert asyncio.run(serve_one()) == [1.0] * 4


def test_a_negative_triton_queue_size_is_refused() -> None:
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))
    policy = QueuePolicy(max_queue_size=-1)
    with pytest.raises(Exception, match="max_queue_size must be >= 0"):
        triton.bind(
            "m",
            lambda requests: [{"y": r["x"]} for r in requests],
            inputs=[Tensor(name="x", dtype=np.float32, shape=(4,))],
            outputs=[Tensor(name="y", dtype=np.float32, shape=(4,))],
            config=ModelConfig(batcher=DynamicBatcher(default_queue_policy=policy)),
        )


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"ring_size": 2**32}, "ring_size must be a power of two from 2 to"),
        ({"ring_size": 2**21}, "ring_size must be a power of two from 2 to"),
        ({"max_clients": 2**32}, "max_clients must be an int from 1 to"),
        ({"rows_per_client": 2**64}, "rows_per_client must be an int from 1 to"),
        ({"cell_bytes": 2**64}, "cell_bytes must be an int from 1 to"),
        ({"max_clients": True}, "max_clients must be an int"),
        ({"metadata": {"a": float("nan")}}, "metadata must be JSON-serializable"),
    ],
)
async def test_share_sizes_are_bounded_before_the_segment_is_made(settings: dict[str, object], words: str) -> None:
    server = fb.Server(lambda b: {"y": b["x"]}, inputs=[fb.TensorSpec("x", "float32", (2,))],
                       outputs=[fb.TensorSpec("y", "float32", (2,))])  # fmt: skip
    async with server:
        with pytest.raises(ValueError, match=words):
            server.share(f"fbtest-bounds-{os.getpid()}", **settings)  # type: ignore[arg-type]
