"""GET /metrics: Triton's metric names, with values from Server.stats()."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_http import WIDTH, X, Y, broken, double, serving
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.metrics import batch_size_buckets, exposition, registry

NAMES = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_pending_request_count",
    "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model",
    "ferrobatch_retry_calls",
    "ferrobatch_batches",
    "ferrobatch_isolated_failures",
    "ferrobatch_invariance_checks",
    "ferrobatch_invariance_mismatches",
    "ferrobatch_batch_size_bucket",
    "ferrobatch_batch_size_sum",
    "ferrobatch_batch_size_count",
    "ferrobatch_request_duration_us_bucket",
    "ferrobatch_request_duration_us_sum",
    "ferrobatch_request_duration_us_count",
}


MACHINE = ("nv_cpu_", "nv_gpu_", "nv_energy_", "process_")


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples by (name as exposed, labels). The parser renames a counter's
    samples to ``<name>_total``; the exposition has Triton's bare names."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = family.name if family.type == "counter" and sample.name == family.name + "_total" else sample.name
            samples[(name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset({"version": "1", **labels}.items()))]


@pytest.mark.parametrize("kind", ["native", "starlette", "aiohttp"])
def test_metrics_count_known_requests(kind: str) -> None:
    servers = [
        fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=8, name="double"),
        fb.Server(broken, inputs=[X], outputs=[Y], name="broken"),
    ]
    with serving(kind, servers) as url:
        client = httpclient.InferenceServerClient(url)
        try:
            rows = 0
            # One at a time: each request is its own batch, so every count is exact.
            for i in range(5):
                n = 1 + i % 3
                tensor = httpclient.InferInput("x", [n, WIDTH], "FP32")
                tensor.set_data_from_numpy(np.zeros((n, WIDTH), np.float32))
                client.infer("double", [tensor])
                rows += n
            bad = httpclient.InferInput("x", [1, WIDTH + 1], "FP32")
            bad.set_data_from_numpy(np.zeros((1, WIDTH + 1), np.float32))
            for _ in range(2):
                with pytest.raises(InferenceServerException):
                    client.infer("double", [bad])
            for _ in range(3):
                tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
                tensor.set_data_from_numpy(np.zeros((1, WIDTH), np.float32))
                with pytest.raises(InferenceServerException):
                    client.infer("broken", [tensor])
        finally:
            client.close()
        response = httpx.get(f"http://{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = scrape(response.text)
    # The model's metrics, beside the machine's (test_host_metrics.py).
    assert {name for name, _ in samples if not name.startswith(MACHINE)} == NAMES

    assert value(samples, "nv_inference_request_success", model="double") == 5
    assert value(samples, "nv_inference_count", model="double") == rows
    assert value(samples, "nv_inference_exec_count", model="double") == 5
    assert value(samples, "nv_inference_request_failure", model="double", reason="invalid_input") == 2
    assert value(samples, "nv_inference_request_failure", model="double", reason="model_error") == 0
    assert value(samples, "nv_inference_request_success", model="broken") == 0
    assert value(samples, "nv_inference_request_failure", model="broken", reason="model_error") == 3
    assert value(samples, "nv_inference_exec_count", model="broken") == 3
    for reason in ("queue_full", "deadline_exceeded", "cancelled", "server_closed"):
        assert value(samples, "nv_inference_request_failure", model="double", reason=reason) == 0
    assert value(samples, "nv_inference_request_duration_us", model="double") > 0
    assert value(samples, "nv_inference_compute_infer_duration_us", model="double") > 0
    assert value(samples, "nv_inference_queue_duration_us", model="double") >= 0
    assert value(samples, "nv_inference_pending_request_count", model="double") == 0


async def test_collector_reads_stats_at_scrape_time() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], name="m")
    reg = registry([server])
    before = scrape(exposition(reg).decode())
    assert value(before, "nv_inference_request_success", model="m") == 0
    async with server:
        client = server.client()
        for i in range(4):
            await client.infer({"x": np.full(WIDTH, i, np.float32)})
    stats = server.stats()
    after = scrape(exposition(reg).decode())
    assert value(after, "nv_inference_request_success", model="m") == 4
    assert value(after, "nv_inference_count", model="m") == stats["rows"] == 4
    assert value(after, "nv_inference_exec_count", model="m") == stats["batches"]
    assert value(after, "nv_inference_request_duration_us", model="m") == stats["request_ns"] // 1000
    assert value(after, "nv_inference_queue_duration_us", model="m") == stats["succeeded_queue_ns"] // 1000
    assert value(after, "nv_inference_compute_infer_duration_us", model="m") == stats["request_compute_ns"] // 1000
    assert value(after, "ferrobatch_retry_calls", model="m") == stats["retry_calls"] == 0
    assert value(after, "ferrobatch_isolated_failures", model="m") == stats["isolated_failures"] == 0
    for reason, n in stats["dispatch_reasons"].items():
        assert value(after, "ferrobatch_batches", model="m", reason=reason) == n
    assert sum(stats["dispatch_reasons"].values()) == stats["batches"]
    assert sum(stats["batch_sizes"].values()) == stats["batches"]
    assert sum(size * n for size, n in stats["batch_sizes"].items()) == stats["rows"]
    assert sum(stats["batch_compute_ns"].values()) == stats["compute_ns"]
    assert value(after, "ferrobatch_batch_size_count", model="m") == stats["batches"]
    assert value(after, "ferrobatch_batch_size_sum", model="m") == stats["rows"]
    assert value(after, "ferrobatch_batch_size_bucket", model="m", le="+Inf") == stats["batches"]


def test_request_durations_count_each_success_once_in_the_bucket_of_its_time() -> None:
    """Successes over HTTP, from a thread and from an event loop land in
    ``ferrobatch_request_duration_us`` once each, in their time's bucket (the
    model sleeps 3 ms, so none is at or below 2 ms); failures are left out."""

    def slow(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.003)
        if bool((d["x"] < 0).any()):
            raise ValueError("negative")
        return {"y": d["x"] * 2}

    server = fb.Server(slow, inputs=[X], outputs=[Y], max_batch_size=1, name="slow")
    with serving("native", [server]) as url:
        http = httpclient.InferenceServerClient(url)
        try:
            for sign in (1, 1, -1):
                tensor = httpclient.InferInput("x", [1, WIDTH], "FP32")
                tensor.set_data_from_numpy(np.full((1, WIDTH), sign, np.float32))
                if sign < 0:
                    with pytest.raises(InferenceServerException):
                        http.infer("slow", [tensor])
                else:
                    http.infer("slow", [tensor])
        finally:
            http.close()
        client = server.client()
        for sign in (1, 1, 1, -1):
            x = torch.full((WIDTH,), float(sign))
            if sign < 0:
                with pytest.raises(fb.ModelError):
                    client.infer_sync({"x": x})
            else:
                client.infer_sync({"x": x})

        async def from_a_loop() -> None:
            await client.infer({"x": np.ones(WIDTH, np.float32)})

        asyncio.run(from_a_loop())
        stats = server.stats()
        samples = scrape(httpx.get(f"http://{url}/metrics").text)
    durations = stats["request_durations_us"]
    assert stats["requests_succeeded"] == 6 and stats["requests_failed"]["model_error"] == 2
    assert sum(durations.values()) == 6
    assert list(durations) == [*fb._core.REQUEST_BOUNDS_US, math.inf]
    assert sum(n for bound, n in durations.items() if bound <= 2000) == 0
    count = value(samples, "ferrobatch_request_duration_us_count", model="slow")
    assert count == value(samples, "ferrobatch_request_duration_us_bucket", model="slow", le="+Inf") == 6
    assert value(samples, "ferrobatch_request_duration_us_bucket", model="slow", le="2000.0") == 0
    assert value(samples, "ferrobatch_request_duration_us_bucket", model="slow", le="20000000.0") == 6
    assert value(samples, "ferrobatch_request_duration_us_sum", model="slow") == stats["request_ns"] / 1000
    assert stats["request_ns"] / 1000 >= 6 * 3000


def test_exposition_types_counters_under_triton_names_and_adds_histograms() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], max_batch_size=12, name="m")
    text = exposition(registry([server], cpu=False, gpu=False)).decode()
    assert "# TYPE nv_inference_request_success counter\nnv_inference_request_success{" in text
    assert "# TYPE nv_inference_pending_request_count gauge\n" in text
    assert "_total" not in text
    # prometheus_client's own writer would announce a name no sample has.
    assert "# TYPE nv_inference_request_success_total counter" in generate_latest(registry([server])).decode()
    assert "# TYPE ferrobatch_batch_size histogram\n" in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    les = [s.labels["le"] for s in families["ferrobatch_batch_size"].samples if "le" in s.labels]
    assert les == ["1.0", "2.0", "4.0", "8.0", "12.0", "+Inf"]
    assert "# TYPE ferrobatch_request_duration_us histogram\n" in text
    les = [s.labels["le"] for s in families["ferrobatch_request_duration_us"].samples if "le" in s.labels]
    assert les[:5] == ["50.0", "100.0", "200.0", "500.0", "1000.0"]
    assert les[-3:] == ["10000000.0", "20000000.0", "+Inf"] and len(les) == len(fb._core.REQUEST_BOUNDS_US) + 1
    assert batch_size_buckets(1) == [1] and batch_size_buckets(16) == [1, 2, 4, 8, 16]


async def test_metrics_count_isolated_failures() -> None:
    def poisoned(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if bool((d["x"][:, 0] < 0).any()):
            raise ValueError("negative")
        return {"y": d["x"] * 2}

    server = fb.Server(poisoned, inputs=[X], outputs=[Y], max_batch_size=4, max_delay=5.0, name="p")
    async with server:
        client = server.client()
        xs = [np.full(WIDTH, -1 if i == 2 else i, np.float32) for i in range(4)]
        await asyncio.gather(*(client.infer({"x": x}) for x in xs), return_exceptions=True)
    samples = scrape(exposition(registry([server])).decode())
    assert value(samples, "ferrobatch_retry_calls", model="p") == 4  # halves of 2, then of 1
    assert value(samples, "ferrobatch_isolated_failures", model="p") == 1
    assert value(samples, "nv_inference_request_success", model="p") == 3


async def test_queue_and_compute_durations_are_the_successes_as_triton_counts_them() -> None:
    def slow(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        time.sleep(0.05)
        if bool((d["x"][:, 0] < 0).any()):
            raise ValueError("negative")
        return {"y": d["x"] * 2}

    failing = fb.Server(slow, inputs=[X], outputs=[Y], max_batch_size=2, max_delay=0.05, name="f")
    async with failing:
        client = failing.client()
        xs = [np.full(WIDTH, -1, np.float32)] * 2
        await asyncio.gather(*(client.infer({"x": x}) for x in xs), return_exceptions=True)
    stats = failing.stats()
    assert stats["requests_failed"]["model_error"] == 2 and stats["queue_ns"] > 0 and stats["compute_ns"] > 0
    assert stats["succeeded_queue_ns"] == 0 and stats["request_compute_ns"] == 0
    samples = scrape(exposition(registry([failing])).decode())
    assert value(samples, "nv_inference_queue_duration_us", model="f") == 0
    assert value(samples, "nv_inference_compute_infer_duration_us", model="f") == 0
    # One request of two fails alone: only the other's durations count.
    mixed = fb.Server(slow, inputs=[X], outputs=[Y], max_batch_size=2, max_delay=0.05, name="m")
    async with mixed:
        client = mixed.client()
        xs = [np.full(WIDTH, -1, np.float32), np.ones(WIDTH, np.float32)]
        await asyncio.gather(*(client.infer({"x": x}) for x in xs), return_exceptions=True)
    stats = mixed.stats()
    assert stats["requests_succeeded"] == 1 and stats["batches"] == 1
    assert 0 < stats["succeeded_queue_ns"] < stats["queue_ns"]
    assert 0 < stats["request_compute_ns"] < 2 * stats["compute_ns"]


def test_the_served_metrics_carry_the_machine_and_the_process() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], name="m")
    with serving("native", [server]) as url:
        text = httpx.get(f"http://{url}/metrics").text
    found = {name: v for (name, labels), v in scrape(text).items() if not labels}
    assert 0.0 <= found["nv_cpu_utilization"] <= 1.0
    assert found["nv_cpu_memory_total_bytes"] >= found["nv_cpu_memory_used_bytes"] > 0
    assert found["process_resident_memory_bytes"] > 0
    assert "# TYPE nv_cpu_utilization gauge\n" in text
