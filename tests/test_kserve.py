"""deploy/kserve: the ClusterServingRuntime, the image's command line, the
InferenceService and the HPA on queue time fit KServe and each other, and the
container's command line serves the example model (run here, on 127.0.0.1)."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferrobatch.serve import add_arguments

yaml = pytest.importorskip("yaml")

KSERVE = Path(__file__).resolve().parent.parent / "deploy" / "kserve"
PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}


def load(name: str) -> Any:
    return yaml.safe_load((KSERVE / name).read_text())


def container() -> dict[str, Any]:
    spec = load("clusterservingruntime.yaml")["spec"]
    first: dict[str, Any] = spec["containers"][0]
    return first


def serve_options(args: list[str]) -> argparse.Namespace:
    """``ferrobatch serve``'s own parser reads the runtime's args."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args)


def dockerfile_instruction(name: str) -> str:
    lines = [line for line in (KSERVE / "Dockerfile").read_text().splitlines() if line.startswith(name + " ")]
    assert lines, f"no {name} in the Dockerfile"
    return lines[-1][len(name) + 1 :].strip()


def test_the_runtime_has_the_fields_kserve_requires() -> None:
    runtime = load("clusterservingruntime.yaml")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] == "ClusterServingRuntime"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", runtime["metadata"]["name"])
    spec = runtime["spec"]
    formats = spec["supportedModelFormats"]
    assert formats and all(isinstance(f["name"], str) and isinstance(f.get("version", ""), str) for f in formats)
    assert set(spec["protocolVersions"]) <= PROTOCOLS
    assert {"v2", "grpc-v2"} <= set(spec["protocolVersions"])
    c = container()
    assert c["name"] == "kserve-container"  # the container KServe merges the predictor's settings into
    assert isinstance(c["image"], str) and c["image"]
    assert {(p["name"], p["containerPort"]) for p in c["ports"]} == {("http1", 8080), ("h2c", 8081)}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": 8080}
    assert spec["annotations"]["prometheus.kserve.io/port"] == "8080"
    assert spec["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    # ferrobatch serve takes these args, and listens where the ports and probes say.
    assert c["command"] == ["ferrobatch", "serve"]
    options = serve_options(c["args"])
    assert (options.host, options.http_port, options.grpc_port) == ("0.0.0.0", 8080, 8081)
    assert options.target == "model:server" and c["workingDir"] == "/mnt/models"
    # KServe's default grace period is 30 s: the drain must fit in it.
    assert options.drain_delay + options.graceful_timeout <= 30


def test_the_image_runs_what_the_runtime_says() -> None:
    c = container()
    assert json.loads(dockerfile_instruction("ENTRYPOINT")) == c["command"]
    assert json.loads(dockerfile_instruction("CMD")) == c["args"]
    assert dockerfile_instruction("WORKDIR") == c["workingDir"]
    assert set(dockerfile_instruction("EXPOSE").split()) == {"8080", "8081"}


def test_the_inference_service_and_the_hpa_fit_the_runtime() -> None:
    runtime = load("clusterservingruntime.yaml")
    isvc = load("inferenceservice.yaml")
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"] in [
        {"name": f["name"], "version": f["version"]} for f in runtime["spec"]["supportedModelFormats"]
    ]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    # The HPA scales KServe's Deployment for it, in raw mode, with KServe's own autoscaler off.
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert annotations["serving.kserve.io/autoscalerClass"] == "external"
    hpa = load("hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["kind"] == "HorizontalPodAutoscaler"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", isvc["metadata"]["name"] + "-predictor")
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    # prometheus-adapter serves that metric from Triton's counters.
    (rule,) = load("prometheus-adapter-values.yaml")["rules"]["custom"]
    assert rule["name"]["as"] == metric["pods"]["metric"]["name"]
    assert "nv_inference_queue_duration_us" in rule["seriesQuery"]
    assert "rate(nv_inference_queue_duration_us" in rule["metricsQuery"]
    assert "rate(nv_inference_request_success" in rule["metricsQuery"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """The example model directory, as KServe's storage initializer leaves it in /mnt/models."""
    target = tmp_path / "models"
    shutil.copytree(KSERVE / "model", target)
    return target


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_the_containers_command_line_serves_the_model_and_drains_on_sigterm(
    model_dir: Path, processes: list[subprocess.Popen[str]]
) -> None:
    c = container()
    assert c["command"][0] == "ferrobatch"
    # The container's command line, run by this interpreter in the model directory; the
    # address and ports are overridden (later flags win) to 127.0.0.1 and free ports.
    argv = [sys.executable, "-m", "ferrobatch", *c["command"][1:], *c["args"]]
    argv += ["--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"]
    proc = subprocess.Popen(
        argv,
        cwd=model_dir,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    processes.append(proc)
    lines: queue.SimpleQueue[str] = queue.SimpleQueue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
    seen: list[str] = []
    http = ""
    while not http:
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            raise AssertionError("serve did not report its ports:\n" + "".join(seen)) from None
        seen.append(line)
        found = re.search(r"HTTP http://([\d.]+:\d+), gRPC ([\d.]+:\d+)", line)
        if found:
            http = found.group(1)
    base = f"http://{http}"
    deadline = time.monotonic() + 60
    while get(f"{base}/v2/health/ready")[0] != 200:
        assert time.monotonic() < deadline, "never ready:\n" + "".join(seen)
        time.sleep(0.05)
    assert get(f"{base}/v2/health/live")[0] == 200
    # The example model answers a v2 request ...
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]})
    request = urllib.request.Request(f"{base}/v2/models/mlp/infer", data=body.encode(), method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        output = json.loads(response.read())["outputs"][0]
    assert output["name"] == "y" and output["shape"] == [1, 256] and len(output["data"]) == 256
    # ... and /metrics has the counters the HPA's queue time is made of.
    status, metrics = get(f"{base}/metrics")
    assert status == 200
    text = metrics.decode()
    assert re.search(r'^nv_inference_queue_duration_us\{model="mlp",version="1"\} \S+$', text, re.M)
    assert re.search(r'^nv_inference_request_success\{model="mlp",version="1"\} 1(\.0)?$', text, re.M)
    # SIGTERM: not ready at once, still live while it drains (--drain-delay), then exit 0.
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while get(f"{base}/v2/health/ready")[0] != 503:
        assert time.monotonic() < deadline, "still ready after SIGTERM"
        time.sleep(0.02)
    assert get(f"{base}/v2/health/live")[0] == 200
    assert proc.wait(60) == 0
