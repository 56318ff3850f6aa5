"""A bound model's configuration as its callable and the decorators see it
(``pytriton.model_config.triton_model_config``): every tensor named, the
batching settings resolved."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import DeviceKind, DynamicBatcher

__all__ = ["TensorSpec", "TritonModelConfig"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a bound model: one sample's ``shape`` (``-1``:
    variable), its numpy ``dtype`` (a scalar type; ``np.bytes_`` or
    ``np.object_`` for BYTES), and whether requests may leave it out."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    optional: bool = False


@dataclasses.dataclass
class TritonModelConfig:
    """What the decorators (and ``@triton_context`` users) read about the
    model being served."""

    model_name: str
    model_version: int = 1
    max_batch_size: int = 4
    batching: bool = True
    batcher: DynamicBatcher | None = None
    instance_group: dict[DeviceKind, int | None] = dataclasses.field(default_factory=dict)
    decoupled: bool = False
    backend_parameters: dict[str, str] = dataclasses.field(default_factory=dict)
    inputs: list[TensorSpec] | None = None
    outputs: list[TensorSpec] | None = None
    response_cache: bool = False
