"""TorchRL's own test suite for its InferenceServer, run against the
installed TorchRL and against ``ferrobatch.torchrl`` with only the import
block switched; prints both counts side by side.

It fetches nothing: give it a local copy of TorchRL's
``test/test_inference_server.py`` (from a checkout of pytorch/rl, e.g.
``git show HEAD:test/test_inference_server.py > /tmp/test_inference_server.py``).
The copy is rewritten in a temporary directory (never in this repository):
the names ``from torchrl.modules.inference_server import (...)`` brings in
are taken from ``ferrobatch.torchrl`` where it has them, and from TorchRL
where it does not yet (each such name is listed: tests that use only those
do not exercise ferrobatch at all).

    python benches/python/torchrl_suite.py /tmp/test_inference_server.py
    python benches/python/torchrl_suite.py /tmp/test_inference_server.py -- -k Threading -x
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

IMPORT = re.compile(r"from torchrl\.modules\.inference_server import \(([^)]*)\)", re.S)
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def switched(source: str) -> tuple[str, list[str], list[str]]:
    """The test file with its import block switched to ferrobatch.torchrl;
    the names ferrobatch provides, and those still taken from TorchRL."""
    import ferrobatch.torchrl as ours

    match = IMPORT.search(source)
    if match is None:
        raise SystemExit("no `from torchrl.modules.inference_server import (...)` block in the file")
    names = [n.strip() for n in match.group(1).split(",") if n.strip()]
    mine = [n for n in names if hasattr(ours, n)]
    theirs = [n for n in names if n not in mine]
    block = f"from ferrobatch.torchrl import ({', '.join(mine)})\n"
    if theirs:
        block += f"from torchrl.modules.inference_server import ({', '.join(theirs)})\n"
    return source[: match.start()] + block + source[match.end() :], mine, theirs


def run(test_file: Path, extra: list[str]) -> dict[str, int]:
    """pytest on ``test_file``; its outcome counts."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            "--timeout=120",
            str(test_file),
            *extra,
        ],
        cwd=test_file.parent,
        capture_output=True,
        text=True,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    counts = {o: int(n) for n, o in re.findall(r"(\d+) (\w+?)s?\b", summary) if o in OUTCOMES}
    print(f"  {summary}")
    for line in done.stdout.splitlines():  # each failure by name (-rf)
        if line.startswith("FAILED "):
            print(f"    {line.split(' - ')[0]}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, help="a local copy of TorchRL's test/test_inference_server.py")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    source = args.test_file.read_text()
    with tempfile.TemporaryDirectory(prefix="torchrl-suite-") as tmp:
        original = Path(tmp, "torchrl") / "test_inference_server.py"
        ours = Path(tmp, "ferrobatch") / "test_inference_server.py"
        original.parent.mkdir()
        ours.parent.mkdir()
        original.write_text(source)
        text, mine, theirs = switched(source)
        ours.write_text(text)
        print(f"from ferrobatch.torchrl: {', '.join(mine)}")
        print(f"still from torchrl (missing in ferrobatch.torchrl): {', '.join(theirs) or '-'}")
        print("TorchRL's InferenceServer:")
        baseline = run(original, args.pytest_args)
        print("ferrobatch.torchrl:")
        switched_counts = run(ours, args.pytest_args)
    print("\n| outcome | TorchRL | ferrobatch.torchrl |\n| --- | ---: | ---: |")
    for outcome in OUTCOMES:
        if baseline.get(outcome) or switched_counts.get(outcome):
            print(f"| {outcome} | {baseline.get(outcome, 0)} | {switched_counts.get(outcome, 0)} |")


if __name__ == "__main__":
    main()
