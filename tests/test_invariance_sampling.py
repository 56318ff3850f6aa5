"""``Server(invariance_sample_rate=r)``: live requests re-run alone, off the
hot path, and counted when their result depended on their batch."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

import ferrobatch as fb

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))


def row_wise(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"y": inputs["x"] * 2 + 1}


def batch_dependent(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    return {"y": x - x.mean(dim=0)}  # a row's result depends on the others


async def _load(server: fb.Server, n: int = 400) -> None:
    client = server.client()
    await asyncio.gather(*(client.infer({"x": torch.full((4,), float(i))}) for i in range(n)))


async def _settled(server: fb.Server) -> dict[str, int]:
    deadline = time.monotonic() + 10
    stats = server.stats()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = server.stats()
        if now["invariance_checks"] == stats["invariance_checks"] and now["invariance_checks"] > 0:
            break
        stats = now
    return dict(server.stats())


async def test_a_batch_dependent_model_is_caught_and_a_row_wise_one_is_not() -> None:
    caught = fb.Server(batch_dependent, inputs=[X], outputs=[Y], max_delay=0.005, invariance_sample_rate=1.0)
    clean = fb.Server(row_wise, inputs=[X], outputs=[Y], max_delay=0.005, invariance_sample_rate=1.0)
    async with caught, clean:
        await _load(caught)
        await _load(clean)
        bad, good = await _settled(caught), await _settled(clean)
    assert bad["invariance_checks"] > 0 and bad["invariance_mismatches"] == bad["invariance_checks"], bad
    assert good["invariance_checks"] > 0 and good["invariance_mismatches"] == 0, good
    assert good["requests_succeeded"] == 400  # callers are unaffected


async def test_off_by_default_and_the_rate_is_checked() -> None:
    server = fb.Server(row_wise, inputs=[X], outputs=[Y], max_delay=0.005)
    async with server:
        await _load(server, 100)
        assert server.stats()["invariance_checks"] == 0
    with pytest.raises(ValueError, match="invariance_sample_rate"):
        fb.Server(row_wise, inputs=[X], outputs=[Y], invariance_sample_rate=1.5)


async def test_metrics_count_the_checks() -> None:
    from ferrobatch.metrics import TritonCollector, exposition

    server = fb.Server(batch_dependent, inputs=[X], outputs=[Y], max_delay=0.005, invariance_sample_rate=1.0)
    async with server:
        await _load(server, 200)
        stats = await _settled(server)
        text = exposition(TritonCollector([server])).decode()
    assert f'ferrobatch_invariance_checks{{model="model",version="1"}} {stats["invariance_checks"]}' in text
    assert "# TYPE ferrobatch_invariance_mismatches counter" in text


TOKENS = fb.TensorSpec("tokens", "float32", (-1,), ragged="pad")
TOTAL = fb.TensorSpec("total", "float32", ())
OUT = fb.TensorSpec("out", "float32", (-1,), ragged="pad")


def padded_row_wise(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens, lengths = inputs["tokens"], inputs["tokens_lengths"]
    mask = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return {"total": (tokens * mask).sum(1), "out": tokens * 2, "out_lengths": lengths}


def padded_batch_dependent(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tokens = inputs["tokens"]  # sums the padding too: a row's result depends on the batch's longest row
    return {"total": tokens.sum(1), "out": tokens * 2, "out_lengths": inputs["tokens_lengths"]}


def bytes_row_wise(inputs: dict[str, object]) -> dict[str, object]:
    return {"echo": inputs["text"]}


async def test_variable_length_and_bytes_models_are_sampled_too() -> None:
    def server(model: object) -> fb.Server:
        return fb.Server(
            model,  # type: ignore[arg-type]
            inputs=[fb.TensorSpec("tokens", "float32", (-1,), ragged="pad", pad_value=1.0)],
            outputs=[TOTAL, OUT],
            max_delay=0.005,
            invariance_sample_rate=1.0,
        )

    text = fb.TensorSpec("text", "bytes", (1,))
    echo = fb.Server(
        bytes_row_wise,  # type: ignore[arg-type]
        inputs=[text],
        outputs=[fb.TensorSpec("echo", "bytes", (1,))],
        max_delay=0.005,
        invariance_sample_rate=1.0,
    )
    caught, clean = server(padded_batch_dependent), server(padded_row_wise)
    async with caught, clean, echo:
        for s in (caught, clean):
            client = s.client()
            await asyncio.gather(*(client.infer({"tokens": torch.ones(1 + i % 7)}) for i in range(300)))
        await asyncio.gather(*(echo.client().infer({"text": [b"w%d" % i]}) for i in range(300)))
        bad, good, words = await _settled(caught), await _settled(clean), await _settled(echo)
    assert bad["invariance_checks"] > 0 and bad["invariance_mismatches"] > 0, bad
    assert good["invariance_checks"] > 0 and good["invariance_mismatches"] == 0, good
    assert words["invariance_checks"] > 0 and words["invariance_mismatches"] == 0, words
