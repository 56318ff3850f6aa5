"""What a model built with ``Server(..., with_requests=True)`` learns about
the requests of its batch, and how request parameters travel."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import _core
from .errors import InvalidInputError

__all__ = ["Parameter", "RequestInfo", "encode_parameters", "request_infos"]

#: A request parameter's value, as the v2 protocol allows (bool, int64, double, string).
Parameter = str | int | float | bool

_NONE: Mapping[str, Parameter] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request of a batch, in row order.

    ``rows``: how many rows of the batch are this request's (1 for
    ``infer``, ``n`` for ``infer_batch`` and for a v2 request of shape
    ``[n, ...]``). ``parameters``: the request's parameters — ``infer(...,
    parameters={...})`` in process, the v2 request's ``parameters`` over HTTP
    and gRPC (``timeout`` and ``priority`` included), plus the headers that
    ``ServeConfig``'s ``http_header_forward_pattern`` /
    ``grpc_header_forward_pattern`` forward, by lowercase name. ``priority``:
    the priority level it waited at (1 is the most urgent; the default level
    when it gave none; 1 for a server without ``priority_levels``).
    ``absent``: the optional inputs (``TensorSpec(optional=True)``) the
    request left out; the model got zeros (or empty rows) in their place.
    ``queued_ns``: nanoseconds from its submit to its batch's model call.
    ``requested_outputs``: the outputs a v2 request asked for (its
    ``outputs``, or every output when it named none) over HTTP and gRPC,
    native or Python front-end; ``None`` where a caller says nothing of the
    kind (in process, shared memory): every output.
    """

    rows: int
    parameters: Mapping[str, Any] = field(default_factory=lambda: _NONE)
    priority: int = 1
    absent: frozenset[str] = frozenset()
    queued_ns: int = field(default=0, compare=False)  # a measurement, not what the request is
    requested_outputs: frozenset[str] | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Sent to instance processes: the read-only view of no parameters does not pickle.
        state = (self.rows, dict(self.parameters), self.priority, self.absent, self.queued_ns, self.requested_outputs)
        return _request_info, state


def _request_info(
    rows: int,
    parameters: dict[str, Any],
    priority: int,
    absent: frozenset[str],
    queued_ns: int,
    requested_outputs: frozenset[str] | None = None,
) -> RequestInfo:
    return RequestInfo(rows, parameters or _NONE, priority, absent, queued_ns, requested_outputs)


def _named(bits: int, names: Sequence[str]) -> frozenset[str]:
    return frozenset(n for i, n in enumerate(names) if bits >> i & 1)


def request_infos(
    entries: Sequence[tuple[int, str | None, int, int, int, int]],
    input_names: Sequence[str] = (),
    output_names: Sequence[str] = (),
) -> list[RequestInfo]:
    """The batch's ``(rows, parameters as JSON text, priority, optional
    inputs left out as bits of ``input_names``, queued ns, outputs asked for
    as bits of ``output_names``)`` as :class:`RequestInfo`s."""
    return [
        RequestInfo(
            rows,
            _NONE if text is None else json.loads(text),
            priority,
            _named(absent, input_names) if absent else frozenset(),
            queued_ns,
            _named(requested, output_names) if requested else None,
        )
        for rows, text, priority, absent, queued_ns, requested in entries
    ]


def encode_parameters(parameters: Mapping[str, Parameter] | None) -> str | None:
    """A caller's parameters as a JSON object's text; a key that is not a
    string or a value that is no bool, int, finite float or string is an
    :class:`InvalidInputError` (the v2 protocol has no other parameter type).
    Encoded in Rust: it runs once per request that has parameters."""
    if parameters is None:
        return None
    if type(parameters) is not dict:
        if not isinstance(parameters, Mapping):
            raise InvalidInputError(f"parameters must be a mapping of name to value, got {type(parameters).__name__}")
        parameters = dict(parameters)
    return _core.encode_parameters(parameters)
