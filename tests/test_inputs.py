"""What a request may carry, and the clear errors for what it may not."""

from __future__ import annotations

import array
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from conftest import WIDTH, make_server, sample

import ferrobatch as fb


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
        ({}, "input 'x': missing"),
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
        with pytest.raises(fb.InvalidInputError, match=r"expected dtype int64, got torch\.int32"):
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
    with pytest.raises(ValueError, match="non-negative ints or -1"):
        fb.TensorSpec("x", "float32", (2, -3))
    with pytest.raises(ValueError, match="ragged='pad' or ragged='jagged'"):
        fb.TensorSpec("x", "float32", (-1,))
    with pytest.raises(ValueError, match="ragged='pad' or ragged='jagged'"):
        fb.TensorSpec("x", "float32", (2, -1))


class OnlyDLPack:
    """An object that offers its data through ``__dlpack__`` alone."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __dlpack__(self, **kwargs: object) -> object:
        return self.value.__dlpack__(**kwargs)  # type: ignore[attr-defined]

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.value.__dlpack_device__()  # type: ignore[attr-defined,no-any-return]


class FailingDLPack:
    def __dlpack__(self, **kwargs: object) -> object:
        raise RuntimeError("the producer failed")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


async def test_negative_strides_are_read_in_logical_order(server: fb.Server) -> None:
    client = server.client()
    backwards = np.arange(WIDTH, dtype=np.float32)[::-1]
    every_other_backwards = np.arange(2 * WIDTH, dtype=np.float32)[::-2]
    for value, first in [
        (backwards, WIDTH - 1),
        (memoryview(backwards), WIDTH - 1),
        (OnlyDLPack(backwards), WIDTH - 1),
        (every_other_backwards, 2 * WIDTH - 1),
    ]:
        out = await client.infer({"x": value})
        step = 1 if first == WIDTH - 1 else 2
        want = torch.arange(first, -1, -step, dtype=torch.float32)[:WIDTH] * 2
        torch.testing.assert_close(out["y"], want, msg=f"input {value!r}")


async def test_flipped_images_and_transposed_arrays_are_read_as_their_contiguous_copies() -> None:
    spec = fb.TensorSpec("img", "uint8", (2, 3, 4))
    server = fb.Server(lambda d: {"out": d["img"]}, inputs=[spec], outputs=[fb.TensorSpec("out", "uint8", (2, 3, 4))])
    img = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    values = [
        img[..., ::-1],  # img[..., ::-1]: last axis backwards
        img[::-1, ::-1],
        np.ascontiguousarray(img.transpose(2, 1, 0)).transpose(2, 1, 0),
        np.broadcast_to(img[:1], (2, 3, 4)),  # zero stride, read-only
        torch.from_numpy(np.ascontiguousarray(img.transpose(1, 0, 2))).permute(1, 0, 2),
        torch.from_numpy(img.astype(np.float32)).to(torch.complex64).conj().imag.to(torch.uint8),
    ]
    async with server:
        for value in values:
            out = await server.client().infer({"img": value})
            want = (
                value.contiguous() if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
            )
            assert torch.equal(out["out"], want)


def _sparse_csr() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.zeros(2, WIDTH // 2).to_sparse_csr()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.zeros(WIDTH, ">f4"), "got big-endian float32"),
        (np.zeros(2 * WIDTH, ">f4")[::2], "got big-endian float32"),
        (np.zeros(2 * WIDTH, ">f4")[::-2], "got big-endian float32"),
        (np.zeros(2 * WIDTH, object)[::2], "got buffer format 'O'"),
        (np.zeros(WIDTH, object), "got buffer format 'O'"),
        (np.zeros(WIDTH, np.complex64), "expected dtype float32"),
        (FailingDLPack(), "the producer failed"),
        (torch.zeros(WIDTH).to_sparse(), "sparse"),
        (torch.Tensor, "got the class Tensor"),
        (np.ndarray, "got the class ndarray"),
        (float, "got the class float"),
        (1.5, "got float"),
        ([0.0] * WIDTH, "got list"),
        (None, "got NoneType"),
        (torch.zeros(WIDTH).to_mkldnn(), "input 'x'"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else None,
)
async def test_every_bad_value_is_invalid_input_naming_the_input(
    server: fb.Server, value: object, message: str
) -> None:
    with pytest.raises(fb.InvalidInputError) as info:
        await server.client().infer({"x": value})
    assert "input 'x'" in str(info.value)
    assert message in str(info.value)
    out = await server.client().infer({"x": sample(2)})
    torch.testing.assert_close(out["y"], sample(4))


async def test_a_scalar_of_another_byte_order_is_worded_as_a_larger_array_is() -> None:
    scalar = fb.Server(lambda b: {"y": b["x"]}, inputs=[fb.TensorSpec("x", "float32", ())],
                       outputs=[fb.TensorSpec("y", "float32", ())])  # fmt: skip
    async with scalar:
        with pytest.raises(fb.InvalidInputError, match=r"input 'x': expected dtype float32, got big-endian float32"):
            await scalar.client().infer({"x": np.array(1.5, ">f4")})
        assert (await scalar.client().infer({"x": np.array(2.5, "<f4")}))["y"].item() == 2.5


async def test_a_lazily_negated_view_is_read_as_its_values(server: fb.Server) -> None:
    z = torch.complex(torch.zeros(WIDTH), torch.arange(1.0, WIDTH + 1)).conj()
    assert z.imag.is_neg()
    out = await server.client().infer({"x": z.imag})
    torch.testing.assert_close(out["y"], -2 * torch.arange(1.0, WIDTH + 1))


async def test_a_lazily_negated_scalar_is_read_as_its_value() -> None:
    """One element counts as contiguous: its raw bytes are not its value."""
    for shape in [(), (1,)]:
        spec = fb.TensorSpec("x", "float32", shape)
        server = fb.Server(lambda d: {"y": d["x"] * 1}, inputs=[spec], outputs=[fb.TensorSpec("y", "float32", shape)])
        x = torch.complex(torch.zeros(shape), torch.full(shape, 3.0)).conj().imag
        assert x.is_neg() and x.is_contiguous()
        async with server:
            out = await server.client().infer({"x": x})
            assert out["y"].tolist() == x.resolve_neg().tolist()
        assert float(out["y"].sum()) == -3.0


async def test_a_contiguous_lazily_negated_view_is_read_as_its_values(server: fb.Server) -> None:
    """A negated view of many elements can be contiguous too (``as_strided``,
    ``_neg_view``): its raw bytes are not its values either."""
    z = torch.complex(torch.zeros(WIDTH), torch.arange(1.0, WIDTH + 1)).conj()
    x = z.imag.as_strided((WIDTH,), (1,))
    assert x.is_neg() and x.is_contiguous()
    client = server.client()
    out = await client.infer({"x": x})
    torch.testing.assert_close(out["y"], 2 * x.resolve_neg())
    assert bool((out["y"] < 0).any())
    rows = torch._neg_view(torch.arange(1.0, 2 * WIDTH + 1).reshape(2, WIDTH))
    assert rows.is_neg() and rows.is_contiguous()
    both = await client.infer_batch({"x": rows})
    torch.testing.assert_close(both["y"], -2 * torch.arange(1.0, 2 * WIDTH + 1).reshape(2, WIDTH))


async def test_numbers_past_what_a_timeout_or_priority_can_be_are_invalid_input() -> None:
    async with make_server(priority_levels=2) as server:
        client = server.client()
        for call in [
            lambda: client.infer({"x": sample(1)}, priority=2**64),
            lambda: client.infer({"x": sample(1)}, timeout=-(10**400)),
            lambda: client.infer({"x": sample(1)}, parameters={"a": "\ud800"}),
        ]:
            with pytest.raises(fb.InvalidInputError):
                await call()
        # An int timeout too large for a float is no deadline, as infinity is.
        out = await client.infer({"x": sample(1)}, timeout=10**400)
        torch.testing.assert_close(out["y"], sample(2))
        failed = server.stats()["requests_failed"]
        assert failed["invalid_input"] == 3, failed  # counted as every refusal is


async def test_sparse_tensors_are_invalid_input_in_batches_too() -> None:
    async with make_server() as server:
        for value in [_sparse_csr(), torch.zeros(WIDTH // 2, 2).to_sparse()]:
            with pytest.raises(fb.InvalidInputError, match="input 'x'"):
                await server.client().infer_batch({"x": value})


async def test_infer_batch_checks_the_row_count_before_copying_anything() -> None:
    async with make_server(max_batch_size=8) as server:
        client = server.client()
        huge = [
            torch.zeros(1, WIDTH).expand(10**12, WIDTH),  # 16 TB if made contiguous
            np.broadcast_to(np.zeros(WIDTH, np.float32), (10**12, WIDTH)),
            memoryview(np.broadcast_to(np.zeros(WIDTH, np.float32), (10**12, WIDTH))),
            OnlyDLPack(torch.zeros(1, WIDTH).expand(10**12, WIDTH)),
        ]
        for value in huge:
            with pytest.raises(
                fb.InvalidInputError, match="input 'x': a request of 1000000000000 rows exceeds max_batch_size \\(8\\)"
            ):
                await client.infer_batch({"x": value})
        tracemalloc.start()
        try:
            strided = np.zeros((2 * 2_000_000, WIDTH), np.float32)[::2]  # 64 MB to copy
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            with pytest.raises(fb.InvalidInputError, match="exceeds max_batch_size"):
                await client.infer_batch({"x": strided})
            assert tracemalloc.get_traced_memory()[1] - before < 1 << 20
        finally:
            tracemalloc.stop()
