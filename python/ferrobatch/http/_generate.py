"""Triton's generate extension: ``POST .../generate`` and ``.../generate_stream``,
a flat JSON object in and out, for text models (LLMs).

A generate request becomes a v2 JSON inference request and takes the path
every inference takes (the model's codec, its client, its counting); the
answer is written flat from the results. The rules (which keys are inputs,
how an array spreads over an input's shape, what the answer carries) are
Triton's and live in Rust, shared with the native front-end:
``ferrobatch_core::v2::generate`` (``_core.generate_request``) and the
codec's ``encode_generate``.

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


def error_event(message: str) -> bytes:
    """The event that ends a stream that failed."""
    return _core.generate_error_event(message)
