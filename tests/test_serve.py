"""``ferrobatch serve``: loading the target, and the process end to end —
HTTP and gRPC on one port each, graceful shutdown on SIGTERM and SIGINT."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import trustme
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import load_servers

HERE = Path(__file__).resolve()
BODY = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
WIDTH = 4
X = fb.TensorSpec("x", "float32", (WIDTH,))
Y = fb.TensorSpec("y", "float32", (WIDTH,))


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def gated(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Holds each batch until the test creates ``release`` in $GATE_DIR
    (it runs in the serve process, so the gate is a pair of files)."""
    gate = Path(os.environ["GATE_DIR"])
    (gate / "entered").touch()
    deadline = time.monotonic() + 60
    while not (gate / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"y": inputs["x"] * 2}


SERVER = fb.Server(double, inputs=[X], outputs=[Y], name="one")


def make_servers() -> list[fb.Server]:
    return [
        fb.Server(double, inputs=[X], outputs=[Y], name="a"),
        fb.Server(double, inputs=[X], outputs=[Y], name="b"),
    ]


def make_gated() -> fb.Server:
    return fb.Server(gated, inputs=[X], outputs=[Y], max_batch_size=1, name="gated")


def slow_to_warm(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Holds warm-up until the test creates ``warmed`` in $GATE_DIR."""
    gate = Path(os.environ["GATE_DIR"])
    (gate / "warming").touch()
    deadline = time.monotonic() + 60
    while not (gate / "warmed").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"y": inputs["x"] * 2}


def make_slow_to_warm() -> fb.Server:
    return fb.Server(slow_to_warm, inputs=[X], outputs=[Y], warmup=True, name="slow")


def stuck(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model call that never returns."""
    (Path(os.environ["GATE_DIR"]) / "entered").touch()
    threading.Event().wait()
    raise AssertionError("unreachable")


def make_stuck() -> fb.Server:
    return fb.Server(stuck, inputs=[X], outputs=[Y], max_batch_size=1, name="stuck")


MODEL = torch.nn.Linear(WIDTH, WIDTH)


# -- load_servers ------------------------------------------------------------------------------


def test_load_servers_accepts_a_server_a_list_or_a_factory() -> None:
    assert [s.name for s in load_servers("test_serve:SERVER")] == ["one"]
    assert [s.name for s in load_servers("test_serve:make_servers")] == ["a", "b"]
    assert [s.name for s in load_servers(f"{HERE}:make_gated")] == ["gated"]


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("test_serve", "module:attr"),
        ("test_serve:missing", "no attribute"),
        ("test_serve:WIDTH", "ferrobatch.Server"),
        ("no/such/file.py:x", "no such file"),
        ("test_serve:MODEL", "wrap the model in one"),
    ],
)
def test_load_servers_says_what_is_wrong(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_servers(target)


# -- the process ------------------------------------------------------------------------------


@dataclass
class Process:
    proc: subprocess.Popen[str]
    http: str
    grpc: str
    lines: queue.SimpleQueue[str]
    startup: str = ""  # what it printed up to its ports

    def log(self) -> str:
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return "".join(out)


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., Process]]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, until: str = r"HTTP http://([\d.]+:\d+), gRPC ([\d.]+:\d+)") -> Process:
        env = {**os.environ, "GATE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "ferrobatch", "serve", *args, "--http-port", "0", "--grpc-port", "0"],
            stderr=subprocess.STDOUT,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        started.append(proc)
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        assert proc.stdout is not None
        stdout = proc.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        seen = []
        while True:
            try:
                line = lines.get(timeout=60)
            except queue.Empty:
                raise AssertionError("serve did not report its ports:\n" + "".join(seen)) from None
            seen.append(line)
            found = re.search(until, line)
            if found:
                return Process(proc, found.group(1), found.group(2), lines, "".join(seen))
            if proc.poll() is not None and lines.empty():
                raise AssertionError("serve exited:\n" + "".join(seen))

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_serve_demo_answers_http_and_grpc_then_stops_on_sigint(
    serve_process: Callable[..., Process],
) -> None:
    served = serve_process("--demo")
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    http = httpclient.InferenceServerClient(served.http)
    tensor = httpclient.InferInput("x", [2, 256], "FP32")
    tensor.set_data_from_numpy(x)
    y_http = http.infer("mlp", [tensor]).as_numpy("y")
    http.close()
    grpc = grpcclient.InferenceServerClient(served.grpc)
    gtensor = grpcclient.InferInput("x", [2, 256], "FP32")
    gtensor.set_data_from_numpy(x)
    y_grpc = grpc.infer("mlp", [gtensor]).as_numpy("y")
    grpc.close()
    from ferrobatch.demo import make_demo_model

    expected = make_demo_model()({"x": torch.from_numpy(x)})["y"].detach().numpy()
    np.testing.assert_allclose(y_http, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y_http, y_grpc)
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0, served.log()


def _pending(http: str) -> float:
    """The requests waiting in the queue, as the server's /metrics on ``http`` counts them."""
    text = httpx.get(f"http://{http}/metrics").text
    found = re.search(r"nv_inference_pending_request_count\{[^}]*\} (\S+)", text)
    return float(found.group(1)) if found else 0.0


def test_sigterm_drains_accepted_requests_and_refuses_new_ones(
    serve_process: Callable[..., Process], tmp_path: Path
) -> None:
    served = serve_process(f"{HERE}:make_gated")
    body = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
    url = f"http://{served.http}"

    def grpc_call() -> np.ndarray:
        client = grpcclient.InferenceServerClient(served.grpc)
        tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
        tensor.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
        try:
            return client.infer("gated", [tensor]).as_numpy("y")  # type: ignore[no-any-return]
        finally:
            client.close()

    with ThreadPoolExecutor(2) as pool:
        in_model = pool.submit(httpx.post, f"{url}/v2/models/gated/infer", content=body, timeout=60)
        assert _wait_for(lambda: (tmp_path / "entered").exists())
        in_queue = pool.submit(grpc_call)
        assert _wait_for(lambda: _pending(served.http) == 1)
        served.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                response = httpx.get(f"{url}/v2/health/ready", timeout=5)
            except httpx.TransportError:
                return True  # the listener is closed
            return response.status_code == 503

        assert _wait_for(refused)
        assert served.proc.poll() is None  # still draining
        (tmp_path / "release").touch()
        response = in_model.result(timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        np.testing.assert_array_equal(in_queue.result(timeout=60), np.full((1, WIDTH), 2.0))
    assert served.proc.wait(60) == 0, served.log()


def _wait_for(condition: Callable[[], bool], seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("endpoint", ["http", "grpc"])
def test_a_port_in_use_fails_the_start_with_a_message(endpoint: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        ports = ["--http-port", port, "--grpc-port", "0"]
        if endpoint == "grpc":
            ports = ["--http-port", "0", "--grpc-port", port]
        done = subprocess.run(
            [sys.executable, "-m", "ferrobatch", "serve", f"{HERE}:SERVER", *ports],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert {"http": "HTTP", "grpc": "gRPC"}[endpoint] + ": cannot listen" in done.stderr


# -- the command line --------------------------------------------------------------------------


def test_a_target_module_imports_from_the_current_directory(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text("WIDTH = 4\n")
    script = Path(sys.executable).with_name("ferrobatch")  # sys.path[0] is its own directory
    done = subprocess.run(
        [str(script), "serve", "my_models:WIDTH"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    # Imported: what is wrong now is the attribute, not the module.
    assert done.returncode == 2, done.stderr
    assert "must be a ferrobatch.Server" in done.stderr, done.stderr


def test_no_http_and_no_grpc_is_a_usage_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "--demo", "--no-http", "--no-grpc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "nothing to serve" in done.stderr
    assert "Traceback" not in done.stderr


def test_help_is_plain_text() -> None:
    done = subprocess.run([sys.executable, "-m", "ferrobatch", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "``" not in done.stdout and ":class:" not in done.stdout
    assert "serve" in done.stdout


def test_a_model_target_is_not_called_as_a_factory() -> None:
    calls: list[object] = []

    class Model(torch.nn.Module):
        def forward(self, *args: object) -> torch.Tensor:
            calls.append(args)
            return torch.zeros(1)

    import types

    module = types.ModuleType("fb_target_module")
    module.model = Model()  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ValueError, match="wrap the model in one"):
            load_servers("fb_target_module:model")
    finally:
        del sys.modules[module.__name__]
    assert calls == []


def test_the_port_answers_not_ready_during_warm_up(serve_process: Callable[..., Process], tmp_path: Path) -> None:
    served = serve_process(
        f"{HERE}:make_slow_to_warm", until=r"listening \(HTTP on ([\d.]+:\d+), gRPC on ([\d.]+:\d+)\)"
    )
    url = f"http://{served.http}"
    assert _wait_for(lambda: (tmp_path / "warming").exists())
    assert httpx.get(f"{url}/v2/health/live").status_code == 200
    assert httpx.get(f"{url}/v2/health/ready").status_code == 503
    refused = httpx.post(f"{url}/v2/models/slow/infer", content=BODY)
    assert refused.status_code == 503, refused.text
    (tmp_path / "warmed").touch()
    assert _wait_for(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 200)
    assert httpx.post(f"{url}/v2/models/slow/infer", content=BODY).status_code == 200
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0
    log = served.log()
    assert "model 'slow': starting (warm-up)" in log and "model 'slow': ready" in log, log


def test_sigterm_with_a_stuck_model_answers_503_and_exits(
    serve_process: Callable[..., Process], tmp_path: Path
) -> None:
    served = serve_process(f"{HERE}:make_stuck", "--graceful-timeout", "1")
    url = f"http://{served.http}/v2/models/stuck/infer"
    with ThreadPoolExecutor(2) as pool:
        in_model = pool.submit(httpx.post, url, content=BODY, timeout=60)
        assert _wait_for(lambda: (tmp_path / "entered").exists())
        queued = pool.submit(httpx.post, url, content=BODY, timeout=60)
        assert _wait_for(lambda: _pending(served.http) == 1)  # it reached the queue
        began = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        for future in (in_model, queued):
            response = future.result(timeout=30)
            assert response.status_code == 503, response.text
            assert response.headers["connection"] == "close"
            assert "stopped" in response.json()["error"] or "shutting down" in response.json()["error"]
    try:
        assert served.proc.wait(30) == 0, served.log()
    except subprocess.TimeoutExpired:
        raise AssertionError("serve did not exit:\n" + served.log()) from None
    assert time.monotonic() - began < 15


def test_serve_freezes_its_start_up_heap_out_of_full_collections(serve_process: Callable[..., Process]) -> None:
    """torch, the model and the imports leave some 200k objects that live as
    long as the process: frozen, a full collection no longer walks them."""
    served = serve_process("--demo")
    found = re.search(r"start-up heap frozen: (\d+) objects", served.startup)
    assert found is not None, served.startup
    assert int(found.group(1)) > 10_000
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0, served.log()


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_drain_delay_says_not_ready_but_goes_on_serving_then_stops(
    serve_process: Callable[..., Process], frontend: str
) -> None:
    delay = 3.0
    served = serve_process(f"{HERE}:SERVER", "--frontend", frontend, "--drain-delay", str(delay))
    url = f"http://{served.http}"
    grpc = grpcclient.InferenceServerClient(served.grpc)
    with httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/v2/health/ready").status_code == 200
        began = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: client.get("/v2/health/ready").status_code == 503, delay)
        assert client.get("/v2/models/one/ready").status_code == 503
        assert not grpc.is_server_ready()
        # Still served, over a kept-alive connection and a new one, while not ready.
        response = client.post("/v2/models/one/infer", content=BODY)
        assert response.status_code == 200, response.text
        assert response.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        assert httpx.post(f"{url}/v2/models/one/infer", content=BODY).status_code == 200
        tensor = grpcclient.InferInput("x", [1, WIDTH], "FP32")
        tensor.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
        np.testing.assert_array_equal(grpc.infer("one", [tensor]).as_numpy("y"), np.full((1, WIDTH), 2.0))
        assert served.proc.poll() is None and time.monotonic() - began < delay
    grpc.close()
    assert served.proc.wait(60) == 0, served.log()
    assert time.monotonic() - began >= delay
    assert _logged(served, "drain delay")


def test_a_second_signal_ends_the_drain_delay(serve_process: Callable[..., Process]) -> None:
    served = serve_process(f"{HERE}:SERVER", "--drain-delay", "120")
    url = f"http://{served.http}"
    served.proc.send_signal(signal.SIGTERM)
    assert _wait_for(lambda: httpx.get(f"{url}/v2/health/ready").status_code == 503, 30)
    assert httpx.post(f"{url}/v2/models/one/infer", content=BODY).status_code == 200
    began = time.monotonic()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(30) == 0, served.log()
    assert time.monotonic() - began < 15
    assert _logged(served, "ending the drain delay")


def _logged(served: Process, text: str) -> bool:
    """Whether the process logged ``text`` (its output read to the end)."""
    seen: list[str] = []
    return _wait_for(lambda: seen.append(served.log()) is None and text in "".join(seen), 10)


def test_limits_and_drain_delay_are_on_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    for flag in ("--drain-delay", "--max-connections", "--header-timeout", "--body-timeout"):
        assert flag in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "ferrobatch", "serve", "--demo", "--header-timeout", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "must be > 0 seconds" in done.stderr, done.stderr


def test_id_names_the_server_and_log_file_takes_the_log(tmp_path: Path) -> None:
    """``--id`` is what server metadata answers on both protocols;
    ``--log-file`` takes the log off standard error into the file."""
    log_file = tmp_path / "serve.log"
    arguments = ["--demo", "--id", "triton", "--log-file", str(log_file), "--http-port", "0", "--grpc-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrobatch", "serve", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        found = None
        deadline = time.monotonic() + 60
        while found is None:
            assert proc.poll() is None, "serve exited"
            assert time.monotonic() < deadline, "serve did not log its ports"
            time.sleep(0.1)
            written = log_file.read_text() if log_file.exists() else ""
            found = re.search(r"HTTP http://([\d.]+:\d+), gRPC ([\d.]+:\d+)", written)
        http, grpc = found.groups()
        assert httpx.get(f"http://{http}/v2", timeout=30).json()["name"] == "triton"
        assert httpx.get(f"http://{http}/v2/logging", timeout=30).json()["log_file"] == str(log_file)
        with grpcclient.InferenceServerClient(grpc) as client:
            assert client.get_server_metadata(as_json=True)["name"] == "triton"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert "serving" not in output, output  # the log went to the file only
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_grpc_use_ssl_serves_grpc_over_tls(serve_process: Callable[..., Process], tmp_path: Path) -> None:
    """Triton's flags: ``--grpc-use-ssl`` with ``--grpc-server-cert`` and
    ``--grpc-server-key``; TLS without its files, or files without TLS, are usage errors."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    root, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    ca.cert_pem.write_to_path(str(root))
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    for args, refusal in (
        (["--grpc-use-ssl"], "grpc_use_ssl needs grpc_server_cert and grpc_server_key"),
        (["--grpc-server-cert", str(cert), "--grpc-server-key", str(key)], "given without grpc_use_ssl"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "ferrobatch", "serve", "--demo", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and refusal in done.stderr, done.stderr
    served = serve_process("--demo", "--grpc-use-ssl", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key))
    with grpcclient.InferenceServerClient(served.grpc, ssl=True, root_certificates=str(root)) as client:
        assert client.is_server_ready()
    with grpcclient.InferenceServerClient(served.grpc) as plain, pytest.raises(InferenceServerException):
        plain.is_server_live(client_timeout=5)


def test_serve_vertex_ai_and_sagemaker_read_their_platforms_variables(
    serve_process: Callable[..., Process], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/predict")
    monkeypatch.delenv("AIP_HEALTH_ROUTE", raising=False)
    for args, refusal in ((["--vertex-ai"], "AIP_HEALTH_ROUTE is not defined"), (["--sagemaker-port", "0"], "need")):
        done = subprocess.run(
            [sys.executable, "-m", "ferrobatch", "serve", "--demo", *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and refusal in done.stderr, done.stderr
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/health")
    monkeypatch.delenv("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", raising=False)
    served = serve_process("--demo", "--vertex-ai", "--vertex-ai-port", "0", "--sagemaker", "--sagemaker-port", "0")
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.5] * 256}]}
    for platform, health, predict in (("Vertex AI", "/health", "/predict"), ("SageMaker", "/ping", "/invocations")):
        found = re.search(platform + r" endpoint on [\d.]+:(\d+)", served.startup)
        assert found, served.startup
        url = f"http://127.0.0.1:{found.group(1)}"
        assert httpx.get(f"{url}{health}").status_code == 200
        answer = httpx.post(f"{url}{predict}", json=body)
        assert answer.status_code == 200 and answer.json()["model_name"] == "mlp", answer.text
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0, served.log()


def _threads_named(pid: int, name: str) -> int:
    tasks = Path(f"/proc/{pid}/task")
    return sum((task / "comm").read_text().strip() == name for task in tasks.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_threads_sets_the_native_runtime_and_the_models_budget_leaves_them(
    serve_process: Callable[..., Process],
) -> None:
    served = serve_process("--demo", "--threads", "3")
    assert "native front-end: 3 runtime thread(s)\n" in served.startup, served.startup
    assert _threads_named(served.proc.pid, "ferrobatch-serv") == 3  # comm keeps 15 characters
    # The demo's worker budgets around them: the usable cores less one for the loop, less 3 (at least 1).
    budget = re.search(r"(\d+) torch intra-op thread\(s\) each \(picked", served.startup)
    cores = len(os.sched_getaffinity(0))
    assert budget is not None and int(budget.group(1)) <= max(1, cores - 1 - 3), served.startup
    response = httpx.post(
        f"http://{served.http}/v2/models/mlp/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 256], "data": [0.0] * 256}]},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0, served.log()


def test_the_native_runtime_takes_half_the_usable_cores_by_default(serve_process: Callable[..., Process]) -> None:
    served = serve_process("--demo")
    cores = len(os.sched_getaffinity(0))
    expected = f"native front-end: {max(1, cores // 2)} runtime thread(s) (picked: half of {cores} usable cores)"
    assert expected in served.startup, served.startup
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(60) == 0, served.log()


def test_the_native_front_end_needs_no_python_web_packages() -> None:
    # uvicorn, Starlette and grpcio belong to frontend="python": a deployment
    # that has only torch beside ferrobatch must still serve natively.
    program = """
import json, sys, urllib.request
for name in ("uvicorn", "starlette", "httptools", "grpc", "aiohttp"):
    sys.modules[name] = None  # importing it now raises ImportError
import torch
import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread
spec = lambda name: fb.TensorSpec(name, "float32", (2,))
server = fb.Server(lambda d: {"y": d["x"] * 2}, inputs=[spec("x")], outputs=[spec("y")], name="double")
with serve_in_thread([server], ServeConfig(http_port=0, grpc_port=0, threads=1)) as where:
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    request = urllib.request.Request(
        f"http://127.0.0.1:{where.http_port}/v2/models/double/infer", data=json.dumps(body).encode()
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        print(json.load(response)["outputs"][0]["data"])
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[2.0, 4.0]", done.stdout
