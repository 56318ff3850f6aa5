"""Model instances as processes (``Server(instance_kind="process")``): each
instance's model runs in a child process fed through shared memory; results
are those of thread instances, a child that dies fails only its batch (and
isolation retries its requests on the restarted process), the children go
with the server, and with a server that dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ferrobatch as fb

X = fb.TensorSpec("x", "float32", (8,))
Y = fb.TensorSpec("y", "float32", (8,))
PID = fb.TensorSpec("pid", "int64", ())


class Affine(torch.nn.Module):
    """A deterministic model (picklable: defined at the module's top level)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def where(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``y = 2x``, and the process that computed each row."""
    x = inputs["x"]
    return {"y": x * 2, "pid": torch.full((x.shape[0],), os.getpid(), dtype=torch.int64)}


def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    time.sleep(0.3)
    return where(inputs)


def raising(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((inputs["x"] < 0).any()):
        raise ValueError("negative input")
    return where(inputs)


def policy(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``y = 2x``, and the scheduling policy of the process that computed each row."""
    x = inputs["x"]
    return {"y": x * 2, "pid": torch.full((x.shape[0],), os.sched_getscheduler(0), dtype=torch.int64)}


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie has: it answers kill(pid, 0) but runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: list[int], seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_process_instances_answer_as_thread_instances_do() -> None:
    model = Affine().eval()
    x = torch.randn(100, 8)
    with torch.inference_mode():
        want = model(x)

    async def run(kind: str) -> tuple[list[torch.Tensor], dict[str, object]]:
        server = fb.Server([model, model], inputs=[X], outputs=[Y], instance_kind=kind, name=kind, max_delay=0.002)
        async with server:
            client = server.client()
            got = await asyncio.gather(*(client.infer({"x": row}) for row in x))
            return [g["y"] for g in got], server.stats()

    rows, stats = asyncio.run(run("process"))
    assert torch.allclose(torch.stack(rows), want, atol=1e-6)
    assert stats["instance_kind"] == "process" and stats["process_restarts"] == 0
    assert stats["requests_succeeded"] == 100


def test_each_instance_is_its_own_process_and_they_go_with_the_server() -> None:
    async def run() -> tuple[set[int], list[int]]:
        server = fb.Server([where, where], inputs=[X], outputs=[Y, PID], instance_kind="process", name="where")
        async with server:
            pids = [e.pid for e in server._executors]  # type: ignore[attr-defined]
            client = server.client()
            got = await asyncio.gather(*(client.infer({"x": torch.ones(8)}) for _ in range(200)))
        return {int(g["pid"]) for g in got}, pids

    seen, pids = asyncio.run(run())
    assert os.getpid() not in seen and seen <= set(pids)
    assert wait_gone(pids), "stop() reaps the instance processes"


@pytest.mark.parametrize("isolate", [True, False])
def test_a_killed_instance_process_fails_only_its_batch_and_is_restarted(isolate: bool) -> None:
    async def run() -> tuple[list[object], dict[str, object], list[int]]:
        server = fb.Server(
            [slow], inputs=[X], outputs=[Y, PID], instance_kind="process", name="slow",
            max_delay=0.05, isolate_failures=isolate,
        )  # fmt: skip
        async with server:
            first = server._executors[0].pid  # type: ignore[attr-defined]
            client = server.client()

            async def kill_mid_batch() -> None:
                await asyncio.sleep(0.15)
                os.kill(first, signal.SIGKILL)

            results = await asyncio.gather(
                kill_mid_batch(), *(client.infer({"x": torch.full((8,), float(i))}) for i in range(4)),
                return_exceptions=True,
            )  # fmt: skip
            after = await client.infer({"x": torch.ones(8)})  # the restarted process serves
            second = server._executors[0].pid  # type: ignore[attr-defined]
            assert int(after["pid"]) == second != first
            return list(results[1:]), server.stats(), [first, second]

    results, stats, pids = asyncio.run(run())
    assert stats["process_restarts"] == 1
    if isolate:  # its requests ran again on the new process
        assert [r["y"][0].item() for r in results] == [0.0, 2.0, 4.0, 6.0]  # type: ignore[index]
        assert stats["requests_succeeded"] == 5 and stats["retry_calls"] >= 1
    else:
        assert all(isinstance(r, fb.ModelError) and "died" in str(r) for r in results)
        assert stats["requests_failed"]["model_error"] == 4  # type: ignore[index]
        assert stats["requests_succeeded"] == 1
    assert wait_gone(pids)


def test_a_model_exception_crosses_with_its_type() -> None:
    async def run() -> tuple[BaseException | None, dict[str, object]]:
        server = fb.Server([raising], inputs=[X], outputs=[Y, PID], instance_kind="process", name="raising")
        async with server:
            client = server.client()
            try:
                await client.infer({"x": -torch.ones(8)})
                error = None
            except fb.ModelError as exc:
                error = exc
            ok = await client.infer({"x": torch.ones(8)})
            assert ok["y"].tolist() == [2.0] * 8
            return error, server.stats()

    error, stats = asyncio.run(run())
    assert error is not None and isinstance(error.__cause__, ValueError) and "negative input" in str(error)
    assert stats["process_restarts"] == 0


def test_what_process_instances_refuse() -> None:
    with pytest.raises(ValueError, match="instance_kind must be"):
        fb.Server(where, inputs=[X], outputs=[Y, PID], instance_kind="fiber")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="variable-length"):
        fb.Server(
            where, inputs=[fb.TensorSpec("x", "float32", (-1,), ragged="pad")], outputs=[Y], instance_kind="process"
        )
    with pytest.raises(ValueError, match="invariance_sample_rate"):
        fb.Server(where, inputs=[X], outputs=[Y, PID], instance_kind="process", invariance_sample_rate=0.1)
    with pytest.raises(ValueError, match="warm-up"):
        fb.Server(where, inputs=[X], outputs=[Y, PID], instance_kind="process", warmup=True)
    server = fb.Server(where, inputs=[X], outputs=[Y, PID], instance_kind="process")
    with pytest.raises(ValueError, match="weights"):
        server.update_weights_sync({})

    async def unpicklable() -> str:
        server = fb.Server(lambda b: where(b), inputs=[X], outputs=[Y, PID], instance_kind="process", name="lam")
        with pytest.raises(fb.ModelError, match="pickled") as refused:
            await server.start()
        assert not server.running
        return str(refused.value)

    assert "top level" in asyncio.run(unpicklable())


def test_instance_processes_exit_when_their_server_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import ferrobatch as fb
            from test_process_instances import PID, X, Y, where

            async def main():
                server = fb.Server([where, where], inputs=[X], outputs=[Y, PID], instance_kind="process")
                async with server:
                    print(*[e.pid for e in server._executors], flush=True)
                    await asyncio.sleep(60)

            if __name__ == "__main__":
                asyncio.run(main())
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        children = [int(p) for p in parent.stdout.readline().split()]
        assert len(children) == 2 and not any(gone(p) for p in children)
        parent.kill()  # no stop(): its instance processes read end-of-file on their pipes
        parent.wait(10)
        assert wait_gone(children), "an instance process outlived its server"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_instance_processes_yield_to_the_native_front_end_as_worker_threads_do() -> None:
    from ferrobatch import server as server_module

    async def run(name: str) -> tuple[int, object]:
        server = fb.Server(policy, inputs=[X], outputs=[Y, PID], instance_kind="process", name=name)
        async with server:
            out = await server.client().infer({"x": torch.ones(8)})
            return int(out["pid"]), server.stats()["workers_yield"]

    assert asyncio.run(run("alone")) == (os.SCHED_OTHER, False)
    server_module.hold_front_end_cores(1)
    try:
        assert asyncio.run(run("beside-front-end")) == (os.SCHED_BATCH, True)
    finally:
        server_module.hold_front_end_cores(-1)
