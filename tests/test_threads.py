"""Callers in plain threads: ``client.infer_sync`` queues from the calling
thread and waits for its batch with the GIL released (no event-loop hop),
and every request still resolves exactly once, counted once."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

import pytest
import torch

import ferrobatch as fb

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def outcomes(server: fb.Server) -> Counter[str]:
    stats = server.stats()
    return Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]})


def test_many_threads_get_their_own_rows_in_shared_batches() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=32, max_delay=0.002)
    with server.run_in_background():
        client = server.client()

        def call(i: int) -> torch.Tensor:
            y: torch.Tensor = client.infer_sync({"x": torch.full((4,), float(i))})["y"]
            return y

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(call, range(400)))
        stats = server.stats()
    for i, y in enumerate(results):
        assert torch.equal(y, torch.full((4,), 2.0 * i))
    assert stats["requests_succeeded"] == 400
    assert stats["batches"] < 400  # batched across threads
    assert stats["request_ns"] > 0


def test_a_batch_goes_once_every_thread_caller_is_in_it() -> None:
    """Threads that each wait for their answer before calling again: once
    all of them are in the batch, no row can join it, so it goes without
    waiting out a long ``max_delay``; a thread that thinks for a while is
    waited for (inside the window), and the batch goes when it arrives."""
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=64, max_delay=1.5)
    callers, rounds = 4, 10
    waited: dict[tuple[int, int], float] = {}
    with server.run_in_background():
        client = server.client()
        barrier = threading.Barrier(callers)

        def call(k: int) -> None:
            for i in range(rounds):
                barrier.wait()  # rounds in step: no thread runs ahead or leaves early
                if k == 0 and i == rounds // 2:
                    time.sleep(0.2)  # the others' batch waits for this thread
                began = time.monotonic()
                y = client.infer_sync({"x": torch.full((4,), float(k * rounds + i))})["y"]
                waited[k, i] = time.monotonic() - began
                assert torch.equal(y, torch.full((4,), 2.0 * (k * rounds + i)))

        with ThreadPoolExecutor(callers) as pool:
            list(pool.map(call, range(callers)))
        stats = server.stats()
    # Round 0 may split: the first thread in is the only one seen yet, so
    # its request goes at once, and the others then wait for it (blocked
    # on the barrier, it looks like a thread thinking) for the window.
    slow = {key: t for key, t in waited.items() if key[1] > 0 and t > 1.0}
    assert not slow, f"batches waited out max_delay: {slow}"
    assert min(waited[k, rounds // 2] for k in range(1, callers)) >= 0.15, "they did not wait for thread 0"
    assert stats["requests_succeeded"] == callers * rounds
    assert stats["batches"] <= rounds + 1  # each round's four rows in one batch


def test_a_thread_that_ended_is_not_waited_for() -> None:
    """A thread caller that ended sends no more rows: the batches of the
    threads still calling go without waiting for it."""
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=64, max_delay=3.0)
    with server.run_in_background():
        client = server.client()
        gone = threading.Thread(target=lambda: client.infer_sync({"x": torch.ones(4)}))
        gone.start()
        gone.join()
        began = time.monotonic()
        client.infer_sync({"x": torch.ones(4)})  # this thread is now the only caller
        took = time.monotonic() - began
    assert took < 1.5, f"waited {took:.2f}s for a thread that had ended"


def test_below_min_batch_size_a_thread_that_went_quiet_is_not_waited_for_forever() -> None:
    """A's request goes alone (A is every caller then); A stays alive but
    calls no more. B's request, below ``min_batch_size``, waits for A for the
    horizon (about a second), then goes: nothing else can come."""
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=2, min_batch_size=2, max_delay=0.001)
    quiet = threading.Event()
    with server.run_in_background():
        client = server.client()
        first = threading.Thread(target=lambda: (client.infer_sync({"x": torch.ones(4)}), quiet.wait(30)))
        first.start()
        try:
            while server.stats()["requests_succeeded"] < 1:
                time.sleep(0.01)
            began = time.monotonic()
            out = client.infer_sync({"x": torch.full((4,), 3.0)}, timeout=15)
            waited = time.monotonic() - began
        finally:
            quiet.set()
            first.join()
    assert torch.equal(out["y"], torch.full((4,), 6.0))
    assert waited < 5, waited


def test_no_event_loop_hop_the_server_loop_may_be_busy() -> None:
    """The thread queues the request itself: a server loop blocked for a
    while does not hold it up (it would, through the loop)."""
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=8, max_delay=0.001)
    with server.run_in_background():
        loop = server._token.native_token  # type: ignore[union-attr]
        blocked = threading.Event()
        loop.call_soon_threadsafe(lambda: (blocked.set(), time.sleep(3.0)))
        assert blocked.wait(5)
        began = time.monotonic()
        out = server.client().infer_sync({"x": torch.ones(4)})
        took = time.monotonic() - began
    assert torch.equal(out["y"], torch.full((4,), 2.0))
    assert took < 2.0, took  # not held for the loop's 3 s


def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    time.sleep(0.3)
    return double(inputs)


def test_a_deadline_fails_the_waiting_thread_once() -> None:
    entered = threading.Event()

    def slow_entered(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        return slow(inputs)

    server = fb.Server(slow_entered, inputs=[X], outputs=[Y], max_batch_size=1, max_delay=0)
    with server.run_in_background():
        client = server.client()
        holder = threading.Thread(target=client.infer_sync, args=({"x": torch.ones(4)},))
        holder.start()
        assert entered.wait(30)  # the holder's request runs: the next waits behind it
        with pytest.raises(fb.DeadlineExceededError, match=r"exceeded its 0\.05s timeout"):
            client.infer_sync({"x": torch.ones(4)}, timeout=0.05)
        holder.join()
        time.sleep(0.4)
        seen = outcomes(server)
        batches = server.stats()["batches"]
    assert seen["deadline_exceeded"] == 1 and seen["succeeded"] == 1
    assert batches == 1  # the expired request never ran


def poisoned(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((inputs["x"] < 0).any()):
        raise ValueError("negative input")
    return double(inputs)


def test_model_errors_reach_the_thread_as_model_error_and_fail_alone() -> None:
    server = fb.Server(poisoned, inputs=[X], outputs=[Y], max_batch_size=16, max_delay=0.01)
    with server.run_in_background():
        client = server.client()

        def call(i: int) -> str:
            try:
                client.infer_sync({"x": torch.full((4,), -1.0 if i == 3 else float(i))})
            except fb.ModelError as exc:
                assert isinstance(exc.__cause__, ValueError)
                return "model_error"
            return "ok"

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(8)))
        seen = outcomes(server)
    assert results == ["model_error" if i == 3 else "ok" for i in range(8)]
    assert seen["model_error"] == 1 and seen["succeeded"] == 7


def test_bad_inputs_and_a_stopped_server_raise_at_once_and_are_counted() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y])
    with server.run_in_background():
        client = server.client()
        with pytest.raises(fb.InvalidInputError, match="expected shape"):
            client.infer_sync({"x": torch.ones(3)})
        with pytest.raises(fb.InvalidInputError, match="timeout"):
            client.infer_sync({"x": torch.ones(4)}, timeout=-1)
    with pytest.raises(fb.ServerClosedError):
        client.infer_sync({"x": torch.ones(4)})
    seen = outcomes(server)
    assert seen["invalid_input"] == 2 and seen["server_closed"] == 1


def test_stopping_the_server_answers_waiting_threads() -> None:
    gate = threading.Event()

    def stuck(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        gate.wait(30)
        return double(inputs)

    server = fb.Server(stuck, inputs=[X], outputs=[Y], max_batch_size=1, max_delay=0)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            server.client().infer_sync({"x": torch.ones(4)})
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            errors.append(exc)

    with server.run_in_background(stop_timeout=0.2):
        threads = [threading.Thread(target=call) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # one in the model, two queued
    gate.set()
    for t in threads:
        t.join(10)
    assert len(errors) == 3 and all(isinstance(e, fb.ServerClosedError) for e in errors), errors
    seen = outcomes(server)
    assert seen["server_closed"] == 3


def test_ctrl_c_withdraws_the_waiting_request() -> None:
    gate, entered = threading.Event(), threading.Event()

    def held(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        entered.set()
        gate.wait(30)
        return double(inputs)

    # CPython runs a signal's handler at the main thread's next check, which
    # may fall in a finalizer run there (an object freed when the waiting
    # call takes the GIL back); an exception raised in one is printed and
    # dropped. So this handler raises only in the waiting call's own frame,
    # notes a press spent elsewhere, and such a press is repeated.
    spent_elsewhere: list[str] = []

    def on_ctrl_c(signum: int, frame: FrameType | None) -> None:
        if frame is not None and frame.f_code is fb.Client.infer_sync.__code__:
            raise KeyboardInterrupt
        spent_elsewhere.append(repr(frame))

    server = fb.Server(held, inputs=[X], outputs=[Y], max_batch_size=1, max_delay=0)
    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        with server.run_in_background():
            client = server.client()
            holder = threading.Thread(target=client.infer_sync, args=({"x": torch.ones(4)},))
            holder.start()
            assert entered.wait(10)

            def press_while_waiting() -> None:
                deadline = time.monotonic() + 10
                while server.stats()["queue_depth"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)  # until the call is queued behind the held batch
                for _ in range(5):
                    spent = len(spent_elsewhere)
                    _thread.interrupt_main()
                    time.sleep(1.0)
                    if len(spent_elsewhere) == spent:
                        return  # acted on where the call waits (or still to be)

            threading.Thread(target=press_while_waiting).start()
            with pytest.raises(KeyboardInterrupt):
                client.infer_sync({"x": torch.ones(4)})
            gate.set()
            holder.join()
            time.sleep(0.1)
            seen = outcomes(server)
            batches = server.stats()["batches"]
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen["cancelled"] == 1 and seen["succeeded"] == 1, spent_elsewhere
    assert batches == 1  # the withdrawn request never ran
