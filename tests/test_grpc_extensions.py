"""Triton's gRPC extensions (ModelConfig, ModelStatistics, RepositoryIndex)
on both front-ends, driven by tritonclient.grpc: the same documents the HTTP
routes serve, wire-compatible with Triton's own messages."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import model_config_pb2 as triton_config
from tritonclient.grpc import service_pb2 as triton_service
from tritonclient.utils import InferenceServerException

import ferrobatch as fb
from ferrobatch.grpc import grpc_predict_v2_pb2 as pb
from ferrobatch.http import protocol
from ferrobatch.serve import ServeConfig, serve_in_thread

X = fb.TensorSpec("x", "float32", (4,))
Y = fb.TensorSpec("y", "float32", (4,))
N = fb.TensorSpec("n", "int64", ())
EXTENSIONS = list(protocol.EXTENSIONS)


def double(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    x = inputs["x"]
    return {"y": x * 2, "n": (x > 0).sum(dim=1)}


class Served:
    def __init__(self, grpc_address: str, http_url: str) -> None:
        self.grpc_address = grpc_address
        self.http_url = http_url

    def client(self) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(self.grpc_address)

    def http(self, path: str) -> Any:
        response = httpx.get(self.http_url + path, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module", params=["native", "python"])
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    servers = [
        fb.Server(
            double,
            inputs=[X],
            outputs=[Y, N],
            max_batch_size=8,
            max_delay=0.002,
            preferred_batch_sizes=(4, 8),
            name="m",
        ),
        fb.Server(double, inputs=[X], outputs=[Y, N], max_batch_size=2, name="other"),
    ]
    config = ServeConfig(http_port=0, grpc_port=0, frontend=request.param, log_level="warning")
    with serve_in_thread(servers, config) as listening:
        yield Served(f"127.0.0.1:{listening.grpc_port}", f"http://127.0.0.1:{listening.http_port}")


def _infer(triton: grpcclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = triton.infer(model, [inp])
    out = result.as_numpy("y")
    assert out is not None
    return out


# -- the messages ---------------------------------------------------------------------


def _fields(descriptor: Descriptor) -> dict[str, tuple[int, int, bool, str]]:
    def kind(f: Any) -> str:
        typed = f.message_type or f.enum_type
        return typed.full_name if typed is not None else ""

    def repeated(f: Any) -> bool:
        # protobuf >= 6.31 deprecates `label` for `is_repeated`.
        is_repeated = getattr(f, "is_repeated", None)
        return bool(is_repeated) if is_repeated is not None else f.label == f.LABEL_REPEATED

    return {f.name: (f.number, f.type, repeated(f), kind(f)) for f in descriptor.fields}


def _messages(descriptor: Descriptor) -> Iterator[Descriptor]:
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def test_added_messages_are_a_wire_compatible_subset_of_tritons() -> None:
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    checked = set()
    for name in ("ModelConfig", "ModelStatistics", "RepositoryIndex"):
        method, triton_method = ours.methods_by_name[name], theirs.methods_by_name[name]
        assert method.input_type.full_name == triton_method.input_type.full_name
        assert method.output_type.full_name == triton_method.output_type.full_name
        pending = [method.input_type, method.output_type]
        while pending:
            message = pending.pop()
            if message.full_name in checked:
                continue
            checked.add(message.full_name)
            for nested in _messages(message):
                triton = triton_service.DESCRIPTOR.pool.FindMessageTypeByName(nested.full_name)
                ours_fields, triton_fields = _fields(nested), _fields(triton)
                for field, spec in ours_fields.items():
                    assert triton_fields.get(field) == spec, f"{nested.full_name}.{field}"
                for f in nested.fields:
                    if f.message_type is not None:
                        pending.append(f.message_type)
                    if f.enum_type is not None:
                        triton_enum = triton_service.DESCRIPTOR.pool.FindEnumTypeByName(f.enum_type.full_name)
                        values = {v.name: v.number for v in f.enum_type.values}
                        assert values.items() <= {v.name: v.number for v in triton_enum.values}.items()
    assert {"inference.ModelConfig", "inference.ModelStatistics", "inference.StatisticDuration"} <= checked


# -- over the network -----------------------------------------------------------------


def test_server_metadata_announces_the_extensions(served: Served) -> None:
    with served.client() as triton:
        assert triton.get_server_metadata(as_json=True)["extensions"] == EXTENSIONS
    assert served.http("/v2")["extensions"] == EXTENSIONS


def test_model_config_is_the_http_document(served: Served) -> None:
    with served.client() as triton:
        response = triton.get_model_config("m")
        as_json = triton.get_model_config("m", "1", as_json=True)
    config = response.config
    assert config.name == "m"
    assert config.platform == "pytorch"
    assert config.max_batch_size == 8
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("x", triton_config.TYPE_FP32, [4])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [
        ("y", triton_config.TYPE_FP32, [4]),
        ("n", triton_config.TYPE_INT64, []),
    ]
    assert list(config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(g.count, g.kind) for g in config.instance_group] == [(1, triton_config.ModelInstanceGroup.KIND_CPU)]
    assert as_json["config"]["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": ["4"]}]
    http = served.http("/v2/models/m/config")
    assert config == json_format.ParseDict(http, triton_config.ModelConfig())


def test_statistics_count_the_inferences_as_http_does(served: Served) -> None:
    before = served.http("/v2/models/other/stats")["model_stats"][0]
    with served.client() as triton:
        for i in range(5):
            x = np.full((1, 4), i + 1, np.float32)
            np.testing.assert_array_equal(_infer(triton, "other", x), x * 2)
        # The tally may trail the reply by a moment: wait until HTTP agrees.
        deadline = time.monotonic() + 5
        while True:
            http = served.http("/v2/models/other/stats")
            if int(http["model_stats"][0]["inference_stats"]["success"]["count"]) >= 5 + int(
                before["inference_stats"]["success"]["count"]
            ):
                break
            assert time.monotonic() < deadline, http
            time.sleep(0.02)
        response = triton.get_inference_statistics("other")
        stats = triton.get_inference_statistics("other", "1", as_json=True)["model_stats"][0]
        everything = triton.get_inference_statistics()
    assert response == json_format.ParseDict(http, triton_service.ModelStatisticsResponse())
    assert stats["name"] == "other" and stats["version"] == "1"
    assert int(stats["inference_count"]) == int(before["inference_count"]) + 5
    assert int(stats["execution_count"]) >= int(before["execution_count"]) + 3  # at most 2 rows a batch
    assert int(stats["inference_stats"]["success"]["count"]) == int(before["inference_stats"]["success"]["count"]) + 5
    assert int(stats["inference_stats"]["success"]["ns"]) > 0
    assert int(stats["last_inference"]) > 0
    rows = sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in stats["batch_stats"])
    assert rows == int(stats["inference_count"])
    assert sorted(s.name for s in everything.model_stats) == ["m", "other"]


def test_repository_index_lists_every_model(served: Served) -> None:
    with served.client() as triton:
        index = triton.get_model_repository_index(as_json=True)
        response = triton.get_model_repository_index()
    assert index == {
        "models": [
            {"name": "m", "version": "1", "state": "READY"},
            {"name": "other", "version": "1", "state": "READY"},
        ]
    }
    http = httpx.post(served.http_url + "/v2/repository/index", timeout=10).json()
    assert response == json_format.ParseDict({"models": http}, triton_service.RepositoryIndexResponse())


@pytest.mark.parametrize("rpc", ["get_model_config", "get_inference_statistics"])
def test_unknown_model_or_version_is_not_found(served: Served, rpc: str) -> None:
    with served.client() as triton:
        call = getattr(triton, rpc)
        with pytest.raises(InferenceServerException) as unknown:
            call("nope")
        with pytest.raises(InferenceServerException) as version:
            call("m", "2")
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert unknown.value.message() == "Request for unknown model: 'nope' is not found"
    assert version.value.status() == "StatusCode.NOT_FOUND"
    assert version.value.message() == "Request for unknown model: 'm' version 2 is not found"
