"""ferrobatch.triton, PyTriton's binding model: the decorators and output
checks on plain requests, then bound models served for real on 127.0.0.1
and called with tritonclient over HTTP and gRPC."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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

from ferrobatch import RequestInfo
from ferrobatch.serve import StartupError
from ferrobatch.triton import (
    ConstantPadder,
    DynamicBatcher,
    ModelConfig,
    PyTritonInvalidOperationError,
    PyTritonModelConfigError,
    PyTritonRuntimeError,
    PyTritonValidationError,
    Request,
    Tensor,
    Triton,
    TritonConfig,
    UnrecoverableError,
    batch,
    first_value,
    group_by_keys,
    group_by_values,
    sample,
    triton_context,
)
from ferrobatch.triton._binding import BoundModel, TritonContext, collect_outputs, model_config_of

pytestmark = pytest.mark.timeout(60)

X = Tensor(name="x", dtype=np.float32, shape=(4,))
Y = Tensor(name="y", dtype=np.float32, shape=(4,))


def requests_of(*arrays: np.ndarray, **extra: np.ndarray) -> list[Request]:
    return [Request({"x": a, **{k: v[i] for k, v in extra.items()}}) for i, a in enumerate(arrays)]


def rows(n: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(n * 4, dtype=np.float32) + start).reshape(n, 4)


def config_of(*outputs: Tensor, inputs: tuple[Tensor, ...] = (X,), **kwargs: Any) -> Any:
    return model_config_of("m", 1, ModelConfig(**kwargs), list(inputs), list(outputs or (Y,)), 1)


# -- decorators on plain requests ------------------------------------------------------------


def test_batch_concatenates_the_requests_and_splits_the_outputs_by_their_rows() -> None:
    calls: list[np.ndarray] = []

    @batch
    def infer(x: np.ndarray) -> dict[str, np.ndarray]:
        calls.append(x)
        return {"y": x * 2}

    a, b, c = rows(1), rows(3, 100), rows(2, 200)
    out = infer(requests_of(a, b, c))
    assert len(calls) == 1 and calls[0].shape == (6, 4)
    assert [o["y"].shape[0] for o in out] == [1, 3, 2]
    for got, sent in zip(out, (a, b, c)):
        np.testing.assert_array_equal(got["y"], sent * 2)


def test_batch_works_on_methods_and_refuses_mismatched_requests_and_batch_sizes() -> None:
    class Model:
        def __init__(self) -> None:
            self.scale = 3.0

        @batch
        def infer(self, x: np.ndarray) -> dict[str, np.ndarray]:
            return {"y": x * self.scale}

        @batch
        def shortchanges(self, x: np.ndarray) -> dict[str, np.ndarray]:
            return {"y": x[:1]}

    model = Model()
    np.testing.assert_array_equal(model.infer(requests_of(rows(2)))[0]["y"], rows(2) * 3)
    with pytest.raises(PyTritonValidationError, match="different set of inputs keys"):
        model.infer([Request({"x": rows(1)}), Request({"z": rows(1)})])
    with pytest.raises(ValueError, match="batch size"):
        model.shortchanges(requests_of(rows(2), rows(1)))


def test_sample_calls_once_per_request_with_its_inputs_as_keywords() -> None:
    seen: list[tuple[str, ...]] = []

    @sample
    def infer(x: np.ndarray, scale: np.ndarray) -> dict[str, np.ndarray]:
        seen.append(tuple(sorted(("x", "scale"))))
        return {"y": x * scale}

    reqs = [Request({"x": rows(1), "scale": np.float32([2])}), Request({"x": rows(2), "scale": np.float32([3])})]
    out = infer(reqs)
    assert len(seen) == 2
    np.testing.assert_array_equal(out[0]["y"], rows(1) * 2)
    np.testing.assert_array_equal(out[1]["y"], rows(2) * 3)


def test_first_value_under_batch_squeezes_and_checks_the_values_are_equal() -> None:
    got: list[Any] = []

    @batch
    @first_value("temperature")
    def infer(x: np.ndarray, temperature: Any) -> dict[str, np.ndarray]:
        got.append(temperature)
        return {"y": x * temperature}

    temps = np.float32([[0.5], [0.5]])
    out = infer([Request({"x": rows(1), "temperature": temps[:1]}), Request({"x": rows(1), "temperature": temps[1:]})])
    assert got == [np.float32(0.5)] and np.ndim(got[0]) == 0
    np.testing.assert_array_equal(out[1]["y"], rows(1) * 0.5)
    unequal = [
        Request({"x": rows(1), "temperature": np.float32([[0.5]])}),
        Request({"x": rows(1), "temperature": np.float32([[0.7]])}),
    ]
    with pytest.raises(PyTritonRuntimeError, match="input are not equal"):
        infer(unequal)

    @batch
    @first_value("temperature", strict=False, squeeze_single_values=False)
    def lenient(x: np.ndarray, temperature: Any) -> dict[str, np.ndarray]:
        got.append(temperature)
        return {"y": x}

    lenient(unequal)
    np.testing.assert_array_equal(got[-1], np.float32([0.5]))


def test_first_value_on_a_list_of_requests_rewrites_each_request() -> None:
    @first_value("k")
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"] * r["k"]} for r in requests]

    out = infer([Request({"x": rows(2), "k": np.int64([[3], [3]])}), Request({"x": rows(1), "k": np.int64([[5]])})])
    np.testing.assert_array_equal(out[0]["y"], rows(2) * 3)
    np.testing.assert_array_equal(out[1]["y"], rows(1) * 5)


def test_group_by_values_calls_once_per_group_and_keeps_row_order() -> None:
    groups: list[list[int]] = []

    @batch
    @group_by_values("mode")
    def infer(x: np.ndarray, mode: np.ndarray) -> dict[str, np.ndarray]:
        groups.append(sorted(set(mode.ravel().tolist())))
        assert len(set(mode.ravel().tolist())) == 1
        return {"y": x * mode.reshape(-1, 1)}

    modes = np.int64([[1], [2], [1], [3], [2]])
    x = rows(5)
    out = infer([Request({"x": x[:2], "mode": modes[:2]}), Request({"x": x[2:], "mode": modes[2:]})])
    assert sorted(groups) == [[1], [2], [3]]
    np.testing.assert_array_equal(np.concatenate([o["y"] for o in out]), x * modes)

    with pytest.raises(PyTritonRuntimeError, match="after"):
        group_by_values("mode")(batch(lambda **kw: kw))


def test_group_by_values_on_bytes_with_a_padder() -> None:
    @batch
    @group_by_values("lang", pad_fn=ConstantPadder(-1))
    def infer(x: np.ndarray, lang: np.ndarray) -> dict[str, np.ndarray]:
        width = 1 if lang[0][0] == b"en" else 3
        return {"y": np.ones((x.shape[0], width), dtype=np.int64)}

    lang = np.array([[b"en"], [b"fr"], [b"en"]], dtype=object)
    (out,) = infer([Request({"x": rows(3), "lang": lang})])
    np.testing.assert_array_equal(out["y"], [[1, -1, -1], [1, 1, 1], [1, -1, -1]])


def test_group_by_keys_calls_once_per_set_of_inputs_in_request_order() -> None:
    calls: list[int] = []

    @group_by_keys
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        calls.append(len(requests))
        return [{"keys": np.array([",".join(sorted(r))])} for r in requests]

    out = infer([Request({"a": rows(1)}), Request({"a": rows(1), "b": rows(1)}), Request({"a": rows(1)})])
    assert sorted(calls) == [1, 2]
    assert [o["keys"][0] for o in out] == ["a", "a,b", "a"]


# -- what a callable returns -----------------------------------------------------------------


def test_outputs_must_be_one_dict_of_arrays_per_request_with_its_rows() -> None:
    config = config_of()
    with pytest.raises(PyTritonValidationError, match="list of dicts"):
        collect_outputs({"y": rows(1)}, [1], config, strict=False)
    with pytest.raises(PyTritonValidationError, match="2 responses for 1 requests"):
        collect_outputs([{"y": rows(1)}, {"y": rows(1)}], [1], config, strict=False)
    with pytest.raises(PyTritonValidationError, match="no output 'y'"):
        collect_outputs([{"z": rows(1)}], [1], config, strict=False)
    with pytest.raises(PyTritonValidationError, match="expected 2 rows"):
        collect_outputs([{"y": rows(1)}], [2], config, strict=False)
    with pytest.raises(PyTritonValidationError, match="numpy array"):
        collect_outputs([{"y": torch.zeros(1, 4)}], [1], config, strict=False)
    out = collect_outputs([{"y": rows(1)}, {"y": rows(2, 10)}], [1, 2], config, strict=False)
    np.testing.assert_array_equal(out["y"], np.concatenate([rows(1), rows(2, 10)]))


def test_strict_refuses_what_non_strict_casts_or_drops() -> None:
    config = config_of()
    wide = {"y": rows(2).astype(np.float64), "extra": rows(2)}
    out = collect_outputs([wide], [2], config, strict=False)  # cast within its kind, the extra dropped
    assert list(out) == ["y"] and out["y"].dtype == np.float32
    with pytest.raises(PyTritonValidationError, match="invalid dtype: returned float64, declared float32"):
        collect_outputs([{"y": rows(2).astype(np.float64)}], [2], config, strict=True)
    with pytest.raises(PyTritonValidationError, match=r"not declared"):
        collect_outputs([wide], [2], config, strict=True)
    # Not strict: cast as PyTriton's astype casts, whatever it loses; strings and numbers never mix.
    ints = collect_outputs(
        [{"y": rows(2) + 0.7}], [2], config_of(Tensor(name="y", dtype=np.int64, shape=(4,))), strict=False
    )
    np.testing.assert_array_equal(ints["y"], (rows(2) + 0.7).astype(np.int64))
    flags = collect_outputs(
        [{"y": rows(2).astype(np.int64)}], [2], config_of(Tensor(name="y", dtype=np.bool_, shape=(4,))), strict=False
    )
    assert flags["y"].dtype == np.bool_
    with pytest.raises(PyTritonValidationError, match="strings and numbers"):
        collect_outputs([{"y": rows(2)}], [2], config_of(Tensor(name="y", dtype=np.bytes_, shape=(4,))), strict=False)
    with pytest.raises(PyTritonValidationError, match="invalid shape"):
        collect_outputs([{"y": np.zeros((2, 5), np.float32)}], [2], config, strict=True)
    variable = config_of(Tensor(name="y", dtype=np.float32, shape=(-1,)))
    assert collect_outputs([{"y": np.zeros((2, 5), np.float32)}], [2], variable, strict=True)["y"].shape == (2, 5)


def test_a_bound_model_cuts_the_batch_into_its_requests_with_their_parameters() -> None:
    seen: list[tuple[int, dict[str, Any]]] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        seen.extend((r["x"].shape[0], dict(r.parameters)) for r in requests)
        return [{"y": r["x"] + float(r.parameters.get("add", 0))} for r in requests]

    config = config_of()
    model = BoundModel(infer, config, TritonContext(), strict=True, on_unrecoverable=lambda e: None)
    x = torch.from_numpy(rows(6))
    out = model({"x": x}, [RequestInfo(2, {"add": 10}), RequestInfo(1), RequestInfo(3, {"add": 1, "tag": "t"})])
    assert seen == [(2, {"add": 10}), (1, {}), (3, {"add": 1, "tag": "t"})]
    np.testing.assert_array_equal(out["y"], rows(6) + np.float32([[10]] * 2 + [[0]] + [[1]] * 3))
    x.zero_()  # the staging slot is reused: what the callable got was its own copy
    assert seen[0][0] == 2


def test_variable_length_rows_reach_each_request_unpadded_and_return_padded_with_lengths() -> None:
    tokens = Tensor(name="tokens", dtype=np.int64, shape=(-1,))
    out = Tensor(name="out", dtype=np.int64, shape=(-1,))
    config = config_of(out, inputs=(tokens,))
    seen: list[tuple[int, ...]] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        seen.extend(r["tokens"].shape for r in requests)
        return [{"out": np.concatenate([r["tokens"], r["tokens"]], axis=1)} for r in requests]

    model = BoundModel(infer, config, TritonContext(), strict=True, on_unrecoverable=lambda e: None)
    padded = torch.tensor([[1, 2, 0, 0, 0], [3, 4, 0, 0, 0], [5, 6, 7, 8, 9]])
    result = model({"tokens": padded, "tokens_lengths": torch.tensor([2, 2, 5])}, [RequestInfo(2), RequestInfo(1)])
    assert seen == [(2, 2), (1, 5)]  # each request's own rows, cut to its own length
    assert result["out_lengths"].tolist() == [4, 4, 10]
    np.testing.assert_array_equal(result["out"][0], [1, 2, 1, 2, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(result["out"][2], [5, 6, 7, 8, 9, 5, 6, 7, 8, 9])


def test_bytes_outputs_may_be_bytes_or_text_arrays() -> None:
    config = config_of(Tensor(name="y", dtype=np.bytes_, shape=(1,)))
    out = collect_outputs([{"y": np.array([["é"]])}, {"y": np.array([[b"ab"], [b""]])}], [1, 2], config, strict=True)
    assert out["y"].dtype == object and out["y"].ravel().tolist() == ["é".encode(), b"ab", b""]
    with pytest.raises(PyTritonValidationError, match="invalid dtype"):
        collect_outputs([{"y": np.ones((1, 1), np.float32)}], [1], config, strict=False)


def test_triton_context_and_list_outputs_read_the_bound_models_config() -> None:
    @batch
    @triton_context
    def infer(x: np.ndarray, triton_context: TritonContext) -> tuple[np.ndarray, np.ndarray]:
        names = [t.name for t in triton_context.model_configs[infer].outputs]
        assert names == ["y", "OUTPUT_2"]
        return x, x + 1

    config = config_of(Y, Tensor(dtype=np.float32, shape=(4,)))
    context = TritonContext()
    context.model_configs[infer] = config
    model = BoundModel(infer, config, context, strict=True, on_unrecoverable=lambda e: None)
    out = model({"x": torch.from_numpy(rows(2))}, [RequestInfo(2)])
    np.testing.assert_array_equal(out["OUTPUT_2"], rows(2) + 1)


def test_unrecoverable_error_is_reported_then_raised() -> None:
    reported: list[BaseException] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        raise UnrecoverableError("the GPU fell off")

    model = BoundModel(infer, config_of(), TritonContext(), strict=False, on_unrecoverable=reported.append)
    with pytest.raises(UnrecoverableError):
        model({"x": torch.from_numpy(rows(1))}, [RequestInfo(1)])
    assert len(reported) == 1


# -- configuration ------------------------------------------------------------------------------


def test_tensor_dtypes_and_what_bind_refuses() -> None:
    assert Tensor(dtype=np.dtype("float32"), shape=(2,)).dtype is np.float32
    with pytest.raises(ValueError, match="-1"):
        Tensor(dtype=np.float32, shape=(-2,))
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return []

    decoupled_cached = ModelConfig(response_cache=True, decoupled=True)
    cached = Triton(config=TritonConfig(http_port=0, grpc_port=0, cache_config=["local,size=4096"]))
    with pytest.raises(PyTritonModelConfigError, match="response_cache"):  # one result per request
        cached.bind("m", infer, [X], [Y], config=decoupled_cached)
    with pytest.raises(PyTritonModelConfigError, match="outputs cannot be optional"):
        triton.bind("m", infer, [X], [Tensor(name="y", dtype=np.float32, shape=(4,), optional=True)])
    with pytest.raises(PyTritonModelConfigError, match="preferred_batch_sizes"):
        triton.bind("m", infer, [X], [Y], config=ModelConfig(batcher=DynamicBatcher(preferred_batch_size=[64])))
    with pytest.raises(PyTritonValidationError, match="model name"):
        triton.bind("no spaces", infer, [X], [Y])
    triton.bind("m", infer, [X], [Y], config=ModelConfig(max_batch_size=8, batcher=DynamicBatcher(
        max_queue_delay_microseconds=2500, preferred_batch_size=[4, 8])))  # fmt: skip
    (server,) = triton.servers
    assert (server.max_batch_size, server.max_delay, server.preferred_batch_sizes) == (8, 0.0025, (4, 8))
    with pytest.raises(PyTritonInvalidOperationError, match="already bound"):  # PyTriton's error
        triton.bind("m", infer, [X], [Y])
    batcher = DynamicBatcher(priority_levels=3, default_priority_level=2)
    triton.bind("urgent", infer, [X], [Y], config=ModelConfig(batcher=batcher))
    assert (triton.servers[1].priority_levels, triton.servers[1].default_priority) == (3, 2)


def test_triton_config_from_env_and_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTRITON_TRITON_CONFIG_GRPC_PORT", "45436")
    monkeypatch.setenv("PYTRITON_TRITON_CONFIG_ALLOW_HTTP", "false")
    monkeypatch.setenv("PYTRITON_TRITON_CONFIG_CACHE_CONFIG_0", "local,size=1")
    config = TritonConfig.from_env()
    assert (config.grpc_port, config.allow_http, config.cache_config) == (45436, False, ["local,size=1"])
    with pytest.raises(PyTritonValidationError, match="HTTP or the gRPC"):
        TritonConfig(allow_http=False, allow_grpc=False)
    triton = Triton(config=TritonConfig(grpc_port=0))  # explicit beats the environment
    assert (triton._serve_config.http_port, triton._serve_config.grpc_port) == (None, 0)


# -- served for real: tritonclient over HTTP and gRPC ------------------------------------------


@contextlib.contextmanager
def running(triton: Triton) -> Iterator[tuple[str, str]]:
    """``triton.run()``; yields its HTTP and gRPC addresses; stops it on exit."""
    with triton:
        triton.run()
        yield f"127.0.0.1:{triton.http_port}", f"127.0.0.1:{triton.grpc_port}"
    assert not triton.is_alive()


def ephemeral(**kwargs: Any) -> Triton:
    return Triton(config=TritonConfig(http_port=0, grpc_port=0, **kwargs))


@gevent_hub_freed()  # called from pools' threads too
def http_infer(address: str, model: str, x: np.ndarray, **kwargs: Any) -> dict[str, np.ndarray]:
    client = httpclient.InferenceServerClient(address, network_timeout=30)
    try:
        tensor = httpclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor], **kwargs)
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}
    finally:
        client.close()


@gevent_hub_freed()  # called from pools' threads
def infer_over(i: int, http: str, grpc: str, model: str, name: str, value: np.ndarray, datatype: str) -> Any:
    """One request of one input to ``model``: over HTTP for odd ``i``, gRPC
    for even; the client's result (closed on this thread)."""
    kind: Any = httpclient if i % 2 else grpcclient
    client = kind.InferenceServerClient(http if i % 2 else grpc)
    try:
        tensor = kind.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value)
        return client.infer(model, [tensor])
    finally:
        client.close()


def grpc_infer(address: str, model: str, x: np.ndarray, **kwargs: Any) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(address)
    try:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor], client_timeout=30, **kwargs)
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
    finally:
        client.close()


def test_a_bound_callable_answers_tritonclient_over_http_and_grpc() -> None:
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"] * 2} for r in requests]

    triton = ephemeral()
    triton.bind("double", infer, inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with running(triton) as (http, grpc):
        np.testing.assert_array_equal(http_infer(http, "double", rows(3))["y"], rows(3) * 2)
        np.testing.assert_array_equal(grpc_infer(grpc, "double", rows(2, 7))["y"], rows(2, 7) * 2)
        meta = httpclient.InferenceServerClient(http).get_model_metadata("double")
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert triton.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{http}/v2/health/live", timeout=5)


def test_batch_callables_serve_concurrent_clients_their_own_rows() -> None:
    """The first call is held until several requests wait, so later calls
    get several requests (of 1 to 3 rows each) in one batch."""
    calls: list[int] = []
    first = threading.Event()
    server: list[Any] = []

    @batch
    def doubled(x: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * 2 + 1}

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        calls.append(len(requests))
        if not first.is_set():
            deadline = time.monotonic() + 10
            while server[0].stats()["queue_depth"] < 6 and time.monotonic() < deadline:
                time.sleep(0.005)
            first.set()
        out: list[dict[str, np.ndarray]] = doubled(requests)
        return out

    triton = ephemeral()
    triton.bind("b", infer, inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=32))
    server.extend(triton.servers)
    with running(triton) as (http, grpc):

        def call(i: int) -> tuple[np.ndarray, np.ndarray]:
            x = rows(1 + i % 3, start=1000 * i)
            infer_over = http_infer if i % 2 else grpc_infer
            return x, infer_over(http if i % 2 else grpc, "b", x)["y"]

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(call, range(24)))
    for x, y in results:
        np.testing.assert_array_equal(y, x * 2 + 1)
    assert max(calls) > 1, calls  # several requests in one call, each given back its own rows


def test_a_list_of_callables_is_one_instance_each() -> None:
    def instance(k: int) -> Callable[[list[Request]], list[dict[str, np.ndarray]]]:
        def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
            time.sleep(0.05)  # so that concurrent requests need the other instance too
            return [{"y": r["x"] + 1, "who": np.full((r["x"].shape[0], 1), k, dtype=np.int64)} for r in requests]

        return infer

    who = Tensor(name="who", dtype=np.int64, shape=(1,))
    triton = ephemeral()
    triton.bind("pair", [instance(0), instance(1)], inputs=[X], outputs=[Y, who], config=ModelConfig(max_batch_size=1))
    with running(triton) as (http, _):
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: (i, http_infer(http, "pair", rows(1, i))), range(12)))
    for i, out in results:
        np.testing.assert_array_equal(out["y"], rows(1, i) + 1)
    assert {int(out["who"][0, 0]) for _, out in results} == {0, 1}


def test_strict_mode_fails_the_call_with_a_clear_error_and_serves_on() -> None:
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        out = []
        for r in requests:
            x = r["x"]
            if x[0, 0] == -1:
                out.append({"y": x.astype(np.float64)})  # wrong dtype
            elif x[0, 0] == -2:
                out.append({"y": np.zeros((x.shape[0], 3), np.float32)})  # wrong shape
            else:
                out.append({"y": x})
        return out

    triton = ephemeral()
    triton.bind("strict", infer, inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=4), strict=True)
    with running(triton) as (http, grpc):
        bad = rows(1)
        bad[0, 0] = -1
        with pytest.raises(InferenceServerException, match="invalid dtype: returned float64, declared float32") as e:
            http_infer(http, "strict", bad)
        assert e.value.status() == "500"
        bad[0, 0] = -2
        with pytest.raises(InferenceServerException, match=r"invalid shape: returned \(3,\) per row") as e:
            grpc_infer(grpc, "strict", bad)
        assert e.value.status() == "StatusCode.INTERNAL"
        np.testing.assert_array_equal(http_infer(http, "strict", rows(2))["y"], rows(2))


@pytest.mark.parametrize("frontend", ["native", "python"])
def test_unrecoverable_error_stops_the_server_after_answering_what_it_accepted(frontend: str) -> None:
    """Two instances: one holds a request while the other raises
    UnrecoverableError; readiness says 503 (the listeners still open), the
    held request is still answered, then serve() returns."""
    entered, release = threading.Event(), threading.Event()

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        x = requests[0]["x"]
        if x[0, 0] == -1:
            raise UnrecoverableError("the accelerator is gone")
        if x[0, 0] == -2:
            entered.set()
            release.wait(30)
        return [{"y": r["x"]} for r in requests]

    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0), frontend=frontend)
    triton.bind("fragile", [infer, infer], inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=1))
    assert not triton._triton_server.is_alive()  # what PyTriton's own tests poll
    serving = threading.Thread(target=triton.serve)
    serving.start()
    try:
        deadline = time.monotonic() + 30
        while triton.http_port is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert triton._triton_server.is_alive()
        http, grpc = f"127.0.0.1:{triton.http_port}", f"127.0.0.1:{triton.grpc_port}"
        assert httpx.get(f"http://{http}/v2/health/ready", timeout=5).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            held_x = rows(1)
            held_x[0, 0] = -2
            held = pool.submit(http_infer, http, "fragile", held_x)
            assert entered.wait(10)
            fatal = rows(1)
            fatal[0, 0] = -1
            with pytest.raises(InferenceServerException, match="the accelerator is gone"):
                grpc_infer(grpc, "fragile", fatal)
            seen = None
            while time.monotonic() < deadline:
                try:
                    seen = httpx.get(f"http://{http}/v2/health/ready", timeout=5).status_code
                except httpx.TransportError:
                    seen = "closed"
                if seen != 200:
                    break
                time.sleep(0.01)
            assert seen == 503  # readiness says so before the listeners close
            release.set()
            np.testing.assert_array_equal(held.result(30)["y"], held_x)  # accepted: still answered
        serving.join(30)
        assert not serving.is_alive() and not triton.is_alive() and not triton._triton_server.is_alive()
        assert isinstance(triton.unrecoverable, UnrecoverableError)
    finally:
        release.set()
        triton.stop()
        serving.join(30)


def test_serve_blocks_until_stop_and_stop_unbinds_the_models() -> None:
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"]} for r in requests]

    triton = ephemeral(allow_grpc=False)
    with pytest.raises(PyTritonInvalidOperationError, match="bind at least one"):
        triton.run()
    triton.bind("echo", infer, inputs=[X], outputs=[Y])
    serving = threading.Thread(target=triton.serve)
    serving.start()
    deadline = time.monotonic() + 30
    while not triton.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert triton.grpc_port is None
    np.testing.assert_array_equal(http_infer(f"127.0.0.1:{triton.http_port}", "echo", rows(1))["y"], rows(1))
    triton.bind("late", infer, inputs=[X], outputs=[Y])  # served once bind returns, as PyTriton loads it
    np.testing.assert_array_equal(http_infer(f"127.0.0.1:{triton.http_port}", "late", rows(1))["y"], rows(1))
    assert serving.is_alive()
    assert triton.stop() is True  # returns once serve() has shut down
    assert not triton.is_alive() and triton.stop() is False
    serving.join(5)
    assert not serving.is_alive()
    with pytest.raises(PyTritonInvalidOperationError, match="stop\\(\\) unbinds the models"):
        triton.run()


def test_a_stopped_triton_serves_again_what_is_bound_after_the_stop() -> None:
    """PyTriton's notebook: run, stop, bind the model again (a new callable,
    the same name), run again; the last run's servers keep their stats
    until the next bind."""

    def plus(k: float) -> Any:
        def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
            return [{"y": r["x"] + k} for r in requests]

        return infer

    triton = ephemeral()
    for k in (1.0, 2.0, 3.0):
        triton.bind("AddSub", plus(k), inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
        with running(triton) as (http, grpc):
            np.testing.assert_array_equal(http_infer(http, "AddSub", rows(2))["y"], rows(2) + k)
            np.testing.assert_array_equal(grpc_infer(grpc, "AddSub", rows(1))["y"], rows(1) + k)
        assert [s.stats()["requests_succeeded"] for s in triton.servers] == [2]
    # After run() and stop(), serve() serves (it does not wait for the stopped run).
    triton.bind("AddSub", plus(4.0), inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
    serving = threading.Thread(target=triton.serve)
    serving.start()
    try:
        deadline = time.monotonic() + 30
        while not triton.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        np.testing.assert_array_equal(http_infer(f"127.0.0.1:{triton.http_port}", "AddSub", rows(1))["y"], rows(1) + 4)
    finally:
        assert triton.stop() is True
        serving.join(30)
    assert not serving.is_alive()


def test_parameters_and_forwarded_headers_reach_the_callable() -> None:
    seen: list[dict[str, Any]] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        seen.extend(dict(r.parameters) for r in requests)
        return [{"y": r["x"] + float(r.parameters.get("add", 0))} for r in requests]

    triton = ephemeral(http_header_forward_pattern="^x-trace", grpc_header_forward_pattern="^x-trace")
    triton.bind("params", infer, inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with running(triton) as (http, grpc):
        out = http_infer(
            http, "params", rows(2), parameters={"add": 10, "tag": "h"}, headers={"X-Trace-Id": "t1", "X-Other": "no"}
        )
        np.testing.assert_array_equal(out["y"], rows(2) + 10)
        out = grpc_infer(grpc, "params", rows(1), parameters={"add": 5, "flag": True}, headers={"x-trace-id": "g1"})
        np.testing.assert_array_equal(out["y"], rows(1) + 5)
        np.testing.assert_array_equal(http_infer(http, "params", rows(1), timeout=30_000_000)["y"], rows(1))
    assert seen == [
        {"add": 10, "tag": "h", "x-trace-id": "t1"},
        {"add": 5, "flag": True, "x-trace-id": "g1"},
        {},  # the timeout is the server's, as in Triton
    ]


def gated(server: list[Any], depth: int) -> Callable[[], None]:
    """Holds the first call until ``depth`` requests wait, so that the next
    call gets several requests at once."""
    first = threading.Event()

    def hold() -> None:
        if not first.is_set():
            deadline = time.monotonic() + 10
            while server[0].stats()["queue_depth"] < depth and time.monotonic() < deadline:
                time.sleep(0.005)
            first.set()

    return hold


def test_bytes_of_several_lengths_in_one_batch_over_http_and_grpc() -> None:
    calls: list[int] = []
    server: list[Any] = []
    hold = gated(server, 4)

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        calls.append(len(requests))
        hold()
        out = []
        for r in requests:
            text = r["text"]
            assert text.dtype == object and all(isinstance(t, bytes) for t in text.flat)
            out.append({
                "upper": np.array([[t.upper() + b"!" for t in row] for row in text], dtype=np.bytes_),
                "size": np.array([[len(t) for t in row] for row in text], dtype=np.int64),
            })  # fmt: skip
        return out

    triton = ephemeral()
    triton.bind(
        "shout",
        infer,
        inputs=[Tensor(name="text", dtype=np.bytes_, shape=(1,))],
        outputs=[Tensor(name="upper", dtype=np.bytes_, shape=(1,)), Tensor(name="size", dtype=np.int64, shape=(1,))],
        config=ModelConfig(max_batch_size=16),
        strict=True,
    )
    server.extend(triton.servers)
    with running(triton) as (http, grpc):

        def call(i: int) -> tuple[list[bytes], dict[str, np.ndarray]]:
            words = [b"x" * (1 + (i * 7 + j) % 13) + str(i).encode() for j in range(1 + i % 3)]
            text = np.array([[w] for w in words], dtype=object)
            result = infer_over(i, http, grpc, "shout", "text", text, "BYTES")
            return words, {n: result.as_numpy(n) for n in ("upper", "size")}

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(16)))
    for words, out in results:
        assert [row[0] for row in out["upper"].tolist()] == [w.upper() + b"!" for w in words]
        assert out["size"].ravel().tolist() == [len(w) for w in words]
    assert max(calls) > 1, calls


def test_variable_length_inputs_and_outputs_of_several_lengths_in_one_batch() -> None:
    """``shape=(-1,)``: each request gets its own rows unpadded, and each
    caller gets back its own length."""
    seen: list[int] = []
    server: list[Any] = []
    hold = gated(server, 4)

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        hold()
        seen.append(len(requests))
        out = []
        for r in requests:
            tokens = r["tokens"]
            assert tokens.min(initial=1) > 0  # no padding reached the callable
            out.append({"doubled": np.concatenate([tokens, tokens], axis=1) * 2, "total": tokens.sum(1, keepdims=True)})
        return out

    triton = ephemeral()
    triton.bind(
        "tokens",
        infer,
        inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
        outputs=[Tensor(name="doubled", dtype=np.int64, shape=(-1,)), Tensor(name="total", dtype=np.int64, shape=(1,))],
        config=ModelConfig(max_batch_size=16),
        strict=True,
    )
    server.extend(triton.servers)
    with running(triton) as (http, grpc):

        def call(i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            length = 1 + (i * 5) % 9
            tokens = np.arange(1, length + 1, dtype=np.int64)[None].repeat(1 + i % 2, axis=0) + 100 * i
            result = infer_over(i, http, grpc, "tokens", "tokens", tokens, "INT64")
            return tokens, {n: result.as_numpy(n) for n in ("doubled", "total")}

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(16)))
    for tokens, out in results:
        np.testing.assert_array_equal(out["doubled"], np.concatenate([tokens, tokens], axis=1) * 2)
        np.testing.assert_array_equal(out["total"], tokens.sum(1, keepdims=True))
    assert max(seen) > 1, seen


def test_a_port_in_use_fails_run_with_a_startup_error() -> None:
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [{"y": r["x"]} for r in requests]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        triton = Triton(config=TritonConfig(http_port=taken.getsockname()[1], grpc_port=0))
        triton.bind("echo", infer, inputs=[X], outputs=[Y])
        with pytest.raises(StartupError):
            triton.run()
    assert not triton.is_alive()


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_model_client_infers_samples_and_batches_the_pytriton_way(scheme: str) -> None:
    from ferrobatch.triton.client import (
        ModelClient,
        PyTritonClientInferenceServerError,
        PyTritonClientTimeoutError,
        PyTritonClientValueError,
    )

    @batch
    def infer(x: np.ndarray, k: np.ndarray) -> dict[str, np.ndarray]:
        if (k < 0).any():
            raise ValueError("k must be >= 0")
        if (k == 99).any():  # a slow call
            time.sleep(1.0)
        return {"y": x * k}

    k = Tensor(name="k", dtype=np.float32, shape=(1,))
    triton = ephemeral()
    triton.bind("scale", infer, inputs=[X, k], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with running(triton):
        port = triton.http_port if scheme == "http" else triton.grpc_port
        with ModelClient(f"{scheme}://127.0.0.1:{port}", "scale", lazy_init=False) as client:
            assert client.is_batching_supported
            config = client.model_config  # typed, as PyTriton's
            assert (config.model_name, config.max_batch_size, config.batching) == ("scale", 8, True)
            assert [(t.name, t.shape, t.dtype) for t in config.inputs or []] == [
                ("x", (4,), np.float32),
                ("k", (1,), np.float32),
            ]
            client.wait_for_server(5)
            out = client.infer_sample(rows(1)[0], np.float32([3]))  # positional: the model's order
            np.testing.assert_array_equal(out["y"], rows(1)[0] * 3)
            out = client.infer_batch(x=rows(3), k=np.float32([[1], [2], [3]]))
            np.testing.assert_array_equal(out["y"], rows(3) * np.float32([[1], [2], [3]]))
            with pytest.raises(PyTritonClientValueError, match="by position or by name"):
                client.infer_batch(rows(1), k=np.float32([[1]]))
            with pytest.raises(PyTritonClientInferenceServerError, match="k must be >= 0"):
                client.infer_sample(x=rows(1)[0], k=np.float32([-1]))
        with pytest.raises(PyTritonClientTimeoutError, match="not ready"):
            ModelClient(f"{scheme}://127.0.0.1:{port}", "missing", lazy_init=False, init_timeout_s=0.2)
        # A call past inference_timeout_s: a timeout, as PyTriton's (over gRPC the server, told the
        # deadline, says DEADLINE_EXCEEDED first).
        with ModelClient(f"{scheme}://127.0.0.1:{port}", "scale", inference_timeout_s=0.3) as client:
            with pytest.raises(PyTritonClientTimeoutError):
                client.infer_sample(rows(1)[0], np.float32([99]))


SERVE_SCRIPT = """
import logging, numpy as np
from ferrobatch.triton import Triton, TritonConfig, Tensor, batch
logging.basicConfig(level=logging.INFO, format="%(message)s")

@batch
def infer(x):
    return {"y": x + 1}

with Triton(config=TritonConfig(http_port=0, grpc_port=0)) as triton:
    triton.bind("inc", infer, inputs=[Tensor(name="x", dtype=np.float32, shape=(4,))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(4,))])
    triton.serve()
print("serve returned", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_in_a_script_serves_until_a_signal_then_returns(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            found = re.search(r"HTTP port (\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "the script did not report its port"
        np.testing.assert_array_equal(http_infer(f"127.0.0.1:{port}", "inc", rows(2))["y"], rows(2) + 1)
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, rest
        assert "serve returned" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


RUN_AND_EXIT_SCRIPT = """
import atexit, json, socket, urllib.request
import numpy as np
from ferrobatch.triton import Triton, TritonConfig, Tensor, batch

@batch
def infer(x):
    return {"y": x + 1}

triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))
triton.bind("inc", infer, inputs=[Tensor(name="x", dtype=np.float32, shape=(4,))],
            outputs=[Tensor(name="y", dtype=np.float32, shape=(4,))])
triton.run()
port = triton.http_port
body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]})
with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/inc/infer", body.encode(), timeout=30) as reply:
    print("answered", json.load(reply)["outputs"][0]["data"], flush=True)

def after_exit_hooks():  # atexit functions run once the server's exit hook has run
    with socket.socket() as probe:
        refused = probe.connect_ex(("127.0.0.1", port)) != 0
    print("alive", triton.is_alive(), "refused", refused, flush=True)

atexit.register(after_exit_hooks)
"""


def test_interpreter_exit_after_run_stops_the_server_silently() -> None:
    proc = subprocess.run([sys.executable, "-c", RUN_AND_EXIT_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "answered [1.0, 2.0, 3.0, 4.0]" in proc.stdout, (proc.stdout, proc.stderr)
    assert "alive False refused True" in proc.stdout, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "ERROR" not in proc.stderr, proc.stderr


def test_bytes_of_variable_length_several_rows_and_requests_in_one_call() -> None:
    """``dtype=bytes, shape=(-1,)``: each request gets its own rows, cut to its
    own number of strings, of several lengths; each caller gets back its own."""
    calls: list[list[tuple[int, ...]]] = []
    server: list[Any] = []
    hold = gated(server, 4)

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        hold()
        calls.append([r["text"].shape for r in requests])
        out = []
        for r in requests:
            text = r["text"]
            assert text.dtype == object and all(isinstance(t, bytes) and t for t in text.flat)  # no padding
            out.append({
                "shouted": np.array([[t.upper() for t in row] + [b"!"] for row in text], dtype=object),
                "sizes": np.array([[len(t) for t in row] for row in text], dtype=np.int64),
            })  # fmt: skip
        return out

    triton = ephemeral()
    triton.bind(
        "words",
        infer,
        inputs=[Tensor(name="text", dtype=bytes, shape=(-1,))],
        outputs=[Tensor(name="shouted", dtype=bytes, shape=(-1,)), Tensor(name="sizes", dtype=np.int64, shape=(-1,))],
        config=ModelConfig(max_batch_size=16),
        strict=True,
    )
    server.extend(triton.servers)
    with running(triton) as (http, grpc):

        def call(i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            n, rows = 1 + (i * 5) % 7, 1 + i % 3
            text = np.array(
                [[b"w" + b"x" * ((i + r * 3 + j * 2) % 9) + b"%d" % i for j in range(n)] for r in range(rows)],
                dtype=object,
            )
            result = infer_over(i, http, grpc, "words", "text", text, "BYTES")
            return text, {n: result.as_numpy(n) for n in ("shouted", "sizes")}

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(16)))
    for text, out in results:
        assert out["shouted"].tolist() == [[t.upper() for t in row] + [b"!"] for row in text.tolist()]
        np.testing.assert_array_equal(out["sizes"], [[len(t) for t in row] for row in text.tolist()])
    assert max(len(c) for c in calls) > 1, calls
    # Requests of several lengths shared a call, each with its own.
    assert any(len({shape[1] for shape in c}) > 1 for c in calls), calls


def test_variable_dimensions_anywhere_reach_each_request_unpadded() -> None:
    """``shape=(2, -1)`` in, ``(-1, -1)`` out: each request gets its own rows
    at its own length, never the batch's padding, and each caller gets back
    its own shape."""
    calls: list[list[tuple[int, ...]]] = []
    server: list[Any] = []
    hold = gated(server, 4)

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        hold()
        calls.append([r["x"].shape for r in requests])
        out = []
        for r in requests:
            x = r["x"]  # [n, 2, L]
            assert x.min(initial=1) > 0  # no padding reached the callable
            out.append({"t": np.swapaxes(x, 1, 2).repeat(2, axis=1) * 3})  # [n, 2L, 2]... as (-1, -1)
        return out

    triton = ephemeral()
    triton.bind(
        "grid",
        infer,
        inputs=[Tensor(name="x", dtype=np.int32, shape=(2, -1))],
        outputs=[Tensor(name="t", dtype=np.int32, shape=(-1, -1))],
        config=ModelConfig(max_batch_size=16),
        strict=True,
    )
    server.extend(triton.servers)
    with running(triton) as (http, grpc):

        def call(i: int) -> tuple[np.ndarray, np.ndarray]:
            n, length = 1 + i % 2, 1 + (i * 3) % 7
            x = (np.arange(n * 2 * length, dtype=np.int32).reshape(n, 2, length) + 1 + i) % 50 + 1
            result = infer_over(i, http, grpc, "grid", "x", x, "INT32")
            return x, result.as_numpy("t")

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(call, range(16)))
    for x, t in results:
        np.testing.assert_array_equal(t, np.swapaxes(x, 1, 2).repeat(2, axis=1) * 3)
    assert any(len({shape[2] for shape in c}) > 1 for c in calls), calls  # several lengths in one call
    with pytest.raises(PyTritonModelConfigError, match="first dimension only"):
        ephemeral().bind("b", infer, [Tensor(name="s", dtype=bytes, shape=(2, -1))], [Y])


def test_bind_gives_each_callable_its_context_which_any_wrapt_decorator_reads() -> None:
    import wrapt

    from ferrobatch.triton.decorators import get_model_config

    seen: list[str] = []

    @wrapt.decorator
    def records_its_model(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        seen.append(get_model_config(wrapped, instance).model_name)
        return wrapped(*args, **kwargs)

    class Model:
        @records_its_model
        @batch
        def __call__(self, x: np.ndarray) -> dict[str, np.ndarray]:
            return {"y": x * 2}

    function_model = records_its_model(batch(lambda x: {"y": x + 1}))
    method_model = Model()
    triton = Triton(config=TritonConfig(http_port=0, grpc_port=0))
    triton.bind("f", function_model, [X], [Y])
    triton.bind("m", method_model, [X], [Y])
    assert function_model.__triton_context__ is method_model.__triton_context__  # type: ignore[attr-defined]
    np.testing.assert_array_equal(function_model([Request({"x": rows(1)})])[0]["y"], rows(1) + 1)
    np.testing.assert_array_equal(method_model([Request({"x": rows(2)})])[0]["y"], rows(2) * 2)
    assert seen == ["f", "m"]  # outside any server call: found through the callables alone


def test_fill_optionals_fills_what_each_request_left_out_and_checks_the_defaults() -> None:
    from ferrobatch.triton.decorators import TritonContext, fill_optionals
    from ferrobatch.triton.exceptions import PyTritonBadParameterError
    from ferrobatch.triton.model_config.triton_model_config import TensorSpec, TritonModelConfig
    from ferrobatch.triton.models.model import inject_triton_context

    @fill_optionals(k=np.int64([7, 8]))
    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        return [dict(r) for r in requests]

    def bind(function: Any, dtype: Any = np.int64, batching: bool = True) -> None:
        context = TritonContext()
        specs = [TensorSpec("x", (2,), np.int64), TensorSpec("k", (2,), dtype, optional=True)]
        context.model_configs[function] = TritonModelConfig("m", batching=batching, inputs=specs, outputs=specs)
        inject_triton_context(context, function)

    bind(infer)
    given = np.int64([[1, 2]])
    out = infer([Request({"x": np.int64([[0, 0], [1, 1]])}), Request({"x": np.int64([[2, 2]]), "k": given})])
    np.testing.assert_array_equal(out[0]["k"], [[7, 8], [7, 8]])  # repeated to the request's rows
    np.testing.assert_array_equal(out[1]["k"], given)  # given: kept
    bind(infer, batching=False)
    np.testing.assert_array_equal(infer([Request({"x": np.int64([0, 0])})])[0]["k"], [7, 8])
    bind(infer, dtype=np.int32)
    with pytest.raises(PyTritonBadParameterError, match=r"dtype=int64 expected_dtype=.*input signature dtypes"):
        infer([Request({"x": rows(1)})])


def test_batch_splits_each_result_a_generator_yields() -> None:
    @batch
    def stream(x: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
        for step in range(3):
            yield {"y": x + step}

    parts = list(stream([Request({"x": rows(2)}), Request({"x": rows(1)})]))
    assert len(parts) == 3 and all(len(p) == 2 for p in parts)  # per yield: one response per request
    np.testing.assert_array_equal(parts[2][0]["y"], rows(2) + 2)
    np.testing.assert_array_equal(parts[2][1]["y"], rows(1) + 2)


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_futures_and_asyncio_clients_infer_the_pytriton_way(scheme: str) -> None:
    import asyncio

    from ferrobatch.triton.client import (
        AsyncioModelClient,
        FuturesModelClient,
        PyTritonClientClosedError,
        PyTritonClientInferenceServerError,
    )

    @batch
    def infer(x: np.ndarray) -> dict[str, np.ndarray]:
        if (x < 0).any():
            raise ValueError("x must be >= 0")
        return {"y": x + 1}

    triton = ephemeral()
    triton.bind("inc", infer, inputs=[X], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with running(triton):
        url = f"{scheme}://127.0.0.1:{triton.http_port if scheme == 'http' else triton.grpc_port}"
        with FuturesModelClient(url, "inc", max_workers=4) as futures:
            submitted = [futures.infer_sample(x=rows(1)[0] * i) for i in range(8)]
            for i, future in enumerate(submitted):
                np.testing.assert_array_equal(future.result(30)["y"], rows(1)[0] * i + 1)
            assert futures.model_config().result(30).max_batch_size == 8
            with pytest.raises(PyTritonClientInferenceServerError, match="x must be >= 0"):
                futures.infer_batch(x=-rows(2)).result(30)
        with pytest.raises(PyTritonClientClosedError):
            futures.infer_sample(x=rows(1)[0])

        async def calls() -> None:
            async with AsyncioModelClient(url, "inc", lazy_init=False, access_token="t") as client:
                outs = await asyncio.gather(*(client.infer_sample(rows(1)[0] * i) for i in range(8)))
                for i, out in enumerate(outs):
                    np.testing.assert_array_equal(out["y"], rows(1)[0] * i + 1)
                out = await client.infer_batch(x=rows(3))
                np.testing.assert_array_equal(out["y"], rows(3) + 1)
                assert (await client.model_config).inputs[0].name == "x"  # type: ignore[index]
                with pytest.raises(PyTritonClientInferenceServerError, match="x must be >= 0"):
                    await client.infer_sample(-rows(1)[0])

        asyncio.run(calls())


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_optional_inputs_are_left_out_of_requests_and_filled_by_fill_optionals(scheme: str) -> None:
    from ferrobatch.triton.client import ModelClient
    from ferrobatch.triton.decorators import fill_optionals

    seen: list[list[str]] = []

    @fill_optionals(w=np.float32([2]))
    @group_by_keys
    @batch
    def infer(x: np.ndarray, w: np.ndarray) -> dict[str, np.ndarray]:
        return {"y": x * w}

    def record(requests: list[Request]) -> Any:
        seen.append([",".join(sorted(r)) for r in requests])
        return infer(requests)

    w = Tensor(name="w", dtype=np.float32, shape=(1,), optional=True)
    triton = ephemeral()
    triton.bind("scale", record, inputs=[X, w], outputs=[Y], config=ModelConfig(max_batch_size=8))
    with running(triton):
        port = triton.http_port if scheme == "http" else triton.grpc_port
        with ModelClient(f"{scheme}://127.0.0.1:{port}", "scale") as client:
            assert [t.optional for t in client.model_config.inputs or []] == [False, True]
            np.testing.assert_array_equal(client.infer_batch(rows(2))["y"], rows(2) * 2)  # w left out: filled
            np.testing.assert_array_equal(client.infer_batch(rows(2), np.float32([[3], [3]]))["y"], rows(2) * 3)
    assert seen == [["x"], ["w,x"]]  # the callable sees the request as sent, as in PyTriton


@pytest.mark.parametrize("scheme", ["http", "grpc"])
def test_a_model_without_batching_gets_one_sample_per_call_as_declared(scheme: str) -> None:
    from ferrobatch.triton.client import ModelClient, PyTritonClientValueError

    shapes: list[tuple[int, ...]] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        shapes.extend(tuple(r["x"].shape) for r in requests)
        return [{"y": r["x"] * 2} for r in requests]

    triton = ephemeral()
    triton.bind("double", infer, inputs=[X], outputs=[Y], config=ModelConfig(batching=False))
    with running(triton):
        port = triton.http_port if scheme == "http" else triton.grpc_port
        with ModelClient(f"{scheme}://127.0.0.1:{port}", "double") as client:
            config = client.model_config
            assert (config.batching, config.max_batch_size) == (False, 0)
            out = client.infer_sample(x=rows(1)[0])
            np.testing.assert_array_equal(out["y"], rows(1)[0] * 2)
            assert out["y"].shape == (4,)  # no batch dimension, as declared
            with pytest.raises(PyTritonClientValueError, match="does not batch"):
                client.infer_batch(x=rows(2))
    assert shapes == [(4,)]  # the callable sees the sample as sent


def test_lifecycle_policy_is_accepted() -> None:
    from ferrobatch.triton.triton import TritonLifecyclePolicy

    config = TritonConfig(http_port=0, grpc_port=0)
    Triton(config=config, triton_lifecycle_policy=TritonLifecyclePolicy(launch_triton_on_startup=False))


def test_model_warmup_runs_on_each_instance_before_the_model_serves(tmp_path: Any) -> None:
    """Triton's model_warmup: count calls of batch_size rows of made-up data
    (zeros, random, a saved array) on each instance, before run() returns;
    an input a warm-up leaves out is absent from its request; a warm-up
    that fails fails run()."""
    from ferrobatch.triton.model_config.common import ModelWarmup, WarmupInput

    seen: list[dict[str, np.ndarray]] = []

    def infer(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        seen.extend({k: np.array(v) for k, v in r.items()} for r in requests)
        return [{"y": r["x"]} if "x" in r else {} for r in requests]

    saved = tmp_path / "x.npy"
    np.save(saved, np.arange(4, dtype=np.float32))
    extra = Tensor(name="extra", dtype=np.int64, shape=(-1,), optional=True)
    warmups = [
        ModelWarmup("zeros", batch_size=2, inputs={"x": WarmupInput(np.float32, (4,), zero_data=True)}, count=2),
        ModelWarmup(
            "file", batch_size=3, inputs={"x": WarmupInput(np.float32, (4,), input_data_file=str(saved))}, count=1
        ),
        ModelWarmup("random", batch_size=1, inputs={"extra": WarmupInput(np.int64, (5,), random_data=True)}, count=1),
    ]
    triton = ephemeral()
    triton.bind(
        "warm",
        [infer, infer],
        inputs=[X, extra],
        outputs=[Y],
        config=ModelConfig(max_batch_size=8, model_warmup=warmups),
    )
    with running(triton) as (http, _):
        calls = list(seen)
        np.testing.assert_array_equal(http_infer(http, "warm", rows(1))["y"], rows(1))  # then it serves
    assert len(calls) == 2 * (2 + 1 + 1)  # each instance: every warm-up, count times
    zeros, files, randoms = calls[:4], calls[4:6], calls[6:]  # each warm-up on each instance in turn
    assert all(c["x"].shape == (2, 4) and not c["x"].any() and "extra" not in c for c in zeros)
    for call in files:
        np.testing.assert_array_equal(call["x"], np.tile(np.arange(4, dtype=np.float32), (3, 1)))
    assert all(set(c) == {"extra"} and c["extra"].shape == (1, 5) for c in randoms)

    def broken(requests: list[Request]) -> list[dict[str, np.ndarray]]:
        raise ValueError("not ready for this")

    failing = ephemeral()
    failing.bind("cold", broken, inputs=[X], outputs=[Y], config=ModelConfig(model_warmup=warmups[:1]))
    with pytest.raises(PyTritonModelConfigError, match="warm-up 'zeros' failed: ValueError"):
        failing.run()
    assert not failing.is_alive()
