"""The CUDA instances' two-thread pipeline (launch, then complete), checked
without a GPU: a fake stream runs each instance's enqueued work later, in
order, on its own thread — so a staging slot's "host-to-device copy" reads the
slot only when the stream gets to it, as on a real GPU. Given back too early,
a slot would be rewritten before that copy and the batch corrupted.

The real executor's CUDA calls are covered by the ``gpu`` tests in test_cuda.py.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from conftest import Y, make_server, sample

import ferrobatch as fb
from ferrobatch._cuda import IN_FLIGHT, CudaExecutor, InFlight
from ferrobatch._torch import normalize_outputs


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        if not self._done.wait(30):
            raise TimeoutError("fake stream stalled")


def _run_in_order(work: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while (fn := work.get()) is not None:
        fn()


class FakeStream:
    """Runs enqueued callables in order on a thread of its own, later; the
    thread ends once the stream is freed."""

    def __init__(self) -> None:
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        threading.Thread(target=_run_in_order, args=(self._work,), daemon=True).start()
        weakref.finalize(self, self._work.put, None)

    def enqueue(self, fn: Callable[[], None]) -> None:
        self._work.put(fn)

    def record(self) -> FakeEvent:
        event = FakeEvent()
        self.enqueue(event._done.set)
        return event


class Drain:
    """What the executor synchronises: everything enqueued on the fake stream."""

    def __init__(self, fake: FakeStream) -> None:
        self.fake = fake

    def synchronize(self) -> None:
        self.fake.record().synchronize()


class FakeGpuExecutor(CudaExecutor):
    """A CudaExecutor whose stream is a FakeStream: ``launch`` only enqueues
    the copy in (after ``copy_delay``), the model and the copy out."""

    def __init__(self, model: Any, copy_delay: float = 0.0, compute_delay: float = 0.0) -> None:
        # No super().__init__(): it would make a CUDA stream.
        self.model = model
        self.device = torch.device("cpu")
        self.outputs = (Y,)
        self.pad_to = None
        self.cuda_graphs = False
        self._graphs = {}
        self._padded = {}
        self.fake = FakeStream()
        self.stream = Drain(self.fake)  # type: ignore[assignment]
        self.copy_delay = copy_delay
        self.compute_delay = compute_delay
        self.launched = 0
        self.outstanding = 0  # launched, not yet computed
        self.most_outstanding = 0
        self._lock = threading.Lock()
        self.previous_done: list[bool] = []
        self._last: InFlight | None = None

    def bind_thread(self) -> None:
        pass

    def warm_up(self, batch_for: Any, buckets: Any, slot: Any) -> str | None:
        return None

    def launch(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> InFlight:
        flight = InFlight(rows)
        if start:
            slot = {name: t[start:] for name, t in slot.items()}
        if self._last is not None:
            self.previous_done.append(self._last.done.query())  # type: ignore[union-attr]
        self._last = flight
        self.launched += 1
        with self._lock:
            self.outstanding += 1
            self.most_outstanding = max(self.most_outstanding, self.outstanding)
        on_device: dict[str, torch.Tensor] = {}

        def copy_in() -> None:
            time.sleep(self.copy_delay)
            on_device.update({name: t[:rows].clone() for name, t in slot.items()})

        def compute() -> None:
            time.sleep(self.compute_delay)
            try:
                outputs = normalize_outputs(self.model(on_device), self.outputs, rows)
                flight.outputs.update({name: out.clone() for name, out in outputs.items()})
            except Exception as exc:  # noqa: BLE001 - as the real launch keeps it
                flight.error = exc
            with self._lock:  # before `done`: its token comes back only after that
                self.outstanding -= 1

        self.fake.enqueue(copy_in)
        flight.staged = self.fake.record()  # type: ignore[assignment]
        self.fake.enqueue(compute)
        flight.done = self.fake.record()  # type: ignore[assignment]
        return flight

    def run_alone(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return normalize_outputs(self.model(dict(inputs)), self.outputs, 1)


def fake_gpu_server(monkeypatch: pytest.MonkeyPatch, executors: list[FakeGpuExecutor], **kwargs: Any) -> fb.Server:
    """A server whose instances are ``executors``, set up as the server sets
    up every instance (requests, isolation, sampling)."""
    server = make_server([e.model for e in executors], **kwargs)
    monkeypatch.setattr(server, "_executor_of_kind", lambda i: executors[i])
    return server


def double(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": d["x"] * 2}


async def test_staging_ring_under_pressure_never_corrupts_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two instances share a ring of 2 x IN_FLIGHT slots; every copy in is late.
    executors = [FakeGpuExecutor(double, copy_delay=0.001, compute_delay=0.002) for _ in range(2)]
    server = fake_gpu_server(monkeypatch, executors, max_batch_size=4, max_delay=0.0)
    async with server:
        assert len(server._slots) == 2 * IN_FLIGHT
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(1500)))
        stats = server.stats()
    for i, out in enumerate(outs):
        assert torch.equal(out["y"], sample(2 * i)), f"request {i} got another batch's bytes"
    assert all(e.launched > 0 for e in executors)
    assert stats["batches"] > 10 * len(server._slots), "every slot was reused many times"


async def test_an_instance_holds_at_most_in_flight_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    executor = FakeGpuExecutor(double, compute_delay=0.003)
    server = fake_gpu_server(monkeypatch, [executor], max_batch_size=2, max_delay=0.0)
    async with server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(200)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert executor.most_outstanding == IN_FLIGHT, f"{executor.most_outstanding} batches held at once"


async def test_a_launch_that_raises_fails_its_batch_and_the_instance_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Flaky(FakeGpuExecutor):
        stream = FakeEvent()  # what the server synchronises after a launch raised
        stream._done.set()

        def launch(self, slot: Mapping[str, torch.Tensor], rows: int) -> InFlight:
            if self.launched == 0:
                self.launched += 1
                raise RuntimeError("launch broke")
            return super().launch(slot, rows)

    server = fake_gpu_server(monkeypatch, [Flaky(double)], max_batch_size=4, max_delay=0.0)
    async with server:
        client = server.client()
        with pytest.raises(fb.ModelError, match="launch broke"):
            await client.infer({"x": sample(1)})
        out = await client.infer({"x": sample(2)})
    torch.testing.assert_close(out["y"], sample(4))


async def test_the_next_batch_is_collated_while_this_one_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    executor = FakeGpuExecutor(double, compute_delay=0.01)
    server = fake_gpu_server(monkeypatch, [executor], max_batch_size=4, max_delay=0.0)
    async with server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(100)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert not all(executor.previous_done), "some batch was launched while the one before computed"


async def test_a_failing_batch_fails_alone_and_gives_its_slot_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((d["x"] < 0).any()):
            raise RuntimeError("negative input")
        return {"y": d["x"] * 2}

    server = fake_gpu_server(monkeypatch, [FakeGpuExecutor(model)], max_batch_size=4, max_delay=0.0)
    async with server:
        client = server.client()
        for i in range(4 * IN_FLIGHT):  # a leaked slot or token would hang here
            with pytest.raises(fb.ModelError, match="negative input"):
                await client.infer({"x": sample(-1)})
            out = await client.infer({"x": sample(i)})
            torch.testing.assert_close(out["y"], sample(2 * i))
        stats = server.stats()
    assert stats["failed_batches"] == 4 * IN_FLIGHT
    assert stats["requests_failed"]["model_error"] == 4 * IN_FLIGHT


async def test_stop_resolves_every_launched_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    executor = FakeGpuExecutor(double, compute_delay=0.005)
    server = fake_gpu_server(monkeypatch, [executor], max_batch_size=4, max_delay=0.0)
    await server.start()
    client = server.client()
    pending = [asyncio.ensure_future(client.infer({"x": sample(i)})) for i in range(64)]
    await asyncio.sleep(0)  # submitted
    await server.stop()
    for i, fut in enumerate(pending):
        torch.testing.assert_close((await fut)["y"], sample(2 * i))
    assert not any(t.is_alive() for t in server._threads), "both threads of the instance ended"


async def test_a_cuda_instance_isolates_a_failing_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failure isolation is the executor base's: on a CUDA instance a batch
    whose model raised as it was enqueued is retried in parts, each launched
    and waited for on the launch thread."""

    class RaisesAtLaunch(FakeGpuExecutor):
        def launch(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> InFlight:
            if bool((slot["x"][start : start + rows] < 0).any()):  # the model raises on the host
                flight = InFlight(rows)
                flight.error = RuntimeError("negative input")
                return flight
            return super().launch(slot, rows, start)

    executor = RaisesAtLaunch(double)
    server = fake_gpu_server(monkeypatch, [executor], max_batch_size=8, max_delay=0.05, isolate_failures=True)
    async with server:
        client = server.client()
        values = [1, 2, -1, 3, 4, 5, 6, 7]
        outs = await asyncio.gather(*(client.infer({"x": sample(v)}) for v in values), return_exceptions=True)
        stats = server.stats()
    for v, out in zip(values, outs):
        if v < 0:
            assert isinstance(out, fb.ModelError), out
            assert "negative input" in str(out)
        else:
            assert isinstance(out, dict), out
            torch.testing.assert_close(out["y"], sample(2 * v))
    assert stats["requests_failed"]["model_error"] == 1
    assert stats["isolated_failures"] == 1 and stats["retry_calls"] > 0, stats


def batch_dependent(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": d["x"] - d["x"].mean(dim=0)}


@pytest.mark.parametrize(("model", "mismatches"), [(double, False), (batch_dependent, True)])
async def test_a_cuda_instance_samples_invariance(
    monkeypatch: pytest.MonkeyPatch, model: Callable[[dict[str, torch.Tensor]], Any], mismatches: bool
) -> None:
    """Invariance sampling is the executor base's: the complete thread copies
    a sampled row from the slot once the outputs are in, before giving the
    slot back."""
    executor = FakeGpuExecutor(model, copy_delay=0.001)
    server = fake_gpu_server(monkeypatch, [executor], max_batch_size=4, max_delay=0.0, invariance_sample_rate=1.0)
    async with server:
        client = server.client()
        await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(200)))
        deadline = time.monotonic() + 10
        while server.stats()["invariance_checks"] < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stats = server.stats()
    assert stats["invariance_checks"] >= 20, stats
    assert (stats["invariance_mismatches"] > 0) == mismatches, stats
    if not mismatches:
        assert stats["invariance_mismatches"] == 0
