"""The v2 REST apps against what an attacker or a careless client sends, and at
the edges of their lifecycle: body and decompression limits, malformed JSON,
model errors that must not leak, draining, and a Starlette app mounted in
another. Every app runs on 127.0.0.1 under uvicorn (Starlette) or aiohttp."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import re
import resource
import socket
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

import ferrobatch as fb
from ferrobatch.http import aiohttp_app, starlette_app
from ferrobatch.http.protocol import MAX_BODY_SIZE, MAX_DECOMPRESSED_SIZE, ModelRepository
from ferrobatch.serve import ServeConfig, serve_in_thread

WIDTH = 4
X = fb.TensorSpec("x", "float32", (WIDTH,))
Y = fb.TensorSpec("y", "float32", (WIDTH,))
GOOD = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
INFER = "/v2/models/double/infer"
KINDS = ["starlette", "aiohttp"]


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def leaky(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    raise FileNotFoundError(2, "No such file or directory", "/srv/secret/weights.pt")


def make_servers() -> list[fb.Server]:
    return [
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=8, name="double"),
        fb.Server(leaky, inputs=[X], outputs=[Y], name="leaky"),
    ]


@contextlib.contextmanager
def app_in_thread(kind: str, servers: Any, **options: Any) -> Iterator[str]:
    """The ``kind`` app for ``servers`` (a list or a ModelRepository) on its own
    loop and thread, its lifespan run; yields its base URL."""
    import uvicorn
    from aiohttp import web

    ready = threading.Event()
    stop: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    port: list[int] = []

    async def main() -> None:
        done = asyncio.Event()
        stop.append((asyncio.get_running_loop(), done))
        if kind == "starlette":
            config = uvicorn.Config(starlette_app(servers, **options), host="127.0.0.1", port=0, log_level="warning")
            server = uvicorn.Server(config)
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            port.append(server.servers[0].sockets[0].getsockname()[1])
            ready.set()
            await done.wait()
            server.should_exit = True
            await task
        else:
            runner = web.AppRunner(aiohttp_app(servers, **options))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port.append(runner.addresses[0][1])
            ready.set()
            await done.wait()
            await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the app did not start"
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop, done = stop[0]
        loop.call_soon_threadsafe(done.set)
        thread.join(30)


def raw_exchange(url: str, request: bytes, seconds: float = 10) -> bytes:
    """Sends ``request`` as is and returns the one response that comes back
    (its head and its ``Content-Length`` bytes of body), or what came before
    the server closed the connection or ``seconds`` passed. Not read until
    the connection closes: after refusing a body, aiohttp lingers (reads and
    discards what the client may still send) for its ``lingering_time``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=seconds) as sock:
        sock.sendall(request)
        received = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
                head, blank, body = received.partition(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
                if blank and length and len(body) >= int(length.group(1)):
                    break
    return received


# -- 12: body and decompression limits ------------------------------------------------------


def test_the_limits_have_one_default_everywhere() -> None:
    import inspect

    from ferrobatch.grpc import MAX_MESSAGE_SIZE

    for factory in (starlette_app, aiohttp_app):
        params = inspect.signature(factory).parameters
        assert params["max_body_size"].default == MAX_BODY_SIZE
        assert params["max_decompressed_size"].default == MAX_DECOMPRESSED_SIZE
    assert ServeConfig().max_body_size == MAX_BODY_SIZE == MAX_MESSAGE_SIZE
    assert ServeConfig().max_decompressed_size == MAX_DECOMPRESSED_SIZE


@pytest.mark.parametrize("kind", KINDS)
def test_a_declared_body_over_the_limit_is_413_before_it_is_sent(kind: str) -> None:
    with app_in_thread(kind, make_servers(), max_body_size=1024) as url:
        # Headers only: the 413 must come without waiting for the 1 GB body.
        head = (
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {10**9}\r\n\r\n"
        ).encode()
        reply = raw_exchange(url, head)
        status, _, rest = reply.partition(b"\r\n")
        assert b" 413 " in status, reply[:500]
        assert b"connection: close" in rest.lower()
        assert b"over the limit of 1024 bytes" in rest
        with httpx.Client(base_url=url) as http:  # the app serves on
            assert http.post(INFER, content=GOOD).status_code == 200


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_body_over_the_limit_is_413(kind: str) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        yield GOOD[:-2]
        yield b" " * 4096
        yield GOOD[-2:]

    with app_in_thread(kind, make_servers(), max_body_size=1024) as url:
        response = httpx.post(url + INFER, content=chunks(), timeout=30)
        assert response.status_code == 413, response.text
        assert "over the limit of 1024 bytes" in response.json()["error"]
        # Under the limit, a chunked body is served.
        assert httpx.post(url + INFER, content=iter([GOOD]), timeout=30).status_code == 200


def bomb(size: int, encoding: str) -> bytes:
    """``size`` zero bytes, compressed (about a thousandth of that)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    zeros = bytes(1 << 20)
    parts = [compressor.compress(zeros) for _ in range(size >> 20)]
    return b"".join([*parts, compressor.flush()])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_body_that_expands_past_the_limit_is_413(kind: str, encoding: str) -> None:
    body = bomb(8 << 20, encoding)
    with app_in_thread(kind, make_servers(), max_decompressed_size=1 << 20) as url:
        response = httpx.post(url + INFER, content=body, headers={"Content-Encoding": encoding}, timeout=30)
        assert response.status_code == 413, response.text
        assert str(1 << 20) in response.json()["error"]
        compressed = gzip.compress(GOOD) if encoding == "gzip" else zlib.compress(GOOD)
        ok = httpx.post(url + INFER, content=compressed, headers={"Content-Encoding": encoding})
        assert ok.status_code == 200, ok.text


def test_a_gzip_bomb_is_refused_without_inflating_it() -> None:
    """1 GiB of zeros in 1 MiB of gzip, at the default limits: refused once
    64 MiB have come out, and the process never holds the gigabyte."""
    body = bomb(1 << 30, "gzip")
    with app_in_thread("starlette", make_servers()) as url:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        response = httpx.post(url + INFER, content=body, headers={"Content-Encoding": "gzip"}, timeout=60)
        grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert response.status_code == 413, response.text
        assert grown_mib < 512, f"peak RSS grew by {grown_mib:.0f} MiB"


@pytest.mark.parametrize("kind", KINDS)
def test_bad_encodings_are_400(kind: str) -> None:
    with app_in_thread(kind, make_servers()) as url, httpx.Client(base_url=url) as http:
        for encoding, body in [
            ("gzip", b"not gzip at all"),
            ("gzip", gzip.compress(GOOD)[:-12]),  # truncated
            ("deflate", b"x\x9c not deflate"),
        ]:
            response = http.post(INFER, content=body, headers={"Content-Encoding": encoding})
            assert response.status_code == 400, (encoding, response.text)
            assert "error" in response.json()


# -- 13: malformed requests are 400 ---------------------------------------------------------


def with_input(**fields: Any) -> bytes:
    entry = {"name": "x", "datatype": "FP32", "shape": [1, WIDTH], "data": [1, 2, 3, 4]}
    entry.update(fields)
    return json.dumps({"inputs": [entry]}).encode()


MALFORMED: list[tuple[bytes, str]] = [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
    (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deep"),
    (with_input(datatype=["FP32"]), "'datatype' must be a string"),
    (with_input(datatype={"FP32": 1}), "'datatype' must be a string"),
    (with_input(name=["x"]), "non-empty 'name'"),
    (with_input(shape="1,4"), "'shape'"),
    (with_input(shape=[[1], 4]), "'shape'"),
    (with_input(data="1234"), "'data' must be a JSON array"),
    (with_input(data={"a": 1}), "'data' must be a JSON array"),
    (with_input(data=[{"a": 1}, 2, 3, 4]), "not valid FP32"),
    (with_input(parameters=[1]), "'parameters'"),
    (with_input(parameters={"binary_data_size": "8"}), "binary_data_size"),
    (json.dumps({"id": 7, "inputs": [json.loads(with_input())["inputs"][0]]}).encode(), "'id'"),
    (json.dumps({"inputs": json.loads(with_input())["inputs"], "outputs": [{"name": ["y"]}]}).encode(), "'outputs'"),
    (json.dumps({"inputs": json.loads(with_input())["inputs"], "outputs": ["y"]}).encode(), "'outputs'"),
    (json.dumps({"inputs": json.loads(with_input())["inputs"], "parameters": {"timeout": "x"}}).encode(), "timeout"),
    (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, NaN]}], "id": {}}', "'id'"),
]


@pytest.mark.parametrize("kind", KINDS)
def test_malformed_requests_are_400_with_a_clear_message(kind: str) -> None:
    with app_in_thread(kind, make_servers()) as url, httpx.Client(base_url=url, timeout=30) as http:
        for body, message in MALFORMED:
            response = http.post(INFER, content=body)
            assert response.status_code == 400, (body[:80], response.text[:300])
            assert message in response.json()["error"], (body[:80], response.text[:300])
        assert http.post(INFER, content=GOOD).status_code == 200


def nested(levels: int) -> bytes:
    """A repository index request (``{"ready": true}``) whose extra member
    takes its nesting to ``levels`` levels."""
    return b'{"ready": true, "deep": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frontend", ["python", "native"])
def test_json_nested_past_the_codecs_limit_is_400_on_every_route(frontend: str) -> None:
    config = ServeConfig(http_port=0, grpc_port=None, frontend=frontend)
    with (
        serve_in_thread(make_servers(), config) as listening,
        httpx.Client(base_url=f"http://127.0.0.1:{listening.http_port}", timeout=30) as http,
    ):
        index = "/v2/repository/index"
        at_limit = http.post(index, content=nested(128))  # the v2 codec's limit, exactly
        assert at_limit.status_code == 200, at_limit.text
        assert [m["name"] for m in at_limit.json()] == ["double", "leaky"]
        for route in (index, INFER):
            for body in (nested(129), b"[" * 100_000 + b"]" * 100_000):
                response = http.post(route, content=body)
                assert response.status_code == 400, (frontend, route, len(body), response.text[:300])
                assert "nested too deep" in response.json()["error"], (frontend, route, response.text[:300])
        assert http.post(INFER, content=GOOD).status_code == 200


@pytest.mark.parametrize("kind", KINDS)
def test_huge_and_infinite_timeouts_mean_no_deadline(kind: str) -> None:
    with app_in_thread(kind, make_servers()) as url, httpx.Client(base_url=url, timeout=30) as http:
        for timeout in ["1e25", "Infinity", "1e300"]:
            body = GOOD[:-1] + b', "parameters": {"timeout": ' + timeout.encode() + b"}}"
            response = http.post(INFER, content=body)
            assert response.status_code == 200, (timeout, response.text)


# -- 14: what a model's failure tells a remote client ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_exception_reaches_the_client_as_its_type_and_a_request_id(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="ferrobatch")
    with app_in_thread(kind, make_servers()) as url:
        response = httpx.post(url + "/v2/models/leaky/infer", content=GOOD, timeout=30)
    assert response.status_code == 500
    error = response.json()["error"]
    assert "/srv/secret" not in error and "No such file" not in error
    assert "FileNotFoundError" in error
    found = re.search(r"request id ([0-9a-f]+)", error)
    assert found, error
    # The log has the whole story under that id, traceback included.
    records = [r for r in caplog.records if found.group(1) in r.getMessage()]
    assert records, caplog.text
    assert records[0].exc_info is not None
    assert "/srv/secret/weights.pt" in caplog.text and "Traceback" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_expose_errors_sends_the_model_exception_text(kind: str) -> None:
    with app_in_thread(kind, make_servers(), expose_errors=True) as url:
        response = httpx.post(url + "/v2/models/leaky/infer", content=GOOD, timeout=30)
    assert response.status_code == 500
    assert "/srv/secret/weights.pt" in response.json()["error"]


def test_serve_sends_no_server_header() -> None:
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    with serve_in_thread(make_servers(), config) as listening:
        response = httpx.get(f"http://127.0.0.1:{listening.http_port}/v2/health/live")
    assert response.status_code == 200
    assert "server" not in response.headers


# -- 15: draining ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_replies_while_shutting_down_close_the_connection(kind: str) -> None:
    servers = make_servers()
    repository = ModelRepository(servers)
    with app_in_thread(kind, repository) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.post(INFER, content=GOOD).headers.get("connection") != "close"
        repository.close()  # what a shutdown does first
        refused = http.post(INFER, content=GOOD)
        assert refused.status_code == 503
        assert refused.headers["connection"] == "close"
        assert "shutting down" in refused.json()["error"]
        ready = http.get("/v2/health/ready")
        assert ready.status_code == 503
        assert ready.headers["connection"] == "close"


# -- 18: mounted in another Starlette app ---------------------------------------------------


def test_a_mounted_app_starts_its_servers_on_first_use_and_stops_them_with_the_loop() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    server = fb.Server(double, inputs=[X], outputs=[Y], name="double")
    parent = Starlette(routes=[Mount("/triton", starlette_app(server))])  # manage_servers=True

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=parent)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post("/triton" + INFER, content=GOOD)
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
            assert server.running
            assert (await http.get("/triton/v2/health/ready")).status_code == 200

    asyncio.run(scenario())
    assert not server.running  # stopped as asyncio.run closed the loop


# -- every front-end alike: native, Starlette (with grpcio), aiohttp ------------------------

FRONT_ENDS = ["native", "python", "aiohttp"]


@contextlib.contextmanager
def front_end(kind: str, servers: list[fb.Server]) -> Iterator[tuple[str, int | None]]:
    """``servers`` behind the ``kind`` front-end: its base URL and gRPC port (None for aiohttp)."""
    if kind == "aiohttp":
        with app_in_thread(kind, servers) as url:
            yield url, None
        return
    config = ServeConfig(http_port=0, grpc_port=0, frontend=kind, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield f"http://127.0.0.1:{listening.http_port}", listening.grpc_port


@pytest.mark.parametrize("kind", FRONT_ENDS)
def test_what_each_front_end_read_its_own_way_is_answered_alike(kind: str) -> None:
    """Two Content-Encoding headers: 400 (each front-end read another one);
    ``versions//infer`` names no version: 404 (natively it was the path
    without one); a gzip repository index request is inflated."""
    with front_end(kind, make_servers()) as (url, _), httpx.Client(base_url=url, timeout=30) as http:
        twice = http.post(INFER, content=GOOD, headers=[("Content-Encoding", "identity"), ("Content-Encoding", "gzip")])
        assert twice.status_code == 400 and "Content-Encoding is given more than once" in twice.text, twice.text
        assert http.post("/v2/models/double/versions//infer", content=GOOD).status_code == 404
        assert http.post("/v2/models/double/versions/1/infer", content=GOOD).status_code == 200
        index = http.post(
            "/v2/repository/index", content=gzip.compress(b'{"ready": true}'), headers={"Content-Encoding": "gzip"}
        )
        assert index.status_code == 200, index.text
        assert {m["name"] for m in index.json()} == {"double", "leaky"}
        bad = http.post("/v2/repository/index", content=b"{}", headers={"Content-Encoding": "br"})
        assert bad.status_code == 400, bad.text


# -- shapes with no elements whose dimensions are huge --------------------------------------

NO_ELEMENTS_HUGE = [
    [2**62, 0, WIDTH],  # the strides of the dimensions after the 0 overflow
    [0, 2**62, 2**62],
    [2**63 + 1, 0],  # past what a dimension may be at all
]


@pytest.mark.parametrize("kind", FRONT_ENDS)
def test_a_shape_with_no_elements_and_huge_dimensions_is_400_and_counted(kind: str) -> None:
    """As the native front-end answers it: 400 (gRPC INVALID_ARGUMENT),
    counted as invalid input once checked against the model (a dimension
    past 2**63 fails decoding, as malformed JSON does: uncounted on the
    Python front-ends); the Python front-ends answered 500, counting nothing."""
    import grpc

    from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
    from ferrobatch.grpc import grpc_predict_v2_pb2_grpc as pb_grpc

    checked = [shape for shape in NO_ELEMENTS_HUGE if max(shape) < 2**63]  # the proto's dimensions are int64
    servers = make_servers()
    with contextlib.ExitStack() as stack:
        url, grpc_port = stack.enter_context(front_end(kind, servers))
        http = stack.enter_context(httpx.Client(base_url=url, timeout=30))
        for shape in NO_ELEMENTS_HUGE:
            body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape, "data": []}]}
            response = http.post(INFER, json=body)
            assert response.status_code == 400, (shape, response.text)
        counted = len(checked)
        if grpc_port is not None:
            channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            for shape in checked:
                request = pb.ModelInferRequest(model_name="double", raw_input_contents=[b""])
                request.inputs.add(name="x", datatype="FP32", shape=shape)
                with pytest.raises(grpc.RpcError) as info:
                    stub.ModelInfer(request, timeout=30)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (shape, info.value.details())
            counted += len(checked)
        assert http.post(INFER, content=GOOD).status_code == 200
        stats = servers[0].stats()
    assert stats["requests_failed"]["invalid_input"] >= counted and stats["requests_succeeded"] == 1, stats
    assert stats["requests_failed"]["model_error"] == 0, stats
