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
from conftest import WIDTH, X

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
