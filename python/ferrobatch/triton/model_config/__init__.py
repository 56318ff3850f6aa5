"""PyTriton's model configuration (``pytriton.model_config``): :class:`Tensor`,
:class:`ModelConfig`, :class:`DynamicBatcher`, :class:`QueuePolicy`.

How each maps onto a :class:`ferrobatch.Server`:

- ``ModelConfig.max_batch_size`` → ``max_batch_size`` (rows per model call);
- ``DynamicBatcher.max_queue_delay_microseconds`` → ``max_delay`` (0: greedy,
  a free instance takes whatever is queued, as Triton's dynamic batcher does);
- ``DynamicBatcher.preferred_batch_size`` → ``preferred_batch_sizes``;
- ``DynamicBatcher.default_queue_policy.max_queue_size`` → ``max_queue_size``
  (0, Triton's "unbounded", keeps ferrobatch's default bound);
- ``DynamicBatcher.default_queue_policy.default_timeout_microseconds`` (with
  ``timeout_action=REJECT``) → ``queue_timeout``;
- ``Tensor(shape=...)`` without the batch dimension, as in PyTriton.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

__all__ = ["DeviceKind", "DynamicBatcher", "ModelConfig", "QueuePolicy", "Tensor", "TimeoutAction"]


class DeviceKind(enum.Enum):
    """Where Triton would place instances; ferrobatch runs the callables
    where they run (accepted for compatibility, not used)."""

    KIND_AUTO = "KIND_AUTO"
    KIND_CPU = "KIND_CPU"
    KIND_GPU = "KIND_GPU"


class TimeoutAction(enum.Enum):
    """What Triton does with a request whose queue timeout passed: ``REJECT``
    fails it (here with 504 / DEADLINE_EXCEEDED, never run); ``DELAY``
    moves it behind the others, which ferrobatch does not do (its queue
    timeout is then not applied, with a warning at ``bind``)."""

    REJECT = "REJECT"
    DELAY = "DELAY"


@dataclasses.dataclass
class QueuePolicy:
    """Triton's queue policy. ``max_queue_size`` bounds the waiting requests
    (0: ferrobatch's default bound of 10000). ``default_timeout_microseconds``
    (0: none) bounds a request's wait to be taken into a batch, as
    ``Server(queue_timeout=)``: past it, the request fails (504) and never
    runs. ``allow_timeout_override`` has nothing to switch: a request's own
    ``timeout`` parameter always bounds its whole call, besides."""

    timeout_action: TimeoutAction = TimeoutAction.REJECT
    default_timeout_microseconds: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclasses.dataclass
class DynamicBatcher:
    """Triton's dynamic batcher settings (see the module's docstring for
    what each becomes). ``priority_levels`` and ``default_priority_level``
    are the server's (a request's ``priority`` parameter: 1 most urgent);
    ``priority_queue_policy`` is ignored; ``preserve_ordering`` has nothing
    to do: every request gets its own response."""

    max_queue_delay_microseconds: int = 0
    preferred_batch_size: list[int] | None = None
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy | None = None
    priority_queue_policy: dict[int, QueuePolicy] | None = None


@dataclasses.dataclass
class ModelConfig:
    """A bound model's configuration, with PyTriton's defaults
    (``max_batch_size=4``, batching on, greedy dynamic batching).

    ``response_cache=True`` keeps results by their inputs in the cache
    ``TritonConfig(cache_config=["local,size=<bytes>"])`` describes, one
    for every model (``Server(response_cache=...)``); without one it is
    served uncached, with a warning. ``model_warmup`` (a list of
    :class:`~ferrobatch.triton.model_config.common.ModelWarmup`) runs
    before the model serves, on each instance, as Triton's. What the
    callables see of a bound model is its
    :class:`~ferrobatch.triton.model_config.triton_model_config.TritonModelConfig`.
    """

    batching: bool = True
    max_batch_size: int = 4
    batcher: DynamicBatcher = dataclasses.field(default_factory=DynamicBatcher)
    response_cache: bool = False
    decoupled: bool = False
    model_warmup: list[Any] | None = None


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A model input or output: ``Tensor(name="x", dtype=np.float32, shape=(-1,))``.

    ``shape`` is one sample's, without the batch dimension; ``-1`` marks a
    variable dimension. ``dtype`` is a numpy dtype or scalar type;
    ``np.bytes_``, ``bytes`` and ``object`` declare a BYTES tensor. A
    ``np.dtype`` is stored as its scalar type, as PyTriton does. ``name``
    defaults to ``INPUT_<i>`` / ``OUTPUT_<i>`` (from 1) at bind time.
    """

    shape: tuple[int, ...]
    dtype: Any
    name: str | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.dtype, np.dtype):
            object.__setattr__(self, "dtype", self.dtype.type)
        try:
            shape = tuple(int(d) for d in self.shape)
        except TypeError:
            raise ValueError(f"Tensor shape must be a tuple of ints, got {self.shape!r}") from None
        if any(d < -1 for d in shape):
            raise ValueError(f"Tensor shape dimensions must be >= 0, or -1 for a variable one; got {shape}")
        object.__setattr__(self, "shape", shape)
