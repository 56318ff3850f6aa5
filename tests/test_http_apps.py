"""The embedded v2 apps (``starlette_app``, ``aiohttp_app``) as parts of a
larger application: user middleware, lifespans that run again, apps sharing a
server, clients that leave, and the request rules they share with the native
front-end. Every socket is on 127.0.0.1; every app runs on a loop this file
starts and stops."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import socket
import struct
import threading
import time
from typing import Any

import httpx
import pytest
import torch
from test_http_hardening import GOOD, INFER, KINDS, X, Y, app_in_thread, double

import ferrobatch as fb
from ferrobatch.http import aiohttp_app, starlette_app


def make_server(model: Any = double) -> fb.Server:
    return fb.Server(model, inputs=[X], outputs=[Y], max_batch_size=8, name="double", max_delay=0)


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    fields = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + body


# -- user middleware ----------------------------------------------------------------------


async def test_user_middleware_guards_infer_too() -> None:
    from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    class RequireToken(BaseHTTPMiddleware):
        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            if request.headers.get("authorization") != "Bearer secret":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            return await call_next(request)

    server = make_server()
    app = starlette_app(server, manage_servers=False)
    app.add_middleware(RequireToken)
    transport = httpx.ASGITransport(app=app)
    async with server, httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        assert (await http.post(INFER, content=GOOD)).status_code == 401
        assert (await http.get("/v2/models/double")).status_code == 401
        allowed = await http.post(INFER, content=GOOD, headers={"authorization": "Bearer secret"})
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["outputs"][0]["data"] == [2, 4, 6, 8]


# -- lifespans and lazy starts ------------------------------------------------------------------


async def test_a_starlette_app_serves_again_when_its_lifespan_runs_again() -> None:
    server = make_server()
    app = starlette_app(server, manage_servers=False)
    transport = httpx.ASGITransport(app=app)
    async with server, httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for _ in range(2):  # as two TestClient sessions run it
            async with app.router.lifespan_context(app):
                assert (await http.get("/v2/health/ready")).status_code == 200
                response = await http.post(INFER, content=GOOD)
                assert response.status_code == 200, response.text


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")  # a newer starlette's advice
def test_an_app_that_starts_its_server_serves_again_in_a_second_test_client_session() -> None:
    """The default (manage_servers=True): each TestClient session, on an
    event loop of its own, starts the server in the app's lifespan and stops
    it at the end; the next session starts it again."""
    from starlette.testclient import TestClient

    server = make_server()
    app = starlette_app(server)
    for _ in range(3):
        with TestClient(app) as http:
            assert server.running
            assert http.get("/v2/health/ready").status_code == 200
            response = http.post(INFER, content=GOOD)
            assert response.status_code == 200, response.text
        assert not server.running
    assert server.stats()["requests_succeeded"] == 3


async def test_a_request_refused_because_the_app_closes_is_counted() -> None:
    server = make_server()
    app = starlette_app(server, manage_servers=False)
    transport = httpx.ASGITransport(app=app)
    async with server, httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        async with app.router.lifespan_context(app):
            assert (await http.post(INFER, content=GOOD)).status_code == 200
        # The app's lifespan ended (it closes); the server it embeds still runs.
        response = await http.post(INFER, content=GOOD)
        stats = server.stats()
    assert response.status_code == 503 and "shutting down" in response.json()["error"]
    assert stats["requests_succeeded"] == 1 and stats["requests_failed"]["server_closed"] == 1


@pytest.mark.parametrize("manage_servers", [False, True], ids=["started_by_the_user", "started_by_the_app"])
async def test_an_aiohttp_app_serves_again_when_its_runner_starts_again(manage_servers: bool) -> None:
    """A second AppRunner over the same app serves again: with
    manage_servers, each runner's lifespan starts the server and stops it."""
    from aiohttp import web

    server = make_server()
    app = aiohttp_app(server, manage_servers=manage_servers)
    async with contextlib.AsyncExitStack() as stack:
        if not manage_servers:
            await stack.enter_async_context(server)
        for _ in range(2):
            runner = web.AppRunner(app)
            await runner.setup()
            try:
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                url = f"http://127.0.0.1:{runner.addresses[0][1]}"
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    assert (await http.get("/v2/health/ready")).status_code == 200
                    response = await http.post(INFER, content=GOOD)
                    assert response.status_code == 200, response.text
            finally:
                await runner.cleanup()
            assert server.running is not manage_servers
    assert server.stats()["requests_succeeded"] == 2


def test_two_mounted_apps_sharing_a_server_wait_for_its_one_start() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    server = make_server()
    parent = Starlette(routes=[Mount("/a", starlette_app(server)), Mount("/b", starlette_app(server))])

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=parent)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = await asyncio.gather(http.post("/a" + INFER, content=GOOD), http.post("/b" + INFER, content=GOOD))
            assert [r.status_code for r in first] == [200, 200], [r.text for r in first]

    asyncio.run(scenario())
    assert not server.running  # stopped as asyncio.run closed the loop


# -- clients that leave ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_that_leaves_withdraws_its_queued_request(kind: str) -> None:
    """While the model runs one request, three more are sent and their
    clients leave: they are withdrawn (counted cancelled), never run."""
    rows: list[int] = []

    def slow(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rows.append(inputs["x"].shape[0])
        time.sleep(0.5)
        return double(inputs)

    server = make_server(slow)
    with app_in_thread(kind, [server]) as url, httpx.Client(base_url=url, timeout=30) as http:
        busy = threading.Thread(target=lambda: http.post(INFER, content=GOOD))
        busy.start()
        deadline = time.monotonic() + 10
        while not rows and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(3):
            with connect(url) as sock:
                sock.sendall(post(INFER, GOOD))
                time.sleep(0.05)  # the request is read and queued
        busy.join(30)
        deadline = time.monotonic() + 10
        while server.stats()["requests_failed"]["cancelled"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = server.stats()
    assert rows == [1]
    assert stats["requests_succeeded"] == 1
    assert stats["requests_failed"]["cancelled"] == 3


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_that_leaves_mid_body_is_no_error(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    with app_in_thread(kind, [make_server()]) as url:
        for _ in range(2):
            with connect(url) as sock:
                sock.sendall(post(INFER, GOOD)[:-20])
                time.sleep(0.05)
        time.sleep(0.3)
        assert httpx.post(url + INFER, content=GOOD, timeout=30).status_code == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# -- request rules shared with the native front-end -----------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_content_encoding_is_the_apps_to_undo(kind: str) -> None:
    """aiohttp inflates nothing itself: an unknown or odd coding is 400;
    gzip bodies work, for inference and the repository index alike."""
    with app_in_thread(kind, [make_server()]) as url, httpx.Client(base_url=url, timeout=30) as http:
        for coding in ["x-foo", "identity, identity"]:
            refused = http.post(INFER, content=GOOD, headers={"Content-Encoding": coding})
            assert refused.status_code == 400, refused.text
            assert "unsupported Content-Encoding" in refused.json()["error"]
        index = http.post("/v2/repository/index", content=gzip.compress(b"{}"), headers={"Content-Encoding": "gzip"})
        assert index.status_code == 200, index.text
        ok = http.post(INFER, content=gzip.compress(GOOD), headers={"Content-Encoding": "gzip"})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("kind", KINDS)
def test_a_repeated_inference_header_content_length_is_400(kind: str) -> None:
    header = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}]}
    ).encode()
    body = header + struct.pack("<4f", 1, 2, 3, 4)
    with app_in_thread(kind, [make_server()]) as url, httpx.Client(base_url=url, timeout=30) as http:
        twice = [("Inference-Header-Content-Length", str(len(header)))] * 2
        refused = http.post(INFER, content=body, headers=twice)
        assert refused.status_code == 400, refused.text
        assert "more than once" in refused.json()["error"]
        once = http.post(INFER, content=body, headers={"Inference-Header-Content-Length": str(len(header))})
        assert once.status_code == 200, once.text


@pytest.mark.parametrize("kind", KINDS)
def test_repository_index_bodies_over_the_limit_are_json_413(kind: str) -> None:
    body = b'{"ready": true' + b" " * 5000 + b"}"
    with app_in_thread(kind, [make_server()], max_body_size=1000) as url:
        declared = httpx.post(url + "/v2/repository/index", content=body, timeout=30)
        streamed = httpx.post(url + "/v2/repository/index", content=iter([body]), timeout=30)
        for response in (declared, streamed):
            assert response.status_code == 413, response.text
            assert "over the limit of 1000 bytes" in response.json()["error"]


@pytest.mark.parametrize("kind", KINDS)
def test_expect_100_continue_over_the_limit_gets_413_without_100(kind: str) -> None:
    with app_in_thread(kind, [make_server()], max_body_size=1000) as url, connect(url) as sock:
        head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
        sock.sendall(head.encode())
        reply = b""
        while b"}" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"over the limit of 1000 bytes" in reply
    with app_in_thread(kind, [make_server()], max_body_size=1000) as url, connect(url) as sock:
        # Within the limit: invited, then answered.
        head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(GOOD)}\r\nExpect: 100-continue\r\n\r\n"
        sock.sendall(head.encode())
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue"), "no invitation"
        sock.sendall(GOOD)
        reply = b""
        while b"}" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


@pytest.mark.parametrize("kind", KINDS)
def test_a_trailing_slash_is_404_not_a_redirect(kind: str) -> None:
    with app_in_thread(kind, [make_server()]) as url, httpx.Client(base_url=url, timeout=30) as http:
        for response in (http.post(INFER + "/", content=GOOD), http.get("/v2/health/ready/")):
            assert response.status_code == 404, response.text
            assert response.json() == {"error": "Not Found"}
