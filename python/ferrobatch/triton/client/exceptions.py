"""The clients' errors (``pytriton.client.exceptions``)."""

from __future__ import annotations

from ..exceptions import PyTritonError

__all__ = [
    "PyTritonClientClosedError",
    "PyTritonClientError",
    "PyTritonClientInferenceServerError",
    "PyTritonClientInvalidUrlError",
    "PyTritonClientModelDoesntSupportBatchingError",
    "PyTritonClientModelUnavailableError",
    "PyTritonClientQueueFullError",
    "PyTritonClientTimeoutError",
    "PyTritonClientValueError",
]


class PyTritonClientError(PyTritonError):
    """Base class of the client's errors."""


class PyTritonClientValueError(PyTritonClientError):
    """Inputs or arguments the client cannot send."""


class PyTritonClientInvalidUrlError(PyTritonClientValueError):
    """A server URL the client cannot use."""


class PyTritonClientModelDoesntSupportBatchingError(PyTritonClientValueError):
    """``infer_batch`` on a model that does not batch (``max_batch_size: 0``): use ``infer_sample``."""


class PyTritonClientTimeoutError(PyTritonClientError):
    """The server, the model or an inference took longer than allowed."""


class PyTritonClientModelUnavailableError(PyTritonClientError):
    """The model is not (or not yet) served."""


class PyTritonClientInferenceServerError(PyTritonClientError):
    """The server answered the inference with an error (the message says which)."""


class PyTritonClientClosedError(PyTritonClientError):
    """The client was closed."""


class PyTritonClientQueueFullError(PyTritonClientError):
    """A ``FuturesModelClient`` whose queue of calls is full."""
