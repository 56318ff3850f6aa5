"""Two builds of the extension, side by side on a noisy machine.

A shared machine's speed moves by a third within an hour (the bare hyper echo of
``bench_serve.py`` read 58k to 109k req/s on the same day), so a change to the Rust
hot path is only measured against its base in alternating runs:

    python benches/python/ab_builds.py --base fe8d543 --rounds 5 -- \\
        --models identity --servers ferrobatch --protocols binary,grpc,json --callers 256

builds ``ferrobatch._core`` at ``--base`` (a git worktree, its own cargo target
directory) and at the working tree, then runs ``bench_serve.py`` with the arguments
after ``--`` (``--runs 1`` each time) ``--rounds`` times for each build, alternating
them. ``--bench e2e`` runs ``bench_e2e.py`` instead (every system it runs: requests/s and
p50/p99 latency), ``--bench submit`` runs ``bench_submit.py``
(ns per submit); for example:

    python benches/python/ab_builds.py --base 8ba4789 --bench e2e --rounds 5 -- \\
        --systems ferrobatch --delays 0,0.001 --callers 64,512 --torch-threads 0
 Each build runs with its own Python package: the base's is copied from its
worktree (into ``target/ab-base/python``) and put first on ``PYTHONPATH`` for its
runs, so a change to the Python side, or one that spans both, is measured whole
(the bench scripts are the working tree's for both). It prints, per case
(server, protocol, model and connections for ``serve``), each build's medians
(requests/s and server CPU per request for ``serve``) and their ratio, writes every run (with its ``build``) to
``--out`` when given, and puts the working tree's build back. Its runs are
``bench_serve.py``'s, not that bench's latest results: they are kept out of
``benches/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python"  # the folder holding the working tree's ferrobatch package
INSTALLED = PACKAGE / "ferrobatch" / "_core.abi3.so"
BASE = ROOT / "target" / "ab-base"


@dataclass(frozen=True)
class Build:
    """One build to measure: its extension and the folder holding the
    ``ferrobatch`` package it goes with."""

    library: Path
    package: Path

    @property
    def extension(self) -> Path:
        """Where :meth:`installed` puts the library: the file servers load."""
        return self.package / "ferrobatch" / "_core.abi3.so"

    @contextmanager
    def installed(self) -> Iterator[None]:
        """This build for every server started meanwhile: its extension in its
        package and, for a package other than the working tree's, that
        package first on ``PYTHONPATH`` (wrap in :func:`installed_kept`)."""
        shutil.copy2(self.library, self.extension)
        if self.package == PACKAGE:
            yield
            return
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.package), before]))
        try:
            yield
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before


def build(source: Path, target: Path) -> Path:
    """The extension built from the checkout at ``source`` into ``target``."""
    subprocess.run(
        ["cargo", "build", "--release", "-p", "ferrobatch-ext", "--target-dir", str(target)],
        cwd=source,
        check=True,
    )
    return target / "release" / "lib_core.so"


def builds_of(base: str) -> dict[str, Build]:
    """The builds at commit ``base`` (a git worktree, removed after: its
    package is copied out) and of the working tree, by label."""
    short = subprocess.run(
        ["git", "rev-parse", "--short", base], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="ab_builds-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), short], cwd=ROOT, check=True)
        try:
            shutil.rmtree(BASE / "python", ignore_errors=True)
            shutil.copytree(tree / "python", BASE / "python")
            return {
                f"base {short}": Build(build(tree, BASE), BASE / "python"),
                "working tree": Build(build(ROOT, ROOT / "target"), PACKAGE),
            }
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=True)


@contextmanager
def installed_kept() -> Iterator[None]:
    """Puts the installed extension back as it was, whatever ran in between."""
    with tempfile.TemporaryDirectory(prefix="ab_builds-") as tmp:
        kept = Path(tmp) / "installed.so"
        shutil.copy2(INSTALLED, kept)
        try:
            yield
        finally:
            shutil.copy2(kept, INSTALLED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each build, alternating (default 5)")
    parser.add_argument("--out", help="a JSON-lines file for every run (default: none)")
    parser.add_argument("--bench", choices=sorted(BENCHES), default="serve", help="which bench (default serve)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench's arguments")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    if any(a.startswith(("--runs", "--out", "--report")) for a in bench_args):
        parser.error("--runs, --out and --report are this script's")
    bench = BENCHES[args.bench]
    builds = builds_of(args.base)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="ab_builds-") as tmp, installed_kept():
        for round_ in range(args.rounds):
            for label, build_ in builds.items():
                out = Path(tmp) / f"run-{round_}-{len(rows)}"
                cmd = [sys.executable, str(ROOT / "benches/python" / bench.script), *bench_args]
                with build_.installed():
                    subprocess.run([*cmd, *bench.out_args(out)], cwd=ROOT, check=True)
                for line in Path(f"{out}.jsonl").read_text().splitlines():
                    row = json.loads(line)
                    if not bench.keep(row):
                        continue
                    row.update(build=label, round=round_, command=" ".join(["ab_builds.py", *sys.argv[1:]]))
                    rows.append(row)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    bench.report(rows, list(builds))


def report_serve(rows: list[dict[str, object]], labels: list[str]) -> None:
    """Medians of each build per case, and the working tree's over the base's."""
    cases = sorted({(str(r["server"]), str(r["protocol"]), str(r["model"]), int(str(r["callers"]))) for r in rows})
    print(f"\nmedians of {len({r['round'] for r in rows})} alternating runs per build")
    head = f"{'server':16} {'proto':6} {'model':10} {'C':>4}"
    for label in labels:
        head += f" {label[:16]:>16} {'cpu us':>7}"
    print(head + "   ratio")
    for server, protocol, model, callers in cases:
        line = f"{server:16} {protocol:6} {model:10} {callers:4}"
        rps = []
        for label in labels:
            mine = [
                r
                for r in rows
                if (r["server"], r["protocol"], r["model"], r["callers"], r["build"])
                == (server, protocol, model, callers, label)
            ]
            rate = statistics.median(float(str(r["rps"])) for r in mine)
            cpu = statistics.median(float(str(r["server_cpu_us"])) for r in mine)
            rps.append(rate)
            line += f" {rate:16.0f} {cpu:7.1f}"
        print(line + f"   {rps[-1] / rps[0]:.2f}x")


def report_e2e(rows: list[dict[str, object]], labels: list[str]) -> None:
    """Each system's medians per configuration: requests/s (and the working
    tree's over the base's), p50 and p99 latency. A system that is not
    ferrobatch's runs the same code in both builds: its ratio is the noise."""
    cases = sorted(
        {(str(r["system"]), str(r["model"]), float(str(r["max_delay"])), int(str(r["callers"]))) for r in rows}
    )
    print(f"\nmedians of {len({r['round'] for r in rows})} alternating runs per build")
    head = f"{'system':16} {'model':10} {'delay':>6} {'C':>4}"
    for label in labels:
        head += f" {label[:16]:>16} {'p50 us':>7} {'p99 us':>7}"
    print(head + "   ratio")
    for system, model, delay, callers in cases:
        line = f"{system[:16]:16} {model:10} {delay:6g} {callers:4}"
        rps = []
        for label in labels:
            case = (system, model, delay, callers, label)
            mine = [r for r in rows if (r["system"], r["model"], r["max_delay"], r["callers"], r["build"]) == case]
            rate = statistics.median(float(str(r["requests_per_s"])) for r in mine)
            rps.append(rate)
            p50 = statistics.median(float(str(r["p50_us"])) for r in mine)
            p99 = statistics.median(float(str(r["p99_us"])) for r in mine)
            line += f" {rate:16.0f} {p50:7.0f} {p99:7.0f}"
        print(line + f"   {rps[-1] / rps[0]:.2f}x")


def report_submit(rows: list[dict[str, object]], labels: list[str]) -> None:
    """ferrobatch's median ns per submit, per build."""
    print(f"\nmedians of {len({r['round'] for r in rows})} alternating runs per build (ns per submit)")
    medians = []
    for label in labels:
        runs = sorted(float(str(r["median_ns"])) for r in rows if r["build"] == label)
        medians.append(statistics.median(runs))
        print(f"{label[:16]:>16} {medians[-1]:8.0f}   runs: {', '.join(f'{v:.0f}' for v in runs)}")
    print(f"{'ratio':>16} {medians[-1] / medians[0]:8.2f}x")


@dataclass(frozen=True)
class Bench:
    """A bench ``ab_builds`` can run: its script, how it is told where to
    write, which of its rows are compared, and how they are reported."""

    script: str
    out_args: Callable[[Path], list[str]]
    keep: Callable[[dict[str, Any]], bool]
    report: Callable[[list[dict[str, object]], list[str]], None]


BENCHES = {
    "serve": Bench("bench_serve.py", lambda out: ["--runs", "1", "--out", str(out)], lambda r: True, report_serve),
    "e2e": Bench(
        "bench_e2e.py",
        lambda out: ["--runs", "1", "--no-plot", "--out", str(out)],
        lambda r: r.get("kind") == "result" and "requests_per_s" in r,
        report_e2e,
    ),
    "submit": Bench(
        "bench_submit.py",
        lambda out: ["--out", f"{out}.jsonl"],
        lambda r: r.get("kind") == "result" and r.get("system") == "ferrobatch",
        report_submit,
    ),
}


if __name__ == "__main__":
    main()
