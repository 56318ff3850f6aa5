"""Type stubs for the Rust extension ``ferrobatch._core`` (checked by mypy.stubtest)."""

import asyncio
from collections.abc import Callable
from typing import Any, final

import torch

__all__ = [
    "Batch",
    "Batcher",
    "CodecError",
    "LoopCounters",
    "LoopMailbox",
    "Routes",
    "Submitter",
    "Ticket",
    "V2Codec",
    "V2Request",
    "V2Tensor",
    "Worker",
    "__version__",
    "after_fork_in_child",
]
__version__: str

@final
class Batcher:
    """The submit side of one model's batcher."""

    def __new__(
        cls,
        inputs: list[tuple[str, str, list[int], torch.dtype]],
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
    ) -> Batcher: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

@final
class Submitter:
    """Submits requests to one server from any event loop (``Client.infer``'s way in)."""

    def __new__(
        cls,
        state_for: Callable[[asyncio.AbstractEventLoop], Any],
        not_running: Callable[[], BaseException],
    ) -> Submitter: ...
    def accept(self, batcher: Batcher | None) -> None:
        """Starts (a batcher) or stops (None) accepting requests."""
    def submit(
        self, inputs: Any, timeout: float | None = None, batched: bool = False
    ) -> tuple[asyncio.Future[dict[str, torch.Tensor]], int]:
        """Queues a request from the running event loop: ``(future, request id)``."""

def after_fork_in_child() -> None:
    """Forgets the event loops cached before a fork (``os.register_at_fork``)."""

@final
class Ticket:
    """One submitted request: its future and deadline timer; keeps its inputs alive."""

    @property
    def id(self) -> int: ...
    @property
    def future(self) -> asyncio.Future[dict[str, torch.Tensor]]: ...
    def set_timer(self, handle: asyncio.TimerHandle) -> None: ...
    def cancel_timer(self) -> None: ...
    def withdraw(self, reason: str) -> bool: ...

@final
class Worker:
    """The batch side for one model instance."""

    def __new__(cls, batcher: Batcher) -> Worker: ...
    def deliver(
        self,
        mailbox: LoopMailbox,
        routes: Routes,
        outputs: dict[str, torch.Tensor] | None,
        error: BaseException | None,
    ) -> bool: ...
    def next_batch(self) -> Batch | None: ...

@final
class Batch:
    """A collated batch in a staging slot it holds until ``release_slot()``."""

    @property
    def slot(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def n_requests(self) -> int: ...
    def groups(self) -> list[tuple[int, Routes]]: ...
    def release_slot(self) -> bool: ...

@final
class Routes:
    """The rows of a batch that belong to one event loop's requests."""

    def entries(self) -> list[tuple[int, int, int]]: ...

@final
class LoopMailbox:
    """One event loop's side of the fan-out: pending tickets, posted batches, doorbell."""

    def __new__(
        cls,
        loop_id: int,
        event_loop: asyncio.AbstractEventLoop,
        on_error: Callable[[Routes, BaseException], None],
    ) -> LoopMailbox: ...
    @property
    def pending(self) -> dict[int, Ticket]: ...
    @property
    def counters(self) -> LoopCounters: ...
    @property
    def doorbell_fd(self) -> int | None: ...
    @property
    def wakeups(self) -> int: ...
    def set_doorbell(self, read_fd: int, write_fd: int, eventfd: bool) -> None: ...
    def post(
        self,
        routes: Routes,
        outputs: dict[str, torch.Tensor] | None,
        error: BaseException | None,
    ) -> bool: ...
    def ring(self) -> bool: ...
    def flush(self) -> None:
        """Releases to the workers the requests this loop submitted in its
        iteration (greedy batchers; scheduled with ``call_soon`` by submit)."""
    def drain(self) -> None: ...

@final
class LoopCounters:
    """Per-loop counters updated by the Rust fan-out."""

    @property
    def succeeded(self) -> int: ...
    @property
    def request_ns(self) -> int: ...
    @property
    def failed_in_fan_out(self) -> int: ...

# -- the Open Inference Protocol v2 codec ----------------------------------------------------

class CodecError(ValueError):
    """A v2 request the codec refuses; ``status`` is its HTTP status (400, 413,
    or 500 for an output that cannot be encoded)."""

    status: int

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
    def inputs(self) -> dict[str, V2Tensor]: ...
    @property
    def has_bf16(self) -> bool: ...
    def output_names(self, codec: V2Codec) -> list[str]: ...

@final
class V2Codec:
    """The v2 codec of one served model: one call decodes a request, one encodes its response."""

    def __new__(
        cls,
        model: str,
        outputs: list[tuple[str, str, torch.dtype]],
        *,
        max_body_size: int,
        max_elements: int,
    ) -> V2Codec: ...
    def decode(self, body: bytes, header_length: str | None = None) -> V2Request: ...
    def decode_tensors(self, tensors: list[tuple[str, str, list[int], Any]]) -> dict[str, V2Tensor]: ...
    def encode(self, request: V2Request, results: dict[str, torch.Tensor]) -> tuple[bytes, int | None]: ...
    def raw_output(self, name: str, tensor: torch.Tensor) -> tuple[bytes, list[int]]: ...
