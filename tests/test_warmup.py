"""Warm-up runs every bucket before start() returns; the server is ready only after it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from conftest import WIDTH, X, Y, make_server, sample

import ferrobatch as fb


class Recorder:
    """y = 2x; records the batch sizes and first values it was called with."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.firsts: list[float] = []

    def __call__(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.sizes.append(d["x"].shape[0])
        self.firsts.append(float(d["x"][0, 0]))
        return {"y": d["x"] * 2}


async def test_plain_cpu_model_is_not_called_before_the_first_request() -> None:
    model = Recorder()
    async with make_server(model) as server:
        assert server.ready
        assert model.sizes == []
        await server.client().infer({"x": sample(1)})
    assert model.sizes == [1]


async def test_warmup_true_runs_every_power_of_two_bucket_with_zeros() -> None:
    model = Recorder()
    server = make_server(model, max_batch_size=12, warmup=True)
    assert server.buckets == (1, 2, 4, 8, 12)
    assert not server.ready
    await server.start()
    try:
        assert server.ready
        assert sorted(model.sizes) == [1, 2, 4, 8, 12]
        assert model.firsts == [0.0] * 5
    finally:
        await server.stop()
    assert not server.ready


async def test_warmup_buckets_are_the_preferred_sizes_and_the_max() -> None:
    model = Recorder()
    async with make_server(model, max_batch_size=16, preferred_batch_sizes=(3, 8), warmup=True):
        pass
    assert sorted(model.sizes) == [3, 8, 16]


async def test_warmup_with_given_samples_repeats_them_to_fill_each_bucket() -> None:
    seen: list[torch.Tensor] = []

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        seen.append(d["x"].clone())
        return {"y": d["x"] * 2}

    samples = torch.stack([sample(5), sample(7)])
    async with make_server(model, max_batch_size=4, warmup={"x": samples}):
        pass
    by_size = {t.shape[0]: t[:, 0].tolist() for t in seen}
    assert by_size == {1: [5.0], 2: [5.0, 7.0], 4: [5.0, 7.0, 5.0, 7.0]}


async def test_one_warmup_sample_of_the_spec_shape_is_accepted() -> None:
    model = Recorder()
    async with make_server(model, max_batch_size=2, warmup={"x": sample(9)}):
        pass
    assert model.firsts == [9.0, 9.0]


@pytest.mark.parametrize(
    "warmup, message",
    [
        ({"x": torch.zeros(WIDTH + 1)}, "expected shape"),
        ({"x": torch.zeros(WIDTH, dtype=torch.float64)}, "expected dtype"),
        ({}, "missing input 'x'"),
        ({"x": sample(0), "z": sample(0)}, "unexpected inputs"),
    ],
)
def test_bad_warmup_samples_are_refused_when_the_server_is_made(warmup: Any, message: str) -> None:
    with pytest.raises(fb.InvalidInputError, match=message):
        make_server(warmup=warmup)


def test_warmup_false_is_refused_with_compile() -> None:
    with pytest.raises(ValueError, match="need warm-up"):
        make_server(warmup=False, compile=True)


async def test_a_model_failing_in_warmup_fails_start_and_the_server_never_runs() -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if d["x"].shape[0] == 4:
            raise RuntimeError("no batches of four")
        return {"y": d["x"] * 2}

    server = make_server(model, max_batch_size=8, warmup=True)
    with pytest.raises(fb.ModelError, match=r"warm-up.*no batches of four") as info:
        await server.start()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not server.ready and not server.running
    with pytest.raises(fb.ServerClosedError):
        await server.client().infer({"x": sample(1)})


async def test_server_is_not_ready_and_refuses_requests_during_warmup() -> None:
    entered, release = threading.Event(), threading.Event()

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        release.wait(10)
        return {"y": d["x"] * 2}

    server = make_server(model, max_batch_size=2, warmup=True)
    starting = asyncio.create_task(server.start())
    try:
        while not entered.is_set():  # the loop keeps running while warm-up blocks
            await asyncio.sleep(0.005)
        assert not server.ready
        with pytest.raises(fb.ServerClosedError, match="not running"):
            await server.client().infer({"x": sample(1)})
        release.set()
        await starting
        assert server.ready
        out = await server.client().infer({"x": sample(3)})
        torch.testing.assert_close(out["y"], sample(6))
    finally:
        release.set()
        await server.stop()


async def test_compile_pads_to_buckets_and_compiles_nothing_after_start() -> None:
    compiled_shapes: list[tuple[int, ...]] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiled_shapes.extend(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": d["x"] * 2 + 1}

    server = fb.Server(
        model, inputs=[X], outputs=[Y], max_batch_size=8, max_delay=0.002,
        compile={"backend": counting_backend},
    )  # fmt: skip
    async with server:
        compiled_at_start = len(compiled_shapes)
        assert compiled_at_start > 0, "warm-up compiled the model"
        client = server.client()
        for n in (1, 3, 5, 7, 8, 2):  # batch sizes that are not all buckets
            outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(n)))
            for i, out in enumerate(outs):
                torch.testing.assert_close(out["y"], sample(2 * i + 1))
        big = await client.infer_batch({"x": torch.stack([sample(i) for i in range(6)])})
        torch.testing.assert_close(big["y"], torch.stack([sample(2 * i + 1) for i in range(6)]))
    assert len(compiled_shapes) == compiled_at_start, "a request paid for a compilation"


@pytest.mark.parametrize("annotation", ["dict", "tensor"])
async def test_a_compiled_module_is_called_as_its_own_forward_asks(annotation: str) -> None:
    # torch.compile wraps a module in one whose forward takes (*args, **kwargs):
    # the call style must come from the module it wraps.
    class TakesDict(torch.nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"y": d["x"] * 2}

    class TakesTensor(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    module = TakesDict() if annotation == "dict" else TakesTensor()
    server = fb.Server(module, inputs=[X], outputs=[Y], max_batch_size=4, compile={"backend": "eager"})
    async with server:
        out = await server.client().infer({"x": sample(3)})
    torch.testing.assert_close(out["y"], sample(6))
