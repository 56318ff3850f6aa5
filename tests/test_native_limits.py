"""The native front-end's bounds on what a client can hold: connections at
once, time for a request's headers and for its body. A client past a bound
is cut off; the others are served meanwhile."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
BODY = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
TIMEOUT = 0.5


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def serve(**limits: object) -> Iterator[int]:
    server = fb.Server(double, inputs=[X], outputs=[Y], name="m")
    config = ServeConfig(http_port=0, grpc_port=None, frontend="native", **limits)  # type: ignore[arg-type]
    with serve_in_thread([server], config) as listening:
        assert listening.http_port is not None
        yield listening.http_port


@pytest.fixture
def timed_port() -> Iterator[int]:
    yield from serve(header_timeout=TIMEOUT, body_timeout=TIMEOUT)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``sock`` within ``seconds``, and what it sent first."""
    sock.settimeout(seconds)
    received = b""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                return True, received
            received += chunk
    except (ConnectionResetError, BrokenPipeError):
        return True, received
    except TimeoutError:
        pass
    return False, received


def request(sock: socket.socket, path: str = "/v2/health/ready") -> bytes:
    """One keep-alive GET on ``sock``; the status line and headers."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {head!r}")
        head += chunk
    return head


def test_a_slowloris_client_is_cut_off_after_the_header_timeout_while_others_are_served(timed_port: int) -> None:
    base = f"http://127.0.0.1:{timed_port}"
    slow = connect(timed_port)
    silent = connect(timed_port)  # connects and never sends a byte
    began = time.monotonic()
    slow.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Le")
    # Meanwhile, another client is served.
    assert httpx.post(f"{base}/v2/models/m/infer", content=BODY).json()["outputs"][0]["data"] == [2, 4, 6, 8]
    for sock in (slow, silent):
        closed, _ = closed_within(sock, 10)
        assert closed
        sock.close()
    assert time.monotonic() - began >= TIMEOUT * 0.8
    assert httpx.get(f"{base}/v2/health/ready").status_code == 200


def test_a_body_that_stalls_gets_408_after_the_body_timeout(timed_port: int) -> None:
    sock = connect(timed_port)
    began = time.monotonic()
    sock.sendall(
        b"POST /v2/models/m/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10]
    )
    closed, received = closed_within(sock, 10)
    sock.close()
    assert closed, received
    assert received.startswith(b"HTTP/1.1 408"), received
    assert b"did not arrive in time" in received
    assert time.monotonic() - began >= TIMEOUT * 0.8
    with httpx.Client(base_url=f"http://127.0.0.1:{timed_port}") as client:
        assert client.post("/v2/models/m/infer", content=BODY).status_code == 200


def test_over_max_connections_a_new_connection_is_closed_at_once_and_the_others_go_on() -> None:
    for port in serve(max_connections=2):
        first, second = connect(port), connect(port)
        assert request(first).startswith(b"HTTP/1.1 200")
        assert request(second).startswith(b"HTTP/1.1 200")
        third = connect(port)  # the kernel accepts; the server closes it at once
        closed, received = closed_within(third, 5)
        assert closed and received == b""
        third.close()
        # The open ones keep working.
        assert request(first).startswith(b"HTTP/1.1 200")
        assert request(second).startswith(b"HTTP/1.1 200")
        # Once one closes, a new connection is served.
        first.close()
        deadline = time.monotonic() + 10
        while True:
            fourth = connect(port)
            try:
                assert request(fourth).startswith(b"HTTP/1.1 200")
                break
            except (ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                fourth.close()
        second.close()


def test_http2_connections_are_told_the_stream_limit() -> None:
    """``max_streams`` reaches clients as SETTINGS_MAX_CONCURRENT_STREAMS, so
    a well-behaved HTTP/2 client (gRPC) never opens more."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    for port in serve(max_streams=3):
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(conn.data_to_send())
            limit = None
            deadline = time.monotonic() + 5
            while limit is None and time.monotonic() < deadline:
                for event in conn.receive_data(sock.recv(65536)):
                    if isinstance(event, h2.events.RemoteSettingsChanged):
                        changed = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                        if changed is not None:
                            limit = changed.new_value
    assert limit == 3


@pytest.mark.parametrize("grace", [1e19, math.inf, math.nan, -1.0])
def test_any_grace_period_stops_the_front_end(grace: float) -> None:
    """A grace too long to represent means no end (it used to overflow an
    instant); NaN or a negative one means none. With nothing open, stop
    returns at once either way."""
    from ferrobatch._core import NativeFrontend

    def fallback(
        method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        return 404, [], b""

    frontend = NativeFrontend("127.0.0.1", 0, fallback)
    began = time.monotonic()
    frontend.stop(grace)
    assert time.monotonic() - began < 5
