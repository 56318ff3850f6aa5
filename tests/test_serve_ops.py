"""``ferrobatch serve`` in operation: readiness while models warm up and
drain, loading targets and their failures, the command line's checks, and
signals during a warm-up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import ferrobatch as fb
from ferrobatch.__main__ import main as cli
from ferrobatch.serve import ServeConfig, _Repository, check_config, load_servers, serve, serve_in_thread

HERE = Path(__file__).resolve()
BODY = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'
X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2}


def held_warm_up(warming: threading.Event, release: threading.Event) -> Callable[..., dict[str, torch.Tensor]]:
    """A model whose calls (its warm-up's first) wait for ``release``."""

    def model(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        warming.set()
        release.wait(60)
        return double(inputs)

    return model


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_for(condition: Callable[[], bool], seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def _serving(servers: list[fb.Server], config: ServeConfig) -> Iterator[None]:
    """:func:`serve` on a thread of its own, stopped (by its event) and joined on the way out."""
    loop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def run() -> None:
        stop = asyncio.Event()
        loop_box.append((asyncio.get_running_loop(), stop))
        await serve(servers, config, stop=stop)

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="test-serve", daemon=True)
    thread.start()
    try:
        yield
    finally:
        assert _wait_for(lambda: bool(loop_box))
        loop, stop = loop_box[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)


def _live(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _index(url: str) -> dict[str, tuple[str, str]]:
    entries = httpx.post(f"{url}/v2/repository/index", json={}, timeout=5).json()
    return {e["name"]: (e["state"], e["reason"]) for e in entries}


# -- readiness -----------------------------------------------------------------------------------


def test_a_started_model_is_not_ready_until_the_native_front_end_serves_it() -> None:
    """The native front-end serves the models together once all have started:
    before that, model 'a' (started) must not say ready while its inference answers 503."""
    warming, release = threading.Event(), threading.Event()
    servers = [
        fb.Server(double, inputs=[X], outputs=[Y], name="a"),
        fb.Server(held_warm_up(warming, release), inputs=[X], outputs=[Y], warmup=True, name="b"),
    ]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        with _serving(servers, ServeConfig(http_port=port, grpc_port=None, threads=1)):
            assert _wait_for(lambda: _live(url) and warming.is_set())
            assert servers[0].running  # started: only the front-end has not taken it yet
            assert httpx.post(f"{url}/v2/models/a/infer", content=BODY, timeout=5).status_code == 503
            assert httpx.get(f"{url}/v2/models/a/ready", timeout=5).status_code == 503
            assert _index(url)["a"][0] == "UNAVAILABLE"
            release.set()
            assert _wait_for(lambda: httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200)
            assert httpx.get(f"{url}/v2/models/a/ready", timeout=5).status_code == 200
            assert httpx.post(f"{url}/v2/models/a/infer", content=BODY, timeout=5).status_code == 200
            assert _index(url) == {"a": ("READY", ""), "b": ("READY", "")}
    finally:
        release.set()


async def test_the_repository_index_says_unavailable_during_the_drain_delay() -> None:
    server = fb.Server(double, inputs=[X], outputs=[Y], name="one")
    repository = _Repository([server])
    await server.start()
    try:
        assert repository.repository_index() == [{"name": "one", "version": "1", "state": "READY", "reason": ""}]
        repository.unready = True  # what the drain delay sets, beside readiness
        assert not repository.model_ready("one")
        assert repository.repository_index() == [
            {"name": "one", "version": "1", "state": "UNAVAILABLE", "reason": "draining"}
        ]
        assert repository.repository_index(ready_only=True) == []
    finally:
        await server.stop()


# -- serve_in_thread -----------------------------------------------------------------------------


def test_serve_in_thread_stops_what_it_started_when_the_start_times_out() -> None:
    warming, release = threading.Event(), threading.Event()
    server = fb.Server(held_warm_up(warming, release), inputs=[X], outputs=[Y], warmup=True, name="slow")
    port = _free_port()
    releaser = threading.Timer(2.0, release.set)  # a warm-up cannot be cut short: it ends, later
    releaser.start()
    try:
        with pytest.raises(RuntimeError, match=r"did not become ready within 0\.5s"):
            with serve_in_thread([server], ServeConfig(http_port=port, grpc_port=None, threads=1), start_timeout=0.5):
                pass
        assert not [t for t in threading.enumerate() if t.name == "ferrobatch-serve"]
        with socket.socket() as client:
            assert client.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
        assert _wait_for(lambda: not server.running and release.is_set())
    finally:
        release.set()
        releaser.cancel()


# -- loading the target --------------------------------------------------------------------------


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """sys.path and sys.modules as they were, whatever a target added."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("fbops_"):
            del sys.modules[name]


@pytest.mark.usefixtures("clean_imports")
def test_a_file_target_imports_its_siblings_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "pkgdir"
    package.mkdir()
    (package / "fbops_sibling.py").write_text("NAME = 'from-sibling'\n")
    (package / "fbops_models.py").write_text(
        "import ferrobatch as fb\nfrom fbops_sibling import NAME\n"
        "SPEC = fb.TensorSpec('x', 'float32', (4,))\n"
        "SERVER = fb.Server(lambda d: {'x': d['x']}, inputs=[SPEC], outputs=[SPEC], name=NAME)\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert [s.name for s in load_servers("../pkgdir/fbops_models.py:SERVER")] == ["from-sibling"]
    # First, as `python file.py` puts it: spawned process instances import the module by name too.
    assert sys.path[0] == str(package)


def _serve_cli(target: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``ferrobatch serve TARGET`` run here (it fails before it listens): its status and stderr."""
    status = cli(["serve", target, "--http-port", "0", "--grpc-port", "0"])
    return status, capsys.readouterr().err


@pytest.mark.usefixtures("clean_imports")
@pytest.mark.parametrize(
    ("module", "target", "expected"),
    [
        ("raise RuntimeError('no weights at /models/w.pt')\n", "x", "RuntimeError: no weights at /models/w.pt"),
        ("import json\nCONFIG = json.loads('{bad')\n", "x", "JSONDecodeError: Expecting property name"),
        ("def make():\n    raise KeyError('MODEL_PATH')\n", "make", "KeyError: 'MODEL_PATH'"),
        ("def make(path):\n    pass\n", "make", "TypeError: make() missing 1 required positional argument"),
        ("import fbops_not_installed\n", "x", "ModuleNotFoundError: No module named 'fbops_not_installed'"),
        ("def f(:\n", "x", "SyntaxError"),
    ],
    ids=["raises", "value-error", "factory-raises", "factory-needs-argument", "missing-dependency", "syntax"],
)
def test_a_target_that_fails_to_load_says_so_with_its_own_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    module: str,
    target: str,
    expected: str,
) -> None:
    name = f"fbops_target_{abs(hash(module))}"
    (tmp_path / f"{name}.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    status, err = _serve_cli(f"{name}:{target}", capsys)
    assert status == 1, err
    assert f"ferrobatch serve: cannot load target {name}:{target}: {expected}" in err, err
    assert "ferrobatch/serve.py" not in err and "importlib" not in err, err  # the user's frames only
    if target == "x" and "Syntax" not in expected:
        assert f'{name}.py", line' in err, err


@pytest.mark.usefixtures("clean_imports")
@pytest.mark.parametrize(
    ("target", "message"),
    [("fbops_no_such_module:x", "no module named 'fbops_no_such_module'"), ("fbops-bad", "module:attr")],
)
def test_a_wrong_target_is_a_usage_error(target: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _serve_cli(target, capsys)
    assert status == 2 and message in err and "Traceback" not in err, err


# -- the command line and the config -------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        ["--callers", "0"],
        ["--seconds", "0"],
        ["--seconds", "-1"],
        ["--seconds", "nan"],
        ["--max-batch-size", "0"],
        ["--max-delay", "-1"],
        ["--width", "-3"],
        ["--width", "0"],
        ["--torch-threads", "0"],
    ],
)
def test_demo_refuses_bad_numbers_naming_the_flag(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli(["demo", "--seconds", "0.1", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert f"argument {flags[0]}:" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("expose_errors", "false", "expose_errors must be True or False"),
        ("access_log", 1, "access_log must be True or False"),
        ("cpu_metrics", None, "cpu_metrics must be True or False"),
        ("gpu_metrics", "no", "gpu_metrics must be True or False"),
        ("log_level", "bogus", "log_level must be one of"),
        ("host", "", "host must be a non-empty str"),
        ("host", "not an address", "host must be an IP address"),
        ("share", "a/b", "share must be 1 to 200 letters"),
        ("http_header_forward_pattern", 5, "http_header_forward_pattern must be a regular expression"),
    ],
)
def test_check_config_refuses_wrong_flags_and_names(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_config(ServeConfig(**{field: value}))


def test_check_config_takes_a_host_name_for_the_python_front_end() -> None:
    check_config(ServeConfig(host="localhost"))
    check_config(ServeConfig(host="::1"))
    check_config(ServeConfig(host="example.internal", frontend="python"))


# -- signals -------------------------------------------------------------------------------------


def test_a_second_signal_during_a_start_up_warm_up_exits_at_once(tmp_path: Path) -> None:
    """The first signal stops the start (the warm-up's own thread goes on); the
    second exits at once with status 0, instead of dying by the signal."""
    env = {**os.environ, "GATE_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    # test_serve's model, whose warm-up waits for a file in $GATE_DIR.
    command = [sys.executable, "-m", "ferrobatch", "serve", f"{HERE.with_name('test_serve.py')}:make_slow_to_warm"]
    proc = subprocess.Popen(
        [*command, "--http-port", "0", "--grpc-port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True)
    reader.start()
    output = ""

    def said(text: str) -> bool:
        nonlocal output
        while not lines.empty():
            output += lines.get()
        return text in output

    try:
        assert _wait_for(lambda: (tmp_path / "warming").exists() or proc.poll() is not None, 60)
        proc.send_signal(signal.SIGTERM)
        # serve() has returned; the warm-up holds the process, which says so.
        assert _wait_for(lambda: said("waiting for the threads still running"), 30), output
        assert proc.poll() is None
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(20)
        reader.join(10)
        said("")
        assert status == 0, output
        assert time.monotonic() - began < 10
        assert "SIGTERM again" in output and "Traceback" not in output, output
    finally:
        (tmp_path / "warmed").touch()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
