"""HTTP/2 keepalive on both front-ends (``ServeConfig(keepalive_interval=,
keepalive_timeout=)``, Triton's ``grpc_keepalive_time`` / ``_timeout``): a
connection is pinged, and one whose client stops answering (a host that
vanished without closing) is closed once a ping goes unanswered for the
timeout, so its calls end. The native front-end's h2c port is also in
tests/test_native_limits.py."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import pytest
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, check_config, serve_in_thread
from ferrobatch.triton import TritonConfig
from ferrobatch.triton.triton import serve_config

pytestmark = pytest.mark.timeout(60)

X = fb.TensorSpec("x", "float32", (2,))
Y = fb.TensorSpec("y", "float32", (2,))


def _double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


@contextlib.contextmanager
def _grpc_port(frontend: str, **keepalive: float) -> Iterator[int]:
    server = fb.Server(_double, inputs=[X], outputs=[Y], name="m")
    config = ServeConfig(http_port=None, grpc_port=0, frontend=frontend, threads=1, idle_timeout=30, **keepalive)  # type: ignore[arg-type]
    with serve_in_thread([server], config) as listening:
        assert listening.grpc_port is not None
        yield listening.grpc_port


class Peer:
    """A raw HTTP/2 client on one connection: it sends its preface and
    acknowledges the server's settings, then answers pings only while
    ``answering``."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.answering = True
        self.pings = 0

    def run_until(self, seconds: float, *, ping: bool = False) -> bool:
        """Reads for up to ``seconds``: True once the server closed the
        connection (or, with ``ping``, once a ping arrived)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
            if not data:
                return True
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError:  # frames after its GOAWAY
                return True
            reply = self.conn.data_to_send()  # settings acks, ping answers
            if self.answering and reply:
                self.sock.sendall(reply)
            for event in events:
                if isinstance(event, h2.events.ConnectionTerminated):
                    return True
                if isinstance(event, h2.events.PingReceived):
                    self.pings += 1
                    if ping:
                        return True
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_client_that_answers_pings_is_pinged_and_kept(frontend: str) -> None:
    with _grpc_port(frontend, keepalive_interval=0.2) as port:
        peer = Peer(port)
        try:
            assert peer.run_until(10, ping=True), "no ping within 10 s at a 0.2 s interval"
            assert not peer.run_until(1.5), "a connection that answers its pings was closed"
            assert peer.pings >= 2
        finally:
            peer.close()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_a_client_that_stops_answering_is_closed_after_the_timeout(frontend: str) -> None:
    with _grpc_port(frontend, keepalive_interval=0.2, keepalive_timeout=2.0) as port:
        peer = Peer(port)
        try:
            assert peer.run_until(10, ping=True)
            peer.answering = False
            silent_since = time.monotonic()
            # Not before its timeout (closing at the interval would cut off a slow network)...
            assert not peer.run_until(1.0), "closed before keepalive_timeout"
            # ...and within it, and a little.
            assert peer.run_until(10), "a client that answers no ping was kept for 10 s"
            assert time.monotonic() - silent_since >= 1.0
        finally:
            peer.close()


def test_no_pings_with_an_interval_of_zero() -> None:
    with _grpc_port("native", keepalive_interval=0) as port:
        peer = Peer(port)
        try:
            assert not peer.run_until(1.5, ping=True)
            assert peer.pings == 0
        finally:
            peer.close()


def test_tritons_keepalive_settings_are_milliseconds_of_the_same() -> None:
    served = serve_config(
        TritonConfig(grpc_keepalive_time=500, grpc_keepalive_timeout=2000), expose_errors=False, frontend="native"
    )
    assert (served.keepalive_interval, served.keepalive_timeout) == (0.5, 2.0)
    default = serve_config(TritonConfig(), expose_errors=False, frontend="native")
    assert (default.keepalive_interval, default.keepalive_timeout) == (60.0, None)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "2"])
def test_a_timeout_that_is_no_positive_number_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="keepalive_timeout must be > 0"):
        check_config(ServeConfig(keepalive_timeout=bad))  # type: ignore[arg-type]


def test_an_embedded_grpc_server_pings_as_serve_does() -> None:
    """``ferrobatch.grpc.grpc_server`` owns the keepalive options: an app
    that runs its own grpc.aio server gets the same pings and timeout."""
    import asyncio
    import threading

    from ferrobatch.grpc import grpc_server

    model = fb.Server(_double, inputs=[X], outputs=[Y], name="m")
    started: list[tuple[asyncio.AbstractEventLoop, asyncio.Event, int]] = []
    ready = threading.Event()

    async def run() -> None:
        server = grpc_server([model], None, keepalive_interval=0.2, keepalive_timeout=1.0)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        done = asyncio.Event()
        started.append((asyncio.get_running_loop(), done, port))
        ready.set()
        await done.wait()
        await server.stop(None)

    thread = threading.Thread(target=asyncio.run, args=(run(),))
    thread.start()
    try:
        assert ready.wait(30)
        port = started[0][2]
        peer = Peer(port)
        try:
            assert peer.run_until(10, ping=True), "no ping at a 0.2 s interval"
            peer.answering = False
            assert peer.run_until(10), "a client that answers no ping was kept"
        finally:
            peer.close()
    finally:
        if started:
            started[0][0].call_soon_threadsafe(started[0][1].set)
        thread.join(30)
