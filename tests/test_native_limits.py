"""The native front-end's bounds on what a client can hold: connections at
once, time for a request's headers and for its body. A client past a bound
is cut off; the others are served meanwhile."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
BODY = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
TIMEOUT = 0.5
#: Connections beyond max_connections that answer health checks (ferrobatch-serve's HEADROOM).
HEADROOM = 4


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


def test_over_max_connections_only_health_checks_are_answered_then_new_connections_are_closed() -> None:
    for port in serve(max_connections=2):
        first, second = connect(port), connect(port)
        assert request(first).startswith(b"HTTP/1.1 200")
        assert request(second).startswith(b"HTTP/1.1 200")
        # The headroom: connections beyond the limit that answer health checks only.
        spare = [connect(port) for _ in range(HEADROOM)]
        time.sleep(0.2)
        beyond = connect(port)  # the kernel accepts; the server closes it at once
        closed, received = closed_within(beyond, 5)
        assert closed and received == b""
        beyond.close()
        assert request(spare[0], "/v2/health/live").startswith(b"HTTP/1.1 200")
        assert closed_within(spare[0], 5)[0]  # one probe per connection
        assert request(spare[1], "/v2/models/m/ready").startswith(b"HTTP/1.1 503")
        for sock in spare:
            sock.close()
        # The open ones keep working.
        assert request(first).startswith(b"HTTP/1.1 200")
        assert request(second).startswith(b"HTTP/1.1 200")
        # Once one closes, a new connection is served.
        first.close()
        deadline = time.monotonic() + 10
        while True:
            fourth = connect(port)
            try:
                assert request(fourth, "/v2/models/m/ready").startswith(b"HTTP/1.1 200")
                break
            except (AssertionError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                fourth.close()
        second.close()


def h2_preface() -> bytes:
    """An HTTP/2 client's first bytes: the preface and its SETTINGS."""
    import h2.config
    import h2.connection

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    return conn.data_to_send()


def test_idle_h2_connection_is_closed_after_header_timeout() -> None:
    """Clients that send the HTTP/2 preface and nothing more are cut off
    after the header timeout; while they hold every slot, health checks
    still answer (the headroom), and once they are gone others are served."""
    for port in serve(max_connections=4, header_timeout=TIMEOUT, keepalive_interval=0):
        began = time.monotonic()
        idle = [connect(port) for _ in range(4)]
        for sock in idle:
            sock.sendall(h2_preface())
        time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/v2/health/live", timeout=5).status_code == 200
        for sock in idle:
            closed, _ = closed_within(sock, 10)
            assert closed
            sock.close()
        assert time.monotonic() - began >= TIMEOUT * 0.8
        assert httpx.post(f"{base}/v2/models/m/infer", content=BODY, timeout=5).status_code == 200


def h2_exchange(sock: socket.socket, seconds: float, until: type) -> list[object]:
    """HTTP/2 events read from ``sock`` until one of type ``until`` (or the
    connection closes, or ``seconds`` pass), after one GET of
    /v2/health/live."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(
        1, [(":method", "GET"), (":path", "/v2/health/live"), (":scheme", "http"), (":authority", "t")], end_stream=True
    )
    sock.sendall(conn.data_to_send())
    events: list[object] = []
    deadline = time.monotonic() + seconds
    sock.settimeout(seconds)
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while time.monotonic() < deadline and not any(isinstance(e, until) for e in events):
            data = sock.recv(65536)
            if not data:
                break
            try:
                events.extend(conn.receive_data(data))
            except h2.exceptions.ProtocolError:  # frames after GOAWAY
                events.append(h2.events.ConnectionTerminated())
                break
            sock.sendall(conn.data_to_send())  # acks, ping answers
    return events


def test_a_connection_with_nothing_in_flight_is_closed_after_the_idle_timeout() -> None:
    import h2.events

    for port in serve(idle_timeout=TIMEOUT, header_timeout=10, keepalive_interval=0):
        with connect(port) as sock:
            began = time.monotonic()
            events = h2_exchange(sock, 10, h2.events.ConnectionTerminated)
            assert any(isinstance(e, h2.events.ResponseReceived) for e in events)
            assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events)  # GOAWAY
            assert TIMEOUT * 0.8 <= time.monotonic() - began < 8
        with connect(port) as sock:  # HTTP/1 keep-alive too
            assert request(sock).startswith(b"HTTP/1.1 200")
            assert closed_within(sock, 8)[0]


def test_http2_connections_are_pinged_while_idle() -> None:
    import h2.events

    for port in serve(keepalive_interval=0.2, header_timeout=10, idle_timeout=10):
        with connect(port) as sock:
            events = h2_exchange(sock, 5, h2.events.PingReceived)
        assert any(isinstance(e, h2.events.PingReceived) for e in events)


def test_out_of_file_descriptors_the_accept_loop_backs_off_and_says_so_once(tmp_path: Path) -> None:
    """Under a low open-files limit with more clients than descriptors, the
    server neither spins (CPU) nor logs per attempt; connections it holds
    are still served, and once clients go, new ones are accepted again."""
    limit = 128

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrobatch", "serve", "--demo", "--http-port", "0", "--no-grpc"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=low_limit,
    )
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    held: list[socket.socket] = []
    seen: list[str] = []  # the server's output, for a failure's message
    try:
        port = None
        deadline = time.monotonic() + 90
        while port is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"serve did not report its port: {''.join(seen)}") from None
            seen.append(line)
            found = re.search(r"HTTP http://[\d.]+:(\d+)", line)
            port = int(found.group(1)) if found else None
            assert proc.poll() is None or not lines.empty(), f"serve exited ({proc.poll()}): {''.join(seen)}"
        keep = connect(port)
        assert request(keep).startswith(b"HTTP/1.1 200")
        for _ in range(limit + 30):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)
        before = cpu_seconds(proc.pid)
        time.sleep(1.0)
        spent = cpu_seconds(proc.pid) - before
        assert spent < 0.3, f"the server spent {spent:.2f} s of CPU in 1 s, accepting nothing"
        assert request(keep).startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()
        held.clear()
        with httpx.Client(timeout=5) as client:
            deadline = time.monotonic() + 10
            while client.get(f"http://127.0.0.1:{port}/v2/health/live").status_code != 200:
                assert time.monotonic() < deadline
        keep.close()
        assert proc.poll() is None, "serve exited"
        proc.terminate()
        proc.wait(30)
        log = "".join(iter(lambda: lines.get(timeout=1) if not lines.empty() else "", ""))
        assert log.count("cannot accept connections") == 1, log
    finally:
        for sock in held:
            sock.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid``, every thread, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    from ferrobatch._core import FallbackAnswer, NativeFrontend

    def fallback(method: str, path: str, headers: list[tuple[str, str]], body: bytes, answer: FallbackAnswer) -> None:
        answer((404, [], b""))

    frontend = NativeFrontend("127.0.0.1", 0, fallback)
    began = time.monotonic()
    frontend.stop(grace)
    assert time.monotonic() - began < 5
