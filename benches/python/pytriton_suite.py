"""PyTriton's own unit tests of its decorators and its decoupled-mode test, run
against ``ferrobatch.triton`` with only their imports switched, beside PyTriton
itself; prints both counts.

It fetches nothing: give it a local checkout of triton-inference-server/pytriton
(``git clone https://github.com/triton-inference-server/pytriton``, or any
copy holding ``tests/unit/`` and ``tests/functional/L0_decoupled_mode/``). The test files are copied into a temporary
directory (never into this repository) and each ``from pytriton.X import
names`` becomes ``from ferrobatch.triton.X import names``. A name
ferrobatch.triton does not have (a private helper of PyTriton's, or
something not built yet) is bound to a stand-in that fails the test using it
with ``NotImplementedError`` naming it, and is listed, so each count is
honest: a test that needs a missing name fails.

PyTriton itself runs the unmodified copies with ``--pytriton-python`` (an
interpreter with ``nvidia-pytriton`` and pytest installed, e.g. the one
``make bench-serve-deps`` makes in ``.venv-pytriton``).

``--examples`` runs PyTriton's examples that need no GPU and no downloaded
weights the same way: each ``server.py`` (imports switched) on its default
ports 8000/8001 of 127.0.0.1, then its ``client.py`` (imports switched) as it
is (HTTP) and with its ``ModelClient`` pointed at ``grpc://localhost:8001``
(not for an example whose server forwards HTTP headers only);
an example passes when the client exits 0 within a minute. Each server is
stopped with SIGINT (killed after 30 s), by its PID. Its CPU notebook runs
too, as one script of its code cells (imports switched, shell lines such as
``!pip install`` left out): it serves, stops, binds again and serves again on
port 8000, and passes when it exits 0 within two minutes.

    python benches/python/pytriton_suite.py ~/src/pytriton
    python benches/python/pytriton_suite.py ~/src/pytriton --pytriton-python .venv-pytriton/bin/python -- -x
    python benches/python/pytriton_suite.py ~/src/pytriton --examples
    python benches/python/pytriton_suite.py ~/src/pytriton --functional

``--functional`` runs PyTriton's end-to-end tests that need no GPU, no
container and nothing downloaded (``tests/functional/L*`` listed in
FUNCTIONAL; the client stress tests for at most STRESS_SECONDS, where the L2
ones ask for ten hours) the way their ``test.sh`` does, each in a temporary copy of
``tests/`` with its imports switched. ``pytriton.check.utils`` (PyTriton's
test tooling: free ports, a script runner, process monitoring; only the
standard library and psutil) stays PyTriton's, loaded from the checkout: it
is what drives the test, not what is tested. A test passes when it exits 0
within ten minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The suites run, by their place in PyTriton's checkout, and the name each
#: is run under: its decorator tests (what a model author's code touches),
#: its client's access-token headers (``pytriton.client.auth``) and its
#: decoupled-mode functional test (a streaming model served, and
#: ``DecoupledModelClient`` against it); then the helpers they import from
#: their own package.
TEST_FILES = {
    "tests/unit/test_decorators.py": "test_decorators.py",
    "tests/unit/test_decorators_batch.py": "test_decorators_batch.py",
    "tests/unit/test_client_auth.py": "test_client_auth.py",
    "tests/functional/L0_decoupled_mode/test_pytest.py": "test_decoupled_mode.py",
}
HELPERS = ("__init__.py", "utils.py")

FROM_IMPORT = re.compile(r"^([ \t]*)from pytriton((?:\.\w+)*) import (\([^)]*\)|[^\n]*)", re.M)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")

#: PyTriton's examples that run on a CPU with nothing downloaded.
EXAMPLES = (
    "add_sub_python",
    "add_sub_python_with_optional",
    "add_sub_vertex_ai",
    "identity_python",
    "linear_random_pytorch",
    "multiple_models_python",
    "use_parameters_and_headers",
)
#: The Vertex AI example's scripts (curl to its port 8080), run after its client.
VERTEX_INFER = "infer_vertex_ai_endpoint.sh"
VERTEX_HEALTH = "health_vertex_ai_endpoint.sh"
#: PyTriton's notebooks that run on a CPU (the server and its client in one program).
NOTEBOOKS = ("add_sub_notebook/add_sub.ipynb",)
#: PyTriton's end-to-end tests that run on a CPU with nothing downloaded.
FUNCTIONAL = (
    "L0_fatal_error_handling",
    "L0_inference_with_variable_io_size",
    "L0_model_error_handling",
    "L0_network_timeouts",
    # Not L0_resources_released_after_signals: it asserts that the server process made files
    # in /dev/shm (PyTriton's proxy does; ferrobatch's in-process path makes none), then
    # waits for ever for a server it never signalled.
    "L0_response_cache",
    "L0_run_in_thread",
    "L0_token_based_access_restriction",
    "L0_triton_close_on_parent_death",
    "L0_tritons_cohabitation",
    "L0_warmup_functionality",
    "L0_warning_on_too_verbose_level",
    # Their clients' stress tests: a fake BERT (numpy) with variable-length inputs and outputs
    # of up to 16 x 128 x 30522 floats a batch, 16 requests in flight from FuturesModelClient.
    # Not L2_asyncio_client_long_test: it hands asyncio.wait() coroutines, which Python 3.11
    # refuses (TypeError) whatever serves them.
    "L1_futures_client_stress",
    "L2_futures_client_long_test",
)
#: How long a stress test runs (``--test-time-s``) at most: the L2 tests ask for ten hours.
STRESS_SECONDS = 60
#: Examples whose server forwards HTTP headers only (``http_header_forward_pattern``): no gRPC run.
HTTP_ONLY = frozenset({"use_parameters_and_headers"})

STAND_IN = '''
class _Missing:
    """A name ferrobatch.triton does not have: using it fails the test."""

    def __init__(self, name):
        self._name = name

    def _fail(self, *args, **kwargs):
        raise NotImplementedError(f"ferrobatch.triton has no {self._name}")

    __call__ = __getattr__ = __getitem__ = __iter__ = _fail
'''


def switched(source: str, missing: set[str]) -> str:
    """``source`` with every ``from pytriton.X import ...`` taken from
    ``ferrobatch.triton.X``, names it lacks bound to stand-ins (added to
    ``missing``)."""

    def replace(match: re.Match[str]) -> str:
        indent, submodule = match.group(1), match.group(2)
        module = f"ferrobatch.triton{submodule}"
        names = [n.split("#")[0].strip() for n in match.group(3).strip("()").split(",")]
        names = [n for n in names if n]
        try:
            ours = importlib.import_module(module)
        except ImportError:
            ours = None
        have = [n for n in names if ours is not None and hasattr(ours, n.split(" as ")[0])]
        lines = [f"{indent}from {module} import ({', '.join(have)})"] if have else []
        for name in names:
            if name not in have:
                missing.add(f"pytriton{submodule}.{name}")
                alias = name.split(" as ")[-1]
                lines.append(f"{indent}{alias} = _Missing('pytriton{submodule}.{name}')")
        return "\n".join(lines)

    body = FROM_IMPORT.sub(replace, source)
    return STAND_IN + body if "_Missing(" in body else body


def copy_suite(checkout: Path, into: Path, *, switch: bool, missing: set[str]) -> Path:
    """The test files and their helpers under ``into/tests/unit``."""
    unit = into / "tests" / "unit"
    unit.mkdir(parents=True)
    (into / "tests" / "__init__.py").write_text("")
    files = {**TEST_FILES, **{f"tests/unit/{name}": name for name in HELPERS}}
    for path, name in files.items():
        source = (checkout / path).read_text()
        (unit / name).write_text(switched(source, missing) if switch else source)
    return unit


def run(python: str, unit: Path, extra: list[str]) -> dict[str, int]:
    done = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(unit.parent.parent),
            *extra,
            *TEST_FILES.values(),
        ],
        cwd=unit,
        capture_output=True,
        text=True,
        timeout=600,
        env=_with_libpython(python),
    )
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    for line in failed:
        print(f"    {line[:160]}")
    summary = lines[-1] if lines else done.stderr[-500:]
    print(f"  {summary}")
    return {o: int(n) for n, o in re.findall(r"(\d+) (\w+?)s?\b", summary) if o in OUTCOMES}


def _with_libpython(python: str) -> dict[str, str]:
    """The environment for ``python``, its LIBDIR first on ``LD_LIBRARY_PATH``:
    Triton's Python-backend stub (PyTriton's server) links its libpython."""
    libdir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    env = dict(os.environ)
    if libdir:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
    return env


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def run_example(checkout: Path, name: str, into: Path) -> dict[str, str]:
    """One example served by ferrobatch.triton: ``{"http": outcome, "grpc": outcome}``."""
    source = checkout / "examples" / name
    work = into / name
    work.mkdir(parents=True)
    missing: set[str] = set()
    for script in ("server.py", "client.py"):
        (work / script).write_text(switched((source / script).read_text(), missing))
    grpc_client = (
        (work / "client.py").read_text().replace('ModelClient("localhost"', 'ModelClient("grpc://localhost:8001"')
    )
    (work / "client_grpc.py").write_text(grpc_client)
    if _port_open(8000) or _port_open(8001):
        return {"http": "skipped: port 8000 or 8001 in use", "grpc": "skipped"}
    log = (work / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "server.py"], cwd=work, stdout=log, stderr=subprocess.STDOUT)
    outcomes: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 90
        while not _port_open(8000) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        runs = [("http", "client.py")] + ([] if name in HTTP_ONLY else [("grpc", "client_grpc.py")])
        for protocol, script in runs:
            if server.poll() is not None:
                outcomes[protocol] = f"failed: the server exited ({server.returncode})"
                continue
            try:
                done = subprocess.run([sys.executable, script], cwd=work, capture_output=True, text=True, timeout=60)
            except subprocess.TimeoutExpired:
                outcomes[protocol] = "failed: the client did not finish in 60 s"
                continue
            last = (done.stderr.strip().splitlines() or [""])[-1][:120]
            outcomes[protocol] = "passed" if done.returncode == 0 else f"failed: {last}"
        if (source / VERTEX_INFER).is_file() and server.poll() is None:
            outcomes.update(run_vertex_scripts(checkout, source))
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        server.wait()  # reaped, whatever happened: no zombie left
        log.close()
    if outcomes and any(o != "passed" for o in outcomes.values()):
        tail = (work / "server.log").read_text().strip().splitlines()[-3:]
        for line in tail:
            print(f"      server: {line[:150]}")
    return outcomes


def run_vertex_scripts(checkout: Path, source: Path) -> dict[str, str]:
    """The Vertex AI example's curl scripts, from the checkout's root as its
    test runs them: the health route must say 200 OK, and the predict
    route's answer must hold each output computed from the example's
    request body (``add``: the inputs' sum, ``sub``: their difference)."""
    import json

    import numpy as np

    def script(name: str) -> subprocess.CompletedProcess[str] | str:
        try:
            return subprocess.run(
                ["bash", str(source / name)], cwd=checkout, capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            return "failed: it did not finish in 60 s"

    outcomes: dict[str, str] = {}
    health = script(VERTEX_HEALTH)
    if isinstance(health, str):
        outcomes["vertex health"] = health
    else:
        ok = health.returncode == 0 and "200 OK" in health.stdout
        outcomes["vertex health"] = "passed" if ok else f"failed: {health.stdout.strip()[:120]!r}"
    infer = script(VERTEX_INFER)
    if isinstance(infer, str):
        outcomes["vertex infer"] = infer
        return outcomes
    sent = json.loads((source / "data.json").read_text())
    a, b = (np.asarray(i["data"], np.float32).reshape(i["shape"]) for i in sent["inputs"])
    try:
        answer = json.loads(infer.stdout[infer.stdout.index("{") :])
        got = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in answer["outputs"]}
        ok = np.array_equal(got["add"], a + b) and np.array_equal(got["sub"], a - b)
    except (ValueError, KeyError, TypeError):
        ok = False
    outcomes["vertex infer"] = "passed" if ok else f"failed: {infer.stdout.strip()[-120:]!r}"
    return outcomes


def run_notebook(checkout: Path, path: str, into: Path) -> str:
    """One notebook's code cells, run as one script in a child: its outcome."""
    import json

    cells = json.loads((checkout / "examples" / path).read_text())["cells"]
    code = []
    for cell in cells:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            code.append("\n".join(line for line in source.splitlines() if not line.lstrip().startswith("!")))
    missing: set[str] = set()
    script = into / (Path(path).stem + "_notebook.py")
    script.write_text(switched("\n\n".join(code) + "\n", missing))
    if _port_open(8000) or _port_open(8001):
        return "skipped: port 8000 or 8001 in use"
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=into, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "failed: it did not finish in 120 s"
    if done.returncode == 0:
        return "passed"
    return f"failed: {(done.stderr.strip().splitlines() or [''])[-1][:120]}"


def _test_command(test_sh: str, module: str, directory: str) -> list[str]:
    """The command a functional test's ``test.sh`` runs (its ``python -m``
    or ``pytest`` line, continuations joined), for this interpreter."""
    import shlex

    joined = re.sub(r"\\\n", " ", test_sh)
    for line in joined.splitlines():
        words = shlex.split(line.replace('"${TEST_MODULE}"', module).replace("${THIS_SCRIPT_DIR}", directory))
        if "--test-time-s" in words[:-1]:
            at = words.index("--test-time-s") + 1
            words[at] = str(min(int(words[at]), STRESS_SECONDS))
        if words[:1] == ["pytest"]:
            # Their async fixtures are plain pytest fixtures, which their pinned pytest-asyncio took.
            return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto", *words[1:]]
        if words[:1] and words[0].startswith("python") and words[1:2] and words[1].startswith("-m"):
            return [sys.executable, *words[1:]]
    raise ValueError("no python -m or pytest command in its test.sh")


def run_functional(checkout: Path, name: str, into: Path) -> str:
    """One functional test of PyTriton's, served by ferrobatch.triton: its outcome."""
    root = into / name
    missing: set[str] = set()

    def copy(relative: str, switch: bool) -> None:
        for source in (checkout / relative).rglob("*") if (checkout / relative).is_dir() else [checkout / relative]:
            if source.is_dir():
                continue
            target = root / source.relative_to(checkout)
            target.parent.mkdir(parents=True, exist_ok=True)
            if switch and source.suffix == ".py":
                # PyTriton's test tooling stays its own: it drives the test.
                text = source.read_text().replace("from pytriton.check", "from _pytriton_check")
                text = switched(text, missing).replace("from _pytriton_check", "from pytriton.check")
                target.write_text(text)
            else:
                shutil.copyfile(source, target)

    for relative in ("tests/__init__.py", "tests/functional/__init__.py", "tests/utils.py"):
        if (checkout / relative).exists():
            copy(relative, switch=True)
    copy("tests/functional/common", switch=True)
    copy(f"tests/functional/{name}", switch=True)
    tooling = root / "pytriton" / "check"
    tooling.mkdir(parents=True)
    (root / "pytriton" / "__init__.py").write_text("")
    (tooling / "__init__.py").write_text("")
    shutil.copyfile(checkout / "pytriton" / "check" / "utils.py", tooling / "utils.py")
    directory = f"tests/functional/{name}"
    command = _test_command(
        (root / directory / "test.sh").read_text(), directory.replace("/", ".") + ".test", directory
    )
    # Its scripts start "python": this interpreter, first on PATH.
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }
    log = root / "test.log"
    with log.open("w") as out:
        # A session of its own: whatever it starts (its servers) is killed with it, by its group.
        test = subprocess.Popen(
            command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = test.wait(600)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(test.pid, signal.SIGKILL)
            test.wait()
    if returncode is None:
        return "failed: it did not finish in 600 s"
    if returncode == 0:
        return "passed"
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"Error|error:|FAILED|assert", line)]
    return f"failed: {(errors or lines or [''])[-1].strip()[:140]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a local copy of the pytriton repository")
    parser.add_argument("--pytriton-python", help="an interpreter with nvidia-pytriton and pytest, to run PyTriton")
    parser.add_argument("--examples", action="store_true", help="run PyTriton's CPU examples instead of its tests")
    parser.add_argument("--functional", action="store_true", help="run PyTriton's CPU end-to-end tests instead")
    parser.add_argument(
        "--only", help="with --functional or --examples: these (comma-separated names) of FUNCTIONAL or EXAMPLES"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.functional:
        with tempfile.TemporaryDirectory(prefix="pytriton-functional-") as tmp:
            outcomes = {}
            chosen = FUNCTIONAL if args.only is None else tuple(args.only.split(","))
            unknown = sorted(set(chosen) - set(FUNCTIONAL))
            if unknown:
                raise SystemExit(f"--only: not in FUNCTIONAL: {', '.join(unknown)}")
            for name in chosen:
                outcomes[name] = run_functional(args.checkout, name, Path(tmp))
                print(f"{name}: {outcomes[name]}", flush=True)
            passed = sum(o == "passed" for o in outcomes.values())
            print(f"\nPyTriton's functional tests on ferrobatch.triton: {passed} of {len(outcomes)} passed")
        return
    if args.examples:
        with tempfile.TemporaryDirectory(prefix="pytriton-examples-") as tmp:
            results = {}
            chosen = EXAMPLES if args.only is None else tuple(args.only.split(","))
            unknown = sorted(set(chosen) - set(EXAMPLES))
            if unknown:
                raise SystemExit(f"--only: not in EXAMPLES: {', '.join(unknown)}")
            for name in chosen:
                print(f"{name}:", flush=True)
                results[name] = run_example(args.checkout, name, Path(tmp))
                for protocol, outcome in results[name].items():
                    print(f"  {protocol}: {outcome}", flush=True)
            for path in NOTEBOOKS if args.only is None else ():
                print(f"{path}:", flush=True)
                results[path] = {"notebook": run_notebook(args.checkout, path, Path(tmp))}
                print(f"  notebook: {results[path]['notebook']}", flush=True)
            passed = sum(o == "passed" for r in results.values() for o in r.values())
            total = sum(len(r) for r in results.values())
            print(f"\nexamples served by ferrobatch.triton: {passed} of {total} client and notebook runs passed")
        return
    absent = [path for path in TEST_FILES if not (args.checkout / path).is_file()]
    if absent:
        raise SystemExit(f"{args.checkout} has no {', '.join(absent)}")
    with tempfile.TemporaryDirectory(prefix="pytriton-suite-") as tmp:
        counts = {}
        if args.pytriton_python:
            print(f"PyTriton ({args.pytriton_python}):")
            unit = copy_suite(args.checkout, Path(tmp) / "pytriton", switch=False, missing=set())
            counts["pytriton"] = run(os.path.abspath(args.pytriton_python), unit, args.pytest_args)
        missing: set[str] = set()
        unit = copy_suite(args.checkout, Path(tmp) / "ferrobatch", switch=True, missing=missing)
        print("ferrobatch.triton (imports switched):")
        counts["ferrobatch"] = run(sys.executable, unit, args.pytest_args)
        if missing:
            print("names ferrobatch.triton does not have (tests using them fail):")
            for name in sorted(missing):
                print(f"  {name}")
        print()
        print(f"{'':<12}" + "".join(f"{o:>9}" for o in OUTCOMES))
        for system, c in counts.items():
            print(f"{system:<12}" + "".join(f"{c.get(o, 0):>9}" for o in OUTCOMES))
    shutil.rmtree(Path(tmp), ignore_errors=True)


if __name__ == "__main__":
    main()
