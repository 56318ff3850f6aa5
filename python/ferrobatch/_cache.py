"""The Python half of the response cache (``Server(response_cache=...)``;
the cache itself, its keys and its bounds are ``_core.ResponseCache``'s).

The core looks each request up by a digest of its inputs as its batch is
released (or, while every instance runs a slow batch, as it is submitted:
a hit is then answered by the server's cache thread, never queued): a hit
never runs, a miss runs and carries its key. What is kept
per request is its rows of its batch's outputs, copied: for a model whose
outputs are all fixed-shape tensors, their bytes, copied in Rust (the
outputs named :attr:`CachedRows.fixed`, joined back by
:meth:`CachedRows.join_rows`); for any other, what :meth:`CachedRows.cut`
makes, joined back by :meth:`CachedRows.join`. Hits are answered as a batch
of their kept rows back to back, which every way in reads as it reads a
model's batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._core import ResponseCache
from ._variable import PaddedOutput, RaggedOutput, merge_parts
from .specs import TensorSpec

__all__ = ["CachedRows", "ResponseCache", "response_cache"]


def response_cache(value: object) -> ResponseCache | None:
    """``Server(response_cache=)``'s argument as a cache: ``None``, a byte
    size (a cache of its own) or a :class:`ResponseCache` to share."""
    if value is None or isinstance(value, ResponseCache):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return ResponseCache(value)
    raise ValueError(f"response_cache must be a size in bytes (> 0), a ferrobatch.ResponseCache or None, got {value!r}")


class CachedRows:
    """Cuts what is kept out of a batch's outputs and joins it back."""

    def __init__(self, outputs: Sequence[TensorSpec], version_output: str | None) -> None:
        self.specs = [s for s in outputs if s.name != version_output]
        self.version_output = version_output
        #: The outputs kept as bytes, in order: every one (the version
        #: output included) when all are fixed-shape tensors; else none.
        self.fixed: list[str] = [] if any(s.is_bytes or s.is_ragged for s in outputs) else [s.name for s in outputs]
        self._fixed_specs = list(outputs)

    def join_rows(self, columns: Sequence[bytearray], rows: int) -> dict[str, torch.Tensor]:
        """A batch's outputs from each :attr:`fixed` output's rows' bytes
        (``rows`` rows, back to back): tensors over those bytes."""
        return {
            s.name: torch.frombuffer(column, dtype=s.torch_dtype).reshape(rows, *s.shape)
            if len(column)
            else torch.empty((rows, *s.shape), dtype=s.torch_dtype)
            for s, column in zip(self._fixed_specs, columns, strict=True)
        }

    def cut(self, outputs: Mapping[str, Any], spans: Sequence[tuple[int, int]]) -> list[tuple[Any, int] | None]:
        """Each request's rows (``(start, rows)``) of a succeeded batch's
        ``outputs``, copied (the batch's buffers are used again), with the
        bytes they hold; ``None`` for what is not kept (an output of a batch
        that failure isolation ran in parts)."""
        kept: list[tuple[Any, int] | None] = []
        for start, rows in spans:
            part: dict[str, Any] = {}
            nbytes = _DICT_OVERHEAD
            for name, out in outputs.items():
                piece = _rows_of(out, start, rows)
                if piece is None:
                    break
                part[name] = piece
                nbytes += _nbytes(piece) + _PIECE_OVERHEAD
            else:
                kept.append((part, nbytes))
                continue
            kept.append(None)
        return kept

    def join(self, parts: Sequence[tuple[int, int, Mapping[str, Any]]], rows: int) -> dict[str, Any]:
        """A batch's outputs made of kept parts (``(start, rows, kept)``,
        back to back over ``rows``), none of them sharing memory with what
        is kept: a caller may write into what it gets."""
        return merge_parts(
            [(start, n, _copied(kept)) for start, n, kept in parts], rows, self.specs, self.version_output
        )


#: Bytes counted per kept dict and per output in it beyond their data: the
#: Python objects' own (150,000 results of a 16-float output and a
#: variable-length one took 1,550 bytes each of resident memory; counted
#: with these, about 1,700).
_DICT_OVERHEAD = 256
_PIECE_OVERHEAD = 600


def _rows_of(out: Any, start: int, rows: int) -> Any:
    end = start + rows
    if isinstance(out, torch.Tensor):
        return out[start:end].clone()
    if isinstance(out, np.ndarray):
        return out[start:end].copy()
    if isinstance(out, RaggedOutput):
        values = out.request_rows(start, rows, True)
        return RaggedOutput(values, [], out.lengths[start:end], True, out.pad_value)
    if isinstance(out, PaddedOutput):
        return PaddedOutput(out.request_rows(start, rows, True), out.lengths[start:end], out.variable, out.pad_value)
    return None


def _copied(kept: Mapping[str, Any]) -> dict[str, Any]:
    """``kept`` with its variable-length outputs' values copied (a
    request's row of one is a view of them); the others are copied into
    the joined batch's own tensors and arrays anyway."""
    copied = dict(kept)
    for name, out in kept.items():
        if isinstance(out, RaggedOutput):
            values = out.values.copy() if isinstance(out.values, np.ndarray) else out.values.clone()
            copied[name] = RaggedOutput(values, out.starts, out.lengths, out.padded, out.pad_value)
        elif isinstance(out, PaddedOutput):
            copied[name] = PaddedOutput(out.values.clone(), out.lengths, out.variable, out.pad_value)
    return copied


def _nbytes(piece: Any) -> int:
    values = piece.values if isinstance(piece, (RaggedOutput, PaddedOutput)) else piece
    if isinstance(values, torch.Tensor):
        return int(values.nbytes)
    if values.dtype == object:  # BYTES: the elements' own bytes too
        return int(values.nbytes) + sum(len(v) for v in values.ravel() if isinstance(v, (bytes, str)))
    return int(values.nbytes)
