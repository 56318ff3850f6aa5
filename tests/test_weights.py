"""Versioned weight updates: applied between batches on every instance, never
during a forward pass, never on only some instances; the version each row
ran with, stats, and the blocking form."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from conftest import WIDTH, X, Y

import ferrobatch as fb

A = fb.TensorSpec("a", "float32", (WIDTH,))
B = fb.TensorSpec("b", "float32", (WIDTH,))


class TwoReads(torch.nn.Module):
    """Reads ``a``, lets other threads run, then reads ``b``: a weight update
    landing in between makes a row whose ``a`` and ``b`` disagree."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(WIDTH), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(WIDTH), requires_grad=False)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        a = d["x"] * 0 + self.a
        time.sleep(0.0002)  # the GIL goes to whoever updates the weights
        return {"a": a, "b": d["x"] * 0 + self.b}


def state(k: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((WIDTH,), k), "b": torch.full((WIDTH,), k)}


def two_reads_server(models: Any, **kwargs: Any) -> fb.Server:
    return fb.Server(models, inputs=[X], outputs=[A, B], max_batch_size=8, max_delay=0.0005, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("instances", ["one", "two_copies", "shared"])
async def test_back_to_back_updates_under_load_tear_no_row(instances: str) -> None:
    models: Any = {
        "one": TwoReads(),
        "two_copies": [TwoReads(), TwoReads()],
        "shared": [m := TwoReads(), m],
    }[instances]
    server = two_reads_server(models, version_output="policy_version")
    rows: list[dict[str, torch.Tensor]] = []
    updating = True

    async def caller() -> None:
        client = server.client()
        while updating:
            rows.append(await client.infer({"x": torch.zeros(WIDTH)}))

    async def trainer() -> int:
        nonlocal updating
        version = 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            version = await server.update_weights(state(version + 1))
        updating = False
        return version

    async with server:
        *_, last = await asyncio.gather(*(caller() for _ in range(32)), trainer())
        stats = server.stats()
    assert last > 20, "too few updates to mean anything"
    assert len(rows) > 500
    torn = [r for r in rows if not (torch.equal(r["a"], r["b"]) and bool((r["a"] == r["policy_version"]).all()))]
    assert torn == [], f"{len(torn)} torn rows of {len(rows)}, e.g. {torn[:2]}"
    assert stats["weight_updates"] == last == server.model_version == stats["model_version"]
    seen = {int(r["policy_version"]) for r in rows}
    assert len(seen) > 5  # rows really came from many versions


async def test_update_returns_once_every_instance_has_it() -> None:
    server = two_reads_server([TwoReads(), TwoReads()], version_output="v")
    async with server:
        client = server.client()
        assert server.model_version == 0
        assert (await client.infer({"x": torch.zeros(WIDTH)}))["v"] == 0
        assert await server.update_weights(state(7.0)) == 1
        outs = await asyncio.gather(*(client.infer({"x": torch.zeros(WIDTH)}) for _ in range(64)))
    for out in outs:  # whichever instance ran it
        assert int(out["v"]) == 1
        torch.testing.assert_close(out["a"], torch.full((WIDTH,), 7.0))


async def test_a_callable_update_runs_once_per_distinct_model() -> None:
    shared = TwoReads()
    server = two_reads_server([shared, shared, TwoReads()])
    seen: list[int] = []

    def bump(model: torch.nn.Module) -> None:
        seen.append(id(model))
        model.a.add_(1)  # type: ignore[operator]

    async with server:
        assert await server.update_weights(bump) == 1
    assert len(seen) == 2 and len(set(seen)) == 2
    torch.testing.assert_close(shared.a, torch.ones(WIDTH))


async def test_a_bad_state_dict_changes_nothing() -> None:
    first, second = TwoReads(), TwoReads()
    server = two_reads_server([first, second])
    async with server:
        with pytest.raises(ValueError, match="expected shape"):
            await server.update_weights({"a": torch.ones(WIDTH), "b": torch.ones(WIDTH + 1)})
        with pytest.raises(ValueError, match="missing"):
            await server.update_weights({"a": torch.ones(WIDTH)})
        # Would fail in load_state_dict half-way: the first instance updated, the second not.
        with pytest.raises(ValueError, match="a dense tensor with data is needed"):
            await server.update_weights({"a": torch.full((WIDTH,), 7.0), "b": torch.empty(WIDTH, device="meta")})
        with pytest.raises(ValueError, match="cannot be copied into"):
            await server.update_weights({"a": torch.full((WIDTH,), 7.0), "b": torch.ones(WIDTH, dtype=torch.complex64)})
        assert server.model_version == 0 and server.stats()["weight_updates"] == 0
    for model in (first, second):
        torch.testing.assert_close(model.a, torch.zeros(WIDTH))


@pytest.mark.filterwarnings("ignore:.*quantize_per_tensor:UserWarning")
async def test_a_quantized_entry_is_refused_before_anything_is_copied() -> None:
    first, second = TwoReads(), TwoReads()
    quantized = torch.quantize_per_tensor(torch.ones(WIDTH), 0.1, 0, torch.quint8)
    async with two_reads_server([first, second]) as server:
        with pytest.raises(ValueError, match=r"'b': torch\.quint8 cannot be copied into torch\.float32"):
            await server.update_weights({"a": torch.full((WIDTH,), 7.0), "b": quantized})
        assert server.model_version == 0
    for model in (first, second):
        torch.testing.assert_close(model.a, torch.zeros(WIDTH))


async def test_a_callable_that_fails_part_way_is_undone_on_every_model() -> None:
    first, second = TwoReads(), TwoReads()
    updated: list[torch.nn.Module] = []

    def fails_on_the_second(model: torch.nn.Module) -> None:
        updated.append(model)
        if len(updated) == 2:
            raise RuntimeError("the trainer failed")
        model.a.fill_(1.0)  # type: ignore[operator]

    async with two_reads_server([first, second], version_output="v") as server:
        with pytest.raises(RuntimeError, match="the trainer failed"):
            await server.update_weights(fails_on_the_second)
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": torch.zeros(WIDTH)}) for _ in range(64)))
        assert server.model_version == 0 and server.stats()["weight_updates"] == 0
    assert {(float(o["a"][0]), int(o["v"])) for o in outs} == {(0.0, 0)}  # one version, one set of weights
    for model in (first, second):
        torch.testing.assert_close(model.a, torch.zeros(WIDTH))


class Scaled(torch.nn.Module):
    """Weights and extra state (``get_extra_state``); one that ``refuses``
    raises in ``set_extra_state``, which load_state_dict calls after copying
    the module's weights."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(WIDTH), requires_grad=False)
        self.scale = scale
        self.refuses = False

    def get_extra_state(self) -> dict[str, float]:
        return {"scale": self.scale}

    def set_extra_state(self, state: dict[str, float]) -> None:
        if self.refuses:
            raise ValueError("this instance refuses the new scale")
        self.scale = state["scale"]

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": d["x"] * 0 + self.w * self.scale}


async def test_a_state_dict_with_extra_state_updates_it_too() -> None:
    model, trainer = Scaled(), Scaled(scale=2.0)
    trainer.w.fill_(3.0)
    async with fb.Server(model, inputs=[X], outputs=[Y]) as server:
        assert await server.update_weights(trainer.state_dict()) == 1
        out = await server.client().infer({"x": torch.zeros(WIDTH)})
    assert model.scale == 2.0
    torch.testing.assert_close(out["y"], torch.full((WIDTH,), 6.0))


async def test_a_state_dict_refused_while_copying_is_undone_on_every_instance() -> None:
    first, second = Scaled(), Scaled()
    second.refuses = True  # its weights are copied, then its extra state refused
    async with fb.Server([first, second], inputs=[X], outputs=[Y], version_output="v", max_delay=0) as server:
        with pytest.raises(ValueError, match="refuses the new scale"):
            await server.update_weights({"w": torch.full((WIDTH,), 5.0), "_extra_state": {"scale": 2.0}})
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": torch.zeros(WIDTH)}) for _ in range(64)))
        assert server.model_version == 0
    assert {(float(o["y"][0]), int(o["v"])) for o in outs} == {(0.0, 0)}
    for model in (first, second):
        torch.testing.assert_close(model.w, torch.zeros(WIDTH))
        assert model.scale == 1.0


class Held(TwoReads):
    """Holds each forward pass until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.entered.set()
        self.release.wait(30)
        return super().forward(d)


async def test_an_update_cancelled_while_it_waits_for_a_batch_changes_nothing() -> None:
    model = Held()
    async with two_reads_server(model, version_output="v") as server:
        running = asyncio.ensure_future(server.client().infer({"x": torch.zeros(WIDTH)}))
        while not model.entered.is_set():
            await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(server.update_weights(state(1.0)), 0.1)
        model.release.set()
        assert int((await running)["v"]) == 0
        await asyncio.sleep(0.2)  # the withdrawn update has had the gates by now
        assert server.model_version == 0 and server.stats()["weight_updates"] == 0
        torch.testing.assert_close(model.a, torch.zeros(WIDTH))
        assert await server.update_weights(state(2.0)) == 1  # the next one goes through


async def test_an_update_cancelled_once_begun_is_done_when_the_cancellation_arrives() -> None:
    model = TwoReads()
    begun = threading.Event()

    def slow(m: torch.nn.Module) -> None:
        begun.set()
        time.sleep(0.5)
        m.a.fill_(1.0)  # type: ignore[operator]

    async with two_reads_server(model) as server:
        updating = asyncio.ensure_future(server.update_weights(slow))
        while not begun.is_set():
            await asyncio.sleep(0.01)
        updating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await updating
        assert server.model_version == 1  # what the caller sees is what happened
        torch.testing.assert_close(model.a, torch.ones(WIDTH))


async def test_a_state_dict_cannot_update_a_plain_callable() -> None:
    server = fb.Server(lambda d: {"y": d["x"]}, inputs=[X], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        await server.update_weights({"w": torch.zeros(1)})


def test_update_weights_sync_from_threads_while_serving() -> None:
    server = two_reads_server(TwoReads(), version_output="v")
    with server.run_in_background():
        client = server.client()
        versions: list[int] = []
        threads = [
            threading.Thread(target=lambda: versions.append(server.update_weights_sync(state(1.0)))) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        out = client.infer_sync({"x": torch.zeros(WIDTH)})
    assert sorted(versions) == [1, 2, 3, 4]
    assert int(out["v"]) == 4 == server.stats()["weight_updates"]


async def test_update_weights_sync_refuses_the_event_loop_thread() -> None:
    server = two_reads_server(TwoReads())
    with pytest.raises(RuntimeError, match=r"await server\.update_weights"):
        server.update_weights_sync(state(1.0))


def test_version_output_cannot_shadow_a_model_output() -> None:
    with pytest.raises(ValueError, match="already one of the model's outputs"):
        two_reads_server(TwoReads(), version_output="a")


class CudaTwoReads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(WIDTH), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(WIDTH), requires_grad=False)

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = d["x"]
        for _ in range(50):  # enough kernels that an update landing mid-batch would show
            x = x * 1.0
        return {"a": x * 0 + self.a, "b": x * 0 + self.b}


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cuda_graphs", [False, True])
async def test_cuda_updates_are_copied_in_place_between_batches(cuda_graphs: bool) -> None:
    model = CudaTwoReads().cuda()
    storage = model.a.data_ptr()
    server = fb.Server(
        [model, model], inputs=[X], outputs=[A, B], max_batch_size=8, max_delay=0.0005,
        device="cuda", cuda_graphs=cuda_graphs, version_output="v",
    )  # fmt: skip
    rows: list[dict[str, torch.Tensor]] = []
    updating = True

    async def caller() -> None:
        client = server.client()
        while updating:
            rows.append(await client.infer({"x": torch.zeros(WIDTH)}))

    async def trainer() -> None:
        nonlocal updating
        for k in range(1, 51):
            await server.update_weights(state(float(k)))
        updating = False

    async with server:
        await asyncio.gather(*(caller() for _ in range(32)), trainer())
    assert model.a.data_ptr() == storage  # in place: captured graphs stay valid
    torn = [r for r in rows if not (torch.equal(r["a"], r["b"]) and bool((r["a"] == r["v"]).all()))]
    assert torn == [] and len({int(r["v"]) for r in rows}) > 5
