"""Streaming tokens over HTTP with Triton's generate extension.

A toy language model, decoupled (it yields one word per step for every
prompt of its batch), served by the native front-end:

    ferrobatch serve examples/token_stream.py:make_servers

Then any client of Triton's generate endpoints works, e.g.::

    curl -N localhost:8000/v2/models/toy_lm/generate_stream -d '{"text_input": "tell me"}'
    data: {"model_name":"toy_lm","model_version":"1","text_output":"every"}

    data: {"model_name":"toy_lm","model_version":"1","text_output":"request"}

    data: {"model_name":"toy_lm","model_version":"1","text_output":"tokens"}
    ...                                      (eight events; a greedy toy repeats itself)

Each word is an event, sent as the model makes it; concurrent prompts are
batched (each step runs once for the whole batch). ``.../generate`` answers
the same request in one JSON object only for a model that sends exactly one
response, so this model is asked through ``generate_stream``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import ferrobatch as fb

VOCAB = ["ferrobatch", "batches", "streams", "tokens", "of", "to", "you", "fast", "and", "every", "request", "."]
#: Words each prompt is continued by.
WORDS = 8


class ToyLM(torch.nn.Module):
    """Greedy next-word choice from the last word: an embedding and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(len(VOCAB), 16)
        self.head = torch.nn.Linear(16, len(VOCAB))

    def forward(self, last: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(last)).argmax(-1)


MODEL = ToyLM().eval()


def first_words(prompts: np.ndarray) -> torch.Tensor:
    """A word to start from per prompt (from its bytes: the toy has no tokenizer)."""
    return torch.tensor([sum(p) % len(VOCAB) for p in prompts], dtype=torch.int64)


def continue_prompts(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Yields ``WORDS`` responses, each one word for every prompt of the batch."""
    last = first_words(inputs["text_input"][:, 0])
    with torch.inference_mode():
        for _ in range(WORDS):
            last = MODEL(last)
            yield {"text_output": np.array([[VOCAB[i].encode()] for i in last.tolist()], dtype=object)}


def make_servers() -> list[fb.Server]:
    return [
        fb.Server(
            continue_prompts,
            inputs=[fb.TensorSpec("text_input", "bytes", (1,))],
            outputs=[fb.TensorSpec("text_output", "bytes", (1,))],
            decoupled=True,
            max_batch_size=16,
            max_delay=0.005,
            name="toy_lm",
        )
    ]
