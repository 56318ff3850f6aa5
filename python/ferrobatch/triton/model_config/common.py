"""PyTriton's ``pytriton.model_config.common`` names: the batcher's and
queue's settings, and a model's warm-up (Triton's ``model_warmup``): requests
of made-up data the model runs before it says it is ready."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..exceptions import PyTritonBadParameterError
from . import DeviceKind, DynamicBatcher, QueuePolicy, TimeoutAction

__all__ = [
    "DeviceKind",
    "DynamicBatcher",
    "ModelWarmup",
    "QueuePolicy",
    "TimeoutAction",
    "WarmupInput",
    "generate_warmup_data",
]


@dataclasses.dataclass
class WarmupInput:
    """One input of a warm-up request: one sample's ``shape`` (no batch
    dimension) of ``dtype``, filled with zeros (``zero_data``), random values
    (``random_data``) or the array saved in ``input_data_file`` (``np.save``)."""

    dtype: Any
    shape: Sequence[int]
    zero_data: bool | None = False
    random_data: bool | None = False
    input_data_file: str | None = None


@dataclasses.dataclass
class ModelWarmup:
    """``count`` warm-up calls of ``batch_size`` rows each, with ``inputs``."""

    name: str
    batch_size: int
    inputs: Mapping[str, WarmupInput]
    count: int


def generate_warmup_data(warmup_input: WarmupInput, batch_size: int) -> np.ndarray:
    """``batch_size`` rows of ``warmup_input``'s data, ``[batch_size, *shape]``.
    A file's array is taken as all the rows, or as one row repeated."""
    given = [bool(warmup_input.zero_data), bool(warmup_input.random_data), warmup_input.input_data_file is not None]
    if sum(given) != 1:
        raise PyTritonBadParameterError(
            "a warm-up input takes exactly one of zero_data, random_data and input_data_file"
        )
    shape = (batch_size, *(int(d) for d in warmup_input.shape))
    if any(d < 0 for d in shape):
        raise PyTritonBadParameterError(f"a warm-up input's shape is whole, got {tuple(warmup_input.shape)}")
    dtype = np.dtype(warmup_input.dtype)
    if warmup_input.input_data_file is not None:
        data = np.load(warmup_input.input_data_file, allow_pickle=dtype.kind == "O")
        if data.shape == shape[1:]:
            data = np.broadcast_to(data, shape)
        if data.shape != shape:
            raise PyTritonBadParameterError(
                f"{warmup_input.input_data_file}: an array of shape {data.shape}, where the warm-up takes"
                f" {shape} or {shape[1:]}"
            )
        return np.ascontiguousarray(data, dtype=dtype)
    if dtype.kind in "SUO":  # BYTES
        value = b"" if warmup_input.zero_data else None
        data = np.empty(shape, dtype=object)
        rng = np.random.default_rng()
        for index in np.ndindex(shape):
            data[index] = value if value is not None else rng.bytes(8)
        return data
    if warmup_input.zero_data:
        return np.zeros(shape, dtype=dtype)
    rng = np.random.default_rng()
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 100, size=shape).astype(dtype)
    return rng.random(size=shape).astype(dtype)
