"""The v2 ``GRPCInferenceService`` on grpcio's asyncio server."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import grpc
import grpc.aio

from .. import _core
from .._core import clipped
from ..http.protocol import (
    DATATYPES,
    MODEL_VERSION,
    ModelRepository,
    ProtocolError,
    ServedModel,
    UnknownModelError,
    error_message,
    error_status,
    model_inputs,
)
from ..server import Server
from . import _extensions
from . import grpc_predict_v2_pb2 as pb
from . import grpc_predict_v2_pb2_grpc as pb_grpc

log = logging.getLogger("ferrobatch.grpc")

_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
# Typed contents field of each datatype (FP16 and BF16 travel only as raw bytes).
_CONTENTS = {v2: field for _, v2, field in _core.dtypes() if field is not None}

Context = grpc.aio.ServicerContext[Any, Any]


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a failed request (the HTTP mapping, translated)."""
    if isinstance(exc, UnknownModelError):
        return grpc.StatusCode.NOT_FOUND
    return _STATUS.get(error_status(exc), grpc.StatusCode.INTERNAL)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Implements ServerLive, ServerReady, ModelReady, ServerMetadata,
    ModelMetadata and ModelInfer for ``servers`` (or a shared repository),
    and Triton's ModelConfig, ModelStatistics and RepositoryIndex (the
    documents the HTTP routes serve).

    Failures are the call's status: INVALID_ARGUMENT (bad request), NOT_FOUND
    (unknown model or version), UNAVAILABLE (queue full, not ready, shutting
    down), DEADLINE_EXCEEDED (the ``timeout`` parameter in microseconds, or
    the call's deadline, passed), INTERNAL (model failure: the exception's
    type and a request id; its text too with ``expose_errors``, see
    :class:`~ferrobatch.http.protocol.ModelRepository`; ``None``: the
    repository's setting).
    """

    def __init__(
        self,
        servers: Server | Iterable[Server] | ModelRepository,
        *,
        expose_errors: bool | None = None,
    ) -> None:
        if isinstance(servers, ModelRepository):
            self.repository = servers
        else:
            self.repository = ModelRepository(servers, expose_errors=bool(expose_errors))
        self.expose_errors = self.repository.expose_errors if expose_errors is None else expose_errors

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.repository.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        try:
            return _extensions.model_ready(self.repository, request)
        except ProtocolError as exc:
            _fail(context, exc)
            return pb.ModelReadyResponse()

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.repository.server_metadata())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        try:
            meta = self.repository.model_metadata(request.name, request.version)
        except ProtocolError as exc:
            _fail(context, exc)
            return pb.ModelMetadataResponse()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        try:
            return _extensions.model_config(self.repository, request)
        except ProtocolError as exc:
            _fail(context, exc)
            return pb.ModelConfigResponse()

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        try:
            return _extensions.model_statistics(self.repository, request)
        except ProtocolError as exc:
            _fail(context, exc)
            return pb.ModelStatisticsResponse()

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        return _extensions.repository_index(self.repository, request)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        try:
            return await infer(self.repository, request, _timeout(request.parameters, context))
        except Exception as exc:  # noqa: BLE001 - every failure becomes the call's status
            _fail(context, exc, request.model_name, self.expose_errors)
            return pb.ModelInferResponse()

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's streaming inference: each request of the stream answered
        on it as soon as it can be, the stream's requests at once (so they
        batch together; ``id`` tells their responses apart): a decoupled
        model's responses as they come, any other model's one response,
        flagged ``triton_final_response`` as the native front-end flags
        them. A request's failure is an ``error_message`` on the stream,
        which goes on; a client that goes away cancels what it left."""
        messages: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        answering: set[asyncio.Task[None]] = set()
        open_parts = 1  # the reader, then one per request; each ends with a None
        # Past this many requests of the stream unanswered, the next is read once one is.
        in_flight = asyncio.Semaphore(STREAM_IN_FLIGHT)

        async def answer(request: pb.ModelInferRequest) -> None:
            try:
                async for message in stream_responses(self.repository, request, self.expose_errors):
                    messages.put_nowait(message)
            finally:
                in_flight.release()
                messages.put_nowait(None)

        async def read() -> None:
            nonlocal open_parts
            try:
                requests = aiter(request_iterator)
                while True:
                    await in_flight.acquire()
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        break
                    open_parts += 1
                    task = asyncio.create_task(answer(request))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
            except Exception:  # the client's side broke: answer what came
                log.debug("ModelStreamInfer: the request stream ended with an error", exc_info=True)
            finally:
                messages.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while open_parts:
                message = await messages.get()
                if message is None:
                    open_parts -= 1
                else:
                    yield message
        finally:  # done, or the client went away: nothing is left running
            reader.cancel()
            for task in list(answering):
                task.cancel()


async def infer(
    repository: ModelRepository, request: pb.ModelInferRequest, timeout: float | None
) -> pb.ModelInferResponse:
    """Runs one ModelInfer request; raises what fails it (see :func:`status_code`).
    The native front-end sends here the models it does not answer in Rust
    (BYTES and variable-length tensors)."""
    name = request.model_name
    model = repository.model(name, request.model_version)
    inputs = _decode_inputs(request, model)
    outputs = _requested_outputs(request, model)
    priority = _priority(request.parameters)
    parameters = _parameters_json(request.parameters) if model.server.with_requests else None
    results = await repository.infer(model, inputs, timeout, priority, parameters)
    return _response(model, request, outputs, results)


async def stream_responses(
    repository: ModelRepository, request: pb.ModelInferRequest, expose_errors: bool
) -> AsyncIterator[pb.ModelStreamInferResponse]:
    """One ModelStreamInfer request's messages: a decoupled model's
    responses, then (when asked) the empty final one; another model's one
    response; or the error that ended it, as Triton words it on a stream."""
    name = request.model_name
    flag = request.parameters.get(_EMPTY_FINAL)
    empty_final = flag is not None and flag.WhichOneof("parameter_choice") == "bool_param" and flag.bool_param
    try:
        model = repository.model(name, request.model_version)
        inputs = _decode_inputs(request, model)
        outputs = _requested_outputs(request, model)
        priority = _priority(request.parameters)
        parameters = _parameters_json(request.parameters) if model.server.with_requests else None
        timeout = timeout_parameter(request.parameters)
        if not model.server.decoupled:
            results = await repository.infer(model, inputs, timeout, priority, parameters)
            yield _streamed(_response(model, request, outputs, results), last=True)
            return
        async for results in repository.stream(model, inputs, timeout, priority, parameters):
            yield _streamed(_response(model, request, outputs, results), last=False)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error on the stream
        failed = pb.ModelInferResponse(model_name=name, model_version=MODEL_VERSION, id=request.id)
        message = error_message(exc, name, expose=expose_errors)
        yield pb.ModelStreamInferResponse(
            error_message=message, infer_response=_streamed(failed, last=True).infer_response
        )
        return
    if empty_final:
        yield _streamed(pb.ModelInferResponse(model_name=name, model_version=MODEL_VERSION, id=request.id), last=True)


#: Requests of one ModelStreamInfer stream answered at once, at most (as the native front-end).
STREAM_IN_FLIGHT = 1024
#: Triton's request parameter asking for an empty final response, and the flag on each response.
_EMPTY_FINAL = "triton_enable_empty_final_response"
_FINAL = "triton_final_response"


def _streamed(response: pb.ModelInferResponse, *, last: bool) -> pb.ModelStreamInferResponse:
    response.parameters[_FINAL].bool_param = last
    return pb.ModelStreamInferResponse(infer_response=response)


def _response(
    model: ServedModel, request: pb.ModelInferRequest, outputs: list[str], results: dict[str, Any]
) -> pb.ModelInferResponse:
    """The response to ``request`` from its ``results``: the outputs it asked for, raw."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=MODEL_VERSION, id=request.id)
    datatypes = model.output_types
    raw = response.raw_output_contents
    # One call into the codec for every output of the response.
    for out_name, (data, shape) in zip(outputs, model.codec.raw_outputs(outputs, results), strict=True):
        response.outputs.add(name=out_name, datatype=datatypes[out_name], shape=shape)
        raw.append(data)
    return response


def _fail(context: Context, exc: BaseException, model: str = "", expose: bool = False) -> None:
    context.set_code(status_code(exc))
    context.set_details(error_message(exc, model, expose=expose))


def _decode_inputs(request: pb.ModelInferRequest, model: ServedModel) -> dict[str, Any]:
    """The request's inputs, decoded by the model's codec in one call (raw
    contents as they are, typed contents element by element)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            400,
            f"raw_input_contents has {len(raw)} entries but the request has {len(request.inputs)}"
            " inputs; give one per input, in order",
        )
    tensors: list[tuple[str, str, list[int], Any]] = []
    for i, tensor in enumerate(request.inputs):
        data: Any
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(400, f"input '{clipped(tensor.name)}' has both contents and raw_input_contents")
            data = raw[i]
        elif tensor.datatype in DATATYPES:
            field = _CONTENTS.get(tensor.datatype)
            if field is None:
                raise ProtocolError(
                    400,
                    f"input '{clipped(tensor.name)}': {clipped(tensor.datatype)} data"
                    " must be sent in raw_input_contents",
                )
            data = getattr(tensor.contents, field)
        else:
            data = ()  # the codec names the unknown datatype
        tensors.append((tensor.name, tensor.datatype, list(tensor.shape), data))
    if not tensors:
        raise ProtocolError(400, "the request has no inputs")
    inputs = model.codec.decode_tensors(tensors)
    return model_inputs(inputs, any(t.datatype == "BF16" for t in inputs.values()))


def _requested_outputs(request: pb.ModelInferRequest, model: ServedModel) -> list[str]:
    known = model.output_types
    if not request.outputs:
        return list(known)
    names = []
    for out in request.outputs:
        if out.name not in known:
            raise ProtocolError(
                400,
                f"unknown output {clipped(out.name)!r} for model '{model.server.name}'; outputs: {', '.join(known)}",
            )
        if "classification" in out.parameters:
            raise ProtocolError(400, f"output '{out.name}': the classification extension is not supported")
        names.append(out.name)
    return names


def _priority(parameters: Mapping[str, pb.InferParameter]) -> int | None:
    """The ``priority`` parameter: an int64 or uint64 >= 0 (0: the default level)."""
    if "priority" not in parameters:
        return None
    param = parameters["priority"]
    kind = param.WhichOneof("parameter_choice")
    value = getattr(param, kind) if kind in ("int64_param", "uint64_param") else -1
    if not 0 <= value < 2**32:
        raise ProtocolError(400, "parameter 'priority' must be an integer >= 0")
    return value or None


def _parameters_json(parameters: Mapping[str, pb.InferParameter]) -> str | None:
    """The request's parameters as a JSON object's text (None: it has none)."""
    if not parameters:
        return None
    values = {}
    for name, param in parameters.items():
        kind = param.WhichOneof("parameter_choice")
        values[name] = None if kind is None else getattr(param, kind)
    # NaN and infinities have no JSON number: null, as the native front-end writes them.
    return json.dumps(
        {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in values.items()},
        separators=(",", ":"),
    )


def timeout_parameter(parameters: Mapping[str, pb.InferParameter]) -> float | None:
    """The request's ``timeout`` parameter (µs) in seconds, None without one."""
    timeout: float | None = None
    if "timeout" in parameters:
        param = parameters["timeout"]
        if param.WhichOneof("parameter_choice") != "int64_param" or param.int64_param < 0:
            raise ProtocolError(400, "parameter 'timeout' must be an int64 of microseconds >= 0")
        timeout = param.int64_param / 1e6 or None
    return timeout


def _timeout(parameters: Mapping[str, pb.InferParameter], context: Context) -> float | None:
    timeout = timeout_parameter(parameters)
    remaining = context.time_remaining()
    if remaining is not None:
        timeout = remaining if timeout is None else min(timeout, remaining)
    return timeout


def add_to_server(servicer: InferenceServicer, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` as ``inference.GRPCInferenceService`` on ``server``."""
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
