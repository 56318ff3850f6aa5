"""Regenerates the committed gRPC code from ``grpc_predict_v2.proto``.

    python python/ferrobatch/grpc/_codegen.py      (needs grpcio-tools)

Runs ``grpc_tools.protoc`` with ``python/`` as the include root, so the
generated modules import each other as ``ferrobatch.grpc.*``, then edits the
output twice:

- the messages go into a private descriptor pool instead of protobuf's default
  one: tritonclient (or any other v2 client) registers the same
  ``inference.*`` names there, and two files defining one name cannot share a
  pool. The wire format, and so compatibility, is unchanged;
- the untyped ``*_pb2_grpc.py`` is excluded from mypy, and the ``.pyi`` stub
  generated for ``*_pb2.py`` (which types the messages) may use bare generics.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # python/
PROTO = "ferrobatch/grpc/grpc_predict_v2.proto"
STEM = HERE / "grpc_predict_v2"


def main() -> int:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={ROOT}",
            f"--pyi_out={ROOT}",
            f"--grpc_python_out={ROOT}",
            PROTO,
        ],
        check=True,
    )
    pb2 = STEM.with_name(STEM.name + "_pb2.py")
    text = pb2.read_text()
    default_pool = "_descriptor_pool.Default().AddSerializedFile("
    if default_pool not in text:
        raise SystemExit(f"{pb2.name}: protoc output changed; update {Path(__file__).name}")
    pb2.write_text(text.replace(default_pool, "_descriptor_pool.DescriptorPool().AddSerializedFile("))
    pyi = STEM.with_name(STEM.name + "_pb2.pyi")
    pyi.write_text('# mypy: disable-error-code="type-arg"\n' + pyi.read_text())
    grpc_py = STEM.with_name(STEM.name + "_pb2_grpc.py")
    grpc_py.write_text("# mypy: ignore-errors\n" + grpc_py.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
