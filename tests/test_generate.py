"""Triton's generate extension (``POST .../generate`` and ``.../generate_stream``)
on the native front-end, the Python one and the aiohttp app: a flat JSON
object in (keys naming inputs are inputs, the rest parameters), a flat one
out; a decoupled model's responses as Server-Sent Events, pulled as the
client reads them; a client that leaves ends its request; every request is
counted as its caller saw it."""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from test_http_hardening import app_in_thread

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

TEXT_IN = fb.TensorSpec("text_input", "bytes", (1,))
TEXT_OUT = fb.TensorSpec("text_output", "bytes", (1,))
EVENTS = "text/event-stream; charset=utf-8"


def shout(inputs: dict[str, Any]) -> dict[str, Any]:
    """``text_output``: the text upper-cased; ``budget``: twice ``max_tokens``."""
    texts = [t[0].upper() for t in inputs["text_input"]]
    return {"text_output": np.array([[t] for t in texts], dtype=object), "budget": inputs["max_tokens"] * 2}


def total(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens = inputs["tokens"]  # padded with 0
    return {"sum": tokens.sum(dim=1, keepdim=True), "ends": torch.stack([tokens[:, 0], tokens.max(dim=1).values], 1)}


def tagged(inputs: dict[str, Any], requests: list[fb.RequestInfo]) -> dict[str, Any]:
    """Each request's parameters, as JSON text."""
    said = [json.dumps(dict(r.parameters), sort_keys=True).encode() for r in requests for _ in range(r.rows)]
    return {"text_output": np.array([[s] for s in said], dtype=object)}


def words(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A decoupled model: one response per word; the word ``boom`` fails it."""
    for word in inputs["text_input"][0][0].split():
        if word == b"boom":
            raise RuntimeError("boom")
        yield {"text_output": np.array([[word]], dtype=object)}


class Endless:
    """A decoupled model that answers until it is closed, and says when."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def __call__(self, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            while True:
                time.sleep(0.002)
                yield {"text_output": np.array([[b"tick"]], dtype=object)}
        except GeneratorExit:
            self.closed.set()
            raise


class Served:
    def __init__(self, base: str, servers: dict[str, fb.Server], endless: Endless) -> None:
        self.base = base
        self.servers = servers
        self.endless = endless

    def url(self, model: str, what: str = "generate") -> str:
        return f"{self.base}/v2/models/{model}/{what}"

    def failed(self, model: str) -> dict[str, int]:
        return {k: v for k, v in self.servers[model].stats()["requests_failed"].items() if v}


@pytest.fixture(scope="module", params=["native", "python", "aiohttp"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    endless = Endless()
    servers = {
        "shout": fb.Server(
            shout,
            inputs=[TEXT_IN, fb.TensorSpec("max_tokens", "int32", (1,))],
            outputs=[TEXT_OUT, fb.TensorSpec("budget", "int32", (1,))],
            name="shout",
            max_delay=0.001,
        ),
        "total": fb.Server(
            total,
            inputs=[fb.TensorSpec("tokens", "int64", (-1,), ragged="pad")],
            outputs=[fb.TensorSpec("sum", "int64", (1,)), fb.TensorSpec("ends", "int64", (2,))],
            name="total",
        ),
        "tagged": fb.Server(tagged, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="tagged", with_requests=True),
        "words": fb.Server(words, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="words", decoupled=True),
        "endless": fb.Server(endless, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="endless", decoupled=True),
    }
    if request.param == "aiohttp":
        with app_in_thread("aiohttp", list(servers.values())) as base:
            yield Served(base, servers, endless)
        return
    config = ServeConfig(http_port=0, grpc_port=None, frontend=request.param, log_level="warning")
    with serve_in_thread(list(servers.values()), config) as listening:
        yield Served(f"http://127.0.0.1:{listening.http_port}", servers, endless)


def events(body: str) -> list[dict[str, Any]]:
    """The documents of a Server-Sent Events body."""
    assert body.endswith("\n\n"), body
    chunks = body[:-2].split("\n\n")
    assert all(c.startswith("data: ") for c in chunks), body
    return [json.loads(c.removeprefix("data: ")) for c in chunks]


def test_a_text_model_answers_a_generate_request(served: Served) -> None:
    before = served.servers["shout"].stats()["requests_succeeded"]
    request = {"id": "42", "text_input": "hello", "parameters": {"max_tokens": 5, "temperature": 0.5}}
    answer = httpx.post(served.url("shout"), json=request)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json() == {
        "id": "42",
        "model_name": "shout",
        "model_version": "1",
        "text_output": "HELLO",
        "budget": 10,
    }
    # Without an id, none is answered; an input may be a top-level key too.
    answer = httpx.post(served.url("shout"), json={"text_input": "a", "max_tokens": 1})
    assert answer.json() == {"model_name": "shout", "model_version": "1", "text_output": "A", "budget": 2}
    # The version, and a body coded gzip.
    coded = gzip.compress(json.dumps({"text_input": "b", "max_tokens": 2}).encode())
    answer = httpx.post(
        f"{served.base}/v2/models/shout/versions/1/generate", content=coded, headers={"content-encoding": "gzip"}
    )
    assert answer.json()["text_output"] == "B"
    assert served.servers["shout"].stats()["requests_succeeded"] == before + 3


def test_an_array_fills_a_variable_length_input_and_outputs_of_several_elements_are_arrays(served: Served) -> None:
    answer = httpx.post(served.url("total"), json={"tokens": [3, 9, 4]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"model_name": "total", "model_version": "1", "sum": 16, "ends": [3, 9]}
    answer = httpx.post(served.url("total"), json={"tokens": 5})  # a scalar: one element
    assert answer.json()["sum"] == 5


def test_keys_that_name_no_input_reach_the_model_as_parameters(served: Served) -> None:
    request = {"text_input": "x", "stream": False, "temperature": 0.25, "parameters": {"top_k": 3, "stop": "."}}
    answer = httpx.post(served.url("tagged"), json=request)
    assert answer.status_code == 200, answer.text
    said = json.loads(answer.json()["text_output"])
    assert said == {"stop": ".", "stream": False, "temperature": 0.25, "top_k": 3}


def test_a_model_that_is_not_decoupled_streams_its_one_answer(served: Served) -> None:
    answer = httpx.post(served.url("shout", "generate_stream"), json={"text_input": "hi", "max_tokens": 1})
    assert answer.status_code == 200 and answer.headers["content-type"] == EVENTS
    assert events(answer.text) == [{"model_name": "shout", "model_version": "1", "text_output": "HI", "budget": 2}]


def test_a_decoupled_model_streams_each_response_as_an_event(served: Served) -> None:
    before = served.servers["words"].stats()["requests_succeeded"]
    with httpx.stream("POST", served.url("words", "generate_stream"), json={"id": "s", "text_input": "a b c"}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == EVENTS
        body = "".join(r.iter_text())
    assert [e["text_output"] for e in events(body)] == ["a", "b", "c"]
    assert all(e["id"] == "s" and e["model_name"] == "words" for e in events(body))
    # No response at all: an empty stream.
    answer = httpx.post(served.url("words", "generate_stream"), json={"text_input": ""})
    assert answer.status_code == 200 and answer.text == ""
    assert served.servers["words"].stats()["requests_succeeded"] == before + 2


def test_a_stream_that_fails_after_its_first_response_ends_with_an_error_event(served: Served) -> None:
    failed = served.failed("words").get("model_error", 0)
    answer = httpx.post(served.url("words", "generate_stream"), json={"text_input": "a b boom c"})
    assert answer.status_code == 200
    sent = events(answer.text)
    assert [e.get("text_output") for e in sent[:2]] == ["a", "b"]
    assert len(sent) == 3 and "model 'words'" in sent[2]["error"] and "boom" not in sent[2]["error"]
    # Failing before its first response: a JSON error, with its status.
    answer = httpx.post(served.url("words", "generate_stream"), json={"text_input": "boom"})
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json"
    assert "model 'words'" in answer.json()["error"]
    assert served.failed("words")["model_error"] == failed + 2


def test_generate_takes_exactly_one_response_of_a_decoupled_model(served: Served) -> None:
    answer = httpx.post(served.url("words"), json={"text_input": "one"})
    assert answer.status_code == 200 and answer.json()["text_output"] == "one"
    invalid = served.failed("words").get("invalid_input", 0)
    for text in ("one two", ""):
        answer = httpx.post(served.url("words"), json={"text_input": text})
        assert answer.status_code == 400 and "exactly 1 response" in answer.json()["error"]
    # Counted as their callers saw them.
    assert served.failed("words")["invalid_input"] == invalid + 2


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"[1]", "a JSON object"),
        (b'{"text_input": "a", "max_tokens": 1, "id": 7}', "'id'"),
        (b'{"text_input": "a", "max_tokens": 1, "extra": [1]}', "parameter 'extra' has invalid type"),
        (b'{"text_input": "a", "max_tokens": 1, "extra": null}', "parameter 'extra' has invalid type"),
        (b'{"text_input": "a", "max_tokens": 1, "parameters": 3}', "Expected JSON object for keyword"),
        (b'{"text_input": "a", "parameters": {"text_input": "b"}}', "given more than once"),
        (b'{"text_input": ["a", ["b"]], "max_tokens": 1}', "a scalar or a flat array"),
        (b'{"text": "a"}', "names none of the model's inputs ('text_input', 'max_tokens')"),
        (b'{"text_input": "a"}', "max_tokens"),  # an input left out: the codec's words
        (b'{"text_input": 1, "max_tokens": 1}', "text_input"),  # not text
        (b'{"text_input": "a", "max_tokens": "many"}', "max_tokens"),
        (b'{"text_input": "a"', "JSON"),
    ],
)
def test_bad_generate_requests_are_400s_that_say_what_is_wrong(served: Served, body: bytes, words: str) -> None:
    answer = httpx.post(served.url("shout"), content=body)
    assert answer.status_code == 400, answer.text
    assert words in answer.json()["error"]


def test_shapes_that_cannot_hold_the_elements_are_refused(served: Served) -> None:
    answer = httpx.post(served.url("total"), json={"tokens": [[1, 2]]})
    assert answer.status_code == 400
    two = httpx.post(served.url("shout"), json={"text_input": ["a", "b"], "max_tokens": [1, 2]})
    assert two.status_code == 200  # two elements of a (1,) input: two batch rows, as Triton spreads them
    assert two.json()["text_output"] == ["A", "B"] and two.json()["budget"] == [2, 4]


def test_unknown_models_and_methods(served: Served) -> None:
    answer = httpx.post(served.url("nope"), json={"text_input": "a"})
    assert answer.status_code in (400, 404) and "nope" in answer.json()["error"]
    assert httpx.get(served.url("shout")).status_code == 405


def test_a_client_that_leaves_a_stream_stops_the_model_and_is_counted_cancelled(served: Served) -> None:
    endless = served.endless
    endless.closed.clear()
    cancelled = served.failed("endless").get("cancelled", 0)
    host, port = served.base.removeprefix("http://").split(":")
    body = json.dumps({"text_input": "go"}).encode()
    head = (
        f"POST /v2/models/endless/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        got = b""
        while got.count(b"tick") < 3:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        assert b"200" in got.split(b"\r\n", 1)[0] and b"text/event-stream" in got
    assert endless.closed.wait(10), "the model was not closed"
    deadline = time.monotonic() + 10
    while served.failed("endless").get("cancelled", 0) == cancelled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.failed("endless")["cancelled"] == cancelled + 1


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_the_inference_api_group_restricts_generate(frontend: str) -> None:
    server = fb.Server(words, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="words", decoupled=True)
    config = ServeConfig(
        http_port=0, grpc_port=None, frontend=frontend, log_level="warning", http_restricted_api=("inference:x-key=k",)
    )
    with serve_in_thread([server], config) as listening:
        base = f"http://127.0.0.1:{listening.http_port}/v2/models/words"
        for what in ("generate", "generate_stream"):
            refused = httpx.post(f"{base}/{what}", json={"text_input": "a"})
            assert refused.status_code == 403 and "x-key" in refused.json()["error"]
            answered = httpx.post(f"{base}/{what}", json={"text_input": "a"}, headers={"x-key": "k"})
            assert answered.status_code == 200, answered.text
    assert server.stats()["requests_succeeded"] == 2


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_stopping_the_server_ends_an_open_stream(frontend: str) -> None:
    endless = Endless()
    server = fb.Server(endless, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="endless", decoupled=True)
    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend, log_level="warning", graceful_timeout=1)
    read: list[bytes] = []
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/endless/generate_stream"

        def reader() -> None:
            with contextlib.suppress(httpx.HTTPError):
                with httpx.stream("POST", url, json={"text_input": "go"}, timeout=30) as answer:
                    for chunk in answer.iter_bytes():
                        read.append(chunk)

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not read and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read, "nothing was streamed"
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 15
    thread.join(15)
    assert not thread.is_alive(), "the stream did not end"
    assert endless.closed.wait(10), "the model was not closed"
    assert server.stats()["requests_succeeded"] == 0


@contextlib.contextmanager
def listening_on(frontend: str, servers: list[fb.Server], **options: Any) -> Iterator[int]:
    """The HTTP port of ``servers`` served by ``frontend``: ``ferrobatch serve``'s
    native or Python front-end, or the aiohttp app (``options``: ``ServeConfig``'s,
    or the app's)."""
    if frontend == "aiohttp":
        with app_in_thread("aiohttp", servers, **options) as base:
            yield int(base.rsplit(":", 1)[1])
        return
    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend, log_level="warning", **options)
    with serve_in_thread(servers, config) as listening:
        assert listening.http_port is not None
        yield listening.http_port


@pytest.mark.parametrize("frontend", ["native", "python", "aiohttp"])
def test_a_client_that_stops_reading_a_stream_costs_at_most_its_backlog(frontend: str) -> None:
    made: list[int] = []
    closed = threading.Event()

    def flood(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
        try:
            for step in range(1000):
                made.append(step)
                time.sleep(0.002)  # a reader that reads keeps up
                yield {"text_output": np.array([[b"x" * 65536]], dtype=object)}  # 64 KiB a response
        finally:
            closed.set()

    server = fb.Server(flood, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="flood", decoupled=True)
    with listening_on(frontend, [server], max_stream_backlog=1 << 20) as port:
        body = json.dumps({"text_input": "go"}).encode()
        head = (
            f"POST /v2/models/flood/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # before connecting: a small window
            sock.connect(("127.0.0.1", port))
            sock.sendall(head + body)  # and never read
            deadline = time.monotonic() + 30
            while not server.stats()["requests_failed"]["queue_full"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert closed.wait(10), "the model was not closed"
    assert len(made) < 1000, "the model stopped making what no one read"
    failed = {k: v for k, v in server.stats()["requests_failed"].items() if v}
    # Counted once. The Python front-ends count what the caller saw: the error had not reached
    # a handler still blocked writing to this client when it left, which is then a cancellation.
    assert failed == {"queue_full": 1} or (frontend != "native" and failed == {"cancelled": 1}), failed
    assert server.stats()["requests_succeeded"] == 0


def storm(inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Five responses for each prompt of the batch, its own text; a batch with
    a ``boom`` prompt fails after two."""
    texts = [t[0] for t in inputs["text_input"]]
    for step in range(5):
        if step == 2 and b"boom" in texts:
            raise RuntimeError("boom")
        time.sleep(0.001)
        yield {"text_output": np.array([[t] for t in texts], dtype=object)}


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_concurrent_streams_that_fail_or_are_left_are_each_counted_once(frontend: str) -> None:
    server = fb.Server(
        storm, inputs=[TEXT_IN], outputs=[TEXT_OUT], name="storm", decoupled=True, max_batch_size=8, max_delay=0.002
    )
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def caller(port: int, seed: int) -> None:
        rng = random.Random(seed)
        for n in range(12):
            text = "boom" if rng.random() < 0.1 else f"c{seed}-{n}"
            leave = rng.choice(["never", "never", "at once", "after one"])
            body = json.dumps({"text_input": text}).encode()
            head = (
                f"POST /v2/models/storm/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(head + body)
                if leave == "at once":
                    outcome = "left at once"
                else:
                    got = b""
                    while leave == "never" or b"data: " not in got:
                        chunk = sock.recv(65536)
                        if not chunk:
                            break
                        got += chunk
                    if leave == "after one":
                        outcome = "left after one"
                    elif b" 500 " in got.split(b"\r\n", 1)[0] or b'"error"' in got:
                        outcome = "model_error"
                    else:
                        assert got.count(f'"text_output":"{text}"'.encode()) == 5, got
                        outcome = "succeeded"
            with lock:
                seen[outcome] += 1

    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend, log_level="warning")
    with serve_in_thread([server], config) as listening:
        threads = [threading.Thread(target=caller, args=(listening.http_port, s)) for s in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        total = sum(seen.values())
        deadline = time.monotonic() + 20

        def counted() -> Counter[str]:
            stats = server.stats()
            return Counter({"succeeded": stats["requests_succeeded"], **stats["requests_failed"]}) + Counter()

        while sum(counted().values()) < total - seen["left at once"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # those that left at once and were read are counted by now
    final = counted()
    left = seen["left at once"] + seen["left after one"]
    # Each request is counted once: all that were answered, and at most those that left at once
    # (a connection closed before its request was read never reached the model).
    assert total - seen["left at once"] <= sum(final.values()) <= total == 16 * 12, (final, seen)
    assert set(final) <= {"succeeded", "model_error", "cancelled"}, final
    # What a caller that stayed saw is what was counted; one that left is any of the three.
    for outcome in ("succeeded", "model_error"):
        assert seen[outcome] <= final[outcome] <= seen[outcome] + left, (final, seen)
    assert final["cancelled"] <= left, (final, seen)
