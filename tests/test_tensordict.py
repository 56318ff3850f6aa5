"""TensorDicts and Mappings in and out of the core API, TensorDict modules and
plain single-input modules as models, and specs inferred from an example."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import pytest
import torch
from conftest import WIDTH, X

import ferrobatch as fb

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402

OBS = fb.TensorSpec("obs.pixels", "float32", (WIDTH,))
ACT = fb.TensorSpec("action", "float32", (2,))


def policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(torch.nn.Linear(WIDTH, 2), in_keys=[("obs", "pixels")], out_keys=["action"])


async def test_a_tensordict_module_gets_a_tensordict_batch_and_a_tensordict_comes_back() -> None:
    module = policy()
    seen: list[object] = []
    module.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    server = fb.Server(module, inputs=[OBS], outputs=[ACT], max_batch_size=8, max_delay=0.005)
    obs = [torch.randn(WIDTH) for _ in range(8)]
    async with server:
        client = server.client()
        # Extra keys (what an environment step carries) are not inputs: ignored.
        tds = [TensorDict({"obs": {"pixels": o}, "reward": torch.zeros(1)}) for o in obs]
        outs = await asyncio.gather(*(client.infer(td) for td in tds))
    batch = seen[0]
    assert isinstance(batch, TensorDict) and batch.batch_size[0] >= 1
    assert max(int(b.batch_size[0]) for b in seen) > 1  # type: ignore[attr-defined]
    for o, out in zip(obs, outs):
        assert isinstance(out, TensorDict) and out.batch_size == torch.Size([])
        with torch.no_grad():
            torch.testing.assert_close(out["action"], module.module(o))


async def test_nested_keys_are_named_with_dots_both_ways() -> None:
    def model(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"out.twice": d["obs.pixels"] * 2}

    out_spec = fb.TensorSpec("out.twice", "float32", (WIDTH,))
    server = fb.Server(model, inputs=[OBS], outputs=[out_spec])
    x = torch.arange(WIDTH, dtype=torch.float32)
    async with server:
        client = server.client()
        td = await client.infer(TensorDict({("obs", "pixels"): x}))
        assert torch.equal(td["out", "twice"], x * 2)
        # A nested Mapping that is no TensorDict; a plain dict with the dotted name.
        nested = await client.infer(OrderedDict(obs=OrderedDict(pixels=x)))
        flat = await client.infer({"obs.pixels": x})
    assert type(nested) is dict and torch.equal(nested["out.twice"], x * 2)
    assert torch.equal(flat["out.twice"], x * 2)


@pytest.mark.parametrize("priority", [None, 1])
async def test_infer_batch_takes_tensordicts_and_mappings_as_infer_does(priority: int | None) -> None:
    from types import MappingProxyType

    server = fb.Server(policy(), inputs=[OBS], outputs=[ACT], max_batch_size=8, priority_levels=2)
    obs = torch.randn(3, WIDTH)
    async with server:
        client = server.client()
        td = TensorDict({"obs": {"pixels": obs}, "reward": torch.zeros(3)}, batch_size=[3])
        out = await client.infer_batch(td, priority=priority)  # extra keys ignored, as by infer
        mapped = await client.infer_batch(MappingProxyType({"obs.pixels": obs}), priority=priority)
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([3])
    torch.testing.assert_close(out["action"], policy()(TensorDict({"obs": {"pixels": obs}}, [3]))["action"])
    torch.testing.assert_close(mapped["action"], out["action"])


async def test_a_mapping_with_an_unknown_key_is_refused() -> None:
    server = fb.Server(lambda d: {"y": d["x"]}, inputs=[X], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))])
    async with server:
        with pytest.raises(fb.InvalidInputError):
            await server.client().infer(OrderedDict(x=torch.zeros(WIDTH), z=torch.zeros(WIDTH)))


async def test_a_plain_module_with_one_input_is_called_with_the_tensor() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(WIDTH, 2)
    server = fb.Server(linear, inputs=[X], outputs=[fb.TensorSpec("y", "float32", (2,))])
    x = torch.randn(WIDTH)
    async with server:
        out = await server.client().infer({"x": x})
    with torch.no_grad():
        torch.testing.assert_close(out["y"], linear(x))


async def test_a_module_annotated_to_take_a_dict_still_gets_one() -> None:
    class Takes(torch.nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
            return d["x"] + 1

    server = fb.Server(Takes(), inputs=[X], outputs=[fb.TensorSpec("y", "float32", (WIDTH,))])
    async with server:
        out = await server.client().infer({"x": torch.zeros(WIDTH)})
    assert torch.equal(out["y"], torch.ones(WIDTH))


async def test_from_example_infers_the_specs_of_a_tensordict_module() -> None:
    module = policy()
    example = TensorDict({"obs": {"pixels": torch.zeros(WIDTH)}, "done": torch.zeros(1, dtype=torch.bool)})
    server = fb.Server.from_example(module, example, max_batch_size=4)
    assert server.inputs == (OBS,)  # the module's in_keys, not "done"
    assert server.outputs == (ACT,)
    x = torch.randn(WIDTH)
    async with server:
        out = await server.client().infer(TensorDict({"obs": {"pixels": x}}))
    with torch.no_grad():
        torch.testing.assert_close(out["action"], module.module(x))


def test_from_example_infers_the_specs_of_a_module_and_a_function() -> None:
    server = fb.Server.from_example(torch.nn.Linear(3, 5), {"x": torch.zeros(3)})
    assert server.inputs == (fb.TensorSpec("x", "float32", (3,)),)
    assert server.outputs == (fb.TensorSpec("output", "float32", (5,)),)

    def two(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return d["a"].long(), d["a"].sum(-1)

    server = fb.Server.from_example(two, {"a": torch.zeros(2, 3, dtype=torch.float64)})
    assert server.outputs == (fb.TensorSpec("output_0", "int64", (2, 3)), fb.TensorSpec("output_1", "float64", (2,)))
    with pytest.raises(TypeError, match="infers inputs and outputs"):
        fb.Server.from_example(two, {"a": torch.zeros(1)}, outputs=[X])


async def test_a_tensordict_module_takes_weight_updates() -> None:
    module = policy()
    server = fb.Server.from_example(module, TensorDict({"obs": {"pixels": torch.zeros(WIDTH)}}), version_output="v")
    zero = {k: torch.zeros_like(v) for k, v in module.state_dict().items()}
    async with server:
        client = server.client()
        assert await server.update_weights(zero) == 1
        out = await client.infer(TensorDict({"obs": {"pixels": torch.ones(WIDTH)}}))
    assert torch.equal(out["action"], torch.zeros(2)) and int(out["v"]) == 1


def test_a_streamed_tensordict_response_counts_every_nested_tensor() -> None:
    from ferrobatch.client import response_bytes

    nested = TensorDict({"a": torch.zeros(2), "b": {"c": torch.zeros(3, dtype=torch.int64)}}, batch_size=[])
    assert response_bytes(nested) == 8 + 24, "what counts against max_stream_backlog"
