"""Several model instances: a batch goes to whichever is free; each instance
has its own device; one failing instance does not take down the others."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import X, Y, make_server, sample

import ferrobatch as fb


class Replica:
    """y = 2x, slowly (the GIL is released while it sleeps); records the
    thread it ran on and how many rows it served."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay = delay
        self.rows = 0
        self.threads: set[str] = set()

    def __call__(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.threads.add(threading.current_thread().name)
        self.rows += d["x"].shape[0]
        time.sleep(self.delay)
        return {"y": d["x"] * 2}


async def test_batches_go_to_whichever_instance_is_free() -> None:
    replicas = [Replica(), Replica(), Replica()]
    async with make_server(replicas, max_batch_size=4) as server:
        assert len(server.devices) == 3
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(120)))
        stats = server.stats()
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert sum(r.rows for r in replicas) == 120 == stats["rows"]
    # 30 or more batches of a slow model: every instance takes some.
    assert all(r.rows > 0 for r in replicas), [r.rows for r in replicas]
    assert len(set.union(*(r.threads for r in replicas))) == 3, "one worker thread per instance"


async def test_one_failing_instance_fails_only_its_batches() -> None:
    def broken(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.005)
        raise RuntimeError("broken replica")

    good = Replica(delay=0.005)
    async with make_server([broken, good], max_batch_size=4) as server:
        client = server.client()
        results = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(200)), return_exceptions=True)
        stats = server.stats()
    ok = [(i, r) for i, r in enumerate(results) if isinstance(r, dict)]
    failed = [r for r in results if not isinstance(r, dict)]
    assert ok and failed, "both instances served batches"
    assert all(isinstance(r, fb.ModelError) and "broken replica" in str(r) for r in failed)
    for i, r in ok:
        torch.testing.assert_close(r["y"], sample(2 * i))
    assert stats["requests_succeeded"] == len(ok)
    assert stats["requests_failed"]["model_error"] == len(failed)


def test_the_same_module_on_the_same_device_is_shared_not_copied() -> None:
    module = torch.nn.Linear(4, 4)
    server = fb.Server(module, inputs=[X], outputs=[Y], device=["cpu", "cpu"])
    assert server.devices == [torch.device("cpu")] * 2
    assert server._models[0] is module and server._models[1] is module


def test_one_model_per_device_and_one_device_for_all_models() -> None:
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    server = fb.Server([a, b], inputs=[X], outputs=[Y], device="cpu")
    assert server.devices == [torch.device("cpu")] * 2
    assert server._models == [a, b]


@pytest.mark.parametrize(
    "models, device, message",
    [
        (2, ["cpu", "cpu", "cpu"], "2 models but 3 devices"),
        (1, [], "must not be an empty list"),
    ],
)
def test_mismatched_model_and_device_lists_are_refused(models: int, device: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fb.Server([torch.nn.Linear(4, 4)] * models, inputs=[X], outputs=[Y], device=device)


async def test_instances_with_different_weights_each_serve_their_own_results() -> None:
    # Each replica adds its own offset: every result must be 2x + one of them.
    def replica(offset: float) -> object:
        def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            time.sleep(0.002)
            return {"y": d["x"] * 2 + offset}

        return model

    async with make_server([replica(0.0), replica(1000.0)], max_batch_size=2) as server:  # type: ignore[list-item]
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(100)))
    offsets = set()
    for i, out in enumerate(outs):
        offset = float(out["y"][0]) - 2 * i
        assert offset in (0.0, 1000.0)
        torch.testing.assert_close(out["y"], sample(2 * i + offset))
        offsets.add(offset)
    assert offsets == {0.0, 1000.0}
