"""Staging slots are owned by the batch that holds them: a slot is given back
once (``batch.release_slot()`` or dropping the batch), never by number, and
never handed to another batch while its holder has it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from conftest import WIDTH, X, Y, sample

import ferrobatch as fb
from ferrobatch import _core
from ferrobatch._torch import make_coerce


def test_the_batcher_has_no_release_by_slot_number() -> None:
    assert not hasattr(_core.Batcher, "release_slot")
    assert hasattr(_core.Batch, "release_slot")


async def test_a_batch_owns_its_slot_until_it_releases_it_once() -> None:
    slots = [[torch.zeros(2, WIDTH)] for _ in range(2)]
    batcher = _core.Batcher(
        [("x", "float32", [WIDTH], torch.float32)],
        slots,
        tensor_type=torch.Tensor,
        coerce=make_coerce([X]),
        max_batch_size=2,
        max_delay=0.001,
        min_batch_size=1,
        preferred_batch_sizes=[],
        max_queue_size=16,
        workers=1,
    )
    registry = _core.LoopRegistry("slots")
    submitter = _core.Submitter(registry, lambda: fb.ServerClosedError("closed"))
    submitter.accept(batcher)
    worker = _core.Worker(batcher, registry)
    futures = [submitter.submit({"x": sample(i)})[0] for i in range(5)]

    first = await asyncio.to_thread(worker.next_batch)
    second = await asyncio.to_thread(worker.next_batch)
    assert first is not None and second is not None
    assert (first.rows, second.rows) == (2, 2)
    held = first.slot
    assert {held, second.slot} == {0, 1}

    # A request is queued, but both slots are held: the next batch waits.
    third_batch: list[_core.Batch | None] = []
    taker = threading.Thread(target=lambda: third_batch.append(worker.next_batch()))
    taker.start()
    await asyncio.sleep(0.1)
    assert not third_batch, "a third batch got a slot while both were held"

    assert first.release_slot() is True
    assert first.release_slot() is False, "a slot is given back once"
    with pytest.raises(ValueError, match="released"):
        _ = first.slot
    await asyncio.to_thread(taker.join, 10)
    third = third_batch[0]
    assert third is not None and third.rows == 1
    assert third.slot == held, "the slot given back went to the waiting batch"

    for batch in (first, second, third):
        worker.finish(batch, None, RuntimeError("not run"), ring_now=True)
        batch.release_slot()
    await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 10)
    batcher.close()
    assert await asyncio.to_thread(worker.next_batch) is None


class SlotWatcher:
    """y = 2x, slowly; fails if two calls running at once see the same
    staging memory (a slot handed out while its batch still holds it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_use: set[int] = set()
        self.overlaps = 0
        self.calls = 0

    def __call__(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ptr = d["x"].untyped_storage().data_ptr()
        with self.lock:
            self.calls += 1
            if ptr in self.in_use:
                self.overlaps += 1
            self.in_use.add(ptr)
        time.sleep(0.002)
        y = d["x"] * 2
        with self.lock:
            self.in_use.discard(ptr)
        return {"y": y}


async def test_instances_running_at_once_never_share_a_staging_slot() -> None:
    watcher = SlotWatcher()
    server = fb.Server([watcher, watcher, watcher], inputs=[X], outputs=[Y], max_batch_size=4, max_delay=0.0005)
    async with server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(300)))
    for i, out in enumerate(outs):
        assert torch.equal(out["y"], sample(i) * 2)
    assert watcher.calls > 3
    assert watcher.overlaps == 0
