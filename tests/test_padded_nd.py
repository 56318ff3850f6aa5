"""Variable-length dimensions anywhere (``(3, -1)``, ``(-1, -1)``, ``(-1, 2,
-1)``) with ``ragged="pad"``: the batch padded to its longest along every
variable dimension, collated in Rust, with ``name + "_lengths"`` ``[B, k]``
(``[B]`` for one); each caller's output cut to its own lengths; the token
budget counts the padded batch; and the same over HTTP and gRPC with
tritonclient, on both front-ends."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import gevent_hub_freed

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

pytestmark = pytest.mark.timeout(60)

PAD = -7.0


class Recorder:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []


def grid_model(rec: Recorder) -> Any:
    """``x`` of rows ``[L1, L2]``: each row's own box times 10, padding
    garbage past it (never sent); and each row's sum over its own box."""

    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, lengths = batch["x"], batch["x_lengths"]
        rec.batches.append({"shape": tuple(x.shape), "lengths": lengths.tolist(), "x": x.clone()})
        out = torch.full_like(x, 999.0)
        totals = torch.zeros(x.shape[0])
        for i, (a, b) in enumerate(lengths.tolist()):
            out[i, :a, :b] = x[i, :a, :b] * 10
            totals[i] = x[i, :a, :b].sum()
        return {"y": out, "y_lengths": lengths, "total": totals}

    return model


def make_grid(rec: Recorder, **kwargs: Any) -> fb.Server:
    kwargs.setdefault("max_delay", 0.02)
    return fb.Server(
        grid_model(rec),
        inputs=[fb.TensorSpec("x", "float32", (-1, -1), ragged="pad", pad_value=PAD)],
        outputs=[
            fb.TensorSpec("y", "float32", (-1, -1), ragged="pad", pad_value=-1.0),
            fb.TensorSpec("total", "float32", ()),
        ],
        name="grid",
        **kwargs,
    )


SHAPES = [(2, 3), (1, 1), (4, 2), (0, 3), (3, 5), (2, 0)]


def grid(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(1, 50, shape, generator=torch.Generator().manual_seed(seed)).float()


def test_two_variable_dimensions_several_shapes_in_one_batch() -> None:
    rec = Recorder()
    server = make_grid(rec, max_batch_elements=4096)
    xs = [grid(s, i) for i, s in enumerate(SHAPES)]

    async def main() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            singles = await asyncio.gather(*(client.infer({"x": x}) for x in xs))
            two = await client.infer_batch({"x": torch.ones(2, 2, 3)})
            return singles, two

    singles, two = asyncio.run(main())
    for x, out in zip(xs, singles):
        assert out["y"].shape == x.shape
        assert torch.equal(out["y"], x * 10)
        assert out["total"].item() == x.sum().item()
    assert torch.equal(two["y"], torch.full((2, 2, 3), 10.0))
    big = max(rec.batches, key=lambda b: b["shape"][0])
    rows, l1, l2 = big["shape"]
    assert rows > 1
    assert (l1, l2) == tuple(max(column) for column in zip(*big["lengths"]))  # the longest along each
    for row, (a, b) in zip(big["x"], big["lengths"]):
        assert (row[a:, :] == PAD).all() and (row[:, b:] == PAD).all()  # padded along both
        assert (row[:a, :b] != PAD).all()


def test_a_fixed_dimension_before_a_variable_one_and_lengths_of_one_column() -> None:
    seen: list[torch.Tensor] = []

    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, lengths = batch["x"], batch["x_lengths"]
        seen.append(lengths.clone())
        assert x.shape[1] == 3 and x.shape[2] == lengths.max()
        return {"y": x * 2, "y_lengths": lengths, "n": lengths}

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("x", "int64", (3, -1), ragged="pad")],
        outputs=[fb.TensorSpec("y", "int64", (3, -1), ragged="pad"), fb.TensorSpec("n", "int64", ())],
        max_delay=0.02,
    )
    xs = [torch.arange(3 * n).view(3, n) for n in (1, 4, 2)]

    async def main() -> list[dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            return await asyncio.gather(*(client.infer({"x": x}) for x in xs))

    for x, out in zip(xs, asyncio.run(main())):
        assert torch.equal(out["y"], x * 2)
        assert out["n"].item() == x.shape[1]
    assert any(s.dim() == 1 and len(s) > 1 for s in seen), seen  # one variable dimension: [B]


def test_the_token_budget_counts_the_padded_batch() -> None:
    rec = Recorder()
    server = make_grid(rec, max_batch_elements=24, max_delay=0)
    shapes = [(2, 3), (3, 2), (4, 4), (1, 1), (6, 4)]
    xs = [grid(s, i) for i, s in enumerate(shapes)]

    async def main() -> list[dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            with pytest.raises(fb.InvalidInputError, match=r"'x'.*exceeds max_batch_elements \(24\)"):
                await client.infer({"x": torch.zeros(5, 5)})
            # An empty dimension counts as 1: a box of no elements is bounded too.
            with pytest.raises(fb.InvalidInputError, match=r"'x'.*exceeds max_batch_elements \(24\)"):
                await client.infer({"x": torch.zeros(0, 10**6)})
            with pytest.raises(fb.InvalidInputError, match=r"'x': expected shape \(L1, L2\)"):
                await client.infer({"x": torch.zeros(5)})
            return await asyncio.gather(*(client.infer({"x": x}) for x in xs))

    for x, out in zip(xs, asyncio.run(main())):
        assert torch.equal(out["y"], x * 10)
    order = []
    for b in rec.batches:
        rows, l1, l2 = b["shape"]
        assert rows * l1 * l2 <= 24, b
        order.extend(tuple(n) for n in b["lengths"])
    assert order == shapes  # none overtaken
    assert server.stats()["dispatch_reasons"]["next_does_not_fit"] >= 2


def test_model_outputs_with_bad_lengths_are_model_errors() -> None:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = batch["x"]
        return {"y": x, "y_lengths": batch["x_lengths"][:, :1], "total": x.sum((1, 2))}

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("x", "float32", (-1, -1), ragged="pad")],
        outputs=[fb.TensorSpec("y", "float32", (-1, -1), ragged="pad"), fb.TensorSpec("total", "float32", ())],
    )

    async def main() -> None:
        async with server:
            with pytest.raises(fb.ModelError, match="y_lengths"):
                await server.client().infer({"x": torch.ones(2, 2)})

    asyncio.run(main())


@contextlib.contextmanager
def serving(frontend: str) -> Iterator[tuple[str, str]]:
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    with serve_in_thread([make_grid(Recorder(), max_batch_elements=512)], config) as listening:
        yield f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"


@pytest.fixture(params=["native", "python"], scope="module")
def addresses(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with serving(request.param) as addresses:
        yield addresses


def test_tritonclient_http_and_grpc_with_several_shapes(addresses: tuple[str, str]) -> None:
    http, grpc_address = addresses
    with httpx.Client(base_url=f"http://{http}", timeout=30) as client:
        meta = client.get("/v2/models/grid").json()
        assert meta["inputs"][0]["shape"] == [-1, -1, -1]

    @gevent_hub_freed()
    def call(i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        x = grid((1 + i % 2, 1 + i % 4, 1 + (i * 3) % 5), i).numpy()
        kind: Any = grpcclient if i % 2 else httpclient
        client = kind.InferenceServerClient(grpc_address if i % 2 else http)
        try:
            tensor = kind.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer("grid", [tensor])
            return x, {o: result.as_numpy(o) for o in ("y", "total")}
        finally:
            client.close()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(12)))
    for x, out in results:
        np.testing.assert_array_equal(out["y"], x * 10)
        np.testing.assert_allclose(out["total"], x.sum((1, 2)))


def test_bad_shapes_over_http_are_400_naming_the_input(addresses: tuple[str, str]) -> None:
    http, _ = addresses

    def body(shape: list[int]) -> dict[str, Any]:
        n = int(np.prod(shape))
        return {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": [1.0] * n}]}

    with httpx.Client(base_url=f"http://{http}", timeout=30) as client:
        for case, shape in {"one dimension short": [1, 4], "over the budget": [1, 32, 17]}.items():
            response = client.post("/v2/models/grid/infer", json=body(shape))
            assert response.status_code == 400, (case, response.text)
            assert "'x'" in response.json()["error"], (case, response.text)
        ok = client.post("/v2/models/grid/infer", json=body([2, 16, 16]))
        assert ok.status_code == 200, ok.text


def test_one_poisoned_request_fails_alone_and_each_part_is_padded_to_its_own() -> None:
    rec = Recorder()
    inner = grid_model(rec)

    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((batch["x"] == 77.0).any()):
            raise ValueError("poisoned grid")
        return inner(batch)

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("x", "float32", (-1, -1), ragged="pad", pad_value=PAD)],
        outputs=[fb.TensorSpec("y", "float32", (-1, -1), ragged="pad", pad_value=-1.0)],
        max_batch_size=len(SHAPES),
        max_delay=5.0,
    )
    xs = [grid(s, i) for i, s in enumerate(SHAPES)]
    xs[4][1, 2] = 77.0

    async def main() -> list[Any]:
        async with server:
            return await asyncio.gather(*(server.client().infer({"x": x}) for x in xs), return_exceptions=True)

    results = asyncio.run(main())
    assert [i for i, r in enumerate(results) if isinstance(r, BaseException)] == [4]
    for i, (x, out) in enumerate(zip(xs, results)):
        if i != 4:
            assert torch.equal(out["y"], x * 10)
    for part in rec.batches:  # the parts that ran, each padded to its own longest
        assert part["shape"][1:] == tuple(max(column) for column in zip(*part["lengths"]))


def test_warmup_runs_rows_of_one_element_along_each_variable_dimension() -> None:
    rec = Recorder()

    async def main() -> None:
        async with make_grid(rec, max_batch_size=4, warmup=True):
            pass

    asyncio.run(main())
    assert [b["shape"] for b in rec.batches] == [(1, 1, 1), (2, 1, 1), (4, 1, 1)]
    assert all(b["lengths"] == [[1, 1]] * b["shape"][0] for b in rec.batches)
