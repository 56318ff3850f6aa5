"""PyTriton's binding model on ferrobatch: switch by changing imports.

::

    # from pytriton.triton import Triton, TritonConfig
    # from pytriton.model_config import ModelConfig, Tensor, DynamicBatcher
    # from pytriton.decorators import batch
    from ferrobatch.triton import Triton, TritonConfig, ModelConfig, Tensor, DynamicBatcher, batch

    @batch
    def infer_func(x):
        return {"y": x * 2}

    with Triton(config=TritonConfig(http_port=8000, grpc_port=8001)) as triton:
        triton.bind("double", infer_func,
                    inputs=[Tensor(name="x", dtype=np.float32, shape=(4,))],
                    outputs=[Tensor(name="y", dtype=np.float32, shape=(4,))],
                    config=ModelConfig(max_batch_size=64))
        triton.serve()

The submodules mirror PyTriton's (``pytriton.X`` is ``ferrobatch.triton.X``):
:mod:`.triton`, :mod:`.model_config` (and ``.model_config.triton_model_config``),
:mod:`.decorators`, :mod:`.exceptions`, :mod:`.constants`, :mod:`.proxy.types`,
:mod:`.models.model` and :mod:`.client` (``ModelClient``, on tritonclient).
Each bound model is a :class:`ferrobatch.Server` (``triton.servers``) served
by ferrobatch's own HTTP and gRPC front-end; tritonclient and PyTriton's
``ModelClient`` talk to it as to Triton.
"""

from ._binding import Request, TritonContext
from .decorators import (
    ConstantPadder,
    batch,
    fill_optionals,
    first_value,
    group_by_keys,
    group_by_values,
    pad_batch,
    sample,
    triton_context,
)
from .exceptions import (
    PyTritonBadParameterError,
    PyTritonError,
    PyTritonInvalidOperationError,
    PyTritonModelConfigError,
    PyTritonRuntimeError,
    PyTritonUnrecoverableError,
    PyTritonValidationError,
    UnrecoverableError,
)
from .model_config import DeviceKind, DynamicBatcher, ModelConfig, QueuePolicy, Tensor, TimeoutAction
from .model_config.triton_model_config import TritonModelConfig
from .triton import RemoteTriton, Triton, TritonConfig

__all__ = [
    "RemoteTriton",
    "Triton",
    "TritonConfig",
    "ModelConfig",
    "DynamicBatcher",
    "QueuePolicy",
    "TimeoutAction",
    "DeviceKind",
    "Tensor",
    "Request",
    "TritonContext",
    "TritonModelConfig",
    "batch",
    "fill_optionals",
    "sample",
    "first_value",
    "group_by_values",
    "group_by_keys",
    "pad_batch",
    "triton_context",
    "ConstantPadder",
    "UnrecoverableError",
    "PyTritonUnrecoverableError",
    "PyTritonError",
    "PyTritonValidationError",
    "PyTritonBadParameterError",
    "PyTritonInvalidOperationError",
    "PyTritonModelConfigError",
    "PyTritonRuntimeError",
]
