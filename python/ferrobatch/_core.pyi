"""Type stubs for the Rust extension ``ferrobatch._core`` (checked by mypy.stubtest)."""

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, final

import torch

__all__ = [
    "ApiRestrictions",
    "Batch",
    "Batcher",
    "CodecError",
    "LoopMailbox",
    "LoopRegistry",
    "FallbackAnswer",
    "GrpcInferRequest",
    "NativeFrontend",
    "SharedClient",
    "SharedDrain",
    "SharedServer",
    "ResponseCache",
    "SharedMemoryRegions",
    "Submitter",
    "V2Codec",
    "V2Request",
    "V2Tensor",
    "Worker",
    "__version__",
    "REQUEST_BOUNDS_US",
    "MAX_QUEUE_SIZE",
    "GENERATE_ONE_RESPONSE",
    "MAX_FRONT_END_THREADS",
    "MAX_CONNECTIONS",
    "MAX_SHARED_CLIENTS",
    "MAX_SHARED_CELLS",
    "MAX_SHARED_RING",
    "clipped",
    "after_fork_in_child",
    "check_json",
    "generate_error_event",
    "generate_request",
    "compress",
    "dtypes",
    "inflate",
    "remove_stale_segments",
    "response_coding",
    "encode_parameters",
    "grpc_response",
    "grpc_stream_error",
    "shared_meta",
]
__version__: str
REQUEST_BOUNDS_US: tuple[int, ...]
MAX_QUEUE_SIZE: int
#: What ``generate`` answers (a 400) when a decoupled model does not send
#: exactly one response (Triton's words).
GENERATE_ONE_RESPONSE: str
MAX_FRONT_END_THREADS: int
MAX_CONNECTIONS: int
MAX_SHARED_CLIENTS: int
MAX_SHARED_CELLS: int
MAX_SHARED_RING: int

@final
class Batcher:
    """The submit side of one model's batcher."""

    def __new__(
        cls,
        inputs: list[tuple[str, str, list[int], torch.dtype | None]],
        slots: list[list[torch.Tensor]],
        *,
        tensor_type: type[torch.Tensor],
        coerce: Callable[[Any, int, bool], torch.Tensor],
        max_batch_size: int,
        max_delay: float,
        min_batch_size: int,
        preferred_batch_sizes: list[int],
        max_queue_size: int,
        workers: int,
        adaptive: bool = False,
        layouts: list[tuple[str, bytes | None]] = ...,
        max_batch_elements: int | None = None,
        padded_dims: list[list[int | None] | None] = ...,
        priority_levels: int = 0,
        default_priority: int | None = None,
        max_priority_wait: float | None = None,
        keep_parameters: bool = False,
        optional: list[bool] = ...,
        delay_from_free_worker: bool = False,
        default_timeout: float | None = None,
        first_id: int = 1,
        queue_timeout: float | None = None,
        response_cache: tuple[ResponseCache, int, _CacheRows, bool, list[str]] | None = None,
    ) -> Batcher: ...
    @property
    def next_id(self) -> int:
        """The id its next request will get (a next run's ``first_id``)."""
    def set_cache_namespace(self, namespace: int) -> None:
        """Looks requests up in the response cache under ``namespace`` from now on."""
    def close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...

class _CacheRows(Protocol):
    """What cuts a response cache's results out of a batch's outputs and joins them back."""

    fixed: list[str]
    def join_rows(self, columns: Sequence[bytearray], rows: int, /) -> dict[str, Any]: ...
    def cut(self, outputs: Mapping[str, Any], spans: Sequence[tuple[int, int]], /) -> list[tuple[Any, int] | None]: ...
    def join(self, parts: Sequence[tuple[int, int, Mapping[str, Any]]], rows: int, /) -> dict[str, Any]: ...

@final
class ResponseCache:
    """A bounded, least-recently-used cache of model results by the bytes of
    their requests' inputs (Triton's response cache), shareable by servers."""

    def __new__(cls, max_bytes: int) -> ResponseCache: ...
    @property
    def max_bytes(self) -> int: ...
    def namespace(self) -> int:
        """A namespace of its own for one server's entries."""
    def forget(self, namespace: int) -> None:
        """Drops the entries of ``namespace``."""
    def clear(self) -> None:
        """Drops every entry."""
    def stats(self) -> dict[str, int]:
        """``{entries, bytes, max_bytes, evictions, too_large}``."""

@final
class Submitter:
    """Submits requests to one server from any event loop (``Client.infer``'s way in)."""

    def __new__(
        cls, registry: LoopRegistry, not_running: Callable[[], BaseException], decoupled: bool = False
    ) -> Submitter: ...
    def accept(self, batcher: Batcher | None) -> None:
        """Starts (a batcher) or stops (None) accepting requests."""
    def submit(
        self,
        inputs: Any,
        timeout: float | None = None,
        batched: bool = False,
        priority: int | None = None,
        parameters: Mapping[str, Any] | str | None = None,
        stream: Any = None,
        requested_outputs: int = 0,
        uncached: bool = False,
    ) -> tuple[asyncio.Future[dict[str, torch.Tensor]], int]:
        """Queues a request from the running event loop: ``(future, request id)``;
        a decoupled model's with a ``stream`` (``put_nowait`` gets each response).
        ``requested_outputs``: the outputs a v2 request asked for, as bits of
        their indices (0: not said), told to a model built with its requests.
        ``uncached``: never looked up in nor kept in the response cache (a v2
        request naming a shared-memory region)."""
    def infer_blocking(
        self,
        inputs: Any,
        timeout: float | None = None,
        batched: bool = False,
        priority: int | None = None,
        parameters: Mapping[str, Any] | str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Runs a request from a plain thread, blocking (GIL released) until its batch answers."""
    def cancel(self, id: int, future: asyncio.Future[Any], error: BaseException | None = None) -> None:
        """The task awaiting request ``id``'s ``future`` was cancelled: counted
        as cancelled, or given ``error``, as that error (what its caller saw)."""

def clipped(text: str) -> str:
    """``text``, a client's string, as error messages echo it: cut to 80
    characters, with "..." when cut."""

def after_fork_in_child() -> None:
    """Forgets the event loops cached before a fork (``os.register_at_fork``)."""

@final
class Worker:
    """The batch side for one model instance."""

    def __new__(cls, batcher: Batcher, registry: LoopRegistry) -> Worker: ...
    def answer_found(self) -> bool:
        """Blocks until requests found in the response cache as they were
        submitted wait, answers them; False once closed and none is left."""
    def next_batch(self) -> Batch | None: ...
    def finish(
        self,
        batch: Batch,
        outputs: dict[str, torch.Tensor] | None,
        error: BaseException | None,
        ring_now: bool = False,
        failed: list[tuple[int, BaseException]] | None = None,
    ) -> None:
        """Hands a batch's outputs (or its model error) to its callers' event
        loops; with ``failed`` (``(row_start, error)``), those requests fail
        with ``ModelError`` and the others get their rows of ``outputs``."""
    def stream(self, batch: Batch, outputs: dict[str, Any], only: list[int] | None = None) -> int:
        """Hands one partial answer of a decoupled model's batch to its
        streaming requests (``only``: those whose first rows are these),
        leaving them pending (``finish(batch, {}, None)`` ends their
        streams); returns how many still listen."""

@final
class Batch:
    """A collated batch in a staging slot it holds until ``release_slot()``."""

    @property
    def slot(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def n_requests(self) -> int: ...
    @property
    def has_loop_requests(self) -> bool:
        """Whether any request came from an event loop (its streamed responses are read later)."""
    @property
    def copies_outputs(self) -> bool:
        """Whether ``Worker.finish`` copies every answer out of the outputs before it returns
        (native front-end and shared-memory requests only): outputs may view the slot until then."""
    def request_rows(self) -> list[tuple[int, int]]:
        """Each request's ``(start, rows)``, in batch order."""
    def extents(self) -> list[int]:
        """Per input: a padded one's longest row, a jagged one's total length; 0 otherwise."""
    def take_bytes(self, index: int) -> list[bytes]:
        """BYTES input ``index``'s elements, in batch order (once per input)."""
    def padded_extents(self, index: int) -> list[int]:
        """Input ``index`` padded along several variable dimensions: the batch's
        longest along each (empty for other inputs)."""
    def take_ragged_bytes(self, index: int) -> tuple[list[bytes], list[int]]:
        """Variable-length BYTES input ``index``'s elements, in batch order, and
        each row's length (once per input)."""
    def request_parameters(self) -> list[tuple[int, str | None, int, int, int, int]]:
        """Each request's ``(rows, parameters as JSON text or None, priority,
        optional inputs left out as bits, nanoseconds since its submit,
        outputs asked for as bits (0: not said))``, in row order."""
    def release_slot(self) -> bool: ...

@final
class LoopRegistry:
    """Every event loop that submits to one server: mailboxes and what callers saw."""

    def __new__(cls, model_name: str) -> LoopRegistry: ...
    def count_refusal(self, error: BaseException) -> None:
        """Counts a request refused before it reached the batcher, under
        the outcome ``error`` means."""
    def recount_success(self, error: BaseException) -> None:
        """Counts a request counted as succeeded under the outcome ``error``
        means after all (a front-end could not write its answer)."""
    def mailboxes(self) -> list[LoopMailbox]: ...
    def stats(self) -> dict[str, int]: ...
    def request_buckets(self) -> list[int]: ...
    def fail_all(self, message: str, before: int = ...) -> None:
        """Fails the pending requests numbered below ``before`` (all by default)."""
    def close(self) -> None: ...

@final
class LoopMailbox:
    """One event loop's requests: their pending table, posted batches, doorbell."""

    @property
    def doorbell_fd(self) -> int | None: ...
    @property
    def wakeups(self) -> int: ...
    @property
    def pending_count(self) -> int: ...
    def flush(self) -> None:
        """Releases to the workers the requests this loop submitted in its
        iteration (greedy batchers; scheduled with ``call_soon`` by submit)."""
    def expire(self, id: int, timeout: float) -> None: ...
    def fail_all(self, message: str, before: int = ...) -> None: ...
    def drain(self) -> None: ...

# -- the Open Inference Protocol v2 codec ----------------------------------------------------

class CodecError(ValueError):
    """A v2 request the codec refuses; ``status`` is its HTTP status (400, 413,
    or 500 for an output that cannot be encoded)."""

    status: int

@final
class SharedMemoryRegions:
    """A server's registry of Triton system shared-memory regions, which the
    codecs given it read inputs from and write outputs into. Errors are
    ``CodecError``s with the HTTP status to answer (400; 404 for a region
    not registered)."""

    def __new__(cls) -> SharedMemoryRegions: ...
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Maps ``byte_size`` bytes of the shared-memory object ``key``
        (``/name``) from ``offset`` as region ``name``."""
    def unregister(self, name: str) -> None:
        """Unregisters region ``name`` (empty: every region); an unknown name is no error."""
    def status(self, name: str) -> list[tuple[str, str, int, int]]:
        """``(name, key, offset, byte_size)`` of region ``name``, or of every region for an empty name."""
    def __len__(self) -> int: ...

@final
class V2Tensor:
    """A decoded input: its bytes through the buffer protocol, read-only and
    C-contiguous, with its datatype's format (BF16: raw 16-bit words) and shape."""

    @property
    def datatype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def nbytes(self) -> int: ...

@final
class V2Request:
    """A decoded infer request."""

    @property
    def id(self) -> str | None: ...
    @property
    def timeout(self) -> float | None:
        """The ``timeout`` parameter in seconds (``None``: no deadline)."""
    @property
    def priority(self) -> int | None:
        """The ``priority`` parameter (1: most urgent; ``None``: the default)."""
    @property
    def parameters(self) -> str | None:
        """The request's ``parameters`` object as JSON text (``None``: none)."""
    @property
    def inputs(self) -> dict[str, V2Tensor]: ...
    @property
    def has_bf16(self) -> bool: ...
    @property
    def shared_memory(self) -> bool:
        """Whether a tensor of the request names a shared-memory region (its
        answer is not its body's alone: submit it ``uncached``)."""
    @property
    def requested_outputs(self) -> int:
        """The outputs to send, as bits of their indices: what a model built
        with its requests is told (every output when the request named none)."""
    def output_names(self, codec: V2Codec) -> list[str]: ...

@final
class V2Codec:
    """The v2 codec of one served model: one call decodes a request, one encodes its response."""

    def __new__(
        cls,
        model: str,
        outputs: list[tuple[str, str, torch.dtype | None]],
        *,
        max_body_size: int,
        max_elements: int,
        batching: bool = True,
        decoupled: bool = False,
        regions: SharedMemoryRegions | None = None,
        output_row_bytes: list[int | None] | None = None,
        output_labels: list[list[str] | None] | None = None,
    ) -> V2Codec:
        """``regions``: the server's shared-memory regions, which requests
        may then name (None: refused). ``output_row_bytes``: the bytes of
        one row of each output (of the whole output without batching), None
        where only the model's answer says: an output region too small for
        a known size is refused before the model runs. ``output_labels``:
        each output's class labels (or None), which a classified output's
        classes are answered with."""
    def decode(self, body: bytes, header_length: str | None = None) -> V2Request: ...
    def remembered_headers(self) -> int: ...
    def encode(self, request: V2Request, results: dict[str, torch.Tensor]) -> tuple[bytes, int | None]: ...
    def encode_generate(self, request: V2Request, results: dict[str, torch.Tensor], *, as_event: bool = False) -> bytes:
        """Triton's generate answer to ``request`` (the v2 request a generate
        request stood for): ``results`` written flat, each output its one
        element or its elements as a flat array (``as_event``: as one
        Server-Sent Event)."""

@final
class FallbackAnswer:
    """Where the Python handlers send the answer to a request the native
    front-end hands them: called once with ``(status, headers, body)``
    (gRPC: ``(code, message, response)``), or None when answering failed."""

    def __call__(self, answer: tuple[int, list[tuple[str, str]], bytes] | tuple[int, str, bytes] | None, /) -> None: ...

@final
class NativeFrontend:
    """The native front-end (tokio + hyper for HTTP, tonic for gRPC): listens
    from construction until ``stop()``; serves natively the models given to
    ``serve()``. ``server_metadata`` is ``(name, version, extensions)``;
    ``model_metadata`` has ``(name, platform, inputs, outputs)`` per model,
    each tensor ``(name, datatype, shape)``. gRPC's ``ModelConfig``,
    ``ModelStatistics`` and ``RepositoryIndex`` are answered by
    ``grpc_fallback(method, request, answer) -> cancel``, the messages as
    protobuf bytes, ``answer((code, message, response))`` (code 0: OK; None:
    UNIMPLEMENTED); HTTP's fallback is ``fallback(method, path, headers,
    body, answer) -> cancel``, ``answer((status, headers, body))``. Both
    return at once; ``cancel()`` is called if the client goes away first.
    ``strict_readiness`` (Triton's): the server is ready only while every
    model it serves is; False: while it is itself. ``grpc_server_cert`` and
    ``grpc_server_key`` (PEM files): gRPC over TLS; with
    ``grpc_use_ssl_mutual`` clients must present a certificate that
    ``grpc_root_cert`` signs (``ValueError`` names a file that cannot be used)."""

    def __new__(
        cls,
        host: str,
        port: int | None,
        fallback: Callable[[str, str, list[tuple[str, str]], bytes, FallbackAnswer], Callable[[], object] | None],
        *,
        grpc_port: int | None = None,
        server_metadata: tuple[str, str, list[str]] | None = None,
        model_metadata: list[tuple[str, str, list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]] = ...,
        grpc_fallback: Callable[[str, bytes, FallbackAnswer], Callable[[], object] | None] | None = None,
        threads: int = 1,
        max_body_size: int = ...,
        max_decompressed_size: int = ...,
        max_connections: int = 10000,
        max_streams: int = 1024,
        header_timeout: float = 30.0,
        body_timeout: float = 60.0,
        idle_timeout: float = 300.0,
        keepalive_interval: float = 60.0,
        keepalive_timeout: float | None = None,
        http_header_forward_pattern: str | None = None,
        grpc_header_forward_pattern: str | None = None,
        max_stream_backlog: int = ...,
        http_restricted_api: Sequence[str] = ...,
        grpc_restricted_protocol: Sequence[str] = ...,
        strict_readiness: bool = True,
        grpc_server_cert: str | os.PathLike[str] | None = None,
        grpc_server_key: str | os.PathLike[str] | None = None,
        grpc_root_cert: str | os.PathLike[str] | None = None,
        grpc_use_ssl_mutual: bool = False,
        grpc_response_compression: str = "none",
    ) -> NativeFrontend: ...
    @property
    def port(self) -> int | None: ...
    @property
    def grpc_port(self) -> int | None: ...
    def serve(self, models: list[tuple[Batcher, LoopRegistry, V2Codec, Callable[[BaseException], str]]]) -> None: ...
    def know(
        self, model_metadata: list[tuple[str, str, list[tuple[str, str, list[int]]], list[tuple[str, str, list[int]]]]]
    ) -> None: ...
    def set_ready(self, ready: bool) -> None: ...
    def set_model_ready(self, name: str, ready: bool) -> bool: ...
    def drain(self) -> None: ...
    def close(self, grace: float) -> None: ...
    def stop(self, grace: float = 5.0) -> None: ...

@final
class ApiRestrictions:
    """Triton's access-restricted APIs for the Python front-ends: the groups
    of ``--http-restricted-api`` and ``--grpc-restricted-protocol``, each
    ``<apis>:<key>=<value>`` (a bad one raises ``ValueError``). A request to
    an API of a restricted category must carry the header ``<key>`` (gRPC:
    ``triton-grpc-protocol-<key>``) with exactly ``<value>``; the native
    front-end's categories and words."""

    def __new__(
        cls, http_restricted_api: Sequence[str] = ..., grpc_restricted_protocol: Sequence[str] = ...
    ) -> ApiRestrictions: ...
    def http_refusal(self, path: str, headers: Mapping[str, str]) -> str | None:
        """The refusal's message when ``path``'s API is restricted and
        ``headers`` (names in any case) lack its header or value; else None."""
    def grpc_refusal(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
        """The same for a gRPC method's path and its invocation metadata."""
    def __bool__(self) -> bool:
        """Whether any API is restricted."""

_SpecTuple = tuple[str, str, list[int], torch.dtype | None]

@final
class SharedServer:
    """A model shared under a name through shared memory, until ``close``."""

    def __new__(
        cls,
        name: str,
        batcher: Batcher,
        registry: LoopRegistry,
        outputs: list[_SpecTuple],
        meta: str,
        *,
        model_name: str,
        max_clients: int,
        rows_per_client: int,
        ring_size: int,
        mode: int,
        codec: V2Codec | None = None,
        cell_bytes: int = 0,
    ) -> SharedServer: ...
    @property
    def replaced(self) -> str | None: ...
    def stop_accepting(self) -> None: ...
    def close(self, message: str) -> None: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def reclaimed(self) -> int: ...
    def clients(self) -> list[tuple[int, int]]: ...
    @property
    def faults(self) -> int: ...

@final
class SharedClient:
    """A client of a model shared by another process."""

    def __new__(
        cls,
        name: str,
        inputs: list[_SpecTuple],
        outputs: list[_SpecTuple],
        *,
        model_name: str,
        max_batch_size: int,
        tensor_type: type[torch.Tensor],
        coerce: Callable[[Any, int, bool], Any],
        empty: Callable[..., torch.Tensor],
        owner: int | None = None,
        optional: list[bool] = ...,
        layouts: list[tuple[str, bytes | None]] = ...,
        padded_dims: list[list[int | None] | None] = ...,
        max_batch_elements: int | None = None,
        cell_bytes: int = 0,
        varying: Callable[[list[tuple[bytearray, list[list[int]], bytes]], bool], dict[str, Any]] | None = None,
    ) -> SharedClient: ...
    def submit(
        self,
        inputs: Any,
        timeout: float | None,
        batched: bool,
        future: Any,  # done(), set_result(), set_exception(): the loop's Future, a concurrent one, or alike
        event_loop: asyncio.AbstractEventLoop,
        priority: int | None = None,
        parameters: str | None = None,
    ) -> int: ...
    def cancel(self, key: int) -> None: ...
    def expire(self, key: int, timeout: float) -> None: ...
    def infer_blocking(
        self,
        inputs: Any,
        timeout: float | None = None,
        batched: bool = False,
        priority: int | None = None,
        parameters: str | None = None,
    ) -> Any: ...
    def close(self) -> None: ...
    @property
    def pending(self) -> int: ...
    @property
    def slot(self) -> int: ...
    @property
    def cells_in_use(self) -> int: ...

@final
class SharedDrain:
    """An event loop's reader callback: resolves what a shared client's collector posted."""

    def drain(self) -> None: ...

def dtypes() -> list[tuple[str, str, str | None]]:
    """Every element type: ``(name, v2 datatype, v2 gRPC contents field)``."""

def inflate(body: bytes, coding: str, limit: int) -> bytes:
    """``body`` with its Content-Encoding undone (``CodecError``: 400 or 413)."""

def compress(body: bytes, coding: str) -> bytes | None:
    """``body`` coded ``"gzip"`` or ``"deflate"``; None for another coding."""

def response_coding(accept: str | None = None) -> str | None:
    """The coding of a response to a request with ``Accept-Encoding: accept``."""

def check_json(body: bytes) -> None:
    """``ValueError`` unless ``body`` is one JSON document by the v2 codec's
    rules (its syntax and its nesting limit)."""

def generate_request(body: bytes, inputs: list[tuple[str, str, list[int]]]) -> bytes:
    """The v2 JSON inference request a generate request ``body`` (Triton's
    generate extension) stands for, for a model whose inputs are ``inputs``
    (``(name, datatype, shape)`` as its metadata gives them); ``CodecError``
    400 with Triton's words otherwise."""

def generate_error_event(message: str) -> bytes:
    """The Server-Sent Event that ends a ``generate_stream`` failed after its
    first response: ``{"error": message}``."""

@final
class GrpcInferRequest:
    """One ``ModelInferRequest`` decoded from its message (``CodecError``,
    400, for bytes that are not one), read by the native front-end's gRPC
    infer rules."""

    def __new__(cls, message: bytes) -> GrpcInferRequest: ...
    @property
    def model_name(self) -> str: ...
    @property
    def model_version(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def empty_final(self) -> bool:
        """Whether a streamed request asks for an empty final response."""
    @property
    def classified(self) -> bool:
        """Whether the request's last ``read`` found an output asked for as
        its top classes (Triton's classification extension): answer it with
        ``grpc_response(..., request=self)``."""
    @property
    def shared_memory(self) -> bool:
        """Whether the request's last ``read`` found a tensor naming a
        shared-memory region: submit it ``uncached`` and answer it with
        ``grpc_response(..., request=self)``."""
    def read(
        self, codec: V2Codec, call_timeout: float | None, keeps_parameters: bool
    ) -> tuple[dict[str, V2Tensor], list[str], int | None, str | None, float | None, int]:
        """``(inputs, outputs, priority, parameters, timeout, requested_outputs)``
        for the model of ``codec`` (once): inputs by name, the outputs' names,
        the priority level, the parameters as a JSON object's text (only when
        ``keeps_parameters``), the deadline in seconds (the ``timeout``
        parameter or ``call_timeout``, the smaller) and the outputs as bits of
        their indices (what a model built with its requests is told).
        ``CodecError`` with its HTTP status for a request the rules refuse."""

def grpc_response(
    codec: V2Codec,
    model_name: str,
    id: str,
    outputs: list[str],
    results: Mapping[str, Any],
    last: bool | None = None,
    request: GrpcInferRequest | None = None,
) -> bytes:
    """The encoded answer: a ``ModelInferResponse`` of the ``outputs`` named,
    read from ``results``; with ``last``, a stream's
    ``ModelStreamInferResponse`` flagged ``triton_final_response``. With
    ``request`` (the one read), its outputs in shared memory are written to
    their regions and answered with empty raw contents (``CodecError`` 400
    when one does not fit its region), and those asked for as classes are
    answered as their top classes."""

def grpc_stream_error(model_name: str, id: str, message: str) -> bytes:
    """The encoded ``ModelStreamInferResponse`` that ends a streamed request with ``message``."""

def encode_parameters(parameters: dict[str, Any]) -> str:
    """``parameters`` as a JSON object's text; ``InvalidInputError`` for a
    name that is no str or a value that is no bool, int, finite float or str."""

def remove_stale_segments() -> list[str]:
    """Removes the segments of this user's servers that were killed before
    their stop could; returns their names."""

def shared_meta(name: str, owner: int | None = None) -> str:
    """The metadata (JSON) of the segment ``name``, after checking its owner
    (``owner``'s uid, or this user's) and its version."""
