"""Model instances as processes (``Server(instance_kind="process")``): each
instance's model runs in a child process fed through shared memory; results
are those of thread instances, a child that dies fails only its batch (and
with isolation, the batch runs again on the restarted process), the children
go with the server, and with a server that dies. Faults: every caller is
answered once, with its result or a typed error, and no child outlives the
server."""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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


async def in_its_batch(server: fb.Server, instance: int = 0) -> None:
    """Returns once the instance's worker has sent a batch to its process:
    killed from then on, the process dies during that batch (a sleep
    instead would race the send on a loaded machine)."""
    deadline = time.monotonic() + 30
    while not server._executors[instance]._exchanging:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "no batch reached the process"
        await asyncio.sleep(0.005)


def raising(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((inputs["x"] < 0).any()):
        raise ValueError("negative input")
    return where(inputs)


def stuck(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch with a negative input takes 30 s (a long or hung model call)."""
    if bool((inputs["x"] < 0).any()):
        time.sleep(30)
    return where(inputs)


class Unpicklable:
    """A model whose own pickling code raises (not one of pickle's errors)."""

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return where(inputs)

    def __reduce__(self) -> Any:
        raise ValueError("this model cannot be pickled")


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
                await in_its_batch(server)
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

    async def unpicklable(model: Any) -> str:
        server = fb.Server(model, inputs=[X], outputs=[Y, PID], instance_kind="process", name="unpicklable")
        with pytest.raises(fb.ModelError, match="pickled") as refused:
            await server.start()
        assert not server.running
        return str(refused.value)

    assert "top level" in asyncio.run(unpicklable(lambda b: where(b)))
    # The model's own pickling code raised: a ModelError too, not its ValueError.
    assert "ValueError: this model cannot be pickled" in asyncio.run(unpicklable(Unpicklable()))


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "in_a_batch"])
def test_instance_processes_exit_when_their_server_is_killed(tmp_path: Path, busy: bool) -> None:
    """Idle, a child reads end-of-file on its pipe; in a 30 s model call,
    it sees its parent gone within a second and exits all the same."""
    script = tmp_path / "serve.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio, sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import ferrobatch as fb
            import torch
            from test_process_instances import PID, X, Y, stuck

            async def main():
                server = fb.Server([stuck, stuck], inputs=[X], outputs=[Y, PID], instance_kind="process")
                async with server:
                    if {busy!r}:
                        neg = {{"x": -torch.ones(8)}}
                        calls = [asyncio.ensure_future(server.client().infer(neg)) for _ in range(2)]
                        await asyncio.sleep(1)  # both instances in their 30 s call
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
        assert wait_gone(children, 10), "an instance process outlived its server"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in children if "children" in locals() else []:
            if not gone(pid):  # an orphan the test failed on: not left behind
                os.kill(pid, signal.SIGKILL)


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


# -- faults: every caller answered once, no child left behind ---------------------------


def hung(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((inputs["x"] < 0).any()):
        time.sleep(60)  # killed with its process long before
    return where(inputs)


def with_parameters(inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    """``y = x`` times each request's ``scale`` parameter (1 without one)."""
    scale = torch.cat([torch.full((r.rows,), float(r.parameters.get("scale", 1))) for r in requests])
    x = inputs["x"]
    return {"y": x * scale[:, None], "pid": torch.full((x.shape[0],), os.getpid(), dtype=torch.int64)}


class ShapeError(Exception):
    """Pickles, but cannot be rebuilt from its pickle (its ``__init__``
    takes two arguments and passes one on)."""

    def __init__(self, name: str, got: int) -> None:
        super().__init__(f"{name}: got {got}")


def misshapen(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    raise ShapeError("x", 3)


def forking(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Leaves a helper process holding the instance's pipe (as a model that
    starts a subprocess would), then works slowly. The helper goes 30 s
    after its parent."""
    parent = os.getpid()
    if os.fork() == 0:
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(30)
        os._exit(0)
    return slow(inputs)


class NeedsFile:
    """A model that reads ``path`` when it is unpickled (in each new
    instance process): without it, a process cannot be started."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __setstate__(self, state: dict[str, str]) -> None:
        Path(state["path"]).read_bytes()
        self.path = state["path"]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return where(inputs)


class SlowNeedsFile(NeedsFile):
    """:class:`NeedsFile` whose calls take 0.5 s."""

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.5)
        return where(inputs)


def children() -> list[int]:
    """This process's instance processes still running."""
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.name.startswith("ferrobatch-") and p.pid]


def test_a_model_built_with_requests_gets_them_in_its_process() -> None:
    async def run() -> list[float]:
        server = fb.Server(
            [with_parameters], inputs=[X], outputs=[Y, PID], instance_kind="process", with_requests=True, name="wr"
        )
        async with server:
            client = server.client()
            plain, scaled = await asyncio.gather(
                client.infer({"x": torch.ones(8)}), client.infer({"x": torch.ones(8)}, parameters={"scale": 3})
            )
            return [plain["y"][0].item(), scaled["y"][0].item()]

    assert asyncio.run(run()) == [1.0, 3.0]


def test_a_stop_that_times_out_closes_what_waits_and_kills_a_busy_process_at_once() -> None:
    async def run() -> tuple[list[object], float, dict[str, object], list[int]]:
        server = fb.Server([hung], inputs=[X], outputs=[Y, PID], instance_kind="process", name="hung", max_batch_size=1)
        await server.start()
        pid = server._executors[0].pid  # type: ignore[attr-defined]
        client = server.client()
        calls = [asyncio.ensure_future(client.infer({"x": -torch.ones(8)})) for _ in range(5)]
        await asyncio.sleep(0.5)  # the first is in the process, the others queued
        started = time.monotonic()
        await server.stop(timeout=0.5)
        took = time.monotonic() - started
        results = await asyncio.gather(*calls, return_exceptions=True)
        return results, took, server.stats(), [pid]

    results, took, stats, pids = asyncio.run(run())
    assert all(isinstance(r, fb.ServerClosedError) for r in results), results
    assert {k: n for k, n in stats["requests_failed"].items() if n} == {"server_closed": 5}, stats  # type: ignore[attr-defined]
    assert took < 5, f"stop(timeout=0.5) took {took:.1f} s"
    assert wait_gone(pids) and not children()


def test_a_process_that_died_between_batches_is_replaced_before_the_next_batch() -> None:
    """Replaced once it is seen, with no batch asking (the next one does
    not wait for the start); the batch then fails nothing."""

    async def run() -> tuple[dict[str, object], list[int]]:
        server = fb.Server([where], inputs=[X], outputs=[Y, PID], instance_kind="process", name="idle")
        async with server:
            executor = server._executors[0]  # type: ignore[attr-defined]
            first = executor.pid
            os.kill(first, signal.SIGKILL)
            assert wait_gone([first])
            deadline = time.monotonic() + 30
            while executor.pid in (None, first) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            replaced = executor.pid
            assert replaced not in (None, first), "no batch came: nothing replaced it"
            assert server.stats()["process_restarts"] == 1
            got = await server.client().infer({"x": torch.ones(8)})
            assert int(got["pid"]) == replaced
            return server.stats(), [first, replaced]

    stats, pids = asyncio.run(run())
    assert stats["requests_succeeded"] == 1 and not any(stats["requests_failed"].values())  # type: ignore[attr-defined]
    assert stats["process_restarts"] == 1
    assert wait_gone(pids)


def test_an_idle_process_that_cannot_be_replaced_makes_the_server_not_ready(tmp_path: Path) -> None:
    """Readiness says so with no request sent (a load balancer sends none to
    learn it), and again ready once a later try starts it."""
    weights = tmp_path / "weights"
    weights.write_bytes(b"w")

    async def run() -> None:
        server = fb.Server(NeedsFile(str(weights)), inputs=[X], outputs=[Y, PID], instance_kind="process", name="nf")
        async with server:
            assert server.ready
            weights.unlink()
            os.kill(server._executors[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
            deadline = time.monotonic() + 30
            while server.ready and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not server.ready, "its death was only seen by a batch"
            await asyncio.sleep(2.5)  # tries that fail (after 1 s, then 2 s) are no restarts
            weights.write_bytes(b"w")
            while not server.ready and time.monotonic() < deadline + 30:
                await asyncio.sleep(0.1)
            assert server.ready
            assert (await server.client().infer({"x": torch.ones(8)}))["y"].shape == (8,)
            stats = server.stats()
        assert stats["requests_succeeded"] == 1 and not any(stats["requests_failed"].values()), stats
        assert stats["process_restarts"] == 1, stats

    asyncio.run(run())


def test_a_terminals_ctrl_c_does_not_end_an_instance_process() -> None:
    async def run() -> tuple[int, int]:
        server = fb.Server([where], inputs=[X], outputs=[Y, PID], instance_kind="process", name="sigint")
        async with server:
            pid = server._executors[0].pid  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGINT)
            await asyncio.sleep(0.3)
            got = await server.client().infer({"x": torch.ones(8)})
            return pid, int(got["pid"])

    pid, served_by = asyncio.run(run())
    assert served_by == pid


def test_a_lone_request_whose_process_died_runs_again_on_the_new_one() -> None:
    async def run() -> tuple[object, dict[str, object]]:
        server = fb.Server(
            [slow], inputs=[X], outputs=[Y, PID], instance_kind="process", name="lone", isolate_failures=True
        )
        async with server:
            first = server._executors[0].pid  # type: ignore[attr-defined]
            call = asyncio.ensure_future(server.client().infer({"x": torch.ones(8)}))
            await in_its_batch(server)
            os.kill(first, signal.SIGKILL)
            got = await call
            assert int(got["pid"]) != first
            return got["y"].tolist(), server.stats()

    y, stats = asyncio.run(run())
    assert y == [2.0] * 8
    assert stats["requests_succeeded"] == 1 and stats["retry_calls"] == 1 and stats["process_restarts"] == 1


@pytest.mark.parametrize("isolate", [True, False])
def test_a_killed_process_whose_helper_keeps_its_pipe_is_noticed(isolate: bool) -> None:
    """The pipe stays open (a process the model forked holds it): the
    child's end is seen all the same, and its batch runs again or fails."""

    async def run() -> tuple[object, float, object]:
        server = fb.Server(
            [forking], inputs=[X], outputs=[Y, PID], instance_kind="process", name="forking", isolate_failures=isolate
        )
        async with server:
            first = server._executors[0].pid  # type: ignore[attr-defined]
            call = asyncio.ensure_future(server.client().infer({"x": torch.ones(8)}))
            await in_its_batch(server)
            os.kill(first, signal.SIGKILL)
            started = time.monotonic()
            answer = (await asyncio.gather(call, return_exceptions=True))[0]
            took = time.monotonic() - started
            after = await asyncio.wait_for(server.client().infer({"x": torch.ones(8)}), 60)
            stopping = time.monotonic()
        # The helper holds the new child's sentinel too: its end is asked of waitpid.
        assert time.monotonic() - stopping < 5, "stop() waited for the helper"
        return answer, took, after["y"].tolist()

    answer, took, after = asyncio.run(run())
    if isolate:
        assert answer["y"].tolist() == [2.0] * 8  # type: ignore[index]
    else:
        assert isinstance(answer, fb.ModelError) and "died" in str(answer), answer
        assert str(answer).startswith("model 'forking': instance 0's process (pid"), answer  # named once
    assert took < 20 and after == [2.0] * 8  # not once the helper has gone (30 s)


def test_an_exception_that_cannot_be_rebuilt_arrives_named() -> None:
    async def run() -> tuple[BaseException | None, dict[str, object]]:
        server = fb.Server([misshapen], inputs=[X], outputs=[Y, PID], instance_kind="process", name="misshapen")
        async with server:
            try:
                await server.client().infer({"x": torch.ones(8)})
                return None, server.stats()
            except fb.ModelError as exc:
                return exc, server.stats()

    error, stats = asyncio.run(run())
    assert error is not None and "ShapeError: x: got 3" in str(error), error
    assert stats["process_restarts"] == 0


def test_an_instance_that_cannot_restart_leaves_its_batches_to_the_others(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.write_bytes(b"w")

    async def run() -> tuple[list[object], dict[str, object], bool]:
        model = NeedsFile(str(weights))
        server = fb.Server(
            [model, model], inputs=[X], outputs=[Y, PID], instance_kind="process", name="needs", max_batch_size=4
        )
        async with server:
            down = server._executors[0]
            weights.unlink()
            os.kill(down.pid, signal.SIGKILL)
            client = server.client()
            results = []
            for _ in range(10):  # the first batches may reach instance 0, which then steps aside
                results += await asyncio.gather(
                    *(client.infer({"x": torch.ones(8)}) for _ in range(8)), return_exceptions=True
                )
            weights.write_bytes(b"w")  # it comes back at its next try
            deadline = time.monotonic() + 20
            while not down.up and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return results, server.stats(), down.up

    results, stats, back = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed  # a batch it took before it saw its process gone ran on the other's
    assert back and stats["requests_succeeded"] == 80


def test_a_batch_taken_by_an_instance_whose_process_is_gone_runs_on_another(tmp_path: Path) -> None:
    """Killed while idle, its replacement unable to start: the batches its
    worker takes before the watcher looks (within 0.5 s) run on the other
    instance's process; nothing fails."""
    weights = tmp_path / "weights"
    weights.write_bytes(b"w")

    async def run() -> tuple[list[object], dict[str, Any]]:
        model = NeedsFile(str(weights))
        server = fb.Server(
            [model, model], inputs=[X], outputs=[Y, PID], instance_kind="process", name="borrow",
            max_batch_size=1, max_delay=0.0,
        )  # fmt: skip
        async with server:
            weights.unlink()
            dead = server._executors[0].pid  # type: ignore[attr-defined]
            os.kill(dead, signal.SIGKILL)
            await asyncio.sleep(0.05)  # gone, and not seen yet
            client = server.client()
            results = await asyncio.gather(
                *(client.infer({"x": torch.full((8,), float(i))}, timeout=30) for i in range(4)),
                return_exceptions=True,
            )
            weights.write_bytes(b"w")
            return results, server.stats()

    results, stats = asyncio.run(run())
    assert all(isinstance(r, dict) for r in results), results
    assert stats["requests_succeeded"] == 4 and not any(stats["requests_failed"].values()), stats


def test_a_stop_while_an_instance_restarts_leaves_no_process() -> None:
    async def run() -> None:
        server = fb.Server(
            [slow], inputs=[X], outputs=[Y, PID], instance_kind="process", name="restarting", isolate_failures=True
        )
        await server.start()
        first = server._executors[0].pid  # type: ignore[attr-defined]
        call = asyncio.ensure_future(server.client().infer({"x": torch.ones(8)}))
        await in_its_batch(server)
        os.kill(first, signal.SIGKILL)
        await asyncio.sleep(0.2)  # the worker is starting another process
        started = time.monotonic()
        await server.stop(timeout=0.1)
        assert time.monotonic() - started < 3, "the start in progress is cut short"
        await asyncio.gather(call, return_exceptions=True)

    asyncio.run(run())
    deadline = time.monotonic() + 2
    while children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children()


def test_torch_threads_is_bounded() -> None:
    for bad in (True, 0, 2**31, 1.5):
        with pytest.raises(ValueError, match="torch_threads must be an int from 1 to 1024"):
            fb.Server(where, inputs=[X], outputs=[Y, PID], torch_threads=bad)  # type: ignore[arg-type]


def deadly(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Kills its own process on a negative input (as a crash in native code would)."""
    if bool((inputs["x"] < 0).any()):
        os.kill(os.getpid(), signal.SIGKILL)
    return where(inputs)


def test_a_request_that_kills_its_process_fails_alone_at_a_bounded_cost() -> None:
    async def run() -> tuple[list[object], dict[str, object]]:
        server = fb.Server(
            [deadly], inputs=[X], outputs=[Y, PID], instance_kind="process", name="deadly", max_delay=0.05
        )
        async with server:
            client = server.client()
            xs = [torch.full((8,), -1.0 if i == 2 else float(i)) for i in range(4)]
            results = await asyncio.gather(*(client.infer({"x": x}) for x in xs), return_exceptions=True)
            return results, server.stats()

    results, stats = asyncio.run(run())
    assert isinstance(results[2], fb.ModelError) and "died" in str(results[2])
    assert [r["y"][0].item() for i, r in enumerate(results) if i != 2] == [0.0, 2.0, 6.0]  # type: ignore[index]
    # The whole batch ran twice; then its halves once each, the bad one's halves too: 4 deaths, not 6.
    assert stats["process_restarts"] == 4, stats["process_restarts"]


GRAD_WEIGHT = torch.ones(8, requires_grad=True)


def raises_with_a_grad_tensor(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raises with a tensor that plain pickle takes and the pipe's pickler refuses (non-leaf, needs grad)."""
    x = inputs["x"]
    if bool((x < 0).any()):
        with torch.enable_grad():
            raise ValueError("negative input", x * GRAD_WEIGHT)
    return where(inputs)


class ExitsWhenPickled(Exception):
    def __reduce__(self) -> Any:
        raise SystemExit("pickling this exception exits")


def raises_unpicklable(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((inputs["x"] < 0).any()):
        raise ExitsWhenPickled("negative input")
    return where(inputs)


@pytest.mark.parametrize(
    ("model", "named"),
    [(raises_with_a_grad_tensor, "ValueError: ('negative input', tensor("), (raises_unpicklable, "ExitsWhenPickled")],
    ids=["grad_tensor", "reduce_exits"],
)
def test_an_exception_the_pipe_cannot_carry_fails_its_request_not_the_process(model: Any, named: str) -> None:
    async def run() -> tuple[BaseException, dict[str, Any], dict[str, object]]:
        server = fb.Server([model], inputs=[X], outputs=[Y, PID], instance_kind="process", name="unsendable")
        async with server:
            client = server.client()
            with pytest.raises(fb.ModelError) as failed:
                await client.infer({"x": -torch.ones(8)})
            ok = await client.infer({"x": torch.ones(8)})
            return failed.value, ok, server.stats()

    error, ok, stats = asyncio.run(run())
    assert named in str(error) and "died" not in str(error), error
    assert isinstance(error.__cause__, RuntimeError) and named in str(error.__cause__)
    assert ok["y"].tolist() == [2.0] * 8 and stats["process_restarts"] == 0


def test_a_process_that_cannot_load_its_model_says_how_it_ended(tmp_path: Path) -> None:
    (tmp_path / "vanishing_model.py").write_text("def double(inputs):\n    return {'y': inputs['x'] * 2}\n")
    sys.path.insert(0, str(tmp_path))
    try:
        model = importlib.import_module("vanishing_model").double
    finally:
        sys.path.remove(str(tmp_path))  # the child, spawned with this path, cannot import it

    async def run() -> str:
        server = fb.Server(model, inputs=[X], outputs=[Y], instance_kind="process", name="vanishing")
        with pytest.raises(fb.ModelError) as failed:
            await server.start()
        return str(failed.value)

    try:
        message = asyncio.run(run())
    finally:
        sys.modules.pop("vanishing_model", None)
    assert "exited at start (exit code 1)" in message and "stderr" in message, message
    assert "in time" not in message


def test_a_server_freed_without_stop_leaves_no_instance_process() -> None:
    # Before, stop() alone ended them: a server dropped while running left its children running.
    async def run() -> list[int]:
        server = fb.Server([where, where], inputs=[X], outputs=[Y, PID], instance_kind="process", name="dropped")
        await server.start()
        pids = [e.pid for e in server._executors]  # type: ignore[attr-defined]
        await server.client().infer({"x": torch.ones(8)})
        return pids

    pids = asyncio.run(run())
    gc.collect()
    assert wait_gone(pids), "the freed server's instance processes were not ended"


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_readiness_says_not_ready_while_every_instance_is_down(tmp_path: Path, frontend: str) -> None:
    # Before, readiness stayed 200 while every batch failed 500 (an instance that could not restart).
    import httpx
    import tritonclient.grpc as grpcclient

    from ferrobatch.serve import ServeConfig, serve_in_thread

    weights = tmp_path / "weights"
    weights.write_bytes(b"w")
    server = fb.Server(NeedsFile(str(weights)), inputs=[X], outputs=[Y, PID], instance_kind="process", name="needs")
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend)
    with serve_in_thread([server], config) as listening:
        base = f"http://127.0.0.1:{listening.http_port}"
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 8], "data": [1.0] * 8}]}
        rpc = grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}")

        def statuses() -> tuple[int, int]:
            model = httpx.get(f"{base}/v2/models/needs/ready", timeout=10).status_code
            health = httpx.get(f"{base}/v2/health/ready", timeout=10).status_code
            # gRPC's ModelReady and ServerReady say the same.
            assert rpc.is_model_ready("needs") == (model == 200) and rpc.is_server_ready() == (health == 200)
            return model, health

        assert statuses() == (200, 200) and server.ready
        weights.unlink()
        os.kill(server._executors[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        assert httpx.post(f"{base}/v2/models/needs/infer", json=body, timeout=30).status_code == 500
        assert statuses() == (503, 503) and not server.ready
        weights.write_bytes(b"w")
        # Its next try (1 s after the failed one) comes with no request to ask
        # for it: not ready, a load balancer sends none.
        deadline = time.monotonic() + 20
        while not server.ready and time.monotonic() < deadline:
            time.sleep(0.1)
        assert statuses() == (200, 200) and server.ready
        assert httpx.post(f"{base}/v2/models/needs/infer", json=body, timeout=30).status_code == 200
    assert server._native.watchers == [], "a stopped front-end is told nothing more"  # type: ignore[attr-defined]


def test_a_batch_that_cannot_run_again_is_not_counted_as_run_again(tmp_path: Path) -> None:
    """Its process killed mid-batch, its replacement unable to start: the
    batch never runs again, and retry_calls does not say it did."""
    weights = tmp_path / "weights"
    weights.write_bytes(b"w")

    async def run() -> tuple[list[object], dict[str, Any]]:
        server = fb.Server(
            SlowNeedsFile(str(weights)), inputs=[X], outputs=[Y, PID], instance_kind="process", name="norerun",
            isolate_failures=True,
        )  # fmt: skip
        async with server:
            call = asyncio.ensure_future(server.client().infer({"x": torch.ones(8)}))
            await in_its_batch(server)
            weights.unlink()
            os.kill(server._executors[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
            results = await asyncio.gather(call, return_exceptions=True)
            return results, server.stats()

    results, stats = asyncio.run(run())
    assert isinstance(results[0], fb.ModelError), results
    assert stats["process_restarts"] == 0 and stats["retry_calls"] == 0, stats  # its start failed: no restart


def test_a_response_cache_answers_for_process_instances() -> None:
    """A result computed in an instance process is kept in the server's
    cache: the same inputs again are answered with it (the same process
    id), never sent to a process."""

    async def run() -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
        server = fb.Server([where], inputs=[X], outputs=[Y, PID], instance_kind="process", response_cache=1 << 20)
        async with server:
            client = server.client()
            got = [await client.infer({"x": torch.full((8,), 3.0)}) for _ in range(3)]
            return got, server.stats()

    got, stats = asyncio.run(run())
    assert all(torch.equal(g["y"], torch.full((8,), 6.0)) and g["pid"] == got[0]["pid"] for g in got)
    assert got[0]["pid"] != os.getpid()
    assert (stats["cache_hits"], stats["cache_misses"], stats["batches"]) == (2, 1, 1)
