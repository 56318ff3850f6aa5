"""Heap allocations per request of the native front-end, a build beside its base.

    python benches/python/allocs.py --base 54d8418                 # binary, gRPC and JSON
    python benches/python/allocs.py --base 54d8418 --protocols grpc --seconds 5

builds ``ferrobatch._core`` at ``--base`` and at the working tree (as
``ab_builds.py`` does, each with its own Python package), and for each build: installs it, starts ``ferrobatch
serve`` with ``bench_serve.py``'s models on core 0, puts perf uprobes on the
allocator's entry points, loads the identity model with wrk or h2load (256
connections, on core 1) and counts the calls per answered request with ``perf
stat``. The Rust side allocates from mimalloc, linked into the extension
(``mi_malloc_aligned``, ``mi_zalloc_aligned``, ``mi_realloc_aligned``,
``mi_free``); Python and torch from the C library's ``malloc`` and ``free``,
counted beside them.

Counts, not times: a shared machine's speed moves by a third within an hour,
its allocation counts do not (the probes slow the server several times over,
so its requests per second here mean nothing). Needs root (uprobes) and
``perf`` (Debian's ``linux-perf``); the probes it adds are removed at the end,
and the working tree's build is put back.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import ab_builds  # beside this file, as bench_serve.py imports serve_loadgen
import bench_serve

GROUP = "fballocs"
#: Event names are perf's across groups: distinct from any other probe's.
RUST = (("fb_alloc", "mi_malloc_aligned"), ("fb_zalloc", "mi_zalloc_aligned"), ("fb_realloc", "mi_realloc_aligned"))
RUST_FREE = ("fb_free", "mi_free")
C = (("fb_c_malloc", "malloc"), ("fb_c_free", "free"))


def libc_path() -> str:
    """The C library this interpreter runs with (its mapped file)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "/libc.so" in path or "/libc-" in path:
            return path
    raise SystemExit("no C library mapped in this process")


def add_probes(library: Path) -> list[str]:
    """Probes on the allocator's entry points; their event names."""
    remove_probes()
    events = []
    for name, function in (*RUST, RUST_FREE):
        subprocess.run(["perf", "probe", "-q", "-x", str(library), "-a", f"{GROUP}:{name}={function}"], check=True)
        events.append(f"{GROUP}:{name}")
    for name, function in C:
        subprocess.run(["perf", "probe", "-q", "-x", libc_path(), "-a", f"{GROUP}:{name}={function}"], check=True)
        events.append(f"{GROUP}:{name}")
    return events


def remove_probes() -> None:
    subprocess.run(["perf", "probe", "-q", "-d", f"{GROUP}:*"], check=False, capture_output=True)


def count(protocol: str, seconds: float, extension: Path, logs: Path) -> dict[str, float]:
    """Allocator calls per answered request of one protocol's identity load,
    the server running ``extension`` (the probed file)."""
    native = bench_serve.Native(["identity"], [protocol])
    with bench_serve.ferrobatch_server(logs / f"ferrobatch-{protocol}.log", cpu="0") as endpoint:
        native._load(endpoint, protocol, "identity", 256, 1.0, "1")  # warm: connections, first batches
        events = add_probes(extension)
        perf = subprocess.Popen(
            ["perf", "stat", "-x", ",", "-e", ",".join(events), "-p", str(endpoint.pid)],
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.3)
        load = native._load(endpoint, protocol, "identity", 256, seconds, "1")
        time.sleep(0.2)
        perf.send_signal(2)
        _, err = perf.communicate()
    counted: dict[str, float] = {}
    for line in err.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[2].startswith(f"{GROUP}:") and fields[0].replace(".", "").isdigit():
            counted[fields[2].removeprefix(f"{GROUP}:")] = float(fields[0]) / max(load.requests, 1)
    counted["requests"] = float(load.requests)
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--protocols", default="binary,grpc,json")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    missing = bench_serve.loadgen.tools_missing() + (["perf"] if shutil.which("perf") is None else [])
    if missing:
        raise SystemExit(f"needs perf, wrk, h2load and taskset: missing {missing}")
    protocols = args.protocols.split(",")
    builds = ab_builds.builds_of(args.base)
    results: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="allocs-") as tmp, ab_builds.installed_kept():
        try:
            for label, build in builds.items():
                with build.installed():
                    for protocol in protocols:
                        results[label, protocol] = count(protocol, args.seconds, build.extension, Path(tmp))
        finally:
            remove_probes()
    labels = list(builds)
    print(f"\nallocator calls per request, identity, 256 connections, {args.seconds:g} s each")
    print(f"{'protocol':9} {'build':24} {'Rust allocs':>11} {'Rust frees':>10} {'C mallocs':>9} {'requests':>9}")
    for protocol in protocols:
        for label in labels:
            r = results[label, protocol]
            allocs = sum(r.get(name, 0.0) for name, _ in RUST)
            print(
                f"{protocol:9} {label[:24]:24} {allocs:11.2f} {r.get('fb_free', 0.0):10.2f}"
                f" {r.get('fb_c_malloc', 0.0):9.2f} {r['requests']:9.0f}"
            )
        base, tree = (sum(results[label, protocol].get(n, 0.0) for n, _ in RUST) for label in labels)
        print(f"{protocol:9} {'working tree / base':24} {tree / base if base else float('nan'):11.2f}")


if __name__ == "__main__":
    main()
