"""Triton's generate extension: ``POST .../generate`` and ``.../generate_stream``,
a flat JSON object in and out, for text models (LLMs).

A generate request becomes a v2 inference request and takes the path every
inference takes (the model's codec, its client, its counting); the v2 JSON
answer is flattened back. Triton's rules (its ``extension_generate.md`` and
HTTP server):

- each key of the request, and of its ``"parameters"`` object, that names a
  model input is that input: a scalar or a flat array, spread over the
  input's shape (the fixed dimensions first; the innermost variable one takes
  the rest, any other is 1);
- any other key is a request parameter: a string, a number or a bool;
- ``"id"`` is the request's id, echoed in its answer;
- the answer carries ``id`` (when the request had one), ``model_name``,
  ``model_version`` and each output: its one element, or its elements as a
  flat array.

``generate`` answers one JSON object (a decoupled model must send exactly
one response); ``generate_stream`` answers Server-Sent Events, a ``data:``
event per response, and an ``{"error": ...}`` event if the stream fails
after its first response.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .._core import clipped
from .protocol import MODEL_VERSION, ProtocolError

#: The content type of a ``generate_stream`` answer.
EVENT_STREAM = "text/event-stream; charset=utf-8"
#: The key of a generate request whose object maps more keys the same way.
PARAMETERS = "parameters"
#: What ``generate`` answers when a decoupled model does not send exactly one response.
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model that "
    "generates various number of responses"
)
#: Request parameters a generate request cannot set: its answer is always JSON.
_NOT_TAKEN = frozenset({"binary_data_output"})


def infer_body(document: Any, inputs: Sequence[Mapping[str, Any]]) -> tuple[bytes, str | None]:
    """The v2 JSON inference request a generate request ``document`` (parsed
    JSON) stands for, and its id; ``inputs``: the model metadata's inputs
    (``name``, ``datatype``, ``shape`` with ``-1`` for variable dimensions).
    :class:`ProtocolError` 400 for what Triton refuses."""
    if not isinstance(document, dict):
        raise ProtocolError(400, "a generate request is a JSON object")
    specs = {spec["name"]: spec for spec in inputs}
    rid = document.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(400, "Unable to parse 'id': it must be a string")
    tensors: dict[str, dict[str, Any]] = {}
    parameters: dict[str, Any] = {}

    def take(key: str, value: Any) -> None:
        spec = specs.get(key)
        if spec is None:
            if not isinstance(value, (str, int, float)):  # bool is an int
                raise ProtocolError(
                    400, f"parameter '{clipped(key)}' has invalid type. It should be either 'int', 'bool', or 'string'."
                )
            if key not in _NOT_TAKEN:
                parameters[key] = value
        elif key in tensors:
            raise ProtocolError(400, f"input '{clipped(key)}' is given more than once")
        else:
            tensors[key] = _tensor(spec, value)

    for key, value in document.items():
        if key == "id":
            continue
        if key != PARAMETERS:
            take(key, value)
            continue
        if PARAMETERS in specs:
            raise ProtocolError(400, "Keyword 'parameters' for nested schema also given as input tensor name")
        if not isinstance(value, dict):
            raise ProtocolError(400, "Expected JSON object for keyword: 'parameters'")
        for nested, nested_value in value.items():
            take(nested, nested_value)
    if not tensors:
        names = ", ".join(f"'{clipped(name)}'" for name in specs)
        raise ProtocolError(
            400, f"a generate request names none of the model's inputs ({names}): its keys are parameters"
        )
    request: dict[str, Any] = {"inputs": list(tensors.values())}
    if rid is not None:
        request["id"] = rid
    if parameters:
        request["parameters"] = parameters
    return json.dumps(request, separators=(",", ":")).encode(), rid


def _tensor(spec: Mapping[str, Any], value: Any) -> dict[str, Any]:
    """Input ``spec``'s v2 JSON tensor for a generate request's ``value``."""
    name = spec["name"]
    data = value if isinstance(value, list) else [value]
    if any(isinstance(v, (list, dict)) or v is None for v in data):
        raise ProtocolError(400, f"input '{clipped(name)}' of a generate request is a scalar or a flat array")
    shape = [int(d) for d in spec["shape"]]
    left = len(data)
    for d in shape:  # the fixed dimensions take their share first
        if d == -1:
            continue
        if d == 0 or left % d:
            if d == 0 and left == 0:
                continue
            raise ProtocolError(400, f"The schema can not convert input '{clipped(name)}' to tensor with proper shape")
        left //= d
    variable = [i for i, d in enumerate(shape) if d == -1]
    for i in variable:
        shape[i] = 1
    if variable:
        shape[variable[-1]] = left  # the innermost variable dimension takes the rest
    elif left != 1 and data:
        raise ProtocolError(400, f"The schema can not convert input '{clipped(name)}' to tensor with proper shape")
    return {"name": name, "datatype": spec["datatype"], "shape": shape, "data": data}


def answer(model: str, rid: str | None, payload: bytes) -> dict[str, Any]:
    """The generate answer for a v2 JSON inference answer ``payload`` of ``model``."""
    document: dict[str, Any] = {} if rid is None or rid == "" else {"id": rid}
    document["model_name"] = model
    document["model_version"] = MODEL_VERSION
    for output in json.loads(payload).get("outputs", ()):
        data = output.get("data", [])
        document.setdefault(output["name"], data[0] if len(data) == 1 else data)  # the reserved keys win
    return document


def event(document: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``document``."""
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"
