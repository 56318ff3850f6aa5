"""Prometheus metrics under Triton's names, read from ``Server.stats()``.

    registry = ferrobatch.metrics.registry([server])
    ferrobatch.metrics.exposition(registry)       # what GET /metrics serves

The values are read when Prometheus scrapes (a custom ``Collector``); on the
per-request path there are only the counts ``stats()`` keeps anyway (relaxed
atomic adds in Rust). Every metric below is labelled ``model`` (the server's
name) and ``version`` ("1"); :func:`registry` adds the machine's metrics under
Triton's names (``nv_cpu_*``, ``nv_gpu_*``, see ``ferrobatch._host_metrics``)
and prometheus_client's ``process_*``:

- ``nv_inference_request_success``: requests that returned a result;
- ``nv_inference_request_failure{reason=...}``: failed requests, by ferrobatch
  reason (invalid_input, queue_full, deadline_exceeded, cancelled,
  model_error, server_closed); requests refused before reaching the model
  (unknown model, malformed body) are not counted;
- ``nv_inference_count``: rows (samples) run through the model;
- ``nv_inference_exec_count``: model calls (batches);
- ``nv_inference_request_duration_us``: summed submit-to-result time of
  successful requests;
- ``nv_inference_queue_duration_us``: summed time requests waited in the queue;
- ``nv_inference_compute_infer_duration_us``: summed model-call time, counted
  once per request of each batch, as Triton counts it;
- ``nv_inference_pending_request_count``: requests waiting now (a gauge);
- ``nv_cache_num_hits_per_model`` and ``nv_cache_num_misses_per_model``:
  requests answered from the response cache (never run), and requests
  looked up there and run (``Server(response_cache=...)``; 0 without one);
- ``ferrobatch_retry_calls``: model calls made to isolate failures, and batches
  run again on an instance process started after theirs died
  (``isolate_failures``; Triton has no such metric);
- ``ferrobatch_isolated_failures``: requests that failed in a model call of
  their own once a failed batch was split;
- ``ferrobatch_invariance_checks`` and ``ferrobatch_invariance_mismatches``:
  requests re-run alone (``invariance_sample_rate``) and, of those, the ones
  whose result alone differed from their batch's;
- ``ferrobatch_batches{reason=...}``: model calls by why their batch was
  released (full, next_does_not_fit, preferred_size, delay_expired, greedy,
  adaptive, callers_waiting, shutdown);
- ``ferrobatch_batch_size``: a histogram of batches by their rows, with
  buckets 1, 2, 4, ... up to ``max_batch_size`` (``_bucket{le=...}``,
  ``_sum``: rows, ``_count``: batches), from ``stats()["batch_sizes"]``;
- ``ferrobatch_request_duration_us``: a histogram of successful requests by
  their submit-to-result time in microseconds, with buckets 50, 100, 200,
  500, ... 20,000,000 (``_sum`` is ``nv_inference_request_duration_us``),
  from ``stats()["request_durations_us"]``: the server's own percentiles,
  ``histogram_quantile(0.99, rate(ferrobatch_request_duration_us_bucket[1m]))``
  (Triton's counterpart, ``nv_inference_request_summary_us``, is a summary
  turned on by a flag; a histogram adds up across replicas, a summary does not).

The pending count is a gauge; the others but the histogram are counters
under Triton's exact names, without the ``_total`` suffix (Triton's own
exposition has none, and dashboards query those names).
prometheus_client's ``generate_latest`` would announce a counter as
``# TYPE <name>_total counter``; :func:`exposition` announces it under the
name its samples carry.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from . import _core

if TYPE_CHECKING:
    from .server import Server

__all__ = ["MetricsListener", "TritonCollector", "exposition", "registry"]

log = logging.getLogger("ferrobatch.metrics")

_VERSION = "1"


class CounterFamily(Metric):
    """A counter whose samples keep the family's name (Triton's style:
    ``nv_inference_count``, not ``nv_inference_count_total``); expose it
    with :func:`exposition`."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str]) -> None:
        super().__init__(name, documentation, "counter")
        self._labels = list(labels)

    def add_metric(self, values: Sequence[str], value: float) -> None:
        self.add_sample(self.name, dict(zip(self._labels, values, strict=True)), value)


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self._metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self._metric


def exposition(collector: Collector) -> bytes:
    """The Prometheus text format (0.0.4) of what ``collector`` yields, as
    ``prometheus_client.generate_latest`` writes it, except that a counter
    whose samples carry no ``_total`` suffix is announced under their name:
    ``# TYPE nv_inference_count counter``, then ``nv_inference_count{...}``."""
    parts = []
    for metric in collector.collect():
        if metric.type == "counter" and not any(s.name.endswith("_total") for s in metric.samples):
            twin = Metric(metric.name, metric.documentation, "unknown")
            twin.samples = metric.samples
            text = generate_latest(_One(twin))
            untyped = f"# TYPE {metric.name} untyped\n".encode()
            parts.append(text.replace(untyped, f"# TYPE {metric.name} counter\n".encode(), 1))
        else:
            parts.append(generate_latest(_One(metric)))
    return b"".join(parts)


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """The histogram's upper bounds: 1, 2, 4, ... below ``max_batch_size``, then it."""
    bounds = []
    bound = 1
    while bound < max_batch_size:
        bounds.append(bound)
        bound *= 2
    return [*bounds, max(max_batch_size, 1)]


def le_buckets(bounds: Iterable[float], counts: Mapping[float, int]) -> list[tuple[str, float]]:
    """Prometheus's cumulative ``le`` buckets: for each of ``bounds``, then
    ``+Inf``, the sum of ``counts``' values whose keys are at or below it
    (keys: observed values, or the bounds of a histogram kept bucket by
    bucket)."""
    buckets = [(str(float(b)), float(sum(n for key, n in counts.items() if key <= b))) for b in bounds]
    return [*buckets, ("+Inf", float(sum(counts.values())))]


class TritonCollector(Collector):
    """Yields Triton-named metrics for each server, from ``server.stats()``;
    ``servers`` may be a function giving them, asked at each collection."""

    def __init__(self, servers: Server | Iterable[Server] | Callable[[], Iterable[Server]]) -> None:
        from .server import Server

        if callable(servers) and not isinstance(servers, Server):
            self._listed: Callable[[], Iterable[Server]] = servers
        else:
            fixed = [servers] if isinstance(servers, Server) else list(servers)
            self._listed = lambda: fixed

    @property
    def _servers(self) -> list[Server]:
        return list(self._listed())

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        success = CounterFamily(
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes",
            labels=labels,
        )
        failure = CounterFamily(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            labels=[*labels, "reason"],
        )
        count = CounterFamily(
            "nv_inference_count",
            "Number of inferences performed (rows run through the model)",
            labels=labels,
        )
        exec_count = CounterFamily(
            "nv_inference_exec_count",
            "Number of model executions performed (batches)",
            labels=labels,
        )
        request_us = CounterFamily(
            "nv_inference_request_duration_us",
            "Cumulative inference request duration in microseconds (successful requests)",
            labels=labels,
        )
        queue_us = CounterFamily(
            "nv_inference_queue_duration_us",
            "Cumulative inference queuing duration in microseconds",
            labels=labels,
        )
        compute_us = CounterFamily(
            "nv_inference_compute_infer_duration_us",
            "Cumulative compute inference duration in microseconds, summed per request",
            labels=labels,
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution",
            labels=labels,
        )
        cache_hits = CounterFamily(
            "nv_cache_num_hits_per_model",
            "Number of requests answered from the response cache",
            labels=labels,
        )
        cache_misses = CounterFamily(
            "nv_cache_num_misses_per_model",
            "Number of requests looked up in the response cache and run",
            labels=labels,
        )
        retries = CounterFamily(
            "ferrobatch_retry_calls",
            "Number of model calls made to isolate failed requests of failed batches",
            labels=labels,
        )
        isolated = CounterFamily(
            "ferrobatch_isolated_failures",
            "Number of requests that failed in a model call of their own",
            labels=labels,
        )
        checks = CounterFamily(
            "ferrobatch_invariance_checks",
            "Number of requests re-run alone to check that their batch did not change their result",
            labels=labels,
        )
        mismatches = CounterFamily(
            "ferrobatch_invariance_mismatches",
            "Number of requests re-run alone whose result alone differed from their batch's",
            labels=labels,
        )
        reasons = CounterFamily(
            "ferrobatch_batches",
            "Number of batches, by why they were released",
            labels=[*labels, "reason"],
        )
        batch_size = HistogramMetricFamily(
            "ferrobatch_batch_size",
            "Number of batches by their rows (model calls, retries to isolate failures aside)",
            labels=labels,
        )
        request_durations = HistogramMetricFamily(
            "ferrobatch_request_duration_us",
            "Number of successful requests by their submit-to-result time in microseconds",
            labels=labels,
        )
        for server in self._servers:
            stats = server.stats()
            durations: dict[float, int] = stats["request_durations_us"]
            request_durations.add_metric(
                [server.name, _VERSION],
                le_buckets(_core.REQUEST_BOUNDS_US, durations),
                sum_value=stats["request_ns"] / 1000,
            )
            sizes: dict[int, int] = stats["batch_sizes"]
            batch_size.add_metric(
                [server.name, _VERSION],
                le_buckets(batch_size_buckets(server.max_batch_size), {float(k): n for k, n in sizes.items()}),
                sum_value=sum(size * n for size, n in sizes.items()),
            )
            for reason, n in stats["dispatch_reasons"].items():
                reasons.add_metric([server.name, _VERSION, reason], n)
            model = [server.name, _VERSION]
            success.add_metric(model, stats["requests_succeeded"])
            for reason, n in stats["requests_failed"].items():
                failure.add_metric([*model, reason], n)
            count.add_metric(model, stats["rows"])
            exec_count.add_metric(model, stats["batches"])
            request_us.add_metric(model, stats["request_ns"] // 1000)
            queue_us.add_metric(model, stats["succeeded_queue_ns"] // 1000)
            compute_us.add_metric(model, stats["request_compute_ns"] // 1000)
            pending.add_metric(model, stats["queue_depth"])
            cache_hits.add_metric(model, stats["cache_hits"])
            cache_misses.add_metric(model, stats["cache_misses"])
            retries.add_metric(model, stats["retry_calls"])
            isolated.add_metric(model, stats["isolated_failures"])
            checks.add_metric(model, stats["invariance_checks"])
            mismatches.add_metric(model, stats["invariance_mismatches"])
        yield from (
            success, failure, count, exec_count, request_us, queue_us, compute_us, pending, cache_hits,
            cache_misses, retries, isolated, checks, mismatches, reasons, batch_size, request_durations,
        )  # fmt: skip


def registry(
    servers: Server | Iterable[Server] | Callable[[], Iterable[Server]], *, cpu: bool = True, gpu: bool = True
) -> CollectorRegistry:
    """A fresh registry holding a :class:`TritonCollector` for ``servers``
    (or for what a function gives at each collection: models added while serving);
    with ``cpu``, Triton's CPU metrics of the machine and prometheus_client's
    ``process_*`` metrics of this process (CPU seconds, resident memory, open
    files); with ``gpu``, Triton's GPU metrics (``ferrobatch._host_metrics``:
    Triton's ``--allow-cpu-metrics`` and ``--allow-gpu-metrics``)."""
    from ._host_metrics import HostCollector  # it imports this module

    result = CollectorRegistry(auto_describe=False)
    result.register(TritonCollector(servers))
    if cpu or gpu:
        result.register(HostCollector(cpu=cpu, gpu=gpu))
    if cpu:
        ProcessCollector(registry=result)
    return result


#: Connections the metrics port serves at once (Prometheus opens one or two).
MAX_METRICS_CONNECTIONS = 16


class _MetricsHandler(BaseHTTPRequestHandler):
    """``GET /metrics`` (a query string ignored) and nothing else: 404 for
    another path, 405 for another method."""

    server: _MetricsHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a connection may take to send a request (slow or idle clients go)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def _answer(self, head: bool) -> None:
        if urlsplit(self.path).path != "/metrics":
            self._send(404, b"Not Found\n", "text/plain; charset=utf-8", head)
            return
        try:
            body = exposition(self.server.collector)
        except Exception:
            log.exception("metrics: the scrape failed")
            self._send(500, b"the scrape failed; see the server's log\n", "text/plain; charset=utf-8", head)
            return
        self._send(200, body, CONTENT_TYPE_LATEST, head)

    def _refuse(self) -> None:
        self.send_response(405)
        self.send_header("Allow", "GET, HEAD")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    def _send(self, status: int, body: bytes, content_type: str, head: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("metrics: " + format, *args)


class _MetricsHTTPServer(ThreadingHTTPServer):
    """One thread per connection, at most :data:`MAX_METRICS_CONNECTIONS` at
    once: a connection beyond is closed unanswered."""

    daemon_threads = True
    collector: Collector
    slots = threading.BoundedSemaphore(1)  # replaced per server

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection's failure goes to the log, not to stderr (the
        standard library prints its traceback there): a scraper or a port
        scanner resetting its connection is no error of the server's."""
        if isinstance(sys.exception(), ConnectionError):
            log.debug("metrics: connection from %s ended: %s", client_address, sys.exception())
        else:
            log.exception("metrics: a connection from %s failed", client_address)


class _MetricsHTTPServer6(_MetricsHTTPServer):
    address_family = socket.AF_INET6


class MetricsListener:
    """A port of its own for ``GET /metrics`` (Triton's ``--metrics-port``,
    8002 there), served from a thread by the standard library's HTTP server:
    a scrape every few seconds needs no event loop. :meth:`close` stops it."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        server_class = _MetricsHTTPServer6 if ":" in host else _MetricsHTTPServer
        self._server = server_class((host, port), _MetricsHandler)
        self._server.collector = collector
        self._server.slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="ferrobatch-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
