"""Staging slots are owned by the batch that holds them: a slot is given back
once (``batch.release_slot()`` or dropping the batch), never by number, and
never handed to another batch while its holder has it."""

from __future__ import annotations

import asyncio
import threading
import time

import torch
from conftest import X, Y, sample

import ferrobatch as fb
from ferrobatch import _core


def test_the_batcher_has_no_release_by_slot_number() -> None:
    assert not hasattr(_core.Batcher, "release_slot")
    assert hasattr(_core.Batch, "release_slot")


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
