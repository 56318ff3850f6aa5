"""Shared fixtures: small models and servers, and the `gpu` marker's skip."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch

import ferrobatch as fb

WIDTH = 4
X = fb.TensorSpec("x", "float32", (WIDTH,))
Y = fb.TensorSpec("y", "float32", (WIDTH,))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """y = 2x: every row's output depends only on that row, so mix-ups show."""
    return {"y": inputs["x"] * 2}


def make_server(model: Callable[[dict[str, torch.Tensor]], Any] = double, **kwargs: Any) -> fb.Server:
    kwargs.setdefault("max_batch_size", 16)
    kwargs.setdefault("max_delay", 0.001)
    return fb.Server(model, inputs=[X], outputs=[Y], **kwargs)


@pytest.fixture
async def server() -> AsyncIterator[fb.Server]:
    s = make_server()
    async with s:
        yield s


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (asked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def sample(i: float) -> torch.Tensor:
    return torch.full((WIDTH,), float(i))


@contextlib.contextmanager
def gevent_hub_freed() -> Iterator[None]:
    """Around the work of a thread other than the main one that uses
    tritonclient.http (or a ferrobatch.triton ModelClient over HTTP), also
    as a decorator (``@gevent_hub_freed()``): the clients made inside are
    closed inside, on this thread (a ``finally`` or ``with``), and at the
    end the thread's gevent hub is destroyed, as ferrobatch.triton's own
    workers do (``_gevent_hub_freed``). gevent's state is per thread: a hub
    left alive in a thread that ends, or a client closed (gevent's
    ``Pool.join()``) as a dying thread's locals are cleared or on another
    thread, can crash the interpreter. On the main thread, whose hub lives
    as long as the process, it frees nothing: a helper that both call can
    use it."""
    if threading.current_thread() is threading.main_thread():
        yield
        return
    from ferrobatch.triton.client import _gevent_hub_freed

    with _gevent_hub_freed("http"):
        yield


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Any]:
    """One local Ray cluster on 127.0.0.1 for the whole run, shut down at its
    end: Ray does not survive being shut down and started again in one
    process (ray-project/ray#31145: threads left from the first session call
    into its freed core worker, a segmentation fault tests later)."""
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        address="local",
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        # Ray's handles and references left in cycles are freed now, while its
        # core worker runs, not by a later collection after it stopped.
        gc.collect()
        ray.shutdown()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes a test starts: killed by PID and reaped at its end,
    whatever happened (a child that died and was never reaped included)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(30)
