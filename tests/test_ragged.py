"""Variable-length tensors (a shape starting with -1): rows of several
lengths in one batch, padded or jagged, collated in Rust; outputs of -1
cut back to each caller's own length; the token budget
(``max_batch_elements``); and the same over HTTP and gRPC with tritonclient."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.serve import ServeConfig, serve_in_thread

PAD = -7
LENGTHS = [3, 1, 5, 0, 7, 2, 6, 4]


def spec(mode: str, name: str = "tokens") -> fb.TensorSpec:
    return fb.TensorSpec(name, "int64", (-1,), ragged=mode, pad_value=PAD)


class Recorder:
    """Remembers what each batch looked like."""

    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []


def padded_model(rec: Recorder) -> Any:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens, lengths = batch["tokens"], batch["tokens_lengths"]
        rec.batches.append({"shape": tuple(tokens.shape), "lengths": lengths.tolist(), "tokens": tokens.clone()})
        mask = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
        # Each row reversed within its own length (so a caller's result
        # depends on its length being right), padded with garbage past it.
        out = torch.full_like(tokens, 999)
        for i, n in enumerate(lengths.tolist()):
            out[i, :n] = tokens[i, :n].flip(0) * 10
        return {"out": out, "out_lengths": lengths, "total": (tokens * mask).sum(1)}

    return model


def jagged_model(rec: Recorder) -> Any:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values, offsets = batch["tokens"], batch["tokens_offsets"]
        rec.batches.append({"shape": tuple(values.shape), "offsets": offsets.tolist()})
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
        out = torch.cat([values[a:b].flip(0) * 10 for a, b in bounds])
        totals = torch.stack([values[a:b].sum() for a, b in bounds])
        return {"out": out, "out_offsets": offsets, "total": totals}

    return model


def make_server(mode: str, rec: Recorder, **kwargs: Any) -> fb.Server:
    model = padded_model(rec) if mode == "pad" else jagged_model(rec)
    kwargs.setdefault("max_delay", 0.02)
    return fb.Server(
        model,
        inputs=[spec(mode)],
        outputs=[spec(mode, "out"), fb.TensorSpec("total", "int64", ())],
        name="ragged",
        **kwargs,
    )


def sample(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(seed))


def check_result(x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    assert out["out"].shape == x.shape, (x, out)
    assert torch.equal(out["out"], x.flip(0) * 10)
    assert out["total"].item() == x.sum().item()


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_several_lengths_in_one_batch_each_caller_gets_its_own_row(mode: str) -> None:
    rec = Recorder()
    server = make_server(mode, rec, max_batch_elements=4096)
    xs = [sample(n, i) for i, n in enumerate(LENGTHS)]

    async def main() -> list[dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            return await asyncio.gather(*(client.infer({"tokens": x}) for x in xs))

    for x, out in zip(xs, asyncio.run(main())):
        check_result(x, out)
    big = max(rec.batches, key=lambda b: b["shape"][0])
    if mode == "pad":
        rows, longest = big["shape"]
        assert rows > 1 and longest == max(big["lengths"])
        # Rows are padded with pad_value past their own length.
        for row, n in zip(big["tokens"], big["lengths"]):
            assert (row[n:] == PAD).all()
    else:
        offsets = big["offsets"]
        assert len(offsets) > 2 and offsets[0] == 0 and big["shape"] == (offsets[-1],)


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_inner_dimensions_and_multi_row_requests(mode: str) -> None:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = batch["x"]
        if mode == "pad":
            return {"y": x + 1, "y_lengths": batch["x_lengths"]}
        return {"y": x + 1, "y_offsets": batch["x_offsets"]}

    server = fb.Server(
        model,
        inputs=[fb.TensorSpec("x", "float32", (-1, 3), ragged=mode)],
        outputs=[fb.TensorSpec("y", "float32", (-1, 3), ragged=mode, pad_value=-1.0)],
        max_delay=0.02,
        max_batch_elements=300,
    )

    async def main() -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            xs = [torch.randn(n, 3) for n in (2, 5, 1)]
            singles = await asyncio.gather(*(client.infer({"x": x}) for x in xs))
            for x, out in zip(xs, singles):
                torch.testing.assert_close(out["y"], x + 1)
            both = await client.infer_batch({"x": torch.zeros(2, 4, 3)})
            return singles, both

    _, both = asyncio.run(main())
    assert both["y"].shape == (2, 4, 3)
    assert (both["y"] == 1).all()


def test_model_outputs_with_bad_lengths_are_model_errors() -> None:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = batch["tokens"]
        return {"out": t, "out_lengths": batch["tokens_lengths"] + 100, "total": t.sum(1)}

    server = fb.Server(model, inputs=[spec("pad")], outputs=[spec("pad", "out"), fb.TensorSpec("total", "int64", ())])

    async def main() -> None:
        async with server:
            with pytest.raises(fb.ModelError, match="out_lengths"):
                await server.client().infer({"tokens": torch.arange(3)})

    asyncio.run(main())


def test_specs_say_what_a_variable_dimension_needs() -> None:
    with pytest.raises(ValueError, match="ragged='pad' or ragged='jagged'"):
        fb.TensorSpec("t", "int64", (-1,))
    with pytest.raises(ValueError, match="'jagged' takes one variable dimension, the first"):
        fb.TensorSpec("t", "int64", (3, -1), ragged="jagged")
    with pytest.raises(ValueError, match="'jagged' takes one variable dimension, the first"):
        fb.TensorSpec("t", "int64", (-1, -1), ragged="jagged")
    with pytest.raises(ValueError, match="BYTES tensor may be variable along its first dimension only"):
        fb.TensorSpec("t", "bytes", (2, -1), ragged="pad")
    with pytest.raises(ValueError, match="at most 4 dimensions"):
        fb.TensorSpec("t", "int64", (-1,) * 5, ragged="pad")
    with pytest.raises(ValueError, match="non-negative ints or -1"):
        fb.TensorSpec("t", "int64", (3, -2), ragged="pad")
    with pytest.raises(ValueError, match="needs a -1 in its shape"):
        fb.TensorSpec("t", "int64", (3,), ragged="jagged")
    assert fb.TensorSpec("t", "int64", (3, -1), ragged="pad").variable_dims == (1,)
    with pytest.raises(ValueError, match="max_batch_elements applies"):
        fb.Server(lambda b: b, inputs=[fb.TensorSpec("x", "int64", (3,))], outputs=[fb.TensorSpec("x", "int64", (3,))],
                  max_batch_elements=10)  # fmt: skip
    rec = Recorder()
    assert make_server("pad", rec).max_batch_elements == 64 * 1024


def test_a_request_over_the_token_budget_is_refused_at_submit() -> None:
    rec = Recorder()
    server = make_server("jagged", rec, max_batch_elements=16)

    async def main() -> None:
        async with server:
            client = server.client()
            with pytest.raises(fb.InvalidInputError, match=r"length 17 exceeds max_batch_elements \(16\)"):
                await client.infer({"tokens": torch.arange(17)})
            with pytest.raises(fb.InvalidInputError, match="expected shape"):
                await client.infer({"tokens": torch.zeros(2, 2, dtype=torch.int64)})
            with pytest.raises(fb.InvalidInputError, match="expected dtype int64"):
                await client.infer({"tokens": torch.zeros(3)})
            check_result(torch.arange(16), await client.infer({"tokens": torch.arange(16)}))

    asyncio.run(main())
    assert server.stats()["requests_failed"]["invalid_input"] == 3


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_a_batch_closes_at_the_token_budget_and_the_next_request_leads_the_next(mode: str) -> None:
    rec = Recorder()
    # Greedy: whatever the loop queued in one iteration is one batch, unless
    # the budget (20 elements) closes it first.
    server = make_server(mode, rec, max_batch_elements=20, max_delay=0)
    lengths = [8, 8, 8, 2, 2, 20, 1]
    xs = [sample(n, i) for i, n in enumerate(lengths)]

    async def main() -> list[dict[str, torch.Tensor]]:
        async with server:
            client = server.client()
            return await asyncio.gather(*(client.infer({"tokens": x}) for x in xs))

    for x, out in zip(xs, asyncio.run(main())):
        check_result(x, out)
    key = "lengths" if mode == "pad" else "offsets"
    seen = []
    for b in rec.batches:
        if mode == "pad":
            rows, longest = b["shape"]
            assert rows * longest <= 20, b
            seen.append(b["lengths"])
        else:
            assert b["offsets"][-1] <= 20, b
            seen.append([y - x for x, y in zip(b["offsets"], b["offsets"][1:])])
    assert [n for batch in seen for n in batch] == lengths, (key, seen)  # FIFO: none overtaken
    assert server.stats()["dispatch_reasons"]["next_does_not_fit"] >= 2


@contextlib.contextmanager
def serving(frontend: str) -> Iterator[tuple[str, str]]:
    rec = Recorder()
    servers = [make_server("pad", rec, max_batch_elements=512), _jagged_named(rec)]
    config = ServeConfig(http_port=0, grpc_port=0, frontend=frontend, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield f"127.0.0.1:{listening.http_port}", f"127.0.0.1:{listening.grpc_port}"


def _jagged_named(rec: Recorder) -> fb.Server:
    server = make_server("jagged", rec, max_batch_elements=512)
    server.name = "jagged"
    return server


@pytest.fixture(params=["native", "python"], scope="module")
def addresses(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with serving(request.param) as addresses:
        yield addresses


@pytest.mark.parametrize("model", ["ragged", "jagged"])
def test_tritonclient_http_and_grpc_with_several_lengths(addresses: tuple[str, str], model: str) -> None:
    http, grpc_address = addresses
    xs = [sample(n, 100 + i).numpy() for i, n in enumerate([4, 1, 9, 2])]
    hclient = httpclient.InferenceServerClient(http, concurrency=4)
    gclient = grpcclient.InferenceServerClient(grpc_address)
    try:
        meta = hclient.get_model_metadata(model)
        assert meta["inputs"][0]["shape"] == [-1, -1]
        pending = []
        for x in xs:
            tokens = httpclient.InferInput("tokens", [1, len(x)], "INT64")
            tokens.set_data_from_numpy(x[None, :], binary_data=len(x) % 2 == 0)
            pending.append(hclient.async_infer(model, [tokens]))
        for x, p in zip(xs, pending):
            result = p.get_result()
            assert result.as_numpy("out").tolist() == [list(x[::-1] * 10)]
            assert result.as_numpy("total").tolist() == [int(x.sum())]
        for x in xs:
            tokens = grpcclient.InferInput("tokens", [1, len(x)], "INT64")
            tokens.set_data_from_numpy(x[None, :])
            result = gclient.infer(model, [tokens])
            assert result.as_numpy("out").tolist() == [list(x[::-1] * 10)]
        # Two rows in one request: each padded to the request's longest output row.
        two = grpcclient.InferInput("tokens", [2, 3], "INT64")
        two.set_data_from_numpy(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64))
        assert gclient.infer(model, [two]).as_numpy("out").tolist() == [[30, 20, 10], [60, 50, 40]]
    finally:
        hclient.close()
        gclient.close()


def test_bad_variable_length_requests_over_http_are_400(addresses: tuple[str, str]) -> None:
    import httpx

    http, _ = addresses

    def body(shape: list[int], data: list[int]) -> dict[str, Any]:
        return {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": shape, "data": data}]}

    with httpx.Client(base_url=f"http://{http}", timeout=30) as client:
        cases = {
            "no length dimension": body([1], [1]),
            "an extra dimension": body([1, 2, 2], [1, 2, 3, 4]),
            "over the token budget": body([1, 513], [1] * 513),
            "floats": {"inputs": [{"name": "tokens", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]},
        }
        for case, request in cases.items():
            response = client.post("/v2/models/ragged/infer", json=request)
            assert response.status_code == 400, (case, response.text)
            assert "'tokens'" in response.json()["error"], (case, response.text)
        ok = client.post("/v2/models/ragged/infer", json=body([1, 512], [1] * 512))
        assert ok.status_code == 200, ok.text


def test_variable_length_models_refuse_what_they_cannot_do_yet() -> None:
    model = lambda d: {"n": d["tokens_lengths"]}  # noqa: E731
    out = fb.TensorSpec("n", "int64", ())
    for options in ({"cuda_graphs": True}, {"compile": True}):
        with pytest.raises(ValueError, match="without cuda_graphs or compile"):
            fb.Server(model, inputs=[spec("pad")], outputs=[out], **options)


async def test_variable_length_models_warm_up_with_the_samples_given() -> None:
    """Each sample a row of its own length, collated as requests are: padded
    (values and lengths), jagged (values and offsets), BYTES padded with b""."""
    seen: list[tuple[list[list[float]], list[int], list[int], list[list[bytes]]]] = []

    def model(d: dict[str, Any]) -> dict[str, torch.Tensor]:
        seen.append((d["a"].tolist(), d["a_lengths"].tolist(), d["j_offsets"].tolist(), d["s"].tolist()))
        return {"n": d["a_lengths"]}

    inputs = [
        fb.TensorSpec("a", "float32", (-1,), ragged="pad", pad_value=-1),
        fb.TensorSpec("j", "int64", (-1, 2), ragged="jagged"),
        fb.TensorSpec("s", "bytes", (-1,), ragged="pad"),
    ]
    samples = {
        "a": [torch.tensor([1.0, 2.0]), torch.tensor([3.0])],
        "j": torch.ones(3, 2, dtype=torch.int64),
        "s": [np.array([b"x"], dtype=object), np.array([b"y", b"zz"], dtype=object)],
    }
    server = fb.Server(
        model, inputs=inputs, outputs=[fb.TensorSpec("n", "int64", ())], max_batch_size=3, warmup=samples
    )
    async with server:
        assert seen, "warm-up ran the model"
        assert (server.stats()["batches"], server.stats()["requests_succeeded"]) == (0, 0)
    three = next(s for s in seen if len(s[1]) == 3)  # the bucket of 3 rows: samples repeated
    assert three[0] == [[1.0, 2.0], [3.0, -1.0], [1.0, 2.0]] and three[1] == [2, 1, 2]
    assert three[2] == [0, 3, 6, 9]
    assert three[3] == [[b"x", b""], [b"y", b"zz"], [b"x", b""]]
    bad = [{"a": torch.ones(2, 2)}, {**samples, "a": torch.ones(2, dtype=torch.int64)}, {**samples, "z": 1}]
    for warmup in bad:
        with pytest.raises(fb.InvalidInputError, match="warmup"):
            fb.Server(model, inputs=inputs, outputs=[fb.TensorSpec("n", "int64", ())], warmup=warmup)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["pad", "jagged"])
async def test_a_variable_length_model_runs_on_cuda(mode: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen: list[torch.device] = []

    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        values = d["tokens"]
        seen.append(values.device)
        if mode == "pad":  # rows past a length hold PAD: mask them out
            mask = torch.arange(values.shape[1], device=values.device)[None, :] < d["tokens_lengths"][:, None]
            return {"total": (values * mask).sum(dim=1)}
        offsets = d["tokens_offsets"]
        sums = torch.stack([values[a:b].sum() for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
        return {"total": sums}

    server = fb.Server(
        model, inputs=[spec(mode)], outputs=[fb.TensorSpec("total", "int64", ())], device="cuda", max_delay=0.01
    )
    async with server:
        warmed = len(seen)  # on a GPU, warm-up is the default: rows at their minimum shape
        client = server.client()
        rows = [torch.arange(n, dtype=torch.int64) for n in (1, 5, 3, 8)]
        results = await asyncio.gather(*(client.infer({"tokens": r}) for r in rows))
    assert warmed == len(server.buckets)
    assert all(d.type == "cuda" for d in seen)
    assert [int(r["total"]) for r in results] == [int(r.sum()) for r in rows]


POISON = 555  # a token the sample() tokens never hold: a batch holding it raises


def poisoned(model: Any) -> Any:
    def call(batch: dict[str, torch.Tensor]) -> Any:
        if bool((batch["tokens"] == POISON).any()):
            raise ValueError("poisoned row")
        return model(batch)

    return call


def poisoned_server(mode: str, rec: Recorder, **kwargs: Any) -> fb.Server:
    model = padded_model(rec) if mode == "pad" else jagged_model(rec)
    return fb.Server(
        poisoned(model),
        inputs=[spec(mode)],
        outputs=[spec(mode, "out"), fb.TensorSpec("total", "int64", ())],
        name=mode,
        max_batch_size=len(LENGTHS),
        max_delay=5.0,  # the batch closes full: every request in one batch
        **kwargs,
    )


@pytest.mark.parametrize("mode", ["pad", "jagged"])
async def test_one_poisoned_variable_length_request_fails_alone(mode: str) -> None:
    rec = Recorder()
    xs = [sample(n, i) for i, n in enumerate(LENGTHS)]
    xs[2] = xs[2].clone()
    xs[2][1] = POISON
    async with poisoned_server(mode, rec) as server:
        client = server.client()
        results = await asyncio.gather(*(client.infer({"tokens": x}) for x in xs), return_exceptions=True)
        stats = server.stats()
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == [2]
    assert isinstance(results[2], fb.ModelError) and isinstance(results[2].__cause__, ValueError)
    for i, (x, out) in enumerate(zip(xs, results)):
        if i != 2:
            assert isinstance(out, dict)
            check_result(x, out)
    assert stats["requests_succeeded"] == len(LENGTHS) - 1
    assert stats["isolated_failures"] == 1 and stats["retry_calls"] == 6  # two halves at log2(8) levels
    # Each retried part is a batch of its own: cut to its own longest row, or offsets from 0.
    for part in rec.batches:
        if mode == "pad":
            assert part["shape"][1] == max(part["lengths"], default=0), part
        else:
            assert part["offsets"][0] == 0 and part["shape"] == (part["offsets"][-1],), part


async def test_variable_length_isolation_can_be_turned_off() -> None:
    rec = Recorder()
    xs = [sample(n, i) for i, n in enumerate(LENGTHS)]
    xs[0] = torch.tensor([POISON, 1, 2])
    async with poisoned_server("pad", rec, isolate_failures=False) as server:
        results = await asyncio.gather(*(server.client().infer({"tokens": x}) for x in xs), return_exceptions=True)
    assert all(isinstance(r, fb.ModelError) for r in results)


async def test_one_poisoned_bytes_request_fails_alone() -> None:
    def echo(batch: dict[str, Any]) -> dict[str, Any]:
        if any(b == b"poison" for b in batch["text"].ravel()):
            raise ValueError("poisoned text")
        return {"echo": batch["text"]}

    text = fb.TensorSpec("text", "bytes", (1,))
    server = fb.Server(
        echo, inputs=[text], outputs=[fb.TensorSpec("echo", "bytes", (1,))], max_batch_size=8, max_delay=5.0
    )
    words = [b"a", b"bb", b"poison", b"ccc", b"d", b"ee", b"fff", b"g"]
    async with server:
        client = server.client()
        results = await asyncio.gather(
            *(client.infer({"text": np.array([w], dtype=object)}) for w in words), return_exceptions=True
        )
    assert [i for i, r in enumerate(results) if isinstance(r, BaseException)] == [2]
    assert [list(r["echo"]) for i, r in enumerate(results) if i != 2] == [[w] for i, w in enumerate(words) if i != 2]


@pytest.mark.parametrize("mode", ["pad", "jagged"])
def test_isolated_variable_length_outputs_go_out_natively(mode: str) -> None:
    # The native front-end encodes a merged batch (only the parts that ran) row by row.
    rec = Recorder()
    config = ServeConfig(http_port=0, grpc_port=None, log_level="warning")
    xs = [sample(n, 40 + i).numpy() for i, n in enumerate(LENGTHS)]
    xs[5] = np.array([7, POISON], dtype=np.int64)
    with serve_in_thread([poisoned_server(mode, rec)], config) as listening:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{listening.http_port}", concurrency=len(xs))
        try:
            pending = []
            for i, x in enumerate(xs):
                tokens = httpclient.InferInput("tokens", [1, len(x)], "INT64")
                tokens.set_data_from_numpy(x[None, :], binary_data=i % 2 == 0)
                pending.append(client.async_infer(mode, [tokens]))
            for i, (x, p) in enumerate(zip(xs, pending)):
                if i == 5:
                    with pytest.raises(InferenceServerException, match="failed: ValueError"):
                        p.get_result()
                    continue
                result = p.get_result()
                assert result.as_numpy("out").tolist() == [list(x[::-1] * 10)]
                assert result.as_numpy("total").tolist() == [int(x.sum())]
        finally:
            client.close()
    assert len(rec.batches) > 1  # the first batch failed and was retried in parts


@pytest.mark.parametrize("mode", ["pad", "jagged"])
async def test_warmup_runs_every_bucket_with_rows_at_their_minimum_shape(mode: str) -> None:
    rec = Recorder()
    server = make_server(mode, rec, max_batch_size=8, warmup=True)
    async with server:
        warmed = list(rec.batches)
        out = await server.client().infer({"tokens": torch.tensor([4, 5, 6])})
    assert torch.equal(out["out"], torch.tensor([60, 50, 40]))
    if mode == "pad":
        assert [b["shape"] for b in warmed] == [(n, 1) for n in (1, 2, 4, 8)]
        assert all(b["lengths"] == [1] * b["shape"][0] for b in warmed)
    else:
        assert [b["offsets"] for b in warmed] == [list(range(n + 1)) for n in (1, 2, 4, 8)]


async def test_a_variable_length_model_failing_in_warmup_fails_start() -> None:
    def model(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise RuntimeError("cannot start")

    server = fb.Server(model, inputs=[spec("pad")], outputs=[fb.TensorSpec("total", "int64", ())], warmup=True)
    with pytest.raises(fb.ModelError, match="failed during warm-up"):
        await server.start()
    assert not server.ready


@pytest.mark.gpu
async def test_a_poisoned_variable_length_request_fails_alone_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rec = Recorder()
    xs = [sample(n, i) for i, n in enumerate(LENGTHS)]
    xs[3] = torch.tensor([POISON])
    async with poisoned_server("pad", rec, device="cuda") as server:
        results = await asyncio.gather(*(server.client().infer({"tokens": x}) for x in xs), return_exceptions=True)
    assert [i for i, r in enumerate(results) if isinstance(r, BaseException)] == [3]
    for i, (x, out) in enumerate(zip(xs, results)):
        if i != 3:
            check_result(x, out)
