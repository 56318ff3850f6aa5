"""Triton's ``ModelReady``, ``ModelConfig``, ``ModelStatistics``,
``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``,
``LogSettings`` and ``SystemSharedMemory*`` RPCs, answered from what the HTTP
routes serve (:meth:`ModelRepository.model_config`, ``model_statistics``,
``repository_index``, ``load_model``, the shared-memory regions; the
log settings of :mod:`ferrobatch.http._log_settings`), so both protocols
say the same.

One implementation for both gRPC front-ends: the grpcio servicer calls
:func:`model_config` and the others; the native front-end hands the request
message's bytes to :func:`answer` and decodes the bytes it returns. Needs
only protobuf, not grpcio.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from ..http import _log_settings
from ..http.protocol import ModelRepository, ProtocolError, UnknownModelError
from . import grpc_predict_v2_pb2 as pb

# gRPC status codes (grpc.StatusCode's numbers, without importing grpcio).
OK = 0
INVALID_ARGUMENT = 3
NOT_FOUND = 5
INTERNAL = 13
UNIMPLEMENTED = 12
UNAVAILABLE = 14


def model_ready(repository: ModelRepository, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
    """Whether the model serves now; :class:`UnknownModelError` if unknown."""
    return pb.ModelReadyResponse(ready=repository.model_ready(request.name, request.version))


def model_config(repository: ModelRepository, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
    """The model's configuration; :class:`UnknownModelError` if unknown."""
    config = repository.model_config(request.name, request.version)
    return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))


def model_statistics(repository: ModelRepository, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
    """The statistics of the model (``name`` empty: of every model);
    :class:`UnknownModelError` if unknown."""
    stats = repository.model_statistics(request.name, request.version)
    return json_format.ParseDict(stats, pb.ModelStatisticsResponse())


def repository_index(repository: ModelRepository, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
    """Every model (``ready``: the ready ones) with its state."""
    index = repository.repository_index(request.ready)
    return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in index])


def _parameters(request: pb.RepositoryModelLoadRequest | pb.RepositoryModelUnloadRequest) -> dict[str, Any]:
    return {
        name: getattr(value, value.WhichOneof("parameter_choice") or "", None)
        for name, value in request.parameters.items()
    }


async def load_model(
    repository: ModelRepository, request: pb.RepositoryModelLoadRequest
) -> pb.RepositoryModelLoadResponse:
    """Loads the model (see :meth:`ModelRepository.load_model`)."""
    await repository.load_model(request.model_name, _parameters(request))
    return pb.RepositoryModelLoadResponse()


async def unload_model(
    repository: ModelRepository, request: pb.RepositoryModelUnloadRequest
) -> pb.RepositoryModelUnloadResponse:
    """Unloads the model (see :meth:`ModelRepository.unload_model`)."""
    await repository.unload_model(request.model_name, _parameters(request))
    return pb.RepositoryModelUnloadResponse()


def log_settings(repository: ModelRepository, request: pb.LogSettingsRequest) -> pb.LogSettingsResponse:
    """The log settings, first updated with those ``request`` names;
    :class:`ProtocolError` for a bad one."""
    changes = {
        name: getattr(value, value.WhichOneof("parameter_choice") or "", None)
        for name, value in request.settings.items()
    }
    settings = _log_settings.update(changes) if changes else _log_settings.current()
    response = pb.LogSettingsResponse()
    for name, setting in settings.items():
        value = response.settings[name]
        if isinstance(setting, bool):
            value.bool_param = setting
        elif isinstance(setting, int):
            value.uint32_param = setting
        else:
            value.string_param = setting
    return response


def shared_memory_status(
    repository: ModelRepository, request: pb.SystemSharedMemoryStatusRequest
) -> pb.SystemSharedMemoryStatusResponse:
    """The registered region (every one for an empty name), by name."""
    response = pb.SystemSharedMemoryStatusResponse()
    for region in repository.shared_memory_status(request.name):
        response.regions[region["name"]].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
    return response


def register_shared_memory(
    repository: ModelRepository, request: pb.SystemSharedMemoryRegisterRequest
) -> pb.SystemSharedMemoryRegisterResponse:
    repository.register_shared_memory(request.name, request.key, request.offset, request.byte_size)
    return pb.SystemSharedMemoryRegisterResponse()


def unregister_shared_memory(
    repository: ModelRepository, request: pb.SystemSharedMemoryUnregisterRequest
) -> pb.SystemSharedMemoryUnregisterResponse:
    repository.unregister_shared_memory(request.name)
    return pb.SystemSharedMemoryUnregisterResponse()


def cuda_shared_memory_status(
    repository: ModelRepository, request: pb.CudaSharedMemoryStatusRequest
) -> pb.CudaSharedMemoryStatusResponse:
    """No CUDA region is ever registered (NOT_FOUND for a name)."""
    repository.cuda_shared_memory_status(request.name)
    return pb.CudaSharedMemoryStatusResponse()


def register_cuda_shared_memory(
    repository: ModelRepository, request: pb.CudaSharedMemoryRegisterRequest
) -> pb.CudaSharedMemoryRegisterResponse:
    repository.register_cuda_shared_memory(request.name)
    return pb.CudaSharedMemoryRegisterResponse()


def unregister_cuda_shared_memory(
    repository: ModelRepository, request: pb.CudaSharedMemoryUnregisterRequest
) -> pb.CudaSharedMemoryUnregisterResponse:
    repository.unregister_cuda_shared_memory(request.name)
    return pb.CudaSharedMemoryUnregisterResponse()


_RPCS: dict[str, tuple[type[Message], Callable[[ModelRepository, Any], Message | Awaitable[Message]]]] = {
    "ModelReady": (pb.ModelReadyRequest, model_ready),
    "ModelConfig": (pb.ModelConfigRequest, model_config),
    "ModelStatistics": (pb.ModelStatisticsRequest, model_statistics),
    "RepositoryIndex": (pb.RepositoryIndexRequest, repository_index),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, load_model),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, unload_model),
    "LogSettings": (pb.LogSettingsRequest, log_settings),
    "SystemSharedMemoryStatus": (pb.SystemSharedMemoryStatusRequest, shared_memory_status),
    "SystemSharedMemoryRegister": (pb.SystemSharedMemoryRegisterRequest, register_shared_memory),
    "SystemSharedMemoryUnregister": (pb.SystemSharedMemoryUnregisterRequest, unregister_shared_memory),
    "CudaSharedMemoryStatus": (pb.CudaSharedMemoryStatusRequest, cuda_shared_memory_status),
    "CudaSharedMemoryRegister": (pb.CudaSharedMemoryRegisterRequest, register_cuda_shared_memory),
    "CudaSharedMemoryUnregister": (pb.CudaSharedMemoryUnregisterRequest, unregister_cuda_shared_memory),
}


def error_code(exc: ProtocolError) -> int:
    """The gRPC status code of a refused request: NOT_FOUND for an unknown
    model, version or region, UNIMPLEMENTED for what the server does not do
    (501), UNAVAILABLE for what it does not do now (503), INVALID_ARGUMENT
    otherwise."""
    if isinstance(exc, UnknownModelError) or exc.status == 404:
        return NOT_FOUND
    return {501: UNIMPLEMENTED, 503: UNAVAILABLE}.get(exc.status, INVALID_ARGUMENT)


async def answer(repository: ModelRepository, method: str, request: bytes) -> tuple[int, str, bytes]:
    """Answers RPC ``method`` given its request message's bytes:
    ``(0, "", response bytes)``, or ``(gRPC status code, message, b"")``."""
    rpc = _RPCS.get(method)
    if rpc is None:
        return UNIMPLEMENTED, f"{method} is not implemented", b""
    request_type, handler = rpc
    try:
        message = request_type.FromString(request)
    except DecodeError as exc:
        return INVALID_ARGUMENT, f"malformed {method} request: {exc}", b""
    try:
        response = handler(repository, message)
        if inspect.isawaitable(response):
            response = await response
    except ProtocolError as exc:
        return error_code(exc), exc.message, b""
    return OK, "", response.SerializeToString()
