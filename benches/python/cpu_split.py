"""Server CPU per request by thread, user and kernel, beside the bare hyper echo.

    python benches/python/cpu_split.py                                # binary, 3 rounds of 300,000 requests
    python benches/python/cpu_split.py --protocols binary,grpc,json --requests 100000 --rounds 2
    python benches/python/cpu_split.py --base 3e364ae --rounds 6         # that commit's build in turn too

``bench_serve.py`` reads a server's CPU per request for its whole process
tree. This splits it: ``ferrobatch serve`` (``bench_serve.py``'s models, as it
starts them, on core 0) and the echo (``rust/serve/examples/echo.rs``, the
front-end's stack with no model, on core 0) take turns, each sent
``--requests`` of the bench's identity requests by h2load on core 1 (256
connections, one request in flight on each; HTTP/1.1 for binary and JSON, h2c
for gRPC) after 20,000 unmeasured ones, and each thread's utime and stime
(``/proc/PID/task/TID/stat``) over the measured requests is divided by them.
It prints, per protocol and round, the front-end's thread (the one with the
most kernel time: it does the sockets' work), the other threads (the model's
worker, Python's), and the echo's, each with its context switches per 1,000
requests (``/proc/PID/task/TID/status``, voluntary and not); then medians
over the rounds. What ferrobatch adds to a request over the stack it is
built on is the difference. With
``--base``, ferrobatch at that commit (built, with its own Python package, as
``ab_builds.py`` does) takes its turn in each round too, and the working tree's
build is put back at the end.

The clock ticks of ``/proc`` are 10 ms: 300,000 requests at 60k/s make
about 500 ticks per thread-second, so a figure is good to about 0.1 us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import ab_builds
import bench_serve
import instructions  # its h2load driver

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Split:
    """Microseconds of CPU per request."""

    rate: float  # requests per second, as h2load paced them
    front_user: float
    front_kernel: float
    rest_user: float
    rest_kernel: float
    front_switches: float  # context switches per 1,000 requests, voluntary and not
    rest_switches: float

    @property
    def total(self) -> float:
        return self.front_user + self.front_kernel + self.rest_user + self.rest_kernel


def thread_ticks(pid: int) -> dict[str, tuple[int, int, int]]:
    """(utime, stime) clock ticks and context switches (voluntary and
    not) of each of ``pid``'s threads."""
    ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue  # a thread that ended
        fields = stat[stat.rindex(")") + 2 :].split()
        switches = 0
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                switches += int(value)
        ticks[tid] = (int(fields[11]), int(fields[12]), switches)
    return ticks


def measure(endpoint: bench_serve.Endpoint, protocol: str, requests: int, tmp: Path) -> Split:
    """One measured load of ``requests`` on ``endpoint``, split by thread."""
    native = bench_serve.Native(["identity"], [protocol])
    request = native.requests[protocol, "identity"]
    body = tmp / f"{protocol}.body"
    body.write_bytes(request.body)
    instructions.h2load(endpoint, request, 20_000, body)
    before = thread_ticks(endpoint.pid)
    started = time.perf_counter()
    instructions.h2load(endpoint, request, requests, body)
    elapsed = time.perf_counter() - started
    after = thread_ticks(endpoint.pid)
    used = {tid: tuple(a - b for a, b in zip(now, before.get(tid, (0, 0, 0)))) for tid, now in after.items()}
    front = max(used, key=lambda tid: used[tid][1])
    per = 1e6 / TICK / requests
    rest_user, rest_kernel, rest_switches = (sum(t[i] for tid, t in used.items() if tid != front) for i in range(3))
    return Split(
        requests / elapsed,
        used[front][0] * per,
        used[front][1] * per,
        rest_user * per,
        rest_kernel * per,
        used[front][2] * 1000 / requests,
        rest_switches * 1000 / requests,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocols", default="binary")
    parser.add_argument("--requests", type=int, default=300_000, help="measured requests per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each server, alternating")
    parser.add_argument("--base", help="a commit whose ferrobatch takes its turn too")
    args = parser.parse_args()
    protocols = args.protocols.split(",")
    splits: dict[tuple[str, str], list[Split]] = {}
    builds = ab_builds.builds_of(args.base) if args.base else {}
    servers: list[tuple[str, Callable[..., ContextManager[bench_serve.Endpoint]], ab_builds.Build | None]] = [
        (f"fb {label}"[:18], bench_serve.ferrobatch_server, build) for label, build in builds.items()
    ] or [("ferrobatch", bench_serve.ferrobatch_server, None)]
    servers.append(("hyper-echo", bench_serve.echo_server, None))
    with tempfile.TemporaryDirectory(prefix="cpu-split-") as tmp_name, ab_builds.installed_kept():
        tmp = Path(tmp_name)
        for round_ in range(args.rounds):
            for name, start, build in servers:
                with (
                    build.installed() if build else nullcontext(),
                    start(tmp / f"{name.replace(' ', '-')}.log", "0") as endpoint,
                ):
                    for protocol in protocols:
                        split = measure(endpoint, protocol, args.requests, tmp)
                        splits.setdefault((name, protocol), []).append(split)
                        print(
                            f"round {round_ + 1} {name:18} {protocol:6} {split.rate:8.0f} req/s"
                            f"  front-end user {split.front_user:5.2f} kernel {split.front_kernel:5.2f}"
                            f"  other threads user {split.rest_user:5.2f} kernel {split.rest_kernel:5.2f}"
                            f"  total {split.total:5.2f} us/request"
                            f"  switches/1k front-end {split.front_switches:5.1f} others {split.rest_switches:5.1f}",
                            flush=True,
                        )
    print(f"\nmedians of {args.rounds} round(s), {args.requests} requests each, us of CPU per request")
    print(
        f"{'server':18} {'proto':6} {'req/s':>8} {'fe user':>8} {'fe kernel':>10} {'others':>7} {'total':>7}"
        f" {'fe cs/1k':>9} {'oth cs/1k':>9}"
    )
    for (name, protocol), runs in splits.items():
        median = {
            field: statistics.median(getattr(r, field) for r in runs)
            for field in ("rate", "front_user", "front_kernel", "total", "front_switches", "rest_switches")
        }
        others = statistics.median(r.rest_user + r.rest_kernel for r in runs)
        print(
            f"{name:18} {protocol:6} {median['rate']:8.0f} {median['front_user']:8.2f}"
            f" {median['front_kernel']:10.2f} {others:7.2f} {median['total']:7.2f}"
            f" {median['front_switches']:9.1f} {median['rest_switches']:9.1f}"
        )


if __name__ == "__main__":
    main()
