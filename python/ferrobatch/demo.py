"""The built-in demo: an MLP served in process to many concurrent callers."""

from __future__ import annotations

import asyncio
import statistics
import time

import torch

from .server import Server
from .specs import TensorSpec

__all__ = ["make_demo_model", "make_demo_server", "run_demo"]


class DemoMLP(torch.nn.Module):
    """Linear(width, width) -> ReLU -> Linear(width, width), taking ``{"x": ...}``
    (a module-level class: picklable, for process instances)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": self.net(inputs["x"])}


def make_demo_model(width: int = 256) -> torch.nn.Module:
    """The demo :class:`DemoMLP`, its weights seeded (the same every call)."""
    torch.manual_seed(0)
    return DemoMLP(width).eval()


def make_demo_server(width: int = 256, max_batch_size: int = 64, max_delay: float = 0.001, name: str = "mlp") -> Server:
    """A Server for the demo MLP: ``{"x": float32[width]} -> {"y": float32[width]}``."""
    return Server(
        make_demo_model(width),
        inputs=[TensorSpec("x", "float32", (width,))],
        outputs=[TensorSpec("y", "float32", (width,))],
        max_batch_size=max_batch_size,
        max_delay=max_delay,
        name=name,
    )


async def _demo(callers: int, seconds: float, server: Server, width: int) -> dict[str, float]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    latencies: list[float] = []
    async with server:
        client = server.client()
        deadline = time.perf_counter() + seconds
        bar = tqdm(total=round(seconds, 1), unit="s", bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f}s {postfix}")

        async def caller(seed: int) -> None:
            x = torch.randn(width, generator=torch.Generator().manual_seed(seed))
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await client.infer({"x": x})
                latencies.append(time.perf_counter() - started)

        async def progress() -> None:
            begun = time.perf_counter()
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.2)
                now = time.perf_counter()
                bar.n = min(now - begun, seconds)
                bar.set_postfix_str(f"{len(latencies) / max(now - begun, 1e-9):,.0f} req/s")
            bar.n = seconds
            bar.refresh()

        begun = time.perf_counter()
        await asyncio.gather(progress(), *(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - begun
        bar.close()
        stats = server.stats()
    latencies.sort()
    return {
        "requests": len(latencies),
        "throughput": len(latencies) / elapsed,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "mean_ms": 1e3 * statistics.fmean(latencies),
        "mean_batch_size": stats["mean_batch_size"],
        "batches": stats["batches"],
    }


def run_demo(
    callers: int = 256,
    seconds: float = 5.0,
    max_batch_size: int = 64,
    max_delay: float = 0.001,
    width: int = 256,
    torch_threads: int | None = None,
) -> int:
    if torch_threads is not None:
        torch.set_num_threads(torch_threads)  # workers take the caller's setting
    server = make_demo_server(width, max_batch_size, max_delay)
    print(
        f"ferrobatch demo: MLP {width}->{width}->{width} on CPU, {callers} concurrent callers, "
        f"{seconds:g} s, max_batch_size={max_batch_size}, max_delay={max_delay * 1e3:g} ms, "
        f"{torch.get_num_threads()} torch thread(s)"
    )
    r = asyncio.run(_demo(callers, seconds, server, width))
    rows = [
        ("requests", f"{r['requests']:,.0f}"),
        ("throughput", f"{r['throughput']:,.0f} req/s"),
        ("latency p50", f"{r['p50_ms']:.2f} ms"),
        ("latency p99", f"{r['p99_ms']:.2f} ms"),
        ("mean batch size", f"{r['mean_batch_size']:.1f} (of {max_batch_size})"),
        ("batches", f"{r['batches']:,.0f}"),
    ]
    width_col = max(len(k) for k, _ in rows)
    print()
    for key, value in rows:
        print(f"  {key:<{width_col}}  {value}")
    return 0
