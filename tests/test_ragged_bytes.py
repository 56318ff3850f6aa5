"""BYTES tensors with a variable first dimension (``TensorSpec("text",
"bytes", (-1,), ragged=...)``): rows of several numbers of elements in one
batch, padded with ``b""`` or jagged, collated in Rust; outputs cut back to
each caller's own elements; the token budget counts elements; and the same
over HTTP (JSON, binary) and gRPC with tritonclient, on both front-ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import gevent_hub_freed
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []


def shout(words: list[bytes]) -> list[bytes]:
    """What the models do to a row: reversed, upper-cased, marked."""
    return [w.upper() + b"!" for w in reversed(words)]


def padded_model(rec: Recorder) -> Any:
    def model(batch: dict[str, Any]) -> dict[str, Any]:
        text, lengths = batch["text"], batch["text_lengths"]
        assert isinstance(text, np.ndarray) and text.dtype == object
        assert isinstance(lengths, torch.Tensor) and lengths.dtype == torch.int64
        rec.batches.append({"shape": text.shape, "lengths": lengths.tolist(), "text": text.copy()})
        out = np.full(text.shape, b"garbage", dtype=object)  # past each row's length: never sent
        for i, n in enumerate(lengths.tolist()):
            out[i, :n] = shout(list(text[i, :n]))
        return {"out": out, "out_lengths": lengths, "count": lengths.clone()}

    return model


def jagged_model(rec: Recorder) -> Any:
    def model(batch: dict[str, Any]) -> dict[str, Any]:
        text, offsets = batch["text"], batch["text_offsets"]
        assert isinstance(text, np.ndarray) and text.dtype == object and text.ndim == 1
        rec.batches.append({"shape": text.shape, "offsets": offsets.tolist()})
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
        out = [w for a, b in bounds for w in shout(list(text[a:b]))]
        return {"out": out, "out_offsets": offsets, "count": offsets[1:] - offsets[:-1]}

    return model


def make_server(mode: str, rec: Recorder, name: str = "words", **kwargs: Any) -> fb.Server:
    kwargs.setdefault("max_delay", 0.02)
    return fb.Server(
        padded_model(rec) if mode == "pad" else jagged_model(rec),
        inputs=[fb.TensorSpec("text", "bytes", (-1,), ragged=mode)],
        outputs=[fb.TensorSpec("out", "bytes", (-1,), ragged=mode), fb.TensorSpec("count", "int64", ())],
        name=name,
        **kwargs,
    )


def words(i: int, n: int) -> list[bytes]:
    return [b"w%d-" % i + b"x" * ((i * 7 + j * 3) % 11) for j in range(n)]


LENGTHS = [3, 1, 5, 0, 7, 2]


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_rows_of_several_lengths_in_one_batch_each_caller_gets_its_own(mode: str) -> None:
    rec = Recorder()
    server = make_server(mode, rec, max_batch_elements=256)
    samples: list[Any] = [words(i, n) for i, n in enumerate(LENGTHS)]
    samples[1] = "h\u00e9llo"  # one str: a row of one element, UTF-8

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with server:
            client = server.client()
            singles = await asyncio.gather(*(client.infer({"text": s}) for s in samples))
            two_rows = await client.infer_batch({"text": np.array([[b"a", b"b", b"c"], [b"d", b"", b"e"]])})
            return singles, two_rows

    singles, two_rows = asyncio.run(main())
    for sample, out in zip(samples, singles):
        row = [sample.encode()] if isinstance(sample, str) else sample
        assert isinstance(out["out"], np.ndarray) and out["out"].dtype == object
        assert out["out"].tolist() == shout(row)
        assert out["count"].item() == len(row)
    assert two_rows["out"].tolist() == [shout([b"a", b"b", b"c"]), shout([b"d", b"", b"e"])]
    big = max(rec.batches, key=lambda b: b["shape"][0] if mode == "pad" else len(b["offsets"]))
    if mode == "pad":
        rows, longest = big["shape"]
        assert rows > 1 and longest == max(big["lengths"])
        for row, n in zip(big["text"], big["lengths"]):
            assert all(e == b"" for e in row[n:]), row  # padded with b""
    else:
        offsets = big["offsets"]
        assert len(offsets) > 2 and big["shape"] == (offsets[-1],)


def test_inner_dimensions_and_a_multi_row_output_padded_with_empty_bytes() -> None:
    def model(batch: dict[str, Any]) -> dict[str, Any]:
        pairs = batch["pairs"]  # [B, L, 2]
        return {
            "joined": np.vectorize(lambda a: a + b"+", otypes=[object])(pairs),
            "joined_lengths": batch["pairs_lengths"],
        }

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("pairs", "bytes", (-1, 2), ragged="pad")],
        outputs=[fb.TensorSpec("joined", "bytes", (-1, 2), ragged="pad")],
        max_delay=0.02,
        max_batch_elements=64,
    )

    async def main() -> list[dict[str, Any]]:
        async with server:
            client = server.client()
            return await asyncio.gather(
                client.infer({"pairs": [[b"a", b"b"]]}),
                client.infer({"pairs": [[b"c", b"d"], [b"e", b"f"]]}),
            )

    one, two = asyncio.run(main())
    assert one["joined"].tolist() == [[b"a+", b"b+"]]
    assert two["joined"].tolist() == [[b"c+", b"d+"], [b"e+", b"f+"]]


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_the_token_budget_counts_elements_and_keeps_fifo(mode: str) -> None:
    rec = Recorder()
    server = make_server(mode, rec, max_batch_elements=20, max_delay=0)
    lengths = [8, 8, 8, 2, 2, 20, 1]
    samples = [words(i, n) for i, n in enumerate(lengths)]

    async def main() -> list[dict[str, Any]]:
        async with server:
            client = server.client()
            with pytest.raises(fb.InvalidInputError, match=r"'text'.*length 21 exceeds max_batch_elements \(20\)"):
                await client.infer({"text": words(0, 21)})
            return await asyncio.gather(*(client.infer({"text": s}) for s in samples))

    for sample, out in zip(samples, asyncio.run(main())):
        assert out["out"].tolist() == shout(sample)
    seen = []
    for b in rec.batches:
        if mode == "pad":
            rows, longest = b["shape"]
            assert rows * longest <= 20, b
            seen.extend(b["lengths"])
        else:
            assert b["offsets"][-1] <= 20, b
            seen.extend(y - x for x, y in zip(b["offsets"], b["offsets"][1:]))
    assert seen == lengths  # none overtaken
    assert server.stats()["dispatch_reasons"]["next_does_not_fit"] >= 2


def test_bad_inputs_are_refused_naming_the_input() -> None:
    rec = Recorder()
    server = make_server("pad", rec, max_batch_elements=64)

    async def main() -> list[str]:
        errors = []
        async with server:
            client = server.client()
            for value in ([1, 2], [[b"a"], [b"b"]], torch.zeros(3), 5):
                with pytest.raises(fb.InvalidInputError) as info:
                    await client.infer({"text": value})
                errors.append(str(info.value))
            with pytest.raises(fb.InvalidInputError, match="over the limit"):
                await client.infer({"text": [b"x" * (16 << 20 | 1)]})
            assert (await client.infer({"text": [b"ok"]}))["out"].tolist() == [b"OK!"]
        return errors

    errors = asyncio.run(main())
    assert all(e.startswith("input 'text'") for e in errors), errors
    assert "(L: any length)" in errors[1], errors


def test_model_outputs_with_bad_lengths_or_elements_are_model_errors() -> None:
    def model(batch: dict[str, Any]) -> dict[str, Any]:
        text = batch["text"]
        if text[0, 0] == b"n":
            return {"out": np.full(text.shape, 1, dtype=object), "out_lengths": batch["text_lengths"],
                    "count": batch["text_lengths"]}  # fmt: skip
        return {"out": text, "out_lengths": batch["text_lengths"] + 5, "count": batch["text_lengths"]}

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("text", "bytes", (-1,), ragged="pad")],
        outputs=[fb.TensorSpec("out", "bytes", (-1,), ragged="pad"), fb.TensorSpec("count", "int64", ())],
    )

    async def main() -> None:
        async with server:
            with pytest.raises(fb.ModelError, match="out_lengths"):
                await server.client().infer({"text": [b"a"]})
            with pytest.raises(fb.ModelError, match="bytes or str"):
                await server.client().infer({"text": [b"n"]})

    asyncio.run(main())


@contextlib.contextmanager
def serving(frontend: str) -> Iterator[tuple[str, str]]:
    rec = Recorder()
    servers = [
        make_server("pad", rec, max_batch_elements=64),
        make_server("jagged", rec, "jagged", max_batch_elements=64),
    ]
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"


@pytest.fixture(params=["native", "python"], scope="module")
def addresses(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with serving(request.param) as addresses:
        yield addresses


@pytest.mark.parametrize("model", ["words", "jagged"])
def test_tritonclient_http_json_binary_and_grpc(addresses: tuple[str, str], model: str) -> None:
    http, grpc_address = addresses
    hclient = httpclient.InferenceServerClient(http, concurrency=4)
    try:
        meta = hclient.get_model_metadata(model)
        assert meta["inputs"][0] == {"name": "text", "datatype": "BYTES", "shape": [-1, -1]}
    finally:
        hclient.close()

    @gevent_hub_freed()
    def call(i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        # 1 or 2 rows of 1 to 6 strings each (a request's rows share a length).
        n, rows = 1 + i % 6, 1 + i % 2
        text = np.array([words(10 * i + r, n) for r in range(rows)], dtype=object)
        if i % 3 == 2:
            client: Any = grpcclient.InferenceServerClient(grpc_address)
            tensor: Any = grpcclient.InferInput("text", list(text.shape), "BYTES")
            tensor.set_data_from_numpy(text)
            outputs = None
        else:
            binary = i % 3 == 1
            client = httpclient.InferenceServerClient(http)
            tensor = httpclient.InferInput("text", list(text.shape), "BYTES")
            tensor.set_data_from_numpy(text, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in ("out", "count")]
        try:
            result = client.infer(model, [tensor], outputs=outputs)
        finally:
            client.close()
        return text, {o: result.as_numpy(o) for o in ("out", "count")}

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(12)))
    for i, (text, out) in enumerate(results):
        got = [[e.encode() if isinstance(e, str) else e for e in row] for row in out["out"].tolist()]
        assert got == [shout(list(row)) for row in text], i
        assert out["count"].tolist() == [text.shape[1]] * text.shape[0]


def test_bad_requests_over_http_are_400_naming_the_input(addresses: tuple[str, str]) -> None:
    http, _ = addresses

    def body(shape: list[int], data: list[Any]) -> bytes:
        return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape, "data": data}]}).encode()

    with httpx.Client(base_url=f"http://{http}", timeout=30) as client:
        cases = {
            "no length dimension": body([1], ["a"]),
            "over the token budget": body([1, 65], ["a"] * 65),
            "numbers": body([1, 2], [1, 2]),
            "too few elements": body([1, 3], ["a", "b"]),
        }
        for case, content in cases.items():
            response = client.post("/v2/models/words/infer", content=content)
            assert response.status_code == 400, (case, response.text)
            assert "'text'" in response.json()["error"], (case, response.text)
        ok = client.post("/v2/models/words/infer", content=body([1, 64], ["a"] * 64))
        assert ok.status_code == 200, ok.text
        assert ok.json()["outputs"][0]["shape"] == [1, 64]


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_one_poisoned_request_fails_alone_in_process_and_natively(mode: str) -> None:
    rec = Recorder()
    inner = padded_model(rec) if mode == "pad" else jagged_model(rec)

    def model(batch: dict[str, Any]) -> dict[str, Any]:
        if any(w == b"poison" for w in batch["text"].ravel()):
            raise ValueError("poisoned text")
        return inner(batch)

    def server() -> fb.Server:
        return fb.Server(
            model,
            inputs=[fb.TensorSpec("text", "bytes", (-1,), ragged=mode)],
            outputs=[fb.TensorSpec("out", "bytes", (-1,), ragged=mode), fb.TensorSpec("count", "int64", ())],
            name="words",
            max_batch_size=len(LENGTHS),
            max_delay=5.0,
        )

    rows = [words(i, n) for i, n in enumerate(LENGTHS)]
    rows[2] = [b"a", b"poison"]

    async def in_process() -> list[Any]:
        async with server() as s:
            return await asyncio.gather(
                *(s.client().infer({"text": np.array(r, dtype=object)}) for r in rows), return_exceptions=True
            )

    results = asyncio.run(in_process())
    assert [i for i, r in enumerate(results) if isinstance(r, BaseException)] == [2]
    for i, (r, out) in enumerate(zip(rows, results)):
        if i != 2:
            assert list(out["out"]) == shout(r) and int(out["count"]) == len(r)

    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    with serve_in_thread([server()], config) as listening:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}", concurrency=len(rows))
        try:
            pending = []
            for i, r in enumerate(rows):
                text = httpclient.InferInput("text", [1, len(r)], "BYTES")
                text.set_data_from_numpy(np.array([r], dtype=object), binary_data=i % 2 == 0)
                pending.append(client.async_infer("words", [text]))
            for i, (r, p) in enumerate(zip(rows, pending)):
                if i == 2:
                    with pytest.raises(InferenceServerException, match="failed: ValueError"):
                        p.get_result()
                    continue
                assert p.get_result().as_numpy("out").tolist() == [shout(r)]
        finally:
            client.close()


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_warmup_runs_rows_of_one_empty_element(mode: str) -> None:
    rec = Recorder()

    async def main() -> None:
        async with make_server(mode, rec, max_batch_size=4, warmup=True):
            pass

    asyncio.run(main())
    assert [b["shape"] for b in rec.batches] == ([(n, 1) for n in (1, 2, 4)] if mode == "pad" else [(1,), (2,), (4,)])
    if mode == "pad":
        assert all(b["text"].ravel().tolist() == [b""] * b["shape"][0] for b in rec.batches)
