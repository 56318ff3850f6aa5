"""Every caller gets its own row of the batch output, whatever the model returns."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref

import pytest
import torch
from conftest import WIDTH, X, Y, make_server, sample

import ferrobatch as fb


async def test_a_thousand_concurrent_callers_each_get_their_own_row() -> None:
    async with make_server(max_batch_size=64, max_delay=0.002) as server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(1000)))
        for i, out in enumerate(outs):
            torch.testing.assert_close(out["y"], sample(2 * i), msg=f"caller {i} got another's row")
        stats = server.stats()
    assert stats["requests_succeeded"] == 1000
    assert stats["rows"] == 1000
    assert stats["mean_batch_size"] > 1, "concurrent callers are batched"


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda d: {"y": d["x"] * 2, "extra": d["x"]}, id="dict"),
        pytest.param(lambda d: d["x"] * 2, id="tensor"),
        pytest.param(lambda d: (d["x"] * 2,), id="tuple"),
    ],
)
async def test_model_may_return_a_dict_a_tensor_or_a_tuple(model: object) -> None:
    async with make_server(model) as server:  # type: ignore[arg-type]
        out = await server.client().infer({"x": sample(3)})
    assert set(out) == {"y"}
    torch.testing.assert_close(out["y"], sample(6))


async def test_identity_model_outputs_do_not_alias_the_reused_staging_slot() -> None:
    async with make_server(lambda d: {"y": d["x"]}, max_batch_size=4) as server:
        client = server.client()
        first = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(4)))
        await asyncio.gather(*(client.infer({"x": sample(-1)}) for _ in range(32)))
    for i, out in enumerate(first):
        torch.testing.assert_close(out["y"], sample(i))


async def test_a_model_that_changes_its_input_views_in_place_still_gets_correct_ones() -> None:
    # The executor reuses its views of the staging slot from batch to batch;
    # a model that reshapes one in place must not leave the next batch a
    # mangled view.
    def doubles_then_mangles(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = inputs["x"]
        y = x * 2
        x.unsqueeze_(0)
        return {"y": y}

    async with make_server(doubles_then_mangles, max_batch_size=4, max_delay=0) as server:
        client = server.client()
        for i in range(12):
            out = await asyncio.wait_for(client.infer({"x": sample(i)}), timeout=10)
            torch.testing.assert_close(out["y"], sample(2 * i))


def test_the_cpu_executor_reuses_its_views_of_a_slot() -> None:
    from ferrobatch._torch import CpuExecutor

    executor = CpuExecutor(lambda d: {"y": d["x"] + 1}, torch.device("cpu"), [Y])
    slot = {"x": torch.zeros(4, WIDTH)}
    seen = []
    for rows in (3, 3, 2, 3):
        slot["x"][:rows] = torch.arange(rows, dtype=torch.float32)[:, None]
        out = executor.run(slot, rows)["y"]
        expected = torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, WIDTH) + 1
        torch.testing.assert_close(out, expected)
        seen.append(executor._staged(slot, rows))
    assert seen[0] is seen[1] is seen[3], "one set of views per (slot, rows), made once"
    assert seen[2] is not seen[0]


async def test_results_for_rows_of_multi_row_and_single_requests_in_one_batch() -> None:
    async with make_server(max_batch_size=16, max_delay=0.01) as server:
        client = server.client()
        rng = random.Random(0)
        jobs = []
        for i in range(40):
            n = rng.randint(1, 4)
            if rng.random() < 0.5:
                x = torch.arange(n * WIDTH, dtype=torch.float32).reshape(n, WIDTH) + 100 * i
                jobs.append((x * 2, client.infer_batch({"x": x})))
            else:
                jobs.append((sample(i) * 2, client.infer({"x": sample(i)})))
        outs = await asyncio.gather(*(job for _, job in jobs))
    for (want, _), out in zip(jobs, outs):
        torch.testing.assert_close(out["y"], want)


async def test_one_loop_wakeup_per_batch_not_per_request() -> None:
    """The worker rings the loop's doorbell once for a batch, and never
    schedules per-request callbacks across threads."""
    loop = asyncio.get_running_loop()
    calls = 0
    original = loop.call_soon_threadsafe

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    server = make_server(max_batch_size=64, max_delay=0.05)
    await server.start()
    try:
        client = server.client()
        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(64)))
        finally:
            loop.call_soon_threadsafe = original  # type: ignore[method-assign]
        assert server.stats()["batches"] == 1
        (mailbox,) = server._loops.mailboxes()
        assert mailbox.doorbell_fd is not None, "the default loop watches an eventfd"
        assert mailbox.wakeups == 1, f"{mailbox.wakeups} loop wake-ups for one batch of 64"
        assert calls == 0, "the doorbell, not call_soon_threadsafe, wakes the loop"
        torch.testing.assert_close(outs[63]["y"], sample(126))
    finally:
        await server.stop()


async def test_a_loop_that_cannot_watch_fds_is_woken_with_call_soon_threadsafe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()

    def no_readers(fd: int, callback: object, *args: object) -> None:
        raise NotImplementedError("this loop watches no file descriptors")

    monkeypatch.setattr(loop, "add_reader", no_readers)
    async with make_server(max_batch_size=8, max_delay=0.01) as server:
        client = server.client()
        outs = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(20)))
        (mailbox,) = server._loops.mailboxes()
        assert mailbox.doorbell_fd is None
        assert mailbox.wakeups >= 1
    for i, out in enumerate(outs):
        torch.testing.assert_close(out["y"], sample(i) * 2)


async def test_a_freed_server_stops_the_loop_watching_its_doorbell() -> None:
    server = make_server()
    async with server:
        await server.client().infer({"x": sample(0)})
    (mailbox,) = server._loops.mailboxes()
    fd = mailbox.doorbell_fd
    assert fd is not None
    freed = weakref.ref(server)
    del server, mailbox
    # Another thread's garbage collection may free the server first (its
    # finalizer then hands the removal to the loop): wait for it to be gone,
    # then let the loop run what was handed to it.
    for _ in range(100):
        gc.collect()
        if freed() is None:
            break
        await asyncio.sleep(0.01)
    assert freed() is None, "the server was not freed"
    await asyncio.sleep(0)
    assert not asyncio.get_running_loop().remove_reader(fd), "the reader was left behind"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda d: {"z": d["x"]}, "model output is missing 'y'"),
        (lambda d: {"y": d["x"][:1]}, "output 'y': expected leading dimension"),
        (lambda d: {"y": d["x"].double()}, "output 'y': expected dtype float32, got torch.float64"),
        (lambda d: {"y": d["x"][:, :2]}, "output 'y': expected shape"),
        (lambda d: 42, "model returned int"),
        (lambda d: (d["x"], d["x"]), "model returned 2 values, expected 1 outputs"),
    ],
)
async def test_wrong_model_outputs_are_a_model_error_with_a_clear_message(model: object, message: str) -> None:
    # Without isolation: alone, a request's row of ``x[:1]`` would be right.
    async with make_server(model, max_delay=0.005, isolate_failures=False) as server:  # type: ignore[arg-type]
        client = server.client()
        results = await asyncio.gather(*(client.infer({"x": sample(i)}) for i in range(3)), return_exceptions=True)
    for r in results:
        assert isinstance(r, fb.ModelError), r
        assert message in str(r)


def test_server_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        fb.Server(lambda d: d, inputs=[X], outputs=[Y], max_batch_size=0)
    with pytest.raises(ValueError, match="min_batch_size"):
        fb.Server(lambda d: d, inputs=[X], outputs=[Y], max_batch_size=4, min_batch_size=5)
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        fb.Server(lambda d: d, inputs=[X], outputs=[Y], max_batch_size=4, preferred_batch_sizes=[8])
    with pytest.raises(ValueError, match="max_delay"):
        fb.Server(lambda d: d, inputs=[X], outputs=[Y], max_delay=-1)
    with pytest.raises(ValueError, match="unique"):
        fb.Server(lambda d: d, inputs=[X, X], outputs=[Y])
    with pytest.raises(TypeError, match="callable"):
        fb.Server(42, inputs=[X], outputs=[Y])  # type: ignore[arg-type]


class _Batch:
    """A collated batch as the worker hands it (slot 0, ``rows`` rows), whose
    answers are or are not copied at the finish."""

    def __init__(self, rows: int, copies_outputs: bool) -> None:
        self.slot, self.rows, self.n_requests, self.copies_outputs = 0, rows, rows, copies_outputs
        self.released = False

    def release_slot(self) -> None:
        self.released = True


class _Worker:
    """Hands out ``batches`` once each and records each finish: whether the
    slot was still held, and the outputs."""

    def __init__(self, batches: list[_Batch]) -> None:
        self.batches = batches
        self.finished: list[tuple[bool, dict[str, torch.Tensor]]] = []

    def next_batch(self) -> _Batch | None:
        return self.batches.pop(0) if self.batches else None

    def finish(self, batch: _Batch, outputs: dict[str, torch.Tensor], error: object, *_: object) -> None:
        assert error is None, error
        self.finished.append((not batch.released, outputs))


@pytest.mark.parametrize("copies_outputs", [True, False], ids=["copied-at-finish", "views-handed-out"])
def test_outputs_that_view_the_slot_are_cloned_unless_the_finish_copies_them(copies_outputs: bool) -> None:
    # Native and shared-memory answers are copied out inside finish: an
    # identity model's outputs may then stay views of the slot, given back
    # only after the finish. Event-loop and thread callers keep views: the
    # outputs must own their memory before the slot goes.
    from ferrobatch._executor import WorkerCounters
    from ferrobatch._torch import CpuExecutor

    executor = CpuExecutor(lambda d: {"y": d["x"]}, torch.device("cpu"), [Y])
    slot = {"x": torch.arange(4 * WIDTH, dtype=torch.float32).reshape(4, WIDTH)}
    worker = _Worker([_Batch(3, copies_outputs)])
    executor.serve(worker, [slot], WorkerCounters())  # type: ignore[arg-type]
    [(slot_held, outputs)] = worker.finished
    views_slot = outputs["y"].untyped_storage().data_ptr() == slot["x"].untyped_storage().data_ptr()
    assert (slot_held, views_slot) == (copies_outputs, copies_outputs)
    torch.testing.assert_close(outputs["y"], slot["x"][:3])


@pytest.mark.parametrize("variable", [False, True], ids=["fixed-shape", "variable-length"])
def test_an_identity_model_on_two_instances_answers_native_shared_and_thread_callers_their_own_rows(
    variable: bool,
) -> None:
    # Batches of native and shared-memory requests finish from views of the
    # slot; batches mixing in thread callers clone. Two instances share the
    # slot ring, so a slot given back too early is collated into while it is
    # still read. A (-1,) model runs on VariableExecutor, a fixed one on
    # CpuExecutor.
    import json
    import os
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ferrobatch.serve import ServeConfig, serve_in_thread

    def identity(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"], "y_lengths": inputs["x_lengths"]} if variable else {"y": inputs["x"]}

    def width(i: int) -> int:
        return 1 + i % WIDTH if variable else WIDTH

    x, y = (fb.TensorSpec(n, "float32", (-1,), ragged="pad") for n in "xy") if variable else (X, Y)
    server = fb.Server([identity, identity], inputs=[x], outputs=[y], name="same", max_batch_size=8, max_delay=0.001)
    config = ServeConfig(http_port=0, grpc_port=None, frontend="native")
    with serve_in_thread([server], config) as listening, httpx.Client() as http:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/same/infer"

        def remote(i: int) -> list[float]:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, width(i)], "data": [i] * width(i)}]}
            response = http.post(url, content=json.dumps(body))
            assert response.status_code == 200, response.text
            return list(response.json()["outputs"][0]["data"])

        client = server.client()
        share = server.share(f"fbtest-same-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with fb.connect(share.name) as shared, ThreadPoolExecutor(24) as pool:
            remote_answers = [pool.submit(remote, i) for i in range(300)]
            local_answers = [
                pool.submit(client.infer_sync, {"x": torch.full((width(i),), 1000.0 + i)}) for i in range(300)
            ]
            shared_answers = [
                pool.submit(shared.infer_sync, {"x": torch.full((width(i),), 2000.0 + i)}) for i in range(300)
            ]
            remote_rows = [f.result() for f in remote_answers]
            local_rows = [f.result()["y"] for f in local_answers]
            shared_rows = [f.result()["y"] for f in shared_answers]
        stats = server.stats()
    assert all(row == [float(i)] * width(i) for i, row in enumerate(remote_rows))
    for i, row in enumerate(local_rows):  # read after every batch ran: a view of a reused slot would show
        torch.testing.assert_close(row, torch.full((width(i),), 1000.0 + i), msg=f"thread caller {i} got another's row")
    for i, row in enumerate(shared_rows):
        torch.testing.assert_close(row, torch.full((width(i),), 2000.0 + i), msg=f"shared caller {i} got another's row")
    assert stats["requests_succeeded"] == 900 and stats["mean_batch_size"] > 1


@pytest.mark.parametrize("instance_kind", ["thread", "process"])
async def test_results_are_ordinary_tensors_a_caller_may_change_and_train_with(instance_kind: str) -> None:
    """Not inference tensors: an RL learner changes actions in place and uses
    them beside autograd, which an inference tensor refuses outside
    inference mode."""
    server = fb.Server(_affine, inputs=[X], outputs=[Y], instance_kind=instance_kind)  # type: ignore[arg-type]
    async with server:
        client = server.client()
        one = (await client.infer({"x": sample(1)}))["y"]
        rows = (await client.infer_batch({"x": torch.stack([sample(2), sample(3)])}))["y"]
        from_thread = (await asyncio.to_thread(client.infer_sync, {"x": sample(4)}))["y"]
    weight = torch.ones(WIDTH, requires_grad=True)
    for got in (one, rows, from_thread):
        assert not got.is_inference()
        got.add_(1)  # in place, outside any mode
        (weight * got).sum().backward()  # saved for backward
    assert torch.equal(one, sample(1) * 2 + 2)
    assert weight.grad is not None


def _affine(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": batch["x"] * 2 + 1}
