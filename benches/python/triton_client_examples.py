"""Triton's own client examples, run against ferrobatch.

    python benches/python/triton_client_examples.py <triton client checkout> [--frontends native,python] [--id NAME]

Serves, with ferrobatch, the models the Python examples of Triton's client repository
(``src/python/examples`` of triton-inference-server/client) call, as Triton's example model
repository defines them: ``simple`` (INT32 ``[16]`` sum and difference), ``simple_int8``,
``simple_string`` (the same on numbers written as BYTES), ``simple_identity`` (BYTES),
``repeat_int32`` (decoupled, without batching: one response per element of ``IN``),
``custom_identity_int32``, ``simple_sequence`` (the sequence examples' model, see
:class:`Sequences`) and ``densenet_onnx`` (DenseNet's tensors, ``data_0`` FP32
``[3, 224, 224]`` NCHW to ``fc6_1`` FP32 ``[1000, 1, 1]`` with a label per class, computed by a
small stand-in: the examples check the answers' form, not ImageNet's classes). Then runs each
example as it is, in a process of its own pointed at the server (``-u``), and prints which passed.

``simple_http_model_control.py`` runs against a server of its own in explicit model control
mode, serving seven of these models (it counts the repository's seven; ``repeat_int32`` is left
out): it loads ``simple``, is refused a configuration that is no JSON, reloads it with
``max_batch_size`` 16 and unloads it.

The examples that need what ferrobatch does not serve are listed, not run: CUDA shared memory,
the dynamic sequence models (``-d``), ensembles, the gRPC model-control client (it expects
``INTERNAL`` for a ``file:`` parameter, where ferrobatch answers ``INVALID_ARGUMENT``: a client's
bad input is never a 500), and the memory soak.
The server is started with Triton's own server id, ``"triton"`` (``ServeConfig(server_id=)``,
``ferrobatch serve --id``), which the health examples check; ``--id ferrobatch`` shows them fail.
``image_client.py``'s HTTP mode needs the ``attrdict`` package (``pip install attrdict``); without
it that run is skipped. The checkout is read, never copied: nothing of Triton's code is part of
ferrobatch. Exit status 0 when every run passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

#: Examples not run, and why.
NOT_SERVED = {
    "simple_grpc_cudashm_client.py": "CUDA shared memory",
    "simple_http_cudashm_client.py": "CUDA shared memory",
    "ensemble_image_client.py": "ensembles",
    "simple_grpc_model_control.py": "expects StatusCode.INTERNAL for a file: parameter too long; ferrobatch"
    " answers INVALID_ARGUMENT (a client's bad input is never a 500)",
    "memory_growth_test.py": "a memory soak, not an example",
}


def has_attrdict() -> bool:
    """Whether ``image_client.py``'s HTTP mode can run (it imports ``attrdict`` after patching
    ``collections`` as it does)."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import collections, collections.abc\n"
            "for t in collections.abc.__all__: setattr(collections, t, getattr(collections.abc, t))\n"
            "import attrdict",
        ],
        capture_output=True,
    )
    return done.returncode == 0


def image_arguments(image: Path) -> list[str]:
    return ["-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION", str(image)]


def runs(image: Path, grpc_url: str, http_url: str) -> Iterator[tuple[str, list[str]]]:
    """``(example, arguments)`` for each run: each example once, the image clients in
    each of their modes."""
    grpc, http = ["-u", grpc_url], ["-u", http_url]
    for name in (
        "grpc_client.py",
        "grpc_explicit_byte_content_client.py",
        "grpc_explicit_int8_content_client.py",
        "grpc_explicit_int_content_client.py",
        "simple_grpc_aio_infer_client.py",
        "simple_grpc_async_infer_client.py",
        "simple_grpc_custom_args_client.py",
        "simple_grpc_custom_repeat.py",
        "simple_grpc_health_metadata.py",
        "simple_grpc_infer_client.py",
        "simple_grpc_keepalive_client.py",
        "simple_grpc_sequence_stream_infer_client.py",
        "simple_grpc_sequence_sync_infer_client.py",
        "simple_grpc_aio_sequence_stream_infer_client.py",
        "simple_grpc_shm_client.py",
        "simple_grpc_shm_string_client.py",
        "simple_grpc_string_infer_client.py",
    ):
        yield name, grpc
    for name in (
        "simple_http_aio_infer_client.py",
        "simple_http_async_infer_client.py",
        "simple_http_health_metadata.py",
        "simple_http_infer_client.py",
        "simple_http_sequence_sync_infer_client.py",
        "simple_http_shm_client.py",
        "simple_http_shm_string_client.py",
        "simple_http_string_infer_client.py",
    ):
        yield name, http
    yield "reuse_infer_objects_client.py", ["-i", "grpc", *grpc]
    yield "reuse_infer_objects_client.py", ["-i", "http", *http]
    yield "grpc_image_client.py", [*grpc, *image_arguments(image)]
    yield "grpc_image_client.py", [*grpc, "--streaming", *image_arguments(image)]
    yield "image_client.py", ["-i", "grpc", *grpc, *image_arguments(image)]
    yield "image_client.py", ["-i", "grpc", "--streaming", *grpc, *image_arguments(image)]
    yield "image_client.py", ["-i", "grpc", "-a", *grpc, *image_arguments(image)]
    # Its HTTP mode reads the metadata through the `attrdict` package.
    if has_attrdict():
        yield "image_client.py", ["-i", "http", *http, *image_arguments(image)]
    else:
        print("  (image_client.py -i http skipped: pip install attrdict to run it)", flush=True)


# -- the models -------------------------------------------------------------------------------------


def add_sub(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    a, b = inputs["INPUT0"], inputs["INPUT1"]
    return {"OUTPUT0": a + b, "OUTPUT1": a - b}


def add_sub_strings(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    a = np.vectorize(int)(inputs["INPUT0"])
    b = np.vectorize(int)(inputs["INPUT1"])
    as_bytes = np.vectorize(lambda v: str(v).encode(), otypes=[object])
    return {"OUTPUT0": as_bytes(a + b), "OUTPUT1": as_bytes(a - b)}


def repeat(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """``repeat_int32``: each element of ``IN`` as a response of its own, after its ``DELAY``
    (ms), with its index."""
    values, delays = inputs["IN"].reshape(-1), inputs["DELAY"].reshape(-1)
    for i in range(values.numel()):
        time.sleep(int(delays[i]) / 1000 if i < delays.numel() else 0)
        # Without batching the model still sees (and answers) one leading row.
        yield {"OUT": values[i : i + 1].reshape(1, 1), "IDX": torch.tensor([[i]], dtype=torch.uint32)}


class Sequences:
    """``simple_sequence`` as the sequence examples check it: a sequence's first request
    (``sequence_start``) answers its input plus one, each later one its input; a request of a
    sequence not started (or ended by ``sequence_end``) fails. ferrobatch has no sequence
    batcher: Triton's sequence parameters reach a ``with_requests`` model as parameters, each
    stream's requests in the order it sent them, which is what this model keeps its state by."""

    def __init__(self) -> None:
        self.started: set[int | str] = set()

    def __call__(self, inputs: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        out = inputs["INPUT"].clone()
        row = 0
        for request in requests:
            sequence, rows = request.parameters.get("sequence_id"), slice(row, row + request.rows)
            if request.parameters.get("sequence_start"):
                self.started.add(sequence)
                out[rows] += 1
            elif sequence not in self.started:
                raise ValueError(f"sequence {sequence!r} was not started")
            if request.parameters.get("sequence_end"):
                self.started.discard(sequence)
            row += request.rows
        return {"OUTPUT": out}


class DenseNetStandIn(torch.nn.Module):
    """DenseNet's tensors, not its weights: channel means to 1000 scores."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.classify = torch.nn.Linear(3, 1000)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        scores = torch.softmax(self.classify(inputs["data_0"].mean(dim=(-2, -1))), dim=-1)
        return {"fc6_1": scores.reshape(-1, 1000, 1, 1)}


def servers() -> list[fb.Server]:
    def tensor(name: str, dtype: str, shape: tuple[int, ...], **kw: object) -> fb.TensorSpec:
        return fb.TensorSpec(name, dtype, shape, **kw)  # type: ignore[arg-type]

    def pair(dtype: str) -> list[fb.TensorSpec]:
        return [tensor("INPUT0", dtype, (16,)), tensor("INPUT1", dtype, (16,))]

    def outs(dtype: str) -> list[fb.TensorSpec]:
        return [tensor("OUTPUT0", dtype, (16,)), tensor("OUTPUT1", dtype, (16,))]

    return [
        fb.Server(add_sub, inputs=pair("int32"), outputs=outs("int32"), max_batch_size=8, name="simple"),
        fb.Server(add_sub, inputs=pair("int8"), outputs=outs("int8"), max_batch_size=8, name="simple_int8"),
        fb.Server(add_sub_strings, inputs=pair("bytes"), outputs=outs("bytes"), max_batch_size=8, name="simple_string"),
        fb.Server(
            lambda b: {"OUTPUT0": b["INPUT0"]},
            inputs=[tensor("INPUT0", "bytes", (16,))],
            outputs=[tensor("OUTPUT0", "bytes", (16,))],
            max_batch_size=8,
            name="simple_identity",
        ),
        fb.Server(
            repeat,
            inputs=[
                tensor("IN", "int32", (-1,), ragged="pad"),
                tensor("DELAY", "uint32", (-1,), ragged="pad"),
                tensor("WAIT", "uint32", (1,)),
            ],
            outputs=[tensor("OUT", "int32", (1,)), tensor("IDX", "uint32", (1,))],
            batching=False,
            decoupled=True,
            name="repeat_int32",
        ),
        fb.Server(
            lambda b: {"OUTPUT0": b["INPUT0"]},
            inputs=[tensor("INPUT0", "int32", (-1,), ragged="pad")],
            outputs=[tensor("OUTPUT0", "int32", (-1,), ragged="pad")],
            max_batch_size=8,
            name="custom_identity_int32",
        ),
        fb.Server(
            Sequences(),
            inputs=[tensor("INPUT", "int32", (1,))],
            outputs=[tensor("OUTPUT", "int32", (1,))],
            max_batch_size=8,
            with_requests=True,
            name="simple_sequence",
        ),
        fb.Server(
            DenseNetStandIn(),
            inputs=[tensor("data_0", "float32", (3, 224, 224), format="NCHW")],
            outputs=[tensor("fc6_1", "float32", (1000, 1, 1), labels=tuple(f"CLASS_{i}" for i in range(1000)))],
            batching=False,
            name="densenet_onnx",
        ),
    ]


# -- running them -----------------------------------------------------------------------------------


def write_image(folder: Path) -> Path:
    from PIL import Image

    path = folder / "mug.jpg"
    pixels = np.random.default_rng(0).integers(0, 255, size=(240, 320, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def run_all(
    examples: Path, frontend: str, server_id: str, image: Path, timeout_s: float
) -> list[tuple[str, str, bool, str]]:
    """Each run's ``(example, arguments shown, passed, output)`` against one front-end."""
    config = ServeConfig(
        http_port=0, grpc_port=0, frontend=frontend, allow_client_shm=True, log_level="warning", server_id=server_id
    )
    results = []
    with serve_in_thread(servers(), config) as listening:
        grpc_url, http_url = f"127.0.0.1:{listening.grpc_port}", f"127.0.0.1:{listening.http_port}"
        for name, arguments in runs(image, grpc_url, http_url):
            results.append(run_one(examples, frontend, name, arguments, timeout_s, (grpc_url, http_url, str(image))))
    # Model control: a repository of seven models, in explicit mode.
    seven = [s for s in servers() if s.name != "repeat_int32"]
    config = dataclasses.replace(config, model_control_mode="explicit")
    with serve_in_thread(seven, config) as listening:
        http_url = f"127.0.0.1:{listening.http_port}"
        name, arguments = "simple_http_model_control.py", ["-u", http_url]
        results.append(run_one(examples, frontend, name, arguments, timeout_s, (http_url,)))
    return results


def run_one(
    examples: Path, frontend: str, name: str, arguments: list[str], timeout_s: float, hidden: tuple[str, ...]
) -> tuple[str, str, bool, str]:
    """Runs one example, in a process of its own; ``(example, arguments shown, passed, output)``."""
    command = [sys.executable, str(examples / name), *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=examples)
        passed, output = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as timed_out:
        passed, output = False, f"timed out after {timeout_s} s: {timed_out.stdout or ''}"
    shown = " ".join(a for a in arguments if a not in (*hidden, "-u"))
    print(f"  [{frontend}] {'passed' if passed else 'FAILED'}  {name} {shown}", flush=True)
    if not passed:
        print("    " + "\n    ".join(output.strip().splitlines()[-8:]), flush=True)
    return name, shown, passed, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a checkout of triton-inference-server/client")
    parser.add_argument("--frontends", default="native,python")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per example run")
    parser.add_argument("--id", default="triton", help="the server's name in its metadata (default Triton's)")
    args = parser.parse_args()
    examples = args.checkout / "src" / "python" / "examples"
    if not examples.is_dir():
        sys.exit(f"{examples} is not a folder: pass a checkout of triton-inference-server/client")
    present = {p.name for p in examples.glob("*.py")}
    with tempfile.TemporaryDirectory(prefix="triton_examples-") as tmp:
        image = write_image(Path(tmp))
        totals = []
        for frontend in args.frontends.split(","):
            print(f"ferrobatch serve --frontend {frontend}:", flush=True)
            results = run_all(examples, frontend, args.id, image, args.timeout)
            totals.append((frontend, sum(p for _, _, p, _ in results), len(results)))
    ran = {name for name, _ in runs(Path("x"), "", "")} | {"image_client.py", "simple_http_model_control.py"}
    unknown = sorted(present - ran - set(NOT_SERVED))
    print()
    print("not run, and why:")
    for name, why in sorted(NOT_SERVED.items()):
        print(f"  {name}: {why}")
    if unknown:
        print("in the checkout, not known here:", ", ".join(unknown))
    for frontend, passed, total in totals:
        print(
            f"Triton's client examples on ferrobatch ({frontend} front-end, id {args.id!r}):"
            f" {passed} of {total} runs passed"
        )
    os._exit(0 if all(p == t for _, p, t in totals) else 1)


if __name__ == "__main__":
    main()
