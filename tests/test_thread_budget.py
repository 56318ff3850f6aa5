"""The thread budget: each CPU instance's torch intra-op threads are picked
so that they and the event loop never oversubscribe the usable cores, unless
the user sets ``torch_threads=``."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator

import pytest
import torch

import ferrobatch as fb
from ferrobatch import server as server_module

X = fb.TensorSpec("x", "float32", (2,))
N = fb.TensorSpec("n", "int64", ())


def threads_seen(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Answers each row with the intra-op threads the model ran with."""
    return {"n": torch.full((batch["x"].shape[0],), torch.get_num_threads(), dtype=torch.int64)}


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Restores torch's setting of the test's thread after it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_once(server: fb.Server) -> tuple[int, dict[str, object]]:
    async def main() -> tuple[int, dict[str, object]]:
        async with server:
            out = await server.client().infer({"x": torch.zeros(2)})
            return int(out["n"]), server.stats()

    return asyncio.run(main())


def test_the_default_leaves_the_event_loop_a_core(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(server_module, "usable_cores", lambda: 2)
    torch.set_num_threads(2)  # torch's default on two cores
    server = fb.Server(threads_seen, inputs=[X], outputs=[N], name="budget")
    with caplog.at_level(logging.INFO, logger="ferrobatch"):
        seen, stats = run_once(server)
    assert seen == 1 and stats["torch_threads"] == 1
    assert any("1 torch intra-op thread(s) each (picked: 2 usable cores" in r.getMessage() for r in caplog.records)


def test_cpu_instances_share_the_spare_cores_and_torchs_setting_caps_them(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    monkeypatch.setattr(server_module, "usable_cores", lambda: 16)
    torch.set_num_threads(16)
    assert server_module.thread_budget(1) == 15
    assert server_module.thread_budget(4) == 3
    assert server_module.thread_budget(32) == 1
    torch.set_num_threads(2)  # the user's own setting is a ceiling
    assert server_module.thread_budget(1) == 2
    monkeypatch.setattr(server_module, "usable_cores", lambda: 1)
    assert server_module.thread_budget(1) == 1


def test_torch_threads_given_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch, torch_threads: None) -> None:
    monkeypatch.setattr(server_module, "usable_cores", lambda: 2)
    server = fb.Server(threads_seen, inputs=[X], outputs=[N], torch_threads=3)
    seen, stats = run_once(server)
    assert seen == 3 and stats["torch_threads"] == 3
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="torch_threads"):
            fb.Server(threads_seen, inputs=[X], outputs=[N], torch_threads=bad)  # type: ignore[arg-type]


def test_the_budget_leaves_the_native_front_ends_threads_their_cores(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    monkeypatch.setattr(server_module, "usable_cores", lambda: 16)
    torch.set_num_threads(16)  # torch's default on sixteen cores
    assert server_module.front_end_threads() == 8
    assert server_module.thread_budget(1) == 15
    server_module.hold_front_end_cores(8)
    try:
        assert server_module.thread_budget(1) == 7  # 16 - 1 (event loop) - 8 (front-end)
        assert server_module.thread_budget(2) == 3
        seen, stats = run_once(fb.Server(threads_seen, inputs=[X], outputs=[N], name="beside-front-end"))
        assert seen == stats["torch_threads"] == 7
    finally:
        server_module.hold_front_end_cores(-8)
    assert server_module.thread_budget(1) == 15


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
def test_cpu_affinity_pins_each_instance_to_its_cores_and_sizes_its_threads(torch_threads: None) -> None:
    import os

    usable = sorted(os.sched_getaffinity(0))
    sets = [{usable[0]}, {usable[-1]}]  # two instances on their own cores (one core: both on it)

    def where(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cores = sorted(os.sched_getaffinity(0))
        seen = torch.tensor([cores[0] * 100 + len(cores) * 10 + torch.get_num_threads()], dtype=torch.int64)
        return {"n": seen.expand(batch["x"].shape[0])}

    server = fb.Server([where, where], inputs=[X], outputs=[N], cpu_affinity=sets, name="pinned", max_delay=0)

    async def main() -> set[int]:
        async with server:
            client = server.client()
            outs = await asyncio.gather(*(client.infer({"x": torch.zeros(2)}) for _ in range(64)))
            assert server.stats()["cpu_affinity"] == [sorted(s) for s in sets]
            return {int(o["n"]) for o in outs}

    seen = asyncio.run(main())
    # Each answer: its instance's one core, a set of one, one torch thread.
    assert seen <= {usable[0] * 100 + 11, usable[-1] * 100 + 11}, seen
    assert len(os.sched_getaffinity(0)) == len(usable), "the caller's own affinity is untouched"
    with pytest.raises(ValueError, match="one each"):
        fb.Server(where, inputs=[X], outputs=[N], cpu_affinity=sets)
    with pytest.raises(ValueError, match="usable cores"):
        fb.Server([where, where], inputs=[X], outputs=[N], cpu_affinity=[{usable[0]}, {10_000}])


def policy_seen(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Answers each row with the scheduling policy of the thread the model ran on."""
    return {"n": torch.full((batch["x"].shape[0],), os.sched_getscheduler(0), dtype=torch.int64)}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_cpu_workers_yield_to_the_native_front_end_and_only_to_it() -> None:
    seen, stats = run_once(fb.Server(policy_seen, inputs=[X], outputs=[N], name="alone"))
    assert seen == os.SCHED_OTHER and stats["workers_yield"] is False
    server_module.hold_front_end_cores(1)
    try:
        seen, stats = run_once(fb.Server(policy_seen, inputs=[X], outputs=[N], name="beside-front-end"))
    finally:
        server_module.hold_front_end_cores(-1)
    assert seen == os.SCHED_BATCH and stats["workers_yield"] is True
