"""Triton's generate extension: ``POST .../generate`` and ``.../generate_stream``,
a flat JSON object in and out, for text models (LLMs).

A generate request becomes a v2 JSON inference request and takes the path
every inference takes (the model's codec, its client, its counting); the v2
JSON answer is flattened back. The rules (which keys are inputs, how an
array spreads over an input's shape, what the answer carries) are Triton's
and live in Rust, shared with the native front-end:
``ferrobatch_core::v2::generate`` (``_core.generate_request``,
``_core.generate_answer``).

``generate`` answers one JSON object (a decoupled model must send exactly
one response); ``generate_stream`` answers Server-Sent Events, a ``data:``
event per response, and an ``{"error": ...}`` event if the stream fails
after its first response.
"""

from __future__ import annotations

from .. import _core

#: The content type of a ``generate_stream`` answer.
EVENT_STREAM = "text/event-stream; charset=utf-8"
#: What ``generate`` answers when a decoupled model does not send exactly one response.
ONE_RESPONSE = _core.GENERATE_ONE_RESPONSE


def infer_body(body: bytes, inputs: list[tuple[str, str, list[int]]]) -> bytes:
    """The v2 JSON inference request the generate request ``body`` stands
    for; ``inputs``: the model's (``ServedModel.generate_inputs``).
    ``CodecError`` 400 for what Triton refuses."""
    return _core.generate_request(body, inputs)


def answer(payload: bytes, *, as_event: bool = False) -> bytes:
    """The generate answer for a v2 JSON inference answer ``payload``
    (``as_event``: as one Server-Sent Event)."""
    return _core.generate_answer(payload, as_event=as_event)


def error_event(message: str) -> bytes:
    """The event that ends a stream that failed."""
    return _core.generate_error_event(message)
