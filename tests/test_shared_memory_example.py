"""examples/shared_starlette.py end to end: `uvicorn --workers 2` whose
workers share one model process started with `ferrobatch serve --share`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def post(url: str, body: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in started:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)


def test_uvicorn_workers_share_one_model_process(processes: list[subprocess.Popen[bytes]]) -> None:
    name = f"fbtest-example-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, FERROBATCH_SHARE=name)
    model_port, app_port = free_port(), free_port()
    model = subprocess.Popen(
        [sys.executable, "-m", "ferrobatch", "serve", "_model:make_server", "--share", name, "--no-grpc",
         "--http-port", str(model_port)],
        cwd=EXAMPLES,
        env=env,
    )  # fmt: skip
    processes.append(model)
    app = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "shared_starlette:app", "--workers", "2", "--port", str(app_port),
         "--log-level", "warning"],
        cwd=EXAMPLES,
        env=env,
    )  # fmt: skip
    processes.append(app)
    url = f"http://127.0.0.1:{app_port}/predict"
    # Until both workers have answered: a worker still starting (importing
    # torch on a busy machine) leaves every request to the other.
    deadline = time.monotonic() + 180
    ready: set[int] = set()
    warm_up = 0
    while len(ready) < 2:
        assert model.poll() is None and app.poll() is None, "a process exited"
        try:
            ready.add(post(url, {"features": [0.0] * 16}, timeout=5)["worker"])
            warm_up += 1
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
        assert time.monotonic() < deadline, f"workers {ready} answered; expected 2"

    sys.path.insert(0, str(EXAMPLES))
    try:
        from _model import make_server  # the same seed: the same weights
    finally:
        sys.path.remove(str(EXAMPLES))
    local = make_server()._models[0]
    torch.manual_seed(1)
    features = torch.randn(400, 16)
    with torch.no_grad():
        expected = local({"features": features})["probs"]  # type: ignore[operator]

    def ask(i: int) -> dict[str, Any]:
        return post(url, {"features": features[i].tolist()})

    workers: set[int] = set()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for i, answer in enumerate(pool.map(ask, range(len(features)))):
            assert torch.allclose(torch.tensor(answer["probs"]), expected[i], atol=1e-6), i
            workers.add(answer["worker"])
    assert len(workers) == 2, f"requests reached workers {workers}; expected both"
    # One model process ran them all: its statistics count every request.
    stats = get(f"http://127.0.0.1:{model_port}/v2/models/scorer/stats")
    count = stats["model_stats"][0]["inference_stats"]["success"]["count"]
    assert count == len(features) + warm_up, stats

    app.send_signal(signal.SIGTERM)
    assert app.wait(60) == 0
    model.send_signal(signal.SIGTERM)
    assert model.wait(60) == 0
    assert not os.path.exists(f"/dev/shm/ferrobatch.{name}"), "the segment outlived its server"
