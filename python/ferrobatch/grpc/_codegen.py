"""Regenerates the committed gRPC code from ``grpc_predict_v2.proto``, or
checks that the committed code is what the proto generates.

    python python/ferrobatch/grpc/_codegen.py            # rewrite the generated files
    python python/ferrobatch/grpc/_codegen.py --check    # exit 1 if they differ (CI)

The generator is pinned: ``grpcio-tools`` :data:`GRPCIO_TOOLS`, fetched with
pip (no dependencies, into a temporary folder) whatever the environment holds,
so every run writes the same bytes. Its protoc (protobuf 29) stamps the code
with gencode version 5.29.0, and protobuf's runtime check only asks the runtime
to be at least as new as the gencode, so the modules load on protobuf 5.29
through 7: the range ``pyproject.toml`` declares, and what tritonclient (which
caps protobuf below 7) can share a process with. A newer grpcio-tools would
stamp its own protobuf version and raise that floor.

The generator runs ``grpc_tools.protoc`` with ``python/`` as the include root,
so the generated modules import each other as ``ferrobatch.grpc.*``, then
edits the output twice:

- the messages go into a private descriptor pool instead of protobuf's default
  one: tritonclient (or any other v2 client) registers the same
  ``inference.*`` names there, and two files defining one name cannot share a
  pool. The wire format, and so compatibility, is unchanged;
- the untyped ``*_pb2_grpc.py`` is excluded from mypy, and the ``.pyi`` stub
  generated for ``*_pb2.py`` (which types the messages) may use bare generics.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: The generator's version (see the module docstring before changing it).
GRPCIO_TOOLS = "1.71.2"

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # python/
PROTO = "ferrobatch/grpc/grpc_predict_v2.proto"
STEM = "grpc_predict_v2"
GENERATED = (f"{STEM}_pb2.py", f"{STEM}_pb2.pyi", f"{STEM}_pb2_grpc.py")


def generate(out: Path) -> None:
    """Writes the edited generated files for :data:`PROTO` into ``out``."""
    tools = out / "_tools"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--root-user-action=ignore",
            "--no-deps",
            "--only-binary=:all:",
            "--target",
            str(tools),
            f"grpcio-tools=={GRPCIO_TOOLS}",
        ],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=str(tools))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            PROTO,
        ],
        check=True,
        env=env,
    )
    gen = out / Path(PROTO).parent
    pb2 = gen / GENERATED[0]
    text = pb2.read_text()
    default_pool = "_descriptor_pool.Default().AddSerializedFile("
    if default_pool not in text:
        raise SystemExit(f"{pb2.name}: protoc output changed; update {Path(__file__).name}")
    pb2.write_text(text.replace(default_pool, "_descriptor_pool.DescriptorPool().AddSerializedFile("))
    pyi = gen / GENERATED[1]
    pyi.write_text('# mypy: disable-error-code="type-arg"\n' + pyi.read_text())
    grpc_py = gen / GENERATED[2]
    grpc_py.write_text("# mypy: ignore-errors\n" + grpc_py.read_text())
    for name in GENERATED:
        (out / name).write_bytes((gen / name).read_bytes())


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(f"usage: {Path(__file__).name} [--check]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        stale = [name for name in GENERATED if (out / name).read_bytes() != _read(HERE / name)]
        if check:
            if stale:
                print(
                    f"{', '.join(stale)}: not what {Path(PROTO).name} generates with grpcio-tools "
                    f"{GRPCIO_TOOLS}; run python python/ferrobatch/grpc/_codegen.py",
                    file=sys.stderr,
                )
                return 1
            return 0
        for name in stale:
            (HERE / name).write_bytes((out / name).read_bytes())
            print(f"wrote {name}")
    return 0


def _read(path: Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
