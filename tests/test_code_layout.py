"""The binding crate's modules form layers: no import circle among them
(each concern has one owner, and reading one module never needs another
that needs it back)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXT = ROOT / "rust" / "ext" / "src"
PACKAGE = ROOT / "python" / "ferrobatch"


def package_files() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*.py") if "_pb2" not in p.name]
    assert len(files) >= 30, PACKAGE  # the package was found
    return files


def module_graph() -> dict[str, set[str]]:
    """Module -> the sibling modules it names (``crate::name``)."""
    modules = {p.stem for p in EXT.glob("*.rs")} - {"lib"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        text = (EXT / f"{name}.rs").read_text()
        used = set(re.findall(r"crate::([a-z_]+)", text)) & modules
        graph[name] = used - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_binding_crate_has_no_import_circle() -> None:
    graph = module_graph()
    assert len(graph) >= 10, graph  # the crate's modules were found
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_dtype_table_is_the_cores_alone() -> None:
    """Python's dtype names, v2 datatypes and gRPC contents fields are read
    from the core (``_core.dtypes()``), never restated."""
    restated = re.compile(r'"FP32"\s*:|"float32"\s*:\s*torch\.float32|"fp32_contents"')
    found = [str(p.relative_to(PACKAGE)) for p in package_files() if restated.search(p.read_text())]
    assert found == []
    from ferrobatch import _core
    from ferrobatch.http.protocol import DATATYPES

    assert DATATYPES["FP32"] == "float32" and DATATYPES["BYTES"] == "bytes"
    assert ("float16", "FP16", None) in _core.dtypes()


def test_content_coding_is_the_native_front_ends_alone() -> None:
    """The Python front-ends undo and apply gzip/deflate with the native
    front-end's code (``_core.inflate``/``compress``/``response_coding``)."""
    coded = [
        str(p.relative_to(PACKAGE)) for p in package_files() if re.search(r"^import (zlib|gzip)", p.read_text(), re.M)
    ]
    assert coded == []


def test_every_way_in_waits_in_the_cores_pending_table() -> None:
    """Event loops, blocked threads, native connections and shared-memory
    clients each keep their requests in the core's ``Pending`` table (which
    owns register-before-queue, withdrawal and exactly-once counting);
    nothing else keeps a table of requests by id."""
    owners = {
        "rust/ext/src/mailbox.rs": "event loops",
        "rust/ext/src/threads.rs": "blocked threads",
        "rust/serve/src/replies.rs": "native connections",
        "rust/core/src/shm/server.rs": "shared-memory clients",
    }
    for path, way_in in owners.items():
        assert re.search(r"pending: Pending<", (ROOT / path).read_text()), way_in
    tables = re.compile(r"HashMap<u64,|pending: Py<PyDict>")
    found = [
        str(p.relative_to(ROOT))
        for d in ("rust/ext/src", "rust/serve/src", "rust/core/src")
        for p in (ROOT / d).rglob("*.rs")
        if p.name != "pending.rs" and tables.search(p.read_text())
    ]
    assert found == []


def test_the_worker_pipeline_is_the_executor_bases() -> None:
    """The weight gate, the version output, failure isolation and the worker
    loop live in ``_executor.py`` (a CUDA instance's launch thread takes its
    batches itself, and uses the same gate and isolation)."""
    rules = {
        r"\.gate\b": {"_executor.py"},  # every model call holds it through Executor.gated()
        r"\bisolate\(": {"_executor.py"},
        r"version_rows\(": {"_executor.py"},
        r"\.next_batch\(\)": {"_executor.py", "_cuda.py"},
    }
    files = package_files()
    for pattern, owners in rules.items():
        found = {p.name for p in files if re.search(pattern, p.read_text())}
        assert found == owners, (pattern, found)


def test_the_grpc_infer_rules_are_the_native_front_ends_alone() -> None:
    """The Python servicer reads ModelInfer requests and writes their answers
    with the native front-end's code (``_core.GrpcInferRequest``,
    ``grpc_response``): none of the rules is restated in Python."""
    rules = re.compile(
        r"raw_input_contents has|has both contents|int64 of microseconds|'classification' parameter|class result not"
    )
    found = [str(p.relative_to(PACKAGE)) for p in package_files() if rules.search(p.read_text())]
    assert found == []
