"""The thread budget: each CPU instance's torch intra-op threads are picked
so that they and the event loop never oversubscribe the usable cores, unless
the user sets ``torch_threads=``."""

from __future__ import annotations

import asyncio
import logging
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
