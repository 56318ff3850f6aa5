"""Command line: ``ferrobatch demo`` and ``ferrobatch serve`` (or ``python -m ferrobatch ...``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ferrobatch",
        description="Auto-batching inference for torch models: a load demo, and a model"
        " server speaking the Open Inference Protocol v2 (KServe v2) over HTTP and gRPC.",
        epilog="Run 'ferrobatch COMMAND --help' for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    from .serve import _count, _positive, _positive_seconds, _seconds
    from .server import MAX_BATCH_SIZE

    # Checked here: a bad number is a usage error naming its flag, not a traceback from deep inside.
    demo = commands.add_parser("demo", help="serve a built-in MLP in process to concurrent callers")
    demo.add_argument("--callers", type=_count, default=256, help="concurrent callers (default 256)")
    demo.add_argument("--seconds", type=_positive_seconds, default=5.0, help="how long to run (default 5)")
    demo.add_argument("--max-batch-size", type=_positive("a whole number", MAX_BATCH_SIZE), default=64)
    demo.add_argument("--max-delay", type=_seconds, default=0.001, help="seconds (default 0.001)")
    demo.add_argument("--width", type=_count, default=256, help="MLP width (default 256)")
    demo.add_argument(
        "--torch-threads",
        type=_count,
        default=1,
        help="torch intra-op threads for the model (default 1: batches this small gain nothing "
        "from more, and extra threads fight the event loop for the cores)",
    )

    from .serve import add_arguments as add_serve_arguments
    from .serve import check_arguments

    serve = commands.add_parser(
        "serve",
        help="serve models over HTTP and gRPC (Open Inference Protocol v2)",
        description="Serve ferrobatch Servers over HTTP and gRPC (Open Inference Protocol v2)"
        " until SIGINT or SIGTERM, then shut down gracefully.",
    )
    add_serve_arguments(serve)

    args = parser.parse_args(argv)
    if args.command == "serve" and (problem := check_arguments(args)) is not None:
        serve.error(problem)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(
            callers=args.callers,
            seconds=args.seconds,
            max_batch_size=args.max_batch_size,
            max_delay=args.max_delay,
            width=args.width,
            torch_threads=args.torch_threads,
        )
    if args.command == "serve":
        from .serve import main as serve_main

        return serve_main(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
