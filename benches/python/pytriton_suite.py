"""PyTriton's own unit tests of its decorators, run against ``ferrobatch.triton``
with only their imports switched, beside PyTriton itself; prints both counts.

It fetches nothing: give it a local checkout of triton-inference-server/pytriton
(``git clone https://github.com/triton-inference-server/pytriton``, or any
copy holding ``tests/unit/``). The test files are copied into a temporary
directory (never into this repository) and each ``from pytriton.X import
names`` becomes ``from ferrobatch.triton.X import names``. A name
ferrobatch.triton does not have (a private helper of PyTriton's, or
something not built yet) is bound to a stand-in that fails the test using it
with ``NotImplementedError`` naming it, and is listed, so each count is
honest: a test that needs a missing name fails.

PyTriton itself runs the unmodified copies with ``--pytriton-python`` (an
interpreter with ``nvidia-pytriton`` and pytest installed, e.g. the one
``make bench-serve-deps`` makes in ``.venv-pytriton``).

    python benches/python/pytriton_suite.py ~/src/pytriton
    python benches/python/pytriton_suite.py ~/src/pytriton --pytriton-python .venv-pytriton/bin/python -- -x
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: The suites run: PyTriton's decorator tests (what a model author's code
#: touches), and the helpers they import from their own package.
TEST_FILES = ("test_decorators.py", "test_decorators_batch.py")
HELPERS = ("__init__.py", "utils.py")

FROM_IMPORT = re.compile(r"^from pytriton((?:\.\w+)*) import (\([^)]*\)|[^\n]*)", re.M)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")

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
        module = f"ferrobatch.triton{match.group(1)}"
        names = [n.strip() for n in match.group(2).strip("()").split(",") if n.strip()]
        try:
            ours = importlib.import_module(module)
        except ImportError:
            ours = None
        have = [n for n in names if ours is not None and hasattr(ours, n.split(" as ")[0])]
        lines = [f"from {module} import ({', '.join(have)})"] if have else []
        for name in names:
            if name not in have:
                missing.add(f"pytriton{match.group(1)}.{name}")
                alias = name.split(" as ")[-1]
                lines.append(f"{alias} = _Missing('pytriton{match.group(1)}.{name}')")
        return "\n".join(lines)

    body = FROM_IMPORT.sub(replace, source)
    return STAND_IN + body if "_Missing(" in body else body


def copy_suite(checkout: Path, into: Path, *, switch: bool, missing: set[str]) -> Path:
    """The test files and their helpers under ``into/tests/unit``."""
    unit = into / "tests" / "unit"
    unit.mkdir(parents=True)
    (into / "tests" / "__init__.py").write_text("")
    for name in (*TEST_FILES, *HELPERS):
        source = (checkout / "tests" / "unit" / name).read_text()
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
            *TEST_FILES,
        ],
        cwd=unit,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    for line in failed:
        print(f"    {line[:160]}")
    summary = lines[-1] if lines else done.stderr[-500:]
    print(f"  {summary}")
    return {o: int(n) for n, o in re.findall(r"(\d+) (\w+?)s?\b", summary) if o in OUTCOMES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a local copy of the pytriton repository")
    parser.add_argument("--pytriton-python", help="an interpreter with nvidia-pytriton and pytest, to run PyTriton")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if not (args.checkout / "tests" / "unit" / TEST_FILES[0]).is_file():
        raise SystemExit(f"{args.checkout} has no tests/unit/{TEST_FILES[0]}")
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
