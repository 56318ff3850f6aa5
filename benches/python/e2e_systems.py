"""The systems `bench_e2e.py` drives with one workload: ferrobatch, the asyncio
floor, a naive asyncio batcher, and TorchRL's InferenceServer.

Every system serves the same model, a ``dict[str, Tensor] -> dict[str, Tensor]``
callable mapping ``{"x": (n, 256)}`` to ``{"y": (n, 256)}``, and exposes a
``call(x) -> {"y": row}`` for one ``float32[256]`` sample: an awaitable for the
asyncio systems, a blocking call for the thread-based one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import torch

import ferrobatch as fb

Inputs = dict[str, torch.Tensor]
Model = Callable[[Inputs], Inputs]
AsyncCall = Callable[[torch.Tensor], Awaitable[Inputs]]
SyncCall = Callable[[torch.Tensor], Inputs]

FEATURES = 256
MAX_BATCH_SIZE = 64


def make_model(kind: str) -> Model:
    """``identity`` returns its input; ``mlp`` is Linear-ReLU-Linear (256 wide),
    in eval mode, under ``torch.inference_mode``; weights are seeded."""
    if kind == "identity":

        def identity(inputs: Inputs) -> Inputs:
            return {"y": inputs["x"]}

        return identity
    if kind == "mlp":
        gen = torch.Generator().manual_seed(0)
        net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, FEATURES),
            torch.nn.ReLU(),
            torch.nn.Linear(FEATURES, FEATURES),
        ).eval()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.empty_like(p).uniform_(-0.1, 0.1, generator=gen))

        def mlp(inputs: Inputs) -> Inputs:
            with torch.inference_mode():
                return {"y": net(inputs["x"])}

        return mlp
    raise ValueError(f"unknown model {kind!r}")


class AsyncSystem:
    """An asyncio system: ``start``/``stop`` on the loop, ``call`` per request,
    and the mean batch size since the last ``reset_counters``."""

    name = "?"
    call: AsyncCall

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def reset_counters(self) -> None:
        raise NotImplementedError

    def mean_batch_size(self) -> float:
        raise NotImplementedError


class Ferrobatch(AsyncSystem):
    """ferrobatch, as a user would run it: ``await client.infer({"x": x})``."""

    def __init__(
        self, model: Model, max_delay: float, name: str = "ferrobatch", torch_threads: int | None = None
    ) -> None:
        self.name = name
        spec = [fb.TensorSpec("x", "float32", (FEATURES,))]
        self.server = fb.Server(
            model,
            inputs=spec,
            outputs=[fb.TensorSpec("y", "float32", (FEATURES,))],
            max_batch_size=MAX_BATCH_SIZE,
            max_delay=max_delay,
            torch_threads=torch_threads,  # None: ferrobatch's thread budget
        )
        self._base = (0, 0)

    async def start(self) -> None:
        await self.server.start()
        infer = self.server.client().infer
        self.call = lambda x: infer({"x": x})

    async def stop(self) -> None:
        await self.server.stop()

    def reset_counters(self) -> None:
        s = self.server.stats()
        self._base = (s["rows"], s["batches"])

    def mean_batch_size(self) -> float:
        s = self.server.stats()
        rows, batches = s["rows"] - self._base[0], s["batches"] - self._base[1]
        return rows / batches if batches else 0.0


class AsyncioFloor(AsyncSystem):
    """The bare mechanics every asyncio batcher pays: one future per request,
    created and awaited by the caller, resolved up to 64 at a time by one
    loop callback. No queue, no thread, no copy: an upper bound on the
    throughput of any asyncio library.

    With the identity model each future gets its own input back. With any
    other model the callback runs it inline on the loop (stack, model, rows),
    so the figure is a single-threaded batcher with no hand-off costs.
    """

    name = "asyncio floor"

    def __init__(self, model: Model, identity: bool) -> None:
        self.model = model
        self.identity = identity
        self.pending: list[tuple[torch.Tensor, asyncio.Future[Inputs]]] = []
        self.scheduled = False
        self.batches = self.rows = 0

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        pending = self.pending

        def call(x: torch.Tensor) -> asyncio.Future[Inputs]:
            future: asyncio.Future[Inputs] = loop.create_future()
            pending.append((x, future))
            if not self.scheduled:
                self.scheduled = True
                loop.call_soon(self._resolve)
            return future

        self.call = call
        self._loop = loop

    def _resolve(self) -> None:
        batch = self.pending[:MAX_BATCH_SIZE]
        del self.pending[:MAX_BATCH_SIZE]
        if self.identity:
            for x, future in batch:
                future.set_result({"y": x})
        else:
            ys = self.model({"x": torch.stack([x for x, _ in batch])})["y"].unbind(0)
            for (_, future), y in zip(batch, ys):
                future.set_result({"y": y})
        self.batches += 1
        self.rows += len(batch)
        if self.pending:
            self._loop.call_soon(self._resolve)
        else:
            self.scheduled = False

    async def stop(self) -> None:
        assert not self.pending

    def reset_counters(self) -> None:
        self.batches = self.rows = 0

    def mean_batch_size(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


class NaiveBatcher(AsyncSystem):
    """What a competent user writes in an afternoon: an ``asyncio.Queue`` of
    (input, future); one task gathers up to 64 (waiting at most ``max_delay``
    after the first; ``0``: whatever is queued), stacks them, runs the model
    with ``asyncio.to_thread`` and resolves each future with its row."""

    name = "naive asyncio batcher"

    def __init__(self, model: Model, max_delay: float) -> None:
        self.model = model
        self.max_delay = max_delay
        self.batches = self.rows = 0

    async def start(self) -> None:
        self.queue: asyncio.Queue[tuple[torch.Tensor, asyncio.Future[Inputs]]] = asyncio.Queue()
        self.task = asyncio.create_task(self._serve())
        self.call = self._infer

    async def _infer(self, x: torch.Tensor) -> Inputs:
        future: asyncio.Future[Inputs] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((x, future))
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = loop.time() + self.max_delay
            while len(items) < MAX_BATCH_SIZE:
                try:
                    items.append(self.queue.get_nowait())
                    continue
                except asyncio.QueueEmpty:
                    pass
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            xs = torch.stack([x for x, _ in items])
            try:
                ys = (await asyncio.to_thread(self.model, {"x": xs}))["y"].unbind(0)
            except Exception as exc:  # noqa: BLE001 - every caller hears of it
                for _, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), y in zip(items, ys):
                if not future.done():  # the caller may have been cancelled
                    future.set_result({"y": y})
            self.batches += 1
            self.rows += len(items)

    async def stop(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def reset_counters(self) -> None:
        self.batches = self.rows = 0

    def mean_batch_size(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


def torchrl_available() -> bool:
    try:
        import torchrl.modules.inference_server  # noqa: F401
    except ImportError:
        return False
    return True


class TorchRL:
    """TorchRL's ``InferenceServer`` with its ``ThreadingTransport``: callers
    are threads calling ``client(TensorDict({"x": x}))``.

    ``max_delay`` maps to ``min_batch_size=64, timeout=max_delay`` (gather up
    to 64 for at most that long); greedy (``0``) to ``min_batch_size=1`` with
    the default ``timeout`` (dispatch whatever has arrived).
    """

    name = "torchrl InferenceServer"

    def __init__(self, model: Model, max_delay: float) -> None:
        from tensordict import TensorDict
        from tensordict.nn import TensorDictModule

        class Wrapped(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return model({"x": x})["y"]

        self.module = TensorDictModule(Wrapped(), in_keys=["x"], out_keys=["y"])
        kwargs: dict[str, Any] = {"max_batch_size": MAX_BATCH_SIZE}
        if max_delay > 0:
            kwargs.update(min_batch_size=MAX_BATCH_SIZE, timeout=max_delay)
        else:
            kwargs.update(min_batch_size=1)
        self.server = self.make_server(self.module, kwargs)
        self._tensordict = TensorDict

    def make_server(self, module: Any, kwargs: dict[str, Any]) -> Any:
        from torchrl.modules.inference_server import InferenceServer, ThreadingTransport

        return InferenceServer(module, ThreadingTransport(), **kwargs)

    def start(self) -> None:
        self.server.start()
        client = self.server.client()
        td = self._tensordict

        def call(x: torch.Tensor) -> Inputs:
            out = client(td({"x": x}))
            return {"y": out["y"]}

        self.call: SyncCall = call

    def stop(self) -> None:
        self.server.shutdown()

    def reset_counters(self) -> None:
        self.server.stats(reset=True)

    def mean_batch_size(self) -> float:
        s = self.server.stats()
        return float(s["requests"]) / s["batches"] if s["batches"] else 0.0


class TorchRLCompat(TorchRL):
    """TorchRL's workload (threads calling ``client(TensorDict({"x": x}))``,
    the same ``InferenceServer`` arguments) through ``ferrobatch.torchrl``."""

    name = "ferrobatch.torchrl InferenceServer"

    def make_server(self, module: Any, kwargs: dict[str, Any]) -> Any:
        from ferrobatch.torchrl import InferenceServer, ThreadingTransport

        self._base = (0, 0)
        return InferenceServer(module, ThreadingTransport(), **kwargs)

    def reset_counters(self) -> None:  # its counters count from the start
        s = self.server.stats()
        self._base = (int(s["requests"]), int(s["batches"]))

    def mean_batch_size(self) -> float:
        s = self.server.stats()
        rows, batches = int(s["requests"]) - self._base[0], int(s["batches"]) - self._base[1]
        return rows / batches if batches else 0.0
