"""The exceptions ferrobatch raises; every one is a :class:`FerrobatchError`.

A request resolves exactly once: with its result, or with one of these.
"""

from __future__ import annotations

__all__ = [
    "FerrobatchError",
    "InvalidInputError",
    "QueueFullError",
    "StreamBacklogError",
    "DeadlineExceededError",
    "ServerClosedError",
    "ModelError",
]


class FerrobatchError(Exception):
    """Base class of every error ferrobatch raises for a request."""


class InvalidInputError(FerrobatchError, ValueError):
    """The inputs do not match the model's specs (names, dtype, shape, device).

    Raised at submit: such a request never enters the queue.
    """


class QueueFullError(FerrobatchError):
    """``max_queue_size`` requests are already waiting; raised at once."""


class StreamBacklogError(QueueFullError):
    """A streamed request's responses went unread past ``max_stream_backlog``
    bytes (its reader is slower than its model): the request is cancelled,
    and its stream ends with this error after the responses it holds.
    Counted under ``queue_full`` in ``stats()``.
    """


class DeadlineExceededError(FerrobatchError, TimeoutError):
    """The request's ``timeout`` passed before its result was ready."""


class ServerClosedError(FerrobatchError, RuntimeError):
    """The server is not running, or stopped before the request could be
    answered. A ``RuntimeError`` too: TorchRL's server raises one when it
    shuts down, and callers catch that."""


class ModelError(FerrobatchError):
    """The model call for the request's batch failed, or returned bad outputs.

    When the model raised, ``__cause__`` is the original exception.
    """
