"""The v2 ``GRPCInferenceService`` on grpcio's asyncio server."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from .. import _core
from ..client import MAX_STREAM_BACKLOG, StreamBacklog
from ..http.protocol import (
    ModelRepository,
    ProtocolError,
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
    404: grpc.StatusCode.NOT_FOUND,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
# Typed contents field of each datatype (FP16 and BF16 travel only as raw bytes).
_CONTENTS = {v2: field for _, v2, field in _core.dtypes() if field is not None}

Context = grpc.aio.ServicerContext[Any, Any]
Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status of a failed request (the HTTP mapping, translated)."""
    if isinstance(exc, UnknownModelError):
        return grpc.StatusCode.NOT_FOUND
    return _STATUS.get(error_status(exc), grpc.StatusCode.INTERNAL)


#: A stream that ends this close to its call's deadline ended because of it
#: (the native front-end's DEADLINE_SLACK).
_DEADLINE_SLACK_S = 0.02

#: How a ModelStreamInfer stream ends once the server stops (the native front-end's words).
STREAM_STOPPED = "the server is shutting down: this stream takes no more requests"
#: What the codec says of bytes that are not a ModelInferRequest, and what a
#: stream says of them (tonic's words, as the native front-end's stream ends).
_NOT_A_REQUEST = "the message is not a ModelInferRequest: "
_UNDECODABLE = "failed to decode Protobuf message: "


@dataclass(frozen=True)
class _StreamEnd:
    """How a stream's reader ended it: the call's status, given once its
    responses already made are sent (and, ``after_answers``, once the
    requests already read are answered too)."""

    code: grpc.StatusCode
    details: str
    after_answers: bool


_STOPPED = _StreamEnd(grpc.StatusCode.UNAVAILABLE, STREAM_STOPPED, after_answers=True)


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
        max_stream_backlog: int = MAX_STREAM_BACKLOG,
        allow_client_shm: bool = False,
    ) -> None:
        #: Bytes of decoupled responses one ModelStreamInfer stream holds unread, at most.
        self.max_stream_backlog = max_stream_backlog
        if isinstance(servers, ModelRepository):
            self.repository = servers
        else:
            self.repository = ModelRepository(
                servers, expose_errors=bool(expose_errors), allow_client_shm=allow_client_shm
            )
        self.expose_errors = self.repository.expose_errors if expose_errors is None else expose_errors
        self._stopping = False
        # The ModelStreamInfer streams' readers, stopped by stop_streams().
        self._readers: set[asyncio.Task[None]] = set()

    def stop_streams(self) -> None:
        """The server stops (call it on the server's event loop, before
        ``grpc.aio.Server.stop``, which waits for every call): each
        ModelStreamInfer stream reads no more requests, answers those it
        read, then ends UNAVAILABLE, as on the native front-end; a stream
        opened later ends so at once. Without it, a client that keeps an
        idle stream open holds the server's stop for its whole grace."""
        self._stopping = True
        for reader in list(self._readers):
            reader.cancel()

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.repository.ready)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        return await self._extension(_extensions.model_ready, request, context, pb.ModelReadyResponse)

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
        return await self._extension(_extensions.model_config, request, context, pb.ModelConfigResponse)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Context) -> pb.ModelStatisticsResponse:
        return await self._extension(_extensions.model_statistics, request, context, pb.ModelStatisticsResponse)

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Context) -> pb.RepositoryIndexResponse:
        return _extensions.repository_index(self.repository, request)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        return await self._extension(_extensions.load_model, request, context, pb.RepositoryModelLoadResponse)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        return await self._extension(_extensions.unload_model, request, context, pb.RepositoryModelUnloadResponse)

    async def LogSettings(self, request: pb.LogSettingsRequest, context: Context) -> pb.LogSettingsResponse:
        return await self._extension(_extensions.log_settings, request, context, pb.LogSettingsResponse)

    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        return await self._extension(
            _extensions.shared_memory_status, request, context, pb.SystemSharedMemoryStatusResponse
        )

    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        return await self._extension(
            _extensions.register_shared_memory, request, context, pb.SystemSharedMemoryRegisterResponse
        )

    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        return await self._extension(
            _extensions.unregister_shared_memory, request, context, pb.SystemSharedMemoryUnregisterResponse
        )

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> pb.CudaSharedMemoryStatusResponse:
        return await self._extension(
            _extensions.cuda_shared_memory_status, request, context, pb.CudaSharedMemoryStatusResponse
        )

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> pb.CudaSharedMemoryRegisterResponse:
        return await self._extension(
            _extensions.register_cuda_shared_memory, request, context, pb.CudaSharedMemoryRegisterResponse
        )

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return await self._extension(
            _extensions.unregister_cuda_shared_memory, request, context, pb.CudaSharedMemoryUnregisterResponse
        )

    async def _extension(
        self,
        answer: Callable[[ModelRepository, Request], Response | Awaitable[Response]],
        request: Request,
        context: Context,
        empty: Callable[[], Response],
    ) -> Response:
        """``answer``'s response (see :mod:`._extensions`); a refused request's
        status and details set on ``context``, with an empty response."""
        try:
            response = answer(self.repository, request)
            return await response if inspect.isawaitable(response) else response
        except ProtocolError as exc:
            _fail(context, exc)
            return empty()

    async def ModelInfer(self, request: bytes | pb.ModelInferRequest, context: Context) -> Any:
        """``request``: the message's bytes (as :func:`add_to_server`
        registers it), or the message (as the generated registration does);
        answered in kind."""
        message = request if isinstance(request, bytes) else request.SerializeToString()
        call = None
        try:
            call = _core.GrpcInferRequest(message)
            answer = await infer(self.repository, call, context.time_remaining())
        except Exception as exc:  # noqa: BLE001 - every failure becomes the call's status
            _fail(context, exc, "" if call is None else call.model_name, self.expose_errors)
            answer = b""
        return answer if isinstance(request, bytes) else pb.ModelInferResponse.FromString(answer)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[bytes | pb.ModelInferRequest], context: Context
    ) -> AsyncIterator[Any]:
        """Triton's streaming inference: each request of the stream answered
        on it as soon as it can be, the stream's requests at once (so they
        batch together; ``id`` tells their responses apart): a decoupled
        model's responses as they come, any other model's one response,
        flagged ``triton_final_response`` as the native front-end flags
        them. A request's failure is an ``error_message`` on the stream,
        which goes on; a client that goes away cancels what it left. A
        message that is not a ModelInferRequest ends the stream
        INVALID_ARGUMENT once the responses already made are sent (its
        requests still running are cancelled); :meth:`stop_streams` ends it
        UNAVAILABLE once its requests read are answered (both as natively)."""
        messages: asyncio.Queue[bytes | _StreamEnd | None] = asyncio.Queue()
        # The stream's responses made and not yet sent (its requests' own,
        # then `messages`): a decoupled response past the bound fails its request.
        backlog = StreamBacklog(self.max_stream_backlog)
        as_bytes: bool | None = None  # answered in kind, as ModelInfer
        answering: set[asyncio.Task[None]] = set()
        # The reader, then one per request; each ends with a None (the reader: or how it ends the stream).
        open_parts = 1
        # Past this many requests of the stream unanswered, the next is read once one is.
        in_flight = asyncio.Semaphore(STREAM_IN_FLIGHT)
        # Set when the unread responses fall to the backlog's limit: a client
        # that does not read is sent no more until it does (as natively).
        drained = asyncio.Event()
        # The call's deadline bounds each of its requests, as on the native front-end.
        call_timeout = context.time_remaining()

        async def answer(request: _core.GrpcInferRequest) -> None:
            try:
                async for message in stream_responses(
                    self.repository, request, self.expose_errors, backlog, call_timeout
                ):
                    backlog.add(len(message))
                    messages.put_nowait(message)
            finally:
                in_flight.release()
                messages.put_nowait(None)

        async def read() -> None:
            nonlocal open_parts, as_bytes
            end: _StreamEnd | None = None
            try:
                requests = aiter(request_iterator)
                while True:
                    if self._stopping:  # opened as the server stops
                        end = _STOPPED
                        break
                    while backlog.unread > backlog.limit:
                        drained.clear()
                        await drained.wait()
                    await in_flight.acquire()
                    try:
                        request = await anext(requests)
                    except StopAsyncIteration:
                        break
                    as_bytes = isinstance(request, bytes)
                    if isinstance(request, bytes):
                        try:
                            call = _core.GrpcInferRequest(request)
                        except _core.CodecError as exc:
                            # Not a request at all: the client's stream is broken (as natively, tonic's words).
                            details = _UNDECODABLE + str(exc).removeprefix(_NOT_A_REQUEST)
                            end = _StreamEnd(grpc.StatusCode.INVALID_ARGUMENT, details, after_answers=False)
                            break
                    else:
                        call = _core.GrpcInferRequest(request.SerializeToString())
                    open_parts += 1
                    task = asyncio.create_task(answer(call))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
            except asyncio.CancelledError:
                if not self._stopping:
                    raise  # the call ended: nothing waits for this reader
                # stop_streams(): no more requests are read; a client still
                # sending is told so, not left waiting for answers.
                end = _STOPPED
            except Exception:  # the client's side broke: answer what came
                log.debug("ModelStreamInfer: the request stream ended with an error", exc_info=True)
            finally:
                messages.put_nowait(end)

        reader = asyncio.create_task(read())
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        end: _StreamEnd | None = None
        try:
            while open_parts:
                message = await messages.get()
                if isinstance(message, _StreamEnd):
                    open_parts -= 1
                    end = message
                    if not end.after_answers:
                        break
                elif message is None:
                    open_parts -= 1
                else:
                    backlog.release(len(message))
                    if backlog.unread <= backlog.limit:
                        drained.set()
                    yield message if as_bytes else pb.ModelStreamInferResponse.FromString(message)
            if end is not None:
                await context.abort(end.code, end.details)
        finally:  # done, or the client went away: nothing is left running
            reader.cancel()
            # The call's deadline passed: its requests end by their own, the
            # same one, within moments (counted deadline_exceeded, as
            # natively); any other end of the call cancels them.
            remaining = context.time_remaining()
            if remaining is None or remaining > _DEADLINE_SLACK_S:
                for task in list(answering):
                    task.cancel()


async def infer(repository: ModelRepository, call: _core.GrpcInferRequest, call_timeout: float | None) -> bytes:
    """Runs one ModelInfer request (read by the native front-end's gRPC
    infer rules, in Rust) and returns its response message; raises what
    fails it (see :func:`status_code`). ``call_timeout``: the call's
    deadline, in seconds from now."""
    model = repository.model(call.model_name, call.model_version)
    read = call.read(model.codec, call_timeout, model.server.with_requests)
    inputs, outputs, priority, parameters, timeout, requested = read
    tensors = model_inputs(inputs, _has_bf16(inputs))
    shared = call.shared_memory  # answered into the regions it names
    results = await repository.infer(model, tensors, timeout, priority, parameters, requested, uncached=shared)
    answered_as_read = call if shared or call.classified else None  # regions, classes
    return repository.answer(
        model,
        lambda: _core.grpc_response(model.codec, call.model_name, call.id, outputs, results, request=answered_as_read),
    )


async def stream_responses(
    repository: ModelRepository,
    message: bytes | _core.GrpcInferRequest,
    expose_errors: bool,
    backlog: StreamBacklog,
    call_timeout: float | None = None,
) -> AsyncIterator[bytes]:
    """One ModelStreamInfer request's messages: a decoupled model's
    responses, then (when asked) the empty final one; another model's one
    response; or the error that ended it, as Triton words it on a stream.
    ``message``: the request's bytes, or the request decoded from them. Its
    decoupled responses count against the stream's ``backlog``; ``call_timeout``:
    the stream call's deadline, in seconds, bounding the request as its own
    ``timeout`` parameter does (the smaller wins)."""
    name, rid, empty_final = "", "", False
    try:
        call = message if isinstance(message, _core.GrpcInferRequest) else _core.GrpcInferRequest(message)
        name, rid, empty_final = call.model_name, call.id, call.empty_final
        model = repository.model(name, call.model_version)
        inputs, outputs, priority, parameters, timeout, requested = call.read(
            model.codec, call_timeout, model.server.with_requests
        )
        tensors = model_inputs(inputs, _has_bf16(inputs))
        shared = call.shared_memory  # answered into the regions it names
        answered_as_read = call if shared or call.classified else None  # regions, classes
        if not model.server.decoupled:
            results = await repository.infer(model, tensors, timeout, priority, parameters, requested, uncached=shared)
            yield repository.answer(
                model,
                lambda: _core.grpc_response(
                    model.codec, name, rid, outputs, results, last=True, request=answered_as_read
                ),
            )
            return
        responses = repository.stream(model, tensors, timeout, priority, parameters, backlog, requested, shared)
        async for results in responses:
            yield await repository.answer_streamed(
                responses,
                functools.partial(
                    _core.grpc_response, model.codec, name, rid, outputs, results, last=False, request=answered_as_read
                ),
            )
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error on the stream
        yield _core.grpc_stream_error(name, rid, error_message(exc, name, expose=expose_errors))
        return
    if empty_final:
        yield _core.grpc_response(model.codec, name, rid, [], {}, last=True)


#: Requests of one ModelStreamInfer stream answered at once, at most (as the native front-end).
STREAM_IN_FLIGHT = 1024


def _has_bf16(inputs: Mapping[str, Any]) -> bool:
    return any(t.datatype == "BF16" for t in inputs.values())


def _fail(context: Context, exc: BaseException, model: str = "", expose: bool = False) -> None:
    context.set_code(status_code(exc))
    context.set_details(error_message(exc, model, expose=expose))


SERVICE = "inference.GRPCInferenceService"


class _Handlers:
    """Collects the method handlers the generated registration makes."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self.handlers = dict(handlers)


#: The servicer each server answers with (see stop_streams).
_SERVICERS: weakref.WeakKeyDictionary[grpc.aio.Server, InferenceServicer] = weakref.WeakKeyDictionary()


def stop_streams(server: grpc.aio.Server) -> None:
    """:meth:`InferenceServicer.stop_streams` for the servicer :func:`add_to_server`
    registered on ``server`` (nothing for another server)."""
    servicer = _SERVICERS.get(server)
    if servicer is not None:
        servicer.stop_streams()


def add_to_server(
    servicer: InferenceServicer, server: grpc.aio.Server, grpc_restricted_protocol: Sequence[str] = ()
) -> None:
    """Registers ``servicer`` as ``inference.GRPCInferenceService`` on
    ``server``: ModelInfer and ModelStreamInfer take and give the messages'
    bytes (read and written in Rust), the other RPCs protobuf messages.
    ``grpc_restricted_protocol``: Triton's ``--grpc-restricted-protocol``
    groups; a call of a restricted group without its metadata ends
    UNAVAILABLE before it is read (``ValueError`` for a malformed group)."""
    restrictions = _core.ApiRestrictions([], list(grpc_restricted_protocol))
    _SERVICERS[server] = servicer
    made = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, made)  # type: ignore[no-untyped-call]
    handlers = {
        name: _reading_bytes(handler)
        for name, handler in made.handlers.items()
        if name not in ("ModelInfer", "ModelStreamInfer")  # given below
    }
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(servicer.ModelInfer)
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer)
    if restrictions:
        handlers = {name: _restricted(f"/{SERVICE}/{name}", h, restrictions) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def _restricted(
    method: str, handler: grpc.RpcMethodHandler[Any, Any], restrictions: _core.ApiRestrictions
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` (unary, or ModelStreamInfer's stream) behind the check of
    ``method``'s restriction: a call without the metadata it asks for ends
    UNAVAILABLE, as Triton's restricted protocols."""

    async def check(context: Context) -> None:
        refused = restrictions.grpc_refusal(method, list(context.invocation_metadata() or ()))
        if refused is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refused)

    unary, streaming = handler.unary_unary, handler.stream_stream
    if unary is not None:

        async def call(request: Any, context: Context) -> Any:
            await check(context)
            return await unary(request, context)  # type: ignore[arg-type]  # grpc.aio's context

        return grpc.unary_unary_rpc_method_handler(call, handler.request_deserializer, handler.response_serializer)
    assert streaming is not None, "the service's RPCs are unary but ModelStreamInfer"

    async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        await check(context)
        async for response in streaming(requests, context):  # type: ignore[arg-type,attr-defined]
            yield response

    return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer, handler.response_serializer)


def _reading_bytes(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A unary RPC's handler that parses its request itself: a message that
    does not decode is the client's mistake, INVALID_ARGUMENT, where grpcio's
    own parsing answers UNKNOWN (as the native front-end answers it)."""
    parse = handler.request_deserializer
    behavior = handler.unary_unary
    assert parse is not None and behavior is not None, "the generated handlers are unary, with a parser"

    async def call(raw: bytes, context: Context) -> Any:
        try:
            request = parse(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"failed to decode Protobuf message: {exc}")
        return await behavior(request, context)  # type: ignore[arg-type]  # grpc.aio's context

    return grpc.unary_unary_rpc_method_handler(call, response_serializer=handler.response_serializer)
