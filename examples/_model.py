"""The small model every example serves: 16 features -> 4 class probabilities."""

from __future__ import annotations

import torch

import ferrobatch as fb

FEATURES = 16
CLASSES = 4


class Scorer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"probs": self.linear(inputs["features"]).softmax(-1)}


def make_server() -> fb.Server:
    """Batches up to 32 requests, waiting at most 2 ms for a batch to fill."""
    torch.manual_seed(0)
    return fb.Server(
        Scorer().eval(),
        inputs=[fb.TensorSpec("features", "float32", (FEATURES,))],
        outputs=[fb.TensorSpec("probs", "float32", (CLASSES,))],
        max_batch_size=32,
        max_delay=0.002,
        name="scorer",
    )
