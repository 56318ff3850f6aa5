"""What a request may carry, and the clear errors for what it may not."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch

import ferrobatch as fb
from conftest import WIDTH, make_server, sample


async def test_accepts_torch_numpy_buffer_and_dlpack_inputs(server: fb.Server) -> None:
    client = server.client()
    values = [
        torch.arange(WIDTH, dtype=torch.float32),
        torch.arange(2 * WIDTH, dtype=torch.float32)[::2],  # non-contiguous tensor
        np.arange(WIDTH, dtype=np.float32),
        np.arange(2 * WIDTH, dtype=np.float32)[::2],  # non-contiguous array
        array.array("f", range(WIDTH)),  # plain buffer protocol
        memoryview(np.arange(WIDTH, dtype=np.float32)),
    ]
    expected = [
        torch.arange(WIDTH) * 2.0,
        torch.arange(0, 2 * WIDTH, 2) * 2.0,
        torch.arange(WIDTH) * 2.0,
        torch.arange(0, 2 * WIDTH, 2) * 2.0,
        torch.arange(WIDTH) * 2.0,
        torch.arange(WIDTH) * 2.0,
    ]
    for value, want in zip(values, expected):
        out = await client.infer({"x": value})
        assert out["y"].dtype == torch.float32
        torch.testing.assert_close(out["y"], want.float(), msg=f"input {type(value)}")


async def test_dlpack_only_object_is_accepted(server: fb.Server) -> None:
    class OnlyDLPack:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def __dlpack__(self, **kwargs: object) -> object:
            return self.t.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.t.__dlpack_device__()

    out = await server.client().infer({"x": OnlyDLPack(sample(3))})
    torch.testing.assert_close(out["y"], sample(6))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, "missing input 'x'"),
        ({"x": sample(1), "z": sample(1)}, "unexpected input 'z'"),
        ({"x": torch.zeros(WIDTH, dtype=torch.float64)}, "input 'x': expected dtype float32, got torch.float64"),
        ({"x": np.zeros(WIDTH, dtype=np.float64)}, "input 'x': expected dtype float32, got float64"),
        ({"x": np.zeros(WIDTH, dtype=np.int32)}, "expected dtype float32, got int32"),
        ({"x": torch.zeros(WIDTH + 1)}, "input 'x': expected shape (4,), got (5,)"),
        ({"x": torch.zeros(1, WIDTH)}, "expected shape (4,), got (1, 4)"),
        ({"x": torch.zeros(WIDTH, device="meta")}, "input 'x': tensor is on device 'meta'"),
        ({"x": [0.0] * WIDTH}, "input 'x': expected a torch tensor, numpy array"),
        ([("x", sample(1))], "inputs must be a dict"),
    ],
)
async def test_bad_inputs_are_refused_at_submit_with_a_clear_error(
    server: fb.Server, inputs: object, message: str
) -> None:
    with pytest.raises(fb.InvalidInputError) as info:
        await server.client().infer(inputs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
    stats = server.stats()
    assert stats["requests_failed"]["invalid_input"] == 1
    assert stats["batches"] == 0, "a refused request never enters the queue"
    # ... and the server keeps serving everyone else.
    out = await server.client().infer({"x": sample(2)})
    torch.testing.assert_close(out["y"], sample(4))


async def test_inputs_are_never_cast() -> None:
    spec = fb.TensorSpec("x", "int64", (2,))
    server = fb.Server(lambda d: {"y": d["x"] + 1}, inputs=[spec], outputs=[fb.TensorSpec("y", "int64", (2,))])
    async with server:
        with pytest.raises(fb.InvalidInputError, match="expected dtype int64, got torch.int32"):
            await server.client().infer({"x": torch.tensor([1, 2], dtype=torch.int32)})
        out = await server.client().infer({"x": np.array([1, 2], dtype=np.int64)})
        assert out["y"].tolist() == [2, 3]


async def test_several_inputs_and_outputs_of_several_dtypes() -> None:
    def model(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return d["a"].float() + d["b"].float().sum(dim=(1, 2)).unsqueeze(-1), d["a"] > 1

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("a", "int32", (3,)), fb.TensorSpec("b", torch.float16, (2, 2))],
        outputs=[fb.TensorSpec("s", "float32", (3,)), fb.TensorSpec("m", "bool", (3,))],
    )
    async with server:
        out = await server.client().infer(
            {"a": np.array([0, 1, 2], dtype=np.int32), "b": torch.ones(2, 2, dtype=torch.float16)}
        )
    assert out["s"].tolist() == [4.0, 5.0, 6.0]
    assert out["m"].tolist() == [False, False, True]


async def test_infer_batch_rows_join_one_batch_and_come_back_in_order() -> None:
    async with make_server(max_batch_size=8) as server:
        client = server.client()
        x = torch.arange(3 * WIDTH, dtype=torch.float32).reshape(3, WIDTH)
        out = await client.infer_batch({"x": x})
        torch.testing.assert_close(out["y"], x * 2)
        with pytest.raises(fb.InvalidInputError, match="expected shape \\(n, 4\\), got \\(4,\\)"):
            await client.infer_batch({"x": sample(1)})
        with pytest.raises(fb.InvalidInputError, match="exceeds max_batch_size"):
            await client.infer_batch({"x": torch.zeros(9, WIDTH)})
        with pytest.raises(fb.InvalidInputError, match="at least one row"):
            await client.infer_batch({"x": torch.zeros(0, WIDTH)})


async def test_caller_keeps_ownership_of_its_input(server: fb.Server) -> None:
    x = sample(1)
    out = await server.client().infer({"x": x})
    x.fill_(100.0)  # mutating the input afterwards does not touch the result
    torch.testing.assert_close(out["y"], sample(2))


def test_tensor_spec_normalises_dtypes_and_rejects_bad_shapes() -> None:
    assert fb.TensorSpec("x", torch.float32, (2,)).dtype == "float32"
    assert fb.TensorSpec("x", np.dtype("int16"), (2,)).dtype == "int16"
    assert fb.TensorSpec("x", "float", [3]).shape == (3,)
    with pytest.raises(ValueError, match="unsupported dtype"):
        fb.TensorSpec("x", "complex64", (2,))
    with pytest.raises(ValueError, match="non-negative ints"):
        fb.TensorSpec("x", "float32", (-1,))
