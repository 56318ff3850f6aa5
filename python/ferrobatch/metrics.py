"""Prometheus metrics under Triton's names, read from ``Server.stats()``.

    registry = ferrobatch.metrics.registry([server])
    prometheus_client.generate_latest(registry)   # what GET /metrics serves

The values are read when Prometheus scrapes (a custom ``Collector``); nothing
is added to the per-request path. Every metric is labelled ``model`` (the
server's name) and ``version`` ("1"):

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
- ``ferrobatch_retry_calls``: model calls made to isolate failures
  (``isolate_failures``; Triton has no such metric);
- ``ferrobatch_isolated_failures``: requests that failed in a model call of
  their own once a failed batch was split;
- ``ferrobatch_batches{reason=...}``: model calls by why their batch was
  released (full, next_does_not_fit, preferred_size, delay_expired, greedy,
  shutdown).

The cumulative ones are exposed untyped rather than as counters because
prometheus_client renames counters to ``*_total``; Triton's exact names are
what existing dashboards query, and PromQL's ``rate()`` treats both alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from .server import Server

__all__ = ["TritonCollector", "registry"]

_VERSION = "1"


class TritonCollector(Collector):
    """Yields Triton-named metrics for each server, from ``server.stats()``."""

    def __init__(self, servers: Server | Iterable[Server]) -> None:
        from .server import Server

        self._servers = [servers] if isinstance(servers, Server) else list(servers)

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        success = UnknownMetricFamily(
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes",
            labels=labels,
        )
        failure = UnknownMetricFamily(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            labels=[*labels, "reason"],
        )
        count = UnknownMetricFamily(
            "nv_inference_count",
            "Number of inferences performed (rows run through the model)",
            labels=labels,
        )
        exec_count = UnknownMetricFamily(
            "nv_inference_exec_count",
            "Number of model executions performed (batches)",
            labels=labels,
        )
        request_us = UnknownMetricFamily(
            "nv_inference_request_duration_us",
            "Cumulative inference request duration in microseconds (successful requests)",
            labels=labels,
        )
        queue_us = UnknownMetricFamily(
            "nv_inference_queue_duration_us",
            "Cumulative inference queuing duration in microseconds",
            labels=labels,
        )
        compute_us = UnknownMetricFamily(
            "nv_inference_compute_infer_duration_us",
            "Cumulative compute inference duration in microseconds, summed per request",
            labels=labels,
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution",
            labels=labels,
        )
        retries = UnknownMetricFamily(
            "ferrobatch_retry_calls",
            "Number of model calls made to isolate failed requests of failed batches",
            labels=labels,
        )
        isolated = UnknownMetricFamily(
            "ferrobatch_isolated_failures",
            "Number of requests that failed in a model call of their own",
            labels=labels,
        )
        reasons = UnknownMetricFamily(
            "ferrobatch_batches",
            "Number of batches, by why they were released",
            labels=[*labels, "reason"],
        )
        for server in self._servers:
            stats = server.stats()
            for reason, n in stats["dispatch_reasons"].items():
                reasons.add_metric([server.name, _VERSION, reason], n)
            model = [server.name, _VERSION]
            success.add_metric(model, stats["requests_succeeded"])
            for reason, n in stats["requests_failed"].items():
                failure.add_metric([*model, reason], n)
            count.add_metric(model, stats["rows"])
            exec_count.add_metric(model, stats["batches"])
            request_us.add_metric(model, stats["request_ns"] // 1000)
            queue_us.add_metric(model, stats["queue_ns"] // 1000)
            compute_us.add_metric(model, stats["request_compute_ns"] // 1000)
            pending.add_metric(model, stats["queue_depth"])
            retries.add_metric(model, stats["retry_calls"])
            isolated.add_metric(model, stats["isolated_failures"])
        yield from (
            success, failure, count, exec_count, request_us, queue_us, compute_us, pending, retries, isolated, reasons,
        )  # fmt: skip


def registry(servers: Server | Iterable[Server]) -> CollectorRegistry:
    """A fresh registry holding only a :class:`TritonCollector` for ``servers``."""
    result = CollectorRegistry(auto_describe=False)
    result.register(TritonCollector(servers))
    return result
