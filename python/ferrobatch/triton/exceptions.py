"""PyTriton's exceptions, under the names ``pytriton.exceptions`` gives them.

:class:`UnrecoverableError` (``PyTritonUnrecoverableError``), raised by an
inference callable, fails the requests of that call and shuts the server
down as :meth:`Triton.stop` does: readiness turns 503 and the listeners
close, requests already accepted are answered, then :meth:`Triton.serve`
returns.
"""

from __future__ import annotations

__all__ = [
    "PyTritonError",
    "PyTritonValidationError",
    "PyTritonInvalidOperationError",
    "PyTritonBadParameterError",
    "PyTritonModelConfigError",
    "PyTritonRuntimeError",
    "PyTritonUnrecoverableError",
    "UnrecoverableError",
]


class PyTritonError(Exception):
    """Base class of the binding's errors; ``message`` is the text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PyTritonValidationError(PyTritonError):
    """A configuration, or what an inference callable returned, is not valid."""


class PyTritonInvalidOperationError(PyTritonError):
    """An operation not allowed in the binding's present state."""


class PyTritonBadParameterError(PyTritonError):
    """A decorator or a call was given a parameter it cannot use."""


class PyTritonModelConfigError(PyTritonError):
    """A model configuration ferrobatch cannot serve."""


class PyTritonRuntimeError(PyTritonError):
    """An error while serving that fits none of the other kinds."""


class UnrecoverableError(PyTritonError):
    """Raised by an inference callable: no further inference is possible.

    The requests of that call fail (HTTP 500 / gRPC INTERNAL, with this
    message) and the server shuts down.
    """


#: PyTriton's name for :class:`UnrecoverableError`.
PyTritonUnrecoverableError = UnrecoverableError
