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
- ``ferrobatch_retry_calls``: model calls made to isolate failures
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

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

if TYPE_CHECKING:
    from .server import Server

__all__ = ["TritonCollector", "exposition", "registry"]

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


def cumulative(counts: dict[float, int]) -> list[tuple[str, float]]:
    """Prometheus's ``le`` buckets of ``{upper bound: count in that bucket
    alone}`` (the last bound ``math.inf``): each bound, written as
    ``ferrobatch_batch_size`` writes its own (``1000000.0``, ``+Inf``), with
    the count at or below it."""
    buckets = []
    total = 0
    for bound, n in sorted(counts.items()):
        total += n
        buckets.append(("+Inf" if bound == math.inf else str(float(bound)), float(total)))
    return buckets


class TritonCollector(Collector):
    """Yields Triton-named metrics for each server, from ``server.stats()``."""

    def __init__(self, servers: Server | Iterable[Server]) -> None:
        from .server import Server

        self._servers = [servers] if isinstance(servers, Server) else list(servers)

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
                [server.name, _VERSION], cumulative(durations), sum_value=stats["request_ns"] / 1000
            )
            sizes: dict[int, int] = stats["batch_sizes"]
            buckets = [
                (str(float(b)), sum(n for size, n in sizes.items() if size <= b))
                for b in batch_size_buckets(server.max_batch_size)
            ]
            buckets.append(("+Inf", sum(sizes.values())))
            batch_size.add_metric(
                [server.name, _VERSION], buckets, sum_value=sum(size * n for size, n in sizes.items())
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
            queue_us.add_metric(model, stats["queue_ns"] // 1000)
            compute_us.add_metric(model, stats["request_compute_ns"] // 1000)
            pending.add_metric(model, stats["queue_depth"])
            retries.add_metric(model, stats["retry_calls"])
            isolated.add_metric(model, stats["isolated_failures"])
            checks.add_metric(model, stats["invariance_checks"])
            mismatches.add_metric(model, stats["invariance_mismatches"])
        yield from (
            success, failure, count, exec_count, request_us, queue_us, compute_us, pending, retries, isolated,
            checks, mismatches, reasons, batch_size, request_durations,
        )  # fmt: skip


def registry(servers: Server | Iterable[Server], machine: bool = True) -> CollectorRegistry:
    """A fresh registry holding a :class:`TritonCollector` for ``servers``
    and, with ``machine``, Triton's CPU and GPU metrics of the machine
    (``ferrobatch._host_metrics``) and prometheus_client's ``process_*``
    metrics of this process (CPU seconds, resident memory, open files)."""
    from ._host_metrics import HostCollector  # it imports this module

    result = CollectorRegistry(auto_describe=False)
    result.register(TritonCollector(servers))
    if machine:
        result.register(HostCollector())
        ProcessCollector(registry=result)
    return result
