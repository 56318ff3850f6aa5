"""The CUDA path: pinned staging ring, per-instance streams, event-gated slot
reuse, overlap of collation and compute, CUDA graphs per bucket, compile — and
the clean fallback on machines without CUDA. Tests marked ``gpu`` are skipped
there (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest
import torch
from conftest import X, Y, make_server, sample

import ferrobatch as fb
from ferrobatch._cuda import CudaExecutor
from ferrobatch._torch import CpuExecutor, allocate_slot

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")


def mlp(width: int = 4, layers: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods[:-1])


class Dict(torch.nn.Module):
    """Wraps a tensor -> tensor module as a dict -> dict model; counts Python calls."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"y": self.inner(d["x"])}


# -- CPU-only machines -------------------------------------------------------------------


async def test_cpu_instances_use_ordinary_memory_and_no_streams() -> None:
    async with make_server(device="cpu") as server:
        assert all(isinstance(e, CpuExecutor) for e in server._executors)
        assert not any(t.is_pinned() for slot in server._slots for t in slot.values())
        out = await server.client().infer({"x": sample(2)})
    torch.testing.assert_close(out["y"], sample(4))


async def test_cuda_graphs_without_a_gpu_warn_and_run_eagerly() -> None:
    with pytest.warns(RuntimeWarning, match="no effect without a CUDA device"):
        server = make_server(cuda_graphs=True, device="cpu")
    async with server:
        outs = await asyncio.gather(*(server.client().infer({"x": sample(i)}) for i in range(20)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))


@needs_no_cuda
def test_asking_for_cuda_without_it_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        make_server(device="cuda")


@needs_no_cuda
def test_staging_slots_are_not_pinned_without_cuda() -> None:
    slot = allocate_slot([X], 8, pin=True)
    assert not slot[0].is_pinned()
    assert slot[0].shape == (8, *X.shape) and not slot[0].any()


def test_default_device_of_a_plain_callable_is_the_cpu() -> None:
    assert make_server().devices == [torch.device("cpu")]


# -- on a GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
async def test_results_are_right_and_arrive_in_pinned_host_memory() -> None:
    async with make_server(device="cuda", max_batch_size=16) as server:
        assert all(t.is_pinned() for slot in server._slots for t in slot.values())
        (executor,) = server._executors
        assert isinstance(executor, CudaExecutor)
        assert executor.stream != torch.cuda.default_stream(executor.device)
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(500)))
        batch = await client.infer_batch({"x": torch.stack([sample(i) for i in range(16)])})
    for i, out in enumerate(outs):
        assert out["y"].device.type == "cpu" and out["y"].is_pinned()
        torch.testing.assert_close(out["y"], sample(2 * i))
    torch.testing.assert_close(batch["y"], torch.stack([sample(2 * i) for i in range(16)]))


@pytest.mark.gpu
def test_the_slot_copy_event_is_what_makes_rewriting_a_slot_safe() -> None:
    """Enqueues a batch behind a long GPU sleep, so its host-to-device copy is
    still pending. Rewriting the slot before ``wait_staged`` corrupts the batch
    (the hazard is real); rewriting it after never does."""

    def double(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": d["x"] * 2}

    executor = CudaExecutor(double, torch.device("cuda"), [X], [Y], max_batch_size=8)
    slot = {"x": allocate_slot([X], 8, pin=True)[0]}
    assert slot["x"].is_pinned()
    cycles = 200_000_000  # ~0.1 s
    with torch.cuda.device(executor.device), torch.cuda.stream(executor.stream):
        # Rewritten too early: the pending copy reads the new bytes.
        slot["x"][:8] = 1.0
        torch.cuda._sleep(cycles)
        early = executor.launch(slot, 8)
        assert not early.staged.query(), "the copy is still queued behind the sleep"  # type: ignore[union-attr]
        slot["x"][:8] = -1.0
        torch.testing.assert_close(early.wait()["y"], torch.full((8, 4), -2.0))
        # Rewritten after wait_staged: the batch is intact.
        slot["x"][:8] = 1.0
        torch.cuda._sleep(cycles)
        flight = executor.launch(slot, 8)
        flight.wait_staged()
        slot["x"][:8] = -1.0
        torch.testing.assert_close(flight.wait()["y"], torch.full((8, 4), 2.0))


def gpu_sleepy(cycles: int) -> Any:
    """y = 2x + 1 after a GPU sleep, so every launched batch queues behind the
    one before it on the stream: host-to-device copies stay pending."""

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        torch.cuda._sleep(cycles)
        return {"y": d["x"] * 2 + 1}

    return model


def rows(n: int, j: int, width: int) -> torch.Tensor:
    """n distinct rows for batched request j."""
    return (torch.arange(n, dtype=torch.float32)[:, None] + 10_000 * j).repeat(1, width)


@pytest.mark.gpu
async def test_staging_ring_under_pressure_never_corrupts_a_batch() -> None:
    model = gpu_sleepy(2_000_000)  # ~1 ms per batch
    width = 1024
    spec_x, spec_y = fb.TensorSpec("x", "float32", (width,)), fb.TensorSpec("y", "float32", (width,))
    server = fb.Server(
        [model, model], inputs=[spec_x], outputs=[spec_y], device="cuda", max_batch_size=8, max_delay=0.0
    )
    async with server:
        client = server.client()
        singles = [client.infer({"x": torch.full((width,), float(i))}) for i in range(3000)]
        sizes = [1, 3, 8, 5, 2] * 40
        batches = [client.infer_batch({"x": rows(n, j, width)}) for j, n in enumerate(sizes, start=1)]
        outs = await asyncio.gather(*singles, *batches)
        stats = server.stats()
    for i, out in enumerate(outs[:3000]):
        assert torch.equal(out["y"], torch.full((width,), 2.0 * i + 1)), f"request {i} was corrupted"
    for j, (out, n) in enumerate(zip(outs[3000:], sizes), start=1):
        assert torch.equal(out["y"], rows(n, j, width) * 2 + 1), f"batched request {j} was corrupted"
    assert stats["requests_succeeded"] == 3200
    assert stats["batches"] > 6 * 10, "the 6-slot ring was reused many times over"


@pytest.mark.gpu
async def test_collation_of_the_next_batch_overlaps_the_compute_of_this_one() -> None:
    previous_still_running: list[bool] = []
    last: list[torch.cuda.Event] = []

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Called on the launch thread once the batch is collated: is the
        # batch before it still computing on the GPU?
        if last:
            previous_still_running.append(not last[-1].query())
        torch.cuda._sleep(50_000_000)  # ~25 ms
        y = d["x"] * 2
        event = torch.cuda.Event()
        event.record()
        last.append(event)
        return {"y": y}

    async with make_server(model, device="cuda", max_batch_size=4, max_delay=0.0) as server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(40)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert any(previous_still_running), previous_still_running


@pytest.mark.gpu
async def test_two_instances_on_one_gpu_each_use_their_own_stream() -> None:
    streams: set[int] = set()

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        streams.add(torch.cuda.current_stream().stream_id)
        torch.cuda._sleep(4_000_000)
        return {"y": d["x"] * 2}

    async with make_server([model, model], device="cuda", max_batch_size=4, warmup=False) as server:
        own = {e.stream.stream_id for e in server._executors if isinstance(e, CudaExecutor)}
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(400)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert len(own) == 2
    assert streams == own, "each instance ran on its own stream, and both ran"


@pytest.mark.gpu
async def test_one_module_on_a_gpu_and_on_the_cpu_serves_from_both() -> None:
    devices: set[str] = set()

    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            devices.add(self.scale.device.type)
            if self.scale.device.type == "cpu":
                import time

                time.sleep(0.002)  # slow enough that the GPU instance gets work too
            return {"y": d["x"] * self.scale}

    module = Module()
    async with make_server(module, device=["cuda", "cpu"], max_batch_size=4) as server:
        assert server._models[0] is module and server._models[1] is not module
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(400)))
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(2 * i))
    assert devices == {"cuda", "cpu"}


@pytest.mark.gpu
async def test_a_model_error_fails_its_batch_and_gives_its_slot_back() -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((d["x"] < 0).any()):
            raise RuntimeError("negative input")
        return {"y": d["x"] * 2}

    async with make_server(model, device="cuda", max_batch_size=4, warmup=False) as server:
        client = server.client()
        for i in range(30):  # five times the ring: a leaked slot would hang here
            with pytest.raises(fb.ModelError, match="negative input"):
                await client.infer({"x": sample(-1)})
            out = await client.infer({"x": sample(i)})
            torch.testing.assert_close(out["y"], sample(2 * i))
        assert server.stats()["failed_batches"] == 30


@pytest.mark.gpu
async def test_default_warmup_on_a_gpu_runs_before_start_returns() -> None:
    model = Dict(mlp()).cuda()
    server = make_server(model, max_batch_size=8)
    await server.start()
    try:
        assert server.ready
        assert model.calls == len(server.buckets) == 4
    finally:
        await server.stop()


@pytest.mark.gpu
async def test_cuda_graphs_replay_every_bucket_without_calling_the_model() -> None:
    model = Dict(mlp(width=4)).cuda()
    reference = Dict(mlp(width=4))  # same seed: same weights, on the CPU
    async with make_server(model, max_batch_size=16, cuda_graphs=True) as server:
        (executor,) = server._executors
        assert isinstance(executor, CudaExecutor)
        assert executor.graphed_buckets == server.buckets == (1, 2, 4, 8, 16)
        calls = model.calls
        client = server.client()
        inputs = [torch.randn(4) for _ in range(600)]
        outs = await asyncio.gather(*(client.infer({"x": x}) for x in inputs))
        sizes = [1, 3, 16, 7, 2, 9]
        batches = [torch.randn(n, 4) for n in sizes]
        batch_outs = await asyncio.gather(*(client.infer_batch({"x": b}) for b in batches))
        assert model.calls == calls, "requests replayed graphs, never the Python model"
    with torch.no_grad():
        for x, out in zip(inputs, outs):
            torch.testing.assert_close(out["y"], reference({"x": x[None]})["y"][0], rtol=1e-4, atol=1e-5)
        for b, out in zip(batches, batch_outs):
            torch.testing.assert_close(out["y"], reference({"x": b})["y"], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
async def test_a_model_that_cannot_be_captured_runs_eagerly_with_one_warning() -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if d["x"].sum().item() > 1e30:  # a host sync: not capturable
            raise AssertionError("unreachable")
        return {"y": d["x"] * 2}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server = make_server([model, model], device="cuda", max_batch_size=8, cuda_graphs=True)
        await server.start()
    try:
        ours = [w for w in caught if "cannot be captured" in str(w.message)]
        assert len(ours) == 1, [str(w.message) for w in caught]
        assert issubclass(ours[0].category, RuntimeWarning)
        assert all(isinstance(e, CudaExecutor) and not e.graphed_buckets for e in server._executors)
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(100)))
        for i, out in enumerate(outs):
            torch.testing.assert_close(out["y"], sample(2 * i))
    finally:
        await server.stop()


@pytest.mark.gpu
@pytest.mark.timeout(600)
async def test_compile_with_cuda_graphs_compiles_only_during_warmup() -> None:
    from torch._inductor.compile_fx import compile_fx

    compiles: list[int] = []

    def counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles.append(1)
        return compile_fx(gm, example_inputs)

    model = Dict(mlp(width=4)).cuda()
    reference = Dict(mlp(width=4))
    server = make_server(model, max_batch_size=4, cuda_graphs=True, compile={"backend": counting_inductor})
    async with server:
        (executor,) = server._executors
        assert isinstance(executor, CudaExecutor) and executor.graphed_buckets == (1, 2, 4)
        at_start = len(compiles)
        assert at_start > 0
        client = server.client()
        inputs = [torch.randn(4) for _ in range(50)]
        outs = await asyncio.gather(*(client.infer({"x": x}) for x in inputs))
        assert len(compiles) == at_start, "a request paid for a compilation"
    with torch.no_grad():
        for x, out in zip(inputs, outs):
            torch.testing.assert_close(out["y"], reference({"x": x[None]})["y"][0], rtol=1e-3, atol=1e-4)
