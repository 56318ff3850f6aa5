"""GET /metrics on a port of its own (Triton's --metrics-port, 8002 there)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import logging
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import pytest
from test_http import X, Y, double

import ferrobatch as fb
import ferrobatch.metrics as fb_metrics
from ferrobatch.metrics import MetricsListener, registry
from ferrobatch.serve import ServeConfig, StartupError, add_arguments, serve_in_thread
from ferrobatch.triton import Tensor, Triton, TritonConfig, batch
from ferrobatch.triton import triton as triton_module


@contextlib.contextmanager
def served(frontend: str, **kwargs: object) -> Iterator[tuple[int, int]]:
    """(HTTP port, metrics port) of a server of "m" (doubling) while inside."""
    server = fb.Server(double, inputs=[X], outputs=[Y], name="m")
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning", frontend=frontend, **kwargs)  # type: ignore[arg-type]
    with serve_in_thread([server], config) as listening:
        assert listening.metrics_port is not None
        yield listening.http_port or 0, listening.metrics_port


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_the_metrics_port_answers_get_metrics_and_nothing_else(frontend: str) -> None:
    with served(frontend, metrics_port=0) as (http_port, port):
        httpx.post(
            f"http://127.0.0.1:{http_port}/v2/models/m/infer",
            json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]},
        ).raise_for_status()
        base = f"http://127.0.0.1:{port}"
        scrape = httpx.get(f"{base}/metrics?name[]=x")
        assert scrape.status_code == 200
        assert scrape.headers["content-type"].startswith("text/plain; version=")
        assert 'nv_inference_request_success{model="m",version="1"} 1.0' in scrape.text
        assert "nv_cpu_utilization" in scrape.text
        assert httpx.get(f"{base}/v2/health/ready").status_code == 404
        refused = httpx.post(f"{base}/metrics", content=b"x")
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
        head = httpx.head(f"{base}/metrics")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    with pytest.raises(httpx.ConnectError):  # closed with the server
        httpx.get(f"http://127.0.0.1:{port}/metrics")


def test_without_machine_metrics_only_the_models_are_left() -> None:
    with served("native", metrics_port=0, cpu_metrics=False, gpu_metrics=False) as (http_port, port):
        for url in (f"http://127.0.0.1:{port}/metrics", f"http://127.0.0.1:{http_port}/metrics"):
            text = httpx.get(url).text
            assert "nv_inference_request_success" in text
            assert "nv_cpu_" not in text and "process_" not in text


def test_a_taken_metrics_port_stops_the_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = fb.Server(double, inputs=[X], outputs=[Y], name="m")
        config = ServeConfig(http_port=0, grpc_port=None, log_level="warning", metrics_port=taken.getsockname()[1])
        with pytest.raises(StartupError, match="metrics: cannot listen"), serve_in_thread([server], config):
            pass
    with pytest.raises(ValueError, match="metrics_port"), serve_in_thread([server], ServeConfig(metrics_port=70000)):
        pass


def test_connections_past_the_cap_are_closed_and_the_port_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fb_metrics, "MAX_METRICS_CONNECTIONS", 2)
    listener = MetricsListener(registry([], cpu=False, gpu=False), "127.0.0.1", 0)
    try:
        idle = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(2)]
        extra = socket.create_connection(("127.0.0.1", listener.port))
        extra.settimeout(10)
        assert extra.recv(1) == b""  # closed unanswered
        extra.close()
        for s in idle:
            s.close()
        for _ in range(20):  # the closed connections' threads end, then a scrape is served
            try:
                conn = http.client.HTTPConnection("127.0.0.1", listener.port, timeout=10)
                conn.request("GET", "/metrics")
                if conn.getresponse().status == 200:
                    break
            except (ConnectionError, http.client.RemoteDisconnected):
                pass
        else:
            pytest.fail("the metrics port never served again")
    finally:
        listener.close()


def test_a_connection_reset_mid_request_is_logged_not_printed_and_the_port_serves_on(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A client that resets its connection before its request line ends
    (a scraper going away, a port scanner) leaves no traceback on stderr."""
    listener = MetricsListener(registry([], cpu=False, gpu=False), "127.0.0.1", 0)
    try:
        with caplog.at_level(logging.DEBUG, logger="ferrobatch.metrics"):
            reset = socket.create_connection(("127.0.0.1", listener.port))
            reset.sendall(b"GET /met")
            reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            reset.close()  # an RST, not a FIN
            deadline = time.monotonic() + 10
            while "connection from" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "ended: [Errno 104] Connection reset by peer" in caplog.text
        assert "Traceback" not in capfd.readouterr().err
        assert httpx.get(f"http://127.0.0.1:{listener.port}/metrics").status_code == 200
    finally:
        listener.close()


def test_serve_reads_the_metrics_options() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--demo", "--metrics-port", "8002", "--no-gpu-metrics"])
    assert (args.metrics_port, args.no_cpu_metrics, args.no_gpu_metrics) == (8002, False, True)


def test_triton_takes_its_metrics_port_when_free_and_warns_when_taken(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        free = holder.getsockname()[1]
    monkeypatch.setattr(triton_module, "DEFAULT_METRICS_PORT", free)
    config = TritonConfig(http_port=0, grpc_port=0)
    serve_config = triton_module.serve_config(config, expose_errors=True, frontend="native")
    triton_module.claim_metrics_port(serve_config, config)
    assert serve_config.metrics_port == free
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free))
        taken.listen()
        serve_config = triton_module.serve_config(config, expose_errors=True, frontend="native")
        with caplog.at_level(logging.WARNING, "ferrobatch.triton"):
            triton_module.claim_metrics_port(serve_config, config)
        assert serve_config.metrics_port is None
        assert "metrics port" in caplog.text
    for given in (TritonConfig(metrics_port=0), TritonConfig(allow_metrics=False, metrics_port=5)):
        serve_config = triton_module.serve_config(given, expose_errors=True, frontend="native")
        triton_module.claim_metrics_port(serve_config, given)
        assert serve_config.metrics_port == (0 if given.allow_metrics is None else None)
    quiet = TritonConfig(allow_cpu_metrics=False, allow_gpu_metrics=False)
    serve_config = triton_module.serve_config(quiet, expose_errors=True, frontend="native")
    assert (serve_config.cpu_metrics, serve_config.gpu_metrics) == (False, False)


def test_a_triton_serves_metrics_where_its_config_says() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0, metrics_port=port))

    @batch
    def twice(x: object) -> dict[str, object]:
        return {"y": x * 2}  # type: ignore[operator]

    triton.bind("twice", twice, inputs=[Tensor(name="x", dtype="float32", shape=(-1,))],
                outputs=[Tensor(name="y", dtype="float32", shape=(-1,))])  # fmt: skip
    with triton:
        triton.run()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'nv_inference_request_success{model="twice",version="1"} 0.0' in text
