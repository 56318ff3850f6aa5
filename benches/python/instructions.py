"""Instructions per request of the native front-end, a build beside its base.

    python benches/python/instructions.py --base 0ae3af9                  # binary, gRPC and JSON
    python benches/python/instructions.py --base 0ae3af9 --protocols binary --top 20
    python benches/python/instructions.py --base 0ae3af9 --keep /tmp/profiles   # then callgrind_annotate

builds ``ferrobatch._core`` at ``--base`` and at the working tree (as
``ab_builds.py`` does, each with its own Python package), and for each build: installs it, starts ``ferrobatch
serve`` with ``bench_serve.py``'s models under valgrind's callgrind (one count
per thread, counting off until the measured load) on core 0, and for each
protocol sends the identity model ``--requests`` fixed requests with h2load
(``bench_serve.py``'s bodies; HTTP/1.1 for binary and JSON, h2c for gRPC; 256
connections, one request in flight on each, on core 1), after a warm-up of an
eighth as many. It prints the instructions executed per request by the
front-end's threads (those that ran hyper) and by the rest of the process (the
model's worker and Python), the rows per model execution, and the working
tree's ratio to the base. ``--top`` lists the front-end's costliest functions
(instructions in the function itself, per request) for each build; ``--keep``
leaves the front-end threads' profiles in a folder per build and protocol, for
``callgrind_annotate --tree=caller``.

Counts, not times: a shared machine's speed moves by a third within an hour,
the instructions a request takes do not (two builds of the same code read the
same front-end count to 0.03 %). The rest of the process varies with the batch
size callgrind's scheduling happens to give (its threads run one at a time,
about 50 times slower, so batches are smaller than at full speed): compare
builds by the front-end's column. The counts leave out the kernel (system
calls) and what instructions cost (cache misses, branches): a change that saves
instructions saves time only in proportion. The working tree's build is put
back at the end.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ab_builds  # beside this file, as bench_serve.py imports serve_loadgen
import bench_serve

CONNECTIONS = 256


@dataclass
class Counted:
    """One protocol's measured load under one build."""

    requests: int
    front_end: int  # instructions of the threads that ran hyper
    rest: int  # every other thread's
    rows_per_execution: float
    dumps: list[Path]  # the front-end threads' profiles


def h2load(endpoint: bench_serve.Endpoint, request: bench_serve.loadgen.Request, requests: int, body: Path) -> None:
    """``requests`` of ``request``, all answered, from core 1."""
    address = endpoint.grpc if request.protocol == "grpc" else endpoint.http
    cmd = ["taskset", "-c", "1", "h2load", f"-c{CONNECTIONS}", "-m1", f"-n{requests}", "-d", str(body)]
    if request.protocol != "grpc":
        cmd.append("--h1")
    for name, value in request.headers.items():
        cmd += ["-H", f"{name}: {value}"]
    cmd.append(f"http://{address}{request.path}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    found = re.search(r"^requests: .* (\d+) succeeded", done.stdout, re.MULTILINE)
    status = re.search(r"^status codes: (\d+) 2xx", done.stdout, re.MULTILINE)
    if done.returncode != 0 or not found or int(found.group(1)) != requests or not status:
        raise RuntimeError(f"h2load did not get {requests} answers:\n{done.stdout}{done.stderr}")
    if int(status.group(1)) != requests:
        raise RuntimeError(f"not every answer was a 2xx:\n{done.stdout}")


def callgrind_control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def totals(dump: Path) -> tuple[int, bool]:
    """(instructions, whether the thread ran hyper) of one thread's profile."""
    text = dump.read_text(errors="replace")
    found = re.search(r"^totals: (\d+)", text, re.MULTILINE)
    return (int(found.group(1)) if found else 0), "hyper::proto" in text


def count(protocols: list[str], requests: int, tmp: Path) -> dict[str, Counted]:
    """Each protocol's instructions per request under the installed build."""
    native = bench_serve.Native(["identity"], protocols)
    dumps = Path(tempfile.mkdtemp(prefix="dumps-", dir=tmp))
    counted = {}
    callgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes"]
    callgrind.append(f"--callgrind-out-file={dumps}/callgrind.%p")
    with bench_serve.ferrobatch_server(tmp / "ferrobatch.log", "0", wrapper=callgrind, ready_seconds=600) as endpoint:
        for protocol in protocols:
            request = native.requests[protocol, "identity"]
            bench_serve.loadgen.check(request, endpoint.http, endpoint.grpc, native.expected["identity"])
            body = tmp / f"{protocol}.body"
            body.write_bytes(request.body)
            h2load(endpoint, request, max(requests // 8, CONNECTIONS), body)  # connections, first batches
            rows, executions = bench_serve.scrape_batches(endpoint.metrics, "identity")
            before = set(dumps.iterdir())
            callgrind_control(endpoint.pid, "--zero")
            callgrind_control(endpoint.pid, "--instr=on")
            h2load(endpoint, request, requests, body)
            callgrind_control(endpoint.pid, f"--dump={protocol}")
            callgrind_control(endpoint.pid, "--instr=off")
            rows_after, executions_after = bench_serve.scrape_batches(endpoint.metrics, "identity")
            time.sleep(0.5)  # the dump's files are written by then
            front_end, rest, front_dumps = 0, 0, []
            for dump in sorted(set(dumps.iterdir()) - before):
                instructions, ran_hyper = totals(dump)
                if ran_hyper:
                    front_end += instructions
                    front_dumps.append(dump)
                else:
                    rest += instructions
            executed = executions_after - executions
            counted[protocol] = Counted(
                requests, front_end, rest, (rows_after - rows) / executed if executed else float("nan"), front_dumps
            )
    return counted


def top_functions(dumps: list[Path], requests: int, limit: int) -> list[tuple[float, str]]:
    """The front-end's costliest functions: (instructions per request, name)."""
    costs: dict[str, int] = {}
    for dump in dumps:
        done = subprocess.run(
            ["callgrind_annotate", "--threshold=100", str(dump)], capture_output=True, text=True, check=True
        )
        for line in done.stdout.splitlines():
            found = re.match(r"^\s*([\d,]+) \([ \d.]+%\)\s+(\S.*?)\s*(\[.*\])?$", line)
            if found and "PROGRAM TOTALS" not in line:
                name = found.group(2).split(":", 1)[-1]
                costs[name] = costs.get(name, 0) + int(found.group(1).replace(",", ""))
    ranked = sorted(costs.items(), key=lambda item: -item[1])[:limit]
    return [(cost / requests, name) for name, cost in ranked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--protocols", default="binary,grpc,json")
    parser.add_argument("--requests", type=int, default=10240, help="measured requests per protocol")
    parser.add_argument("--top", type=int, default=0, help="list the front-end's N costliest functions")
    parser.add_argument("--keep", type=Path, help="a folder to leave the threads' profiles in")
    args = parser.parse_args()
    tools = ("valgrind", "callgrind_control", "callgrind_annotate", "h2load", "taskset")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"needs valgrind, h2load and taskset: missing {missing}")
    protocols = args.protocols.split(",")
    builds = ab_builds.builds_of(args.base)
    results: dict[str, dict[str, Counted]] = {}
    tops: dict[tuple[str, str], list[tuple[float, str]]] = {}
    with tempfile.TemporaryDirectory(prefix="instructions-") as tmp, ab_builds.installed_kept():
        for label, build in builds.items():
            run = Path(tempfile.mkdtemp(prefix="build-", dir=tmp))
            with build.installed():
                results[label] = count(protocols, args.requests, run)
            for protocol, counted in results[label].items():
                if args.top:
                    tops[label, protocol] = top_functions(counted.dumps, counted.requests, args.top)
                if args.keep:
                    kept = args.keep / re.sub(r"\W+", "-", label) / protocol
                    kept.mkdir(parents=True, exist_ok=True)
                    for dump in counted.dumps:
                        shutil.copy2(dump, kept / dump.name)
    labels = list(builds)
    print(f"\ninstructions per request, identity, {CONNECTIONS} connections, {args.requests} requests each")
    print(f"{'protocol':9} {'build':24} {'front-end':>10} {'rest':>9} {'total':>9} {'rows/exec':>9}")
    for protocol in protocols:
        for label in labels:
            r = results[label][protocol]
            print(
                f"{protocol:9} {label[:24]:24} {r.front_end / r.requests:10.0f} {r.rest / r.requests:9.0f}"
                f" {(r.front_end + r.rest) / r.requests:9.0f} {r.rows_per_execution:9.1f}"
            )
        base, tree = (results[label][protocol] for label in labels)
        print(
            f"{protocol:9} {'working tree / base':24} {tree.front_end / base.front_end:10.3f}"
            f" {tree.rest / base.rest:9.3f} {(tree.front_end + tree.rest) / (base.front_end + base.rest):9.3f}"
        )
    for (label, protocol), ranked in tops.items():
        print(f"\n{protocol}, {label}: the front-end's costliest functions (instructions per request)")
        for cost, name in ranked:
            print(f"{cost:9.0f}  {name[:110]}")


if __name__ == "__main__":
    main()
