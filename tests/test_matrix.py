"""Every feature through every way in: fixed tensors, BYTES, variable-length
(padded and jagged), optional inputs, priority, parameters, the version
output, failure isolation, deadlines, the queue timeout and the response
cache, each sent in
process (asyncio, a blocked thread), over HTTP (JSON, binary) and gRPC to
the native and the Python front-ends, and through shared memory. A cell
that does not behave as in process fails here. (The Ray client, which needs
a Ray cluster, crosses the same features in tests/test_ray.py; a
shared-memory client in another process, in
tests/test_shared_memory.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import gevent_hub_freed, wait_until

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

LEVELS = 3


def _tag_len(request: fb.RequestInfo) -> int:
    return len(str(request.parameters.get("tag", "")))


def fixed(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    """y = 2x; per row its request's priority and the length of its "tag" parameter."""
    rows = [r for r in requests for _ in range(r.rows)]
    return {
        "y": batch["x"] * 2,
        "pri": torch.tensor([r.priority for r in rows], dtype=torch.int64),
        "tag_len": torch.tensor([_tag_len(r) for r in rows], dtype=torch.int64),
    }


def bytes_len(batch: dict[str, Any]) -> dict[str, Any]:
    return {"n": torch.tensor([len(row[0]) for row in batch["s"]], dtype=torch.int64)}


def padded_sum(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"total": batch["v"].sum(1)}  # the padding is zeros


def jagged_sum(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    offsets = batch["v_offsets"].tolist()
    values = batch["v"]
    return {"total": torch.stack([values[a:b].sum() for a, b in itertools.pairwise(offsets)])}


def optional_sum(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
    absent = [int("w" in r.absent) for r in requests for _ in range(r.rows)]
    return {"total": batch["x"].sum(1) + batch["w"].sum(1), "absent": torch.tensor(absent, dtype=torch.int64)}


def fragile(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if bool((batch["x"] < 0).any()):
        raise RuntimeError("negative input")
    return {"y": batch["x"] * 2}


def slow(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    time.sleep(SLOW_S)
    return {"y": batch["x"]}


SLOW_S = 0.4

#: The first input value of every row the "queued" model ran.
RAN: set[float] = set()


def slow_recording(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    RAN.update(batch["x"][:, 0].tolist())
    return slow(batch)


#: The first input value of every row the "cached" model ran.
CACHED_RAN: list[float] = []


def cached_model(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """y = 2x, a BYTES label and a padded output of x[1] copies of x[0]:
    every kind of output a response cache keeps."""
    x = batch["x"]
    CACHED_RAN.extend(x[:, 0].tolist())
    lengths = x[:, 1].long().clamp(0, 8)
    seq = torch.zeros(len(x), int(lengths.max()) if len(x) else 0)
    for i, n in enumerate(lengths.tolist()):
        seq[i, :n] = x[i, 0]
    label = np.array([[b"v%d" % int(v)] for v in x[:, 0].tolist()], dtype=object)
    return {"y": x * 2, "label": label, "seq": seq, "seq_lengths": lengths}


def servers() -> list[fb.Server]:
    f32 = "float32"
    return [
        fb.Server(
            fragile,
            inputs=[fb.TensorSpec("x", f32, (2,))],
            outputs=[fb.TensorSpec("y", f32, (2,))],
            name="fragile",
            max_delay=0.1,  # two concurrent requests share a batch
            isolate_failures=True,
        ),
        fb.Server(
            slow,
            inputs=[fb.TensorSpec("x", f32, (2,))],
            outputs=[fb.TensorSpec("y", f32, (2,))],
            name="slow",
            max_batch_size=1,  # a request behind a running one waits in the queue
        ),
        fb.Server(
            slow_recording,
            inputs=[fb.TensorSpec("x", f32, (2,))],
            outputs=[fb.TensorSpec("y", f32, (2,))],
            name="queued",
            max_batch_size=1,
            queue_timeout=SLOW_S / 4,
        ),
        fb.Server(
            fixed,
            inputs=[fb.TensorSpec("x", f32, (4,))],
            outputs=[
                fb.TensorSpec("y", f32, (4,)),
                fb.TensorSpec("pri", "int64", ()),
                fb.TensorSpec("tag_len", "int64", ()),
            ],
            name="fixed",
            with_requests=True,
            priority_levels=LEVELS,
            version_output="ver",
        ),
        fb.Server(
            bytes_len,
            inputs=[fb.TensorSpec("s", "bytes", (1,))],
            outputs=[fb.TensorSpec("n", "int64", ())],
            name="bytes",
        ),
        fb.Server(
            padded_sum,
            inputs=[fb.TensorSpec("v", f32, (-1,), ragged="pad")],
            outputs=[fb.TensorSpec("total", f32, ())],
            name="pad",
        ),
        fb.Server(
            jagged_sum,
            inputs=[fb.TensorSpec("v", f32, (-1,), ragged="jagged")],
            outputs=[fb.TensorSpec("total", f32, ())],
            name="jagged",
        ),
        fb.Server(
            optional_sum,
            inputs=[fb.TensorSpec("x", f32, (2,)), fb.TensorSpec("w", f32, (2,), optional=True)],
            outputs=[fb.TensorSpec("total", f32, ()), fb.TensorSpec("absent", "int64", ())],
            name="optional",
            with_requests=True,
        ),
        fb.Server(
            cached_model,
            inputs=[fb.TensorSpec("x", f32, (2,))],
            outputs=[
                fb.TensorSpec("y", f32, (2,)),
                fb.TensorSpec("label", "bytes", (1,)),
                fb.TensorSpec("seq", f32, (-1,), ragged="pad"),
            ],
            name="cached",
            version_output="ver",
            response_cache=1 << 20,
        ),
    ]


Send = Callable[..., dict[str, np.ndarray]]
"""``send(model, inputs, **options)``: one request of a batch of rows
(``inputs``: name -> numpy array with the batch dimension; ``options``:
``priority``, ``parameters`` and ``timeout`` as ``client.infer`` takes
them), its outputs as numpy arrays; a failure raises the way in's error."""


def _numpy(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in outputs.items()}


def _as_input(value: np.ndarray) -> Any:
    return value if value.dtype == object else torch.from_numpy(value)


def in_process(by_name: dict[str, fb.Server], loop: asyncio.AbstractEventLoop, blocking: bool) -> Send:
    def send(model: str, inputs: dict[str, np.ndarray], **options: Any) -> Any:
        client = by_name[model].client()
        given = {k: _as_input(v) for k, v in inputs.items()}
        if blocking:  # a plain thread's calls: one request per row (infer_sync takes one sample)
            n = len(next(iter(given.values())))
            outs = [_numpy(client.infer_sync({k: v[i] for k, v in given.items()}, **options)) for i in range(n)]
            return {k: np.stack([o[k] for o in outs]) for k in outs[0]}
        call = client.infer_batch(given, **options)
        return _numpy(asyncio.run_coroutine_threadsafe(call, loop).result(30))

    return send


def shared(by_name: dict[str, fb.Server], loop: asyncio.AbstractEventLoop) -> Send:
    """Each model shared (``server.share``) and called through ``fb.connect``."""
    clients = {name: fb.connect(server.share(f"matrix-{name}-{id(server)}").name) for name, server in by_name.items()}

    def send(model: str, inputs: dict[str, np.ndarray], **options: Any) -> Any:
        given = {k: _as_input(v) for k, v in inputs.items()}
        call = clients[model].infer_batch(given, **options)
        return _numpy(asyncio.run_coroutine_threadsafe(call, loop).result(30))

    return send


_V2 = {np.dtype("float32"): "FP32", np.dtype("int64"): "INT64", np.dtype(object): "BYTES"}


def remote(address: str, protocol: str) -> Send:
    lib: Any = grpcclient if protocol == "grpc" else httpclient
    binary = protocol == "binary"

    def send(model: str, inputs: dict[str, np.ndarray], **options: Any) -> Any:
        tensors = []
        for name, value in inputs.items():
            tensor = lib.InferInput(name, list(value.shape), _V2[value.dtype])
            if protocol == "grpc":
                tensor.set_data_from_numpy(value)
            else:
                tensor.set_data_from_numpy(value, binary_data=binary)
            tensors.append(tensor)
        timeout = options.get("timeout")
        # A client per call, closed on the calling thread (a pool's, at times), whose
        # gevent hub is then freed: tritonclient's HTTP client is not thread-safe, and runs gevent.
        with contextlib.nullcontext() if protocol == "grpc" else gevent_hub_freed():
            client = lib.InferenceServerClient(address)
            try:
                result = client.infer(
                    model,
                    tensors,
                    priority=options.get("priority") or 0,
                    parameters=options.get("parameters"),
                    timeout=None if timeout is None else int(timeout * 1e6),  # Triton's request `timeout`, in µs
                )
            finally:
                client.close()
        response = result.get_response()
        names = [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [
            o.name for o in response.outputs
        ]  # fmt: skip
        return {n: result.as_numpy(n) for n in names}

    return send


@pytest.fixture(scope="module")
def ways() -> Iterator[dict[str, Send]]:
    """Every way in, to the same models (two servings of them: native, Python)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    native_servers, python_servers = servers(), servers()
    native = ServeConfig(http_port=0, grpc_port=0, frontend="native", log_level="warning")
    python = ServeConfig(http_port=0, grpc_port=0, frontend="python", log_level="warning")
    with serve_in_thread(native_servers, native) as n, serve_in_thread(python_servers, python) as p:
        by_name = {s.name: s for s in native_servers}
        yield {
            "asyncio": in_process(by_name, loop, blocking=False),
            "thread": in_process(by_name, loop, blocking=True),
            "native-json": remote(f"127.0.0.1:{n.http_port}", "json"),
            "native-binary": remote(f"127.0.0.1:{n.http_port}", "binary"),
            "native-grpc": remote(f"127.0.0.1:{n.grpc_port}", "grpc"),
            "python-json": remote(f"127.0.0.1:{p.http_port}", "json"),
            "python-binary": remote(f"127.0.0.1:{p.http_port}", "binary"),
            "python-grpc": remote(f"127.0.0.1:{p.grpc_port}", "grpc"),
            "shared-memory": shared(by_name, loop),
        }
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


WAYS = [
    "asyncio",
    "thread",
    "native-json",
    "native-binary",
    "native-grpc",
    "python-json",
    "python-binary",
    "python-grpc",
    "shared-memory",
]


@pytest.mark.parametrize("way", WAYS)
def test_fixed_tensors_priority_parameters_and_the_version(ways: dict[str, Send], way: str) -> None:
    send = ways[way]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    plain = send("fixed", {"x": x})
    np.testing.assert_array_equal(plain["y"], x * 2)
    assert plain["pri"].tolist() == [LEVELS, LEVELS]  # no priority given: the lowest level
    assert plain["ver"].tolist() == [0, 0]
    urgent = send("fixed", {"x": x[:1]}, priority=1, parameters={"tag": "abcd"})
    assert urgent["pri"].tolist() == [1] and urgent["tag_len"].tolist() == [4]


@pytest.mark.parametrize("way", WAYS)
def test_bytes_and_variable_length_tensors(ways: dict[str, Send], way: str) -> None:
    send = ways[way]
    words = np.array([[b"a"], [b"abcdef"]], dtype=object)
    assert send("bytes", {"s": words})["n"].tolist() == [1, 6]
    values = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    assert send("pad", {"v": values})["total"].tolist() == [6, 15]
    assert send("jagged", {"v": values[:1]})["total"].tolist() == [6]


@pytest.mark.parametrize("way", WAYS)
def test_optional_inputs(ways: dict[str, Send], way: str) -> None:
    send = ways[way]
    x = np.ones((2, 2), dtype=np.float32)
    left_out = send("optional", {"x": x})
    assert left_out["total"].tolist() == [2, 2] and left_out["absent"].tolist() == [1, 1]
    given = send("optional", {"x": x, "w": x * 3})
    assert given["total"].tolist() == [8, 8] and given["absent"].tolist() == [0, 0]


@pytest.mark.parametrize("way", WAYS)
def test_a_failing_request_fails_alone(ways: dict[str, Send], way: str) -> None:
    """A bad request and a good one in one batch: only the bad one fails
    (failure isolation), with the way in's error, and the way in goes on."""
    send = ways[way]
    good, bad = np.ones((1, 2), dtype=np.float32), -np.ones((1, 2), dtype=np.float32)
    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(send, "fragile", {"x": bad})
        time.sleep(0.02)  # both within the batch's 100 ms window
        passing = pool.submit(send, "fragile", {"x": good})
        assert passing.result(30)["y"].tolist() == [[2, 2]]
        with pytest.raises(Exception) as info:  # each way in raises its own type
            failing.result(30)
    assert not isinstance(info.value, AssertionError)
    assert send("fragile", {"x": good})["y"].tolist() == [[2, 2]]


@pytest.mark.parametrize("way", WAYS)
def test_a_request_past_its_deadline_fails_and_the_next_is_served(ways: dict[str, Send], way: str) -> None:
    """A request queued behind a running one past its `timeout` fails with
    the way in's deadline error; a request without one is then served."""
    send = ways[way]
    x = np.ones((1, 2), dtype=np.float32)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(send, "slow", {"x": x})
        time.sleep(SLOW_S / 4)  # the first runs: the next waits in the queue
        started = time.monotonic()
        with pytest.raises(Exception) as info:  # each way in raises its own type
            send("slow", {"x": x}, timeout=0.05)
        waited = time.monotonic() - started
        assert running.result(30)["y"].tolist() == [[1, 1]]
    text = f"{type(info.value).__name__}: {info.value}".lower()
    assert "deadline" in text or "timeout" in text or "timed out" in text, text
    assert waited < SLOW_S, f"answered after {waited:.2f} s, not at its deadline"
    assert send("slow", {"x": x})["y"].tolist() == [[1, 1]]


@pytest.mark.parametrize("way", WAYS)
def test_a_request_past_the_queue_timeout_fails_never_run(ways: dict[str, Send], way: str) -> None:
    """Behind a running request, one that waits past the server's
    `queue_timeout` fails with the way in's deadline error when the
    instance is free, and never runs; a request taken in time runs on past
    it (the running one takes 4 times the queue timeout)."""
    send = ways[way]
    tag = 10.0 * (WAYS.index(way) + 1)
    first, stale = np.full((1, 2), tag, dtype=np.float32), np.full((1, 2), tag + 1, dtype=np.float32)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(send, "queued", {"x": first})
        assert wait_until(lambda: tag in RAN)  # the first runs: the next waits in the queue
        started = time.monotonic()
        with pytest.raises(Exception) as info:  # each way in raises its own type
            send("queued", {"x": stale})
        waited = time.monotonic() - started
        assert running.result(30)["y"].tolist() == [[tag, tag]]
    text = f"{type(info.value).__name__}: {info.value}".lower()
    assert "queue timeout" in text, text
    assert tag + 1 not in RAN and tag in RAN
    assert waited < 2 * SLOW_S, f"answered after {waited:.2f} s: it ran"
    assert send("queued", {"x": first})["y"].tolist() == [[tag, tag]]


@pytest.mark.parametrize("way", WAYS)
def test_a_request_with_cached_inputs_is_answered_without_running(ways: dict[str, Send], way: str) -> None:
    """Sent again, a request (one row, or several as one request) gets the
    same outputs, every kind (tensor, BYTES, variable-length, the version),
    and the model does not run; other inputs run."""
    send = ways[way]
    tag = 100.0 * (WAYS.index(way) + 1)
    one = np.array([[tag, 3]], dtype=np.float32)
    two = np.array([[tag + 1, 2], [tag + 2, 2]], dtype=np.float32)  # one length: a thread sends rows apart
    first = [send("cached", {"x": one}), send("cached", {"x": two})]
    ran = len(CACHED_RAN)
    again = [send("cached", {"x": one}), send("cached", {"x": two})]
    assert len(CACHED_RAN) == ran, f"the model ran again for {CACHED_RAN[ran:]}"
    for before, after in zip(first, again):
        assert sorted(before) == sorted(after) == ["label", "seq", "ver", "y"]
        for name in before:
            np.testing.assert_array_equal(after[name], before[name])
    assert again[0]["seq"].tolist() == [[tag] * 3] and again[0]["label"].tolist() == [[b"v%d" % tag]]
    np.testing.assert_array_equal(again[1]["y"], two * 2)
    send("cached", {"x": one + 0.5})  # other bytes: it runs
    assert CACHED_RAN[ran:] == [tag + 0.5]


def test_every_model_is_ready_with_its_batch_dimension_over_http_and_grpc() -> None:
    natives = servers()
    config = ServeConfig(http_port=0, grpc_port=0, frontend="native", log_level="warning")
    with serve_in_thread(natives, config) as served:
        with httpclient.InferenceServerClient(f"127.0.0.1:{served.http_port}") as h, \
                grpcclient.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as g:  # fmt: skip
            for s in natives:
                assert h.is_model_ready(s.name) and g.is_model_ready(s.name), s.name
                shapes = [i["shape"] for i in h.get_model_metadata(s.name)["inputs"]]
                assert all(shape[0] == -1 for shape in shapes), shapes
