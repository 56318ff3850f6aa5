"""Property: any value in any layout and wrapper is read exactly as its
contiguous copy, or refused with InvalidInputError naming the input.

dtype x shape x layout (contiguous, transposed, negative strides, sliced,
offset, expanded/zero-stride, non-native byte order) x wrapper (torch tensor,
numpy array, memoryview, DLPack-only object, list, scalar, sparse tensor,
class objects), one sample (``infer``) or several (``infer_batch``).
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ferrobatch as fb

NAME = "pixels"
DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
]  # fmt: skip
SHAPES = [(), (3,), (2, 3), (3, 1, 2)]
MAX_BATCH = 4
LAYOUTS = ["contiguous", "transposed", "negative", "sliced", "offset", "expanded", "byteswapped"]
WRAPPERS = ["torch", "numpy", "memoryview", "dlpack", "list", "scalar", "sparse", "class"]


class OnlyDLPack:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.value.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.value.__dlpack_device__()


class Servers:
    """Identity servers, one per (dtype, shape), on a loop in a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: dict[tuple[str, tuple[int, ...]], fb.Server] = {}

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def client(self, dtype: str, shape: tuple[int, ...]) -> fb.Client:
        key = (dtype, shape)
        if key not in self.servers:
            server = fb.Server(
                lambda d: {"out": d[NAME]},
                inputs=[fb.TensorSpec(NAME, dtype, shape)],
                outputs=[fb.TensorSpec("out", dtype, shape)],
                max_batch_size=MAX_BATCH,
                max_delay=0.0,
            )
            self.run(server.start())
            self.servers[key] = server
        return self.servers[key].client()

    def close(self) -> None:
        for server in self.servers.values():
            self.run(server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.close()


@dataclass
class Case:
    value: Any
    reference: torch.Tensor | None  # the contiguous copy, if the value is valid


def random_tensor(draw: st.DrawFn, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(np.prod(shape, dtype=np.int64))
    nbytes = numel * dtype.itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype == torch.bool:
        return torch.tensor(list(raw), dtype=torch.uint8).reshape(shape).bool()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape).clone()


def lay_out_torch(t: torch.Tensor, layout: str, draw: st.DrawFn) -> torch.Tensor:
    """A tensor equal to ``t`` (or, for ``expanded``, to a broadcast of part of it) in ``layout``."""
    if layout == "transposed" and t.dim() >= 2:
        perm = list(reversed(range(t.dim())))
        return t.permute(perm).contiguous().permute(perm)
    if layout == "sliced" and t.dim() >= 1:
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if layout == "offset":
        flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
        flat[1:] = t.reshape(-1)
        return flat[1:].view(t.shape)
    if layout == "expanded" and t.dim() >= 1:
        dim = draw(st.integers(0, t.dim() - 1))
        return t.narrow(dim, 0, 1).expand(t.shape)
    return t


def lay_out_numpy(a: np.ndarray, layout: str, draw: st.DrawFn) -> np.ndarray:
    if layout == "negative" and a.ndim >= 1:
        axis = draw(st.integers(0, a.ndim - 1))
        return np.flip(np.ascontiguousarray(np.flip(a, axis)), axis)
    if layout == "byteswapped":
        return a.astype(a.dtype.newbyteorder(">"))
    if layout == "expanded" and a.ndim >= 1:
        axis = draw(st.integers(0, a.ndim - 1))
        first = np.ascontiguousarray(np.take(a, [0], axis=axis))
        strides = list(first.strides)
        strides[axis] = 0
        return np.lib.stride_tricks.as_strided(first, a.shape, strides)  # zero stride, writable
    return lay_out_torch(torch.from_numpy(a.copy(order="C")), layout, draw).numpy()


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, tuple[int, ...], bool, Case]:
    spec_dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    batched = draw(st.booleans())
    value_dtype = draw(st.sampled_from(DTYPES)) if draw(st.integers(0, 5)) == 0 else spec_dtype
    full = (draw(st.integers(1, MAX_BATCH)), *shape) if batched else shape
    if draw(st.integers(0, 7)) == 0:  # now and then a wrong shape
        full = draw(st.sampled_from([(*full, 1), full[1:], (full[0] + 1, *full[1:]) if full else (2,)]))
    wrapper = draw(st.sampled_from(WRAPPERS))
    layout = draw(st.sampled_from(LAYOUTS))
    t = random_tensor(draw, getattr(torch, value_dtype), full)
    if batched:
        valid_shape = len(full) >= 1 and full[1:] == shape and 1 <= full[0] <= MAX_BATCH
    else:
        valid_shape = full == shape
    valid = value_dtype == spec_dtype and valid_shape
    numpy_ok = value_dtype != "bfloat16"

    if wrapper in ("numpy", "memoryview") or (wrapper == "dlpack" and draw(st.booleans()) and numpy_ok):
        if not numpy_ok:
            wrapper = "torch"
        else:
            a = lay_out_numpy(t.numpy(), layout, draw)
            if layout == "byteswapped" and a.dtype.itemsize > 1:
                valid = False
            ref = torch.from_numpy(a.astype(a.dtype.newbyteorder("="), order="C")).clone()
            buffer: Any = a  # numpy arrays export the buffer protocol
            value: Any = {"numpy": a, "memoryview": memoryview(buffer), "dlpack": OnlyDLPack(a)}[wrapper]
            return spec_dtype, shape, batched, Case(value, ref if valid else None)
    if wrapper in ("torch", "dlpack"):
        v = lay_out_torch(t, layout, draw)
        return (
            spec_dtype,
            shape,
            batched,
            Case(v if wrapper == "torch" else OnlyDLPack(v), v.contiguous() if valid else None),
        )
    if wrapper == "list":
        return spec_dtype, shape, batched, Case(t.tolist(), None)
    if wrapper == "scalar":
        return spec_dtype, shape, batched, Case(draw(st.sampled_from([0, 1.5, True, None, "x"])), None)
    if wrapper == "sparse":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sparse = t.to_sparse() if t.dim() else t.reshape(1).to_sparse()
        except (RuntimeError, NotImplementedError):
            sparse = torch.zeros(full or (1,)).to_sparse()
        return spec_dtype, shape, batched, Case(sparse, None)
    cls = draw(st.sampled_from([torch.Tensor, np.ndarray, memoryview, int, OnlyDLPack]))
    return spec_dtype, shape, batched, Case(cls, None)


@settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_any_layout_reads_as_its_contiguous_copy_and_anything_else_is_invalid_input(
    servers: Servers, case: tuple[str, tuple[int, ...], bool, Case]
) -> None:
    spec_dtype, shape, batched, c = case
    client = servers.client(spec_dtype, shape)
    call = client.infer_batch if batched else client.infer
    event(f"{type(c.value).__name__}: {'valid' if c.reference is not None else 'invalid'}")
    if c.reference is None:
        with pytest.raises(fb.InvalidInputError) as info:
            servers.run(call({NAME: c.value}))
        assert f"input '{NAME}'" in str(info.value)
        return
    out = servers.run(call({NAME: c.value}))["out"]
    want = c.reference
    assert out.dtype == want.dtype and out.shape == want.shape
    assert raw_bytes(out) == raw_bytes(want)


def raw_bytes(t: torch.Tensor) -> list[int]:
    return t.new_empty(t.shape).copy_(t).reshape(-1).view(torch.uint8).tolist()
