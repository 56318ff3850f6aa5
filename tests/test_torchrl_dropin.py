"""ferrobatch.torchrl behaves as TorchRL 0.14's InferenceServer where a
program could tell them apart: interaction types, outputs written to input
keys, collate_fn on the first request, whole-batch failures, dtypes over a
pipe, requests between a shutdown and a restart, stats across restarts,
and a forward pass running at shutdown."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("tensordict")
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule, set_interaction_type
from tensordict.nn.probabilistic import interaction_type

from ferrobatch.torchrl import InferenceServer, MPTransport, ThreadingTransport

pytestmark = pytest.mark.timeout(60)


def obs(value: float = 1.0, dtype: torch.dtype = torch.float32) -> TensorDict:
    return TensorDict({"obs": torch.full((2,), value, dtype=dtype)})


def reports_interaction(td: Any) -> Any:
    """A policy whose action says which interaction type it ran under."""
    current = interaction_type()
    code = -1.0 if current is None else float(list(InteractionType).index(current))
    return td.clone().set("action", torch.full(td.batch_size, code))


def test_policy_client_module_runs_the_model_under_the_callers_interaction_type() -> None:
    torchrl = pytest.importorskip("torchrl.modules.inference_server")
    transport = ThreadingTransport()
    server = InferenceServer(reports_interaction, transport, request_spec=obs())
    random = torchrl.PolicyClientModule(transport, interaction_type=InteractionType.RANDOM)
    mode = torchrl.PolicyClientModule(transport, interaction_type=InteractionType.MODE)
    # Queued before the start: one batch asking for two types (each gets its own).
    futures = [client.submit(obs()) for client in (random, mode, random)]
    with server:
        results = [future.result(10) for future in futures]
        with set_interaction_type(InteractionType.DETERMINISTIC):
            ambient = random.client(obs())  # a plain client: no stamp, the server's own context
    kinds = list(InteractionType)
    assert [r["action"].item() for r in results] == [kinds.index(k) for k in ("random", "mode", "random")]
    assert all("_torchrl_inference_interaction_type" not in r.keys() for r in results)
    assert ambient["action"].item() == kinds.index(InteractionType.DETERMINISTIC)


def test_a_model_output_written_to_an_input_key_reaches_the_caller() -> None:
    doubles = TensorDictModule(lambda x: (x * 2, x + 1), in_keys=["obs"], out_keys=["obs", "act"])
    transport = ThreadingTransport()
    with InferenceServer(doubles, transport):
        result = transport.client()(obs())
    assert result["obs"].tolist() == [2.0, 2.0] and result["act"].tolist() == [2.0, 2.0]

    def plain(td: Any) -> Any:  # no in_keys: the request's last action is an input too
        return td.clone().set("action", td["obs"] * 10)

    transport = ThreadingTransport()
    with InferenceServer(plain, transport):
        result = transport.client()(obs().set("action", torch.full((2,), -7.0)))
    assert result["action"].tolist() == [10.0, 10.0]


def test_the_first_request_reaches_the_model_through_collate_fn() -> None:
    def collate(items: list[Any]) -> Any:  # the model's input, built from other keys
        stacked = torch.stack(items)
        return TensorDict({"obs": stacked["pixels"].float() / 255}, batch_size=stacked.batch_size)

    module = TensorDictModule(lambda x: x + 1, in_keys=["obs"], out_keys=["act"])
    transport = ThreadingTransport()
    with InferenceServer(module, transport, collate_fn=collate):
        client = transport.client()
        results = [client(TensorDict({"pixels": torch.full((2,), 255, dtype=torch.uint8)})) for _ in range(2)]
    assert [r["act"].tolist() for r in results] == [[2.0, 2.0]] * 2


def test_a_failing_model_call_fails_its_whole_batch_in_one_call() -> None:
    calls: list[list[float]] = []

    def model(td: Any) -> Any:
        calls.append(td["obs"][:, 0].tolist())
        if (td["obs"] < 0).any():
            raise KeyError("negative obs")
        return td.clone().set("act", td["obs"] + 1)

    transport = ThreadingTransport()
    server = InferenceServer(model, transport, request_spec=obs(0.0), min_batch_size=3, timeout=5.0)
    values = (1.0, -1.0, 2.0)
    futures = [transport.submit(obs(v)) for v in values]
    with server:
        errors = {v: future.exception(10) for v, future in zip(values, futures)}
    assert sum(map(len, calls[1:])) == 3  # after the spec probe, each request ran once: no retries in parts
    failed = next(call for call in calls if -1.0 in call)
    assert all(isinstance(errors[v], KeyError) for v in failed)  # its batch-mates too


def test_a_model_returning_too_few_rows_fails_its_batch_as_torchrls() -> None:
    def one_row(td: Any) -> Any:
        return TensorDict({"act": td["obs"][:1] + 1}, batch_size=[1])

    transport = ThreadingTransport()
    # min_batch_size: the three in one batch, however they reach its queue.
    server = InferenceServer(one_row, transport, request_spec=obs(), min_batch_size=3, timeout=5.0)
    futures = [transport.submit(obs(v)) for v in (1.0, 2.0, 3.0)]
    with server:
        errors = [future.exception(10) for future in futures]
    for error in errors:
        assert isinstance(error, RuntimeError)
        assert "Model returned 1 results for a batch of 3 inputs" in str(error)


def test_the_first_request_is_answered_by_the_call_that_learns_the_specs() -> None:
    calls: list[int] = []

    def noisy(td: Any) -> Any:
        calls.append(td.batch_size[0])
        return td.clone().set("act", td["obs"] + torch.randn_like(td["obs"]))

    torch.manual_seed(0)
    expected = [(torch.zeros(2) + torch.randn(2)).tolist() for _ in range(3)]  # three calls, in order
    torch.manual_seed(0)
    transport = ThreadingTransport()
    with InferenceServer(noisy, transport) as server:
        client = transport.client()
        acts = [client(obs(0.0))["act"].tolist() for _ in range(3)]
        stats = server.stats()
    assert calls == [1, 1, 1] and acts == expected
    assert stats["requests"] == 3 and stats["batches"] == 3


def test_bfloat16_travels_an_mp_transports_pipe_both_ways() -> None:
    module = TensorDictModule(lambda x: (x * 2, (x * 3).float()), in_keys=["obs"], out_keys=["act", "f"])
    transport = MPTransport()
    client = transport.client()
    with InferenceServer(module, transport):
        result = client(obs(1.0, torch.bfloat16))  # the first request: before any share, through the pipe
    assert result["act"].dtype == torch.bfloat16 and result["act"].tolist() == [2.0, 2.0]
    assert result["f"].tolist() == [3.0, 3.0]


def test_a_request_between_shutdown_and_restart_waits_for_the_restart() -> None:
    module = TensorDictModule(lambda x: x + 1, in_keys=["obs"], out_keys=["act"])
    transport = ThreadingTransport()
    server = InferenceServer(module, transport).start()
    client = transport.client()
    client(obs())
    server.shutdown()
    waiting = client.submit(obs(2.0))
    called: list[Any] = []
    caller = threading.Thread(target=lambda: called.append(client(obs(3.0))), daemon=True)
    caller.start()
    time.sleep(0.1)
    assert not waiting.done() and not called
    with server:
        assert waiting.result(10)["act"].tolist() == [3.0, 3.0]
        caller.join(10)
    assert called[0]["act"].tolist() == [4.0, 4.0]


def test_stats_counts_carry_on_across_a_restart() -> None:
    module = TensorDictModule(lambda x: x + 1, in_keys=["obs"], out_keys=["act"])
    transport = ThreadingTransport()
    server = InferenceServer(module, transport)
    with server:
        transport.client()(obs())
        server.update_model(lambda _: None)
    with server:
        transport.client()(obs())
        stats = server.stats(reset=True)
        assert (stats["requests"], stats["weight_updates"], stats["policy_version"]) == (2, 1, 1)
        after = server.stats()
    assert (after["requests"], after["weight_updates"], after["policy_version"]) == (0, 0, 1)


def test_a_forward_pass_running_at_shutdown_still_answers_its_caller() -> None:
    started = threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            started.set()
            time.sleep(4.0)
        return x + 1

    transport = ThreadingTransport()
    server = InferenceServer(TensorDictModule(slow, in_keys=["obs"], out_keys=["act"]), transport).start()
    client = transport.client()
    client(obs(0.0))
    running = client.submit(obs(1.0))
    assert started.wait(10)
    began = time.monotonic()
    server.shutdown(timeout=0.3)
    assert time.monotonic() - began < 3.0 and not server.is_alive  # not held for the model's 4 s
    assert running.result(10)["act"].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("served", [False, True], ids=["before_the_first_request", "while_serving"])
def test_weights_that_do_not_fit_the_policy_change_nothing(served: bool) -> None:
    torch.manual_seed(0)
    module = TensorDictModule(torch.nn.Linear(2, 2), in_keys=["obs"], out_keys=["action"])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    transport = ThreadingTransport()
    with InferenceServer(module, transport) as server:
        client = transport.client()
        if served:
            client(obs())
        # Copied as far as the first bad entry by a plain load_state_dict: refused whole here.
        extra = {k: torch.zeros_like(v) for k, v in before.items()} | {"module.ema": torch.zeros(1)}
        with pytest.raises(ValueError, match=r"unexpected \['module\.ema'\]"):
            server.update_policy_weights_(policy_or_weights=extra)
        torn = {"module.weight": torch.full((2, 2), 7.0), "module.bias": torch.zeros(3)}
        with pytest.raises(ValueError, match=r"'module\.bias': expected shape"):
            server.update_policy_weights_(policy_or_weights=torn)
        result = client(obs())
        assert server.policy_version == 0 == server.stats()["weight_updates"]
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, before[key])
    with torch.no_grad():
        torch.testing.assert_close(result["action"], module.module(torch.ones(2)))


def _deep(fn: Any, value: Any) -> Any:
    """``fn`` on every element of a nested list (a stacked batch of text)."""
    return [_deep(fn, item) for item in value] if isinstance(value, list) else fn(value)


class ReadsText(torch.nn.Module):
    """Reads non-tensor data (text) beside a tensor and writes some back."""

    def forward(self, obs: torch.Tensor, text: Any) -> tuple[torch.Tensor, Any]:
        lengths = torch.tensor(_deep(lambda t: float(len(t)), text)).reshape(obs.shape[:-1])
        return obs.sum(-1) + lengths, _deep(lambda t: {"upper": t.upper(), "words": t.split()}, text)


def text_policy() -> TensorDictModule:
    return TensorDictModule(ReadsText(), in_keys=["obs", "text"], out_keys=["score", ("out", "reply")])


def text_request(i: int, rows: int | None = None) -> TensorDict:
    from tensordict import NonTensorData, NonTensorStack

    if rows is None:
        return TensorDict({"obs": torch.full((2,), float(i)), "text": NonTensorData(f"a {'b' * i}")}, [])
    texts = NonTensorStack.from_list([f"r{r} {'c' * i}" for r in range(rows)])
    return TensorDict({"obs": torch.full((rows, 2), float(i)), "text": texts}, [rows])


def served_texts(server_type: type, transport: Any, requests: list[TensorDict]) -> list[TensorDict]:
    """The results of ``requests`` from 8 threads at once (an MPTransport's
    through its pipes: a model with non-tensor data is not shared)."""
    from concurrent.futures import ThreadPoolExecutor

    with server_type(text_policy(), transport, max_batch_size=8) as server:
        client = transport.client()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(client, requests))
        if isinstance(transport, MPTransport):
            assert not server._core._shared and client._shared() is None
        return results


@pytest.mark.parametrize("transport_type", [ThreadingTransport, MPTransport])
@pytest.mark.parametrize("rows", [None, 3], ids=["unbatched", "batched"])
def test_non_tensor_data_reaches_the_model_stacked_and_its_callers_row_by_row(
    transport_type: type, rows: int | None
) -> None:
    """A policy reading text (tensordict's NonTensorData) and writing
    Python objects back: each caller gets its own, as from TorchRL's server,
    over shared memory too (an MPTransport's requests after the first)."""
    from torchrl.modules.inference_server import InferenceServer as TorchRLServer
    from torchrl.modules.inference_server import ThreadingTransport as TorchRLThreading

    requests = [text_request(i, rows) for i in range(24)]
    expected = served_texts(TorchRLServer, TorchRLThreading(), requests)
    transport = transport_type()
    got = served_texts(InferenceServer, transport, requests)
    for want, have, sent in zip(expected, got, requests):
        assert have.batch_size == sent.batch_size
        assert have["text"] == sent["text"]  # the request's own, passed through
        assert have.get(("out", "reply")).tolist() == want.get(("out", "reply")).tolist()
        torch.testing.assert_close(have["score"], want["score"])


def test_non_tensor_data_through_collate_fn_split_interaction_types_and_bad_requests() -> None:
    """collate_fn sees each request's text; a batch asking for two
    interaction types is split and put back in order with its text; a
    request without the text, or whose text cannot be pickled, fails alone."""
    from tensordict import NonTensorData

    torchrl = pytest.importorskip("torchrl.modules.inference_server")
    seen: list[Any] = []

    def collate(items: list[Any]) -> Any:
        seen.append([item["text"] for item in items])
        return torch.stack(items)

    def tagged(td: Any) -> Any:  # no in_keys: every leaf of the request is an input
        current = interaction_type()
        code = -1 if current is None else list(InteractionType).index(current)
        return td.clone().set("tag", [f"{code}:{t}" for t in td["text"]])

    def text(value: str) -> TensorDict:
        return TensorDict({"obs": torch.zeros(2), "text": NonTensorData(value)})

    transport = ThreadingTransport()
    server = InferenceServer(tagged, transport, collate_fn=collate, request_spec=text("spec"))
    random = torchrl.PolicyClientModule(transport, interaction_type=InteractionType.RANDOM)
    mode = torchrl.PolicyClientModule(transport, interaction_type=InteractionType.MODE)
    futures = [client.submit(text(f"t{i}")) for i, client in enumerate((random, mode, random, mode))]
    with server:
        results = [future.result(10) for future in futures]
        with pytest.raises(ValueError, match="text"):
            transport.client()(TensorDict({"obs": torch.zeros(2)}))
        with pytest.raises(TypeError, match="pickled on its way"):
            transport.client()(TensorDict({"obs": torch.zeros(2), "text": NonTensorData(lambda: 0)}))
        assert transport.client()(text("after"))["tag"] == "-1:after"  # no stamp: the server's context
    kinds = list(InteractionType)
    codes = [kinds.index(k) for k in ("random", "mode", "random", "mode")]
    assert [r["tag"] for r in results] == [f"{c}:t{i}" for i, c in enumerate(codes)]
    assert [r["text"] for r in results] == ["t0", "t1", "t2", "t3"]
    assert sorted(t for batch in seen for t in batch) == ["after", "spec", "t0", "t1", "t2", "t3"]  # each once


def test_a_shared_memory_transport_refuses_non_tensor_specs_as_torchrls() -> None:
    from tensordict import NonTensorData

    from ferrobatch.torchrl import SharedMemoryTransport

    request = TensorDict({"obs": torch.zeros(2), "text": NonTensorData("x")})
    with pytest.raises(TypeError, match="NonTensorData at 'text': use MPTransport"):
        SharedMemoryTransport(request, TensorDict({"act": torch.zeros(2)}), num_slots=2)


def test_non_tensor_lists_rewritten_inputs_and_unpicklable_outputs_as_torchrls() -> None:
    """A list is one value (never more dimensions, whatever its length); a
    non-tensor input the model rewrites is the caller's result, as TorchRL's;
    an output value pickle refuses fails only the request it is for."""
    from concurrent.futures import ThreadPoolExecutor

    from tensordict import NonTensorData
    from torchrl.modules.inference_server import InferenceServer as TorchRLServer
    from torchrl.modules.inference_server import ThreadingTransport as TorchRLThreading

    def policy(td: Any) -> Any:
        texts = td["text"]  # a list: one value per row
        out = td.clone()
        out.set("text", [t.lower() for t in texts])  # an input rewritten
        out.set("tags", [t.split() for t in texts])  # lists of any length, per row
        out.set("handle", [threading.Lock() if "lock" in t else t for t in texts])
        return out

    texts = ["Hello", "HeLLo World", "A b C d", "take the lock", "x"]
    requests = [TensorDict({"obs": torch.zeros(2), "text": NonTensorData(t)}) for t in texts]

    def served(server_type: type, transport: Any) -> list[Any]:
        with server_type(policy, transport, max_batch_size=8):
            client = transport.client()
            with ThreadPoolExecutor(len(requests)) as pool:
                futures = [pool.submit(client, r) for r in requests]
                return [f.exception() or f.result() for f in futures]

    theirs = served(TorchRLServer, TorchRLThreading())
    ours = served(InferenceServer, ThreadingTransport())
    for text, want, have in zip(texts, theirs, ours):
        if "lock" in text:  # TorchRL hands the object over; here it must cross the batcher
            assert isinstance(have, TypeError) and "pickled" in str(have)
            continue
        assert have["text"] == want["text"] == text.lower()
        assert have["tags"] == want["tags"] == text.split()
        assert have["handle"] == want["handle"] == text
