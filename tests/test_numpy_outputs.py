"""A model may return numpy arrays for its outputs (PyTriton's convention):
taken without a copy where possible, checked like tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ferrobatch as fb

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
N = fb.TensorSpec("n", "int64", ())


async def test_numpy_outputs_in_a_dict_a_tuple_or_alone() -> None:
    def as_dict(d: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        x = d["x"].numpy()
        return {"y": x * 2, "n": (x > 0).sum(axis=1).astype(np.int64)}

    def alone(d: dict[str, torch.Tensor]) -> np.ndarray:
        return d["x"].numpy() * 3  # type: ignore[no-any-return]

    def read_only(d: dict[str, torch.Tensor]) -> np.ndarray:
        out = d["x"].numpy() + 1
        out.flags.writeable = False
        return out

    two = fb.Server(as_dict, inputs=[X], outputs=[Y, N], name="two")
    one = fb.Server(alone, inputs=[X], outputs=[Y], name="one")
    frozen = fb.Server(read_only, inputs=[X], outputs=[Y], name="frozen")
    async with two, one, frozen:
        x = torch.tensor([1.0, -2.0, 3.0, 0.5])
        out = await two.client().infer({"x": x})
        assert torch.equal(out["y"], x * 2) and int(out["n"]) == 3
        assert torch.equal((await one.client().infer({"x": x}))["y"], x * 3)
        assert torch.equal((await frozen.client().infer({"x": x}))["y"], x + 1)


async def test_a_numpy_output_of_the_wrong_dtype_is_a_model_error() -> None:
    def wrong(d: dict[str, torch.Tensor]) -> np.ndarray:
        return d["x"].numpy().astype(np.float64)

    server = fb.Server(wrong, inputs=[X], outputs=[Y], warmup=False)
    async with server:
        with pytest.raises(fb.ModelError, match=r"expected dtype float32, got torch\.float64"):
            await server.client().infer({"x": torch.zeros(4)})
