"""A PyTriton script moved to ferrobatch: only the imports changed.

    # from pytriton.decorators import batch
    # from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    # from pytriton.triton import Triton, TritonConfig

    python examples/pytriton_switch.py      # serves "scorer" on HTTP 8000 and gRPC 8001 until Ctrl-C

Any Triton client then works unchanged, e.g. with tritonclient::

    client = tritonclient.http.InferenceServerClient("127.0.0.1:8000")
    x = tritonclient.http.InferInput("features", [2, 16], "FP32")
    x.set_data_from_numpy(np.random.rand(2, 16).astype(np.float32))
    client.infer("scorer", [x]).as_numpy("probs")    # (2, 4)
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from _model import CLASSES, FEATURES, Scorer

from ferrobatch.triton.decorators import batch
from ferrobatch.triton.model_config import DynamicBatcher, ModelConfig, Tensor
from ferrobatch.triton.triton import Triton, TritonConfig

torch.manual_seed(0)
MODEL = Scorer().eval()


@batch
def infer_fn(features: np.ndarray) -> dict[str, np.ndarray]:
    """Every request's rows, concatenated by @batch; split back after."""
    with torch.inference_mode():
        probs = MODEL({"features": torch.from_numpy(features)})["probs"]
    return {"probs": probs.numpy()}


def bind(triton: Triton) -> None:
    triton.bind(
        model_name="scorer",
        infer_func=infer_fn,
        inputs=[Tensor(name="features", dtype=np.float32, shape=(FEATURES,))],
        outputs=[Tensor(name="probs", dtype=np.float32, shape=(CLASSES,))],
        config=ModelConfig(max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=1000)),
        strict=True,
    )


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    with Triton(config=TritonConfig(http_port=8000, grpc_port=8001)) as triton:
        bind(triton)
        triton.serve()


if __name__ == "__main__":
    main()
