"""Models with BYTES and variable-length (``-1``) tensors behind the native
listener: decoded and encoded in Rust like fixed tensors, no Python per
request. A multi-row request's output rows of several lengths are padded to
its longest (``pad_value``, ``b""`` for BYTES) over JSON, binary and gRPC;
parameters, forwarded headers and priority reach such models as they reach
fixed ones; readiness says ready."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import ferrobatch as fb
from ferrobatch.http._native import NativeListeners
from ferrobatch.serve import ServeConfig, serve_in_thread

PAD = -7


def keep_nonzero(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each row's non-zero tokens, in order: output rows of their own lengths."""
    tokens, lengths = batch["tokens"], batch["tokens_lengths"]
    kept = [row[:n][row[:n] != 0] for row, n in zip(tokens, lengths.tolist())]
    out = torch.full((len(kept), max((len(k) for k in kept), default=0)), 999, dtype=torch.int64)
    for i, k in enumerate(kept):
        out[i, : len(k)] = k
    return {"kept": out, "kept_lengths": torch.tensor([len(k) for k in kept], dtype=torch.int64)}


def split_words(batch: dict[str, Any]) -> dict[str, Any]:
    """Each row's one string, split on spaces: BYTES rows of their own lengths."""
    words = [row[0].split() for row in batch["text"]]
    out = np.full((len(words), max((len(w) for w in words), default=0)), b"?", dtype=object)
    for i, w in enumerate(words):
        out[i, : len(w)] = w
    return {"words": out, "words_lengths": torch.tensor([len(w) for w in words], dtype=torch.int64)}


class Counting:
    """Counts the Python handlers' calls (the native listener's fallback)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        http_fallback, grpc_fallback = NativeListeners._fallback, NativeListeners._grpc_fallback

        def http(listeners: NativeListeners, method: str, path: str, *rest: Any) -> Any:
            self.calls.append(f"{method} {path}")
            return http_fallback(listeners, method, path, *rest)

        def grpc(listeners: NativeListeners, method: str, *rest: Any) -> Any:
            self.calls.append(method)
            return grpc_fallback(listeners, method, *rest)

        monkeypatch.setattr(NativeListeners, "_fallback", http)
        monkeypatch.setattr(NativeListeners, "_grpc_fallback", grpc)


@contextlib.contextmanager
def serving(**overrides: Any) -> Iterator[tuple[str, str]]:
    servers = [
        fb.Server(
            keep_nonzero,
            inputs=[fb.TensorSpec("tokens", "int64", (-1,), ragged="pad")],
            outputs=[fb.TensorSpec("kept", "int64", (-1,), ragged="pad", pad_value=PAD)],
            name="kept",
            max_delay=0.005,
        ),
        fb.Server(
            split_words,
            inputs=[fb.TensorSpec("text", "bytes", (1,))],
            outputs=[fb.TensorSpec("words", "bytes", (-1,), ragged="pad")],
            name="words",
            max_delay=0.005,
        ),
    ]
    config = ServeConfig(http_port=0, grpc_port=0, frontend="native", log_level="warning", **overrides)
    with serve_in_thread(servers, config) as listening:
        yield f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"


def test_multi_row_outputs_of_several_lengths_are_padded_natively(monkeypatch: pytest.MonkeyPatch) -> None:
    python = Counting(monkeypatch)
    tokens = np.array([[1, 0, 0, 2], [3, 4, 5, 6], [0, 0, 0, 0]], dtype=np.int64)
    expected = [[1, 2, PAD, PAD], [3, 4, 5, 6], [PAD, PAD, PAD, PAD]]
    text = np.array([[b"a bb ccc"], [b"z"]], dtype=object)
    with serving() as (http, grpc_address):
        with httpclient.InferenceServerClient(http) as hclient:
            for binary in (False, True):
                given = httpclient.InferInput("tokens", list(tokens.shape), "INT64")
                given.set_data_from_numpy(tokens, binary_data=binary)
                wanted = httpclient.InferRequestedOutput("kept", binary_data=binary)
                assert hclient.infer("kept", [given], outputs=[wanted]).as_numpy("kept").tolist() == expected
                words = httpclient.InferInput("text", [2, 1], "BYTES")
                words.set_data_from_numpy(text, binary_data=binary)
                wanted = httpclient.InferRequestedOutput("words", binary_data=binary)
                got = hclient.infer("words", [words], outputs=[wanted]).as_numpy("words")
                as_bytes = [[w if isinstance(w, bytes) else w.encode() for w in row] for row in got.tolist()]
                assert as_bytes == [[b"a", b"bb", b"ccc"], [b"z", b"", b""]], binary  # JSON gives str
            one = httpclient.InferInput("tokens", [1, 3], "INT64")
            one.set_data_from_numpy(np.array([[0, 9, 0]], dtype=np.int64))
            assert hclient.infer("kept", [one]).as_numpy("kept").tolist() == [[9]]  # one row: its own length
        with grpcclient.InferenceServerClient(grpc_address) as gclient:
            given = grpcclient.InferInput("tokens", list(tokens.shape), "INT64")
            given.set_data_from_numpy(tokens)
            assert gclient.infer("kept", [given]).as_numpy("kept").tolist() == expected
            words = grpcclient.InferInput("text", [2, 1], "BYTES")
            words.set_data_from_numpy(text)
            got = gclient.infer("words", [words]).as_numpy("words")
            assert got.tolist() == [[b"a", b"bb", b"ccc"], [b"z", b"", b""]]
            assert gclient.is_model_ready("kept") and gclient.is_model_ready("words")
    assert python.calls == [], "no Python handler answers inference"


def test_a_variable_length_model_with_parameters_and_forwarded_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTriton's usual model: a ``(-1,)`` input and ``use_parameters_and_headers``."""
    python = Counting(monkeypatch)
    seen: list[dict[str, Any]] = []

    def model(batch: dict[str, torch.Tensor], requests: list[fb.RequestInfo]) -> dict[str, torch.Tensor]:
        seen.extend(r.parameters for r in requests)
        divisor = torch.tensor([float(r.parameters.get("x-divisor", 1)) for r in requests])
        return {"out": batch["values"] / divisor[:, None], "out_lengths": batch["values_lengths"]}

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("values", "float32", (-1,), ragged="pad")],
        outputs=[fb.TensorSpec("out", "float32", (-1,), ragged="pad")],
        name="div",
        with_requests=True,
        max_delay=0.005,
    )
    patterns = {"http_header_forward_pattern": "^x-", "grpc_header_forward_pattern": "^x-"}
    config = ServeConfig(http_port=0, grpc_port=0, frontend="native", log_level="warning", **patterns)
    body = {"inputs": [{"name": "values", "datatype": "FP32", "shape": [1, 3], "data": [2, 4, 6]}]}
    with serve_in_thread([server], config) as listening:
        url = f"http://127.0.0.1:{listening.http_port}/v2/models/div/infer"
        plain = httpx.post(url, json={**body, "parameters": {"priority": 1}}, headers={"x-divisor": "2"}, timeout=30)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{listening.grpc_port}") as triton:
            tensor = grpcclient.InferInput("values", [1, 2], "FP32")
            tensor.set_data_from_numpy(np.array([[3, 9]], dtype=np.float32))
            reply = triton.infer("div", [tensor], parameters={"note": "x"}, headers={"x-divisor": "3"})
    assert plain.status_code == 200, plain.text
    assert plain.json()["outputs"][0]["data"] == [1, 2, 3]
    assert reply.as_numpy("out").tolist() == [[1, 3]]
    assert {"priority": 1, "x-divisor": "2"} in seen and {"note": "x", "x-divisor": "3"} in seen, seen
    assert python.calls == []
