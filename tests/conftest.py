"""Shared fixtures: small models and servers, and the `gpu` marker's skip."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
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


def sample(i: float) -> torch.Tensor:
    return torch.full((WIDTH,), float(i))
