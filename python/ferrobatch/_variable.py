"""Models with BYTES or variable-length tensors: their staging slots, how a
collated batch becomes the model's inputs, and how their outputs are cut
into each request's result.

The Rust core collates these inputs (``Batcher`` layouts): a BYTES input
into the batch's own buffer (its elements serialized, turned into a numpy
object array here), a variable-length one into the staging slot, padded
(values ``[B, L_max, ...]`` and lengths ``[B]``) or jagged (values
``[sum L, ...]`` and offsets ``[B + 1]``), with the GIL released. Such
models are called with a dict of inputs, on CPU or (without CUDA graphs,
compile or warm-up) on a CUDA device.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import _core
from ._executor import PartlyAnswered, RequestsFailed, Retried, WorkerCounters
from ._requests import RequestInfo
from ._torch import CpuExecutor, _storage_ptr, check_warmup_names, model_mode, normalize_outputs
from .errors import InvalidInputError, ModelError
from .specs import TensorSpec

#: ``max_batch_elements`` when a model has a variable-length input and none is given.
DEFAULT_ELEMENTS_PER_ROW = 1024

LENGTHS = "_lengths"
OFFSETS = "_offsets"
INDEX = "#index"  # the key of a ragged input's index (lengths or offsets) in a slot


def is_variable(specs: Sequence[TensorSpec]) -> bool:
    """Whether any spec is BYTES or variable-length."""
    return any(s.is_bytes or s.is_ragged for s in specs)


def layouts(specs: Sequence[TensorSpec]) -> list[tuple[str, bytes | None]]:
    """Each input's collation for ``_core.Batcher``: ``("fixed" | "bytes" |
    "pad" | "jagged", pad value bytes)``."""
    out: list[tuple[str, bytes | None]] = []
    for s in specs:
        if s.is_bytes:
            out.append((s.ragged or "bytes", None))
        elif s.is_padded_nd:
            one = torch.full((1,), s.pad_value, dtype=s.torch_dtype)
            out.append(("pad", one.view(torch.uint8).numpy().tobytes()))
        elif s.ragged == "pad":
            one = torch.full((1, *s.inner_shape), s.pad_value, dtype=s.torch_dtype)
            out.append(("pad", one.contiguous().view(torch.uint8).numpy().tobytes()))
        elif s.ragged == "jagged":
            out.append(("jagged", None))
        else:
            out.append(("fixed", None))
    return out


def core_shape(spec: TensorSpec) -> list[int]:
    """The shape the core checks rows against: what follows a variable dimension
    (nothing for one padded along several: its ``padded_dims`` say)."""
    return [] if spec.is_padded_nd else list(spec.inner_shape)


def padded_dims(specs: Sequence[TensorSpec]) -> list[list[int | None] | None]:
    """Per input, for one padded along variable dimensions other than (or
    besides) the first: its row shape with ``None`` for each ``-1``."""
    return [[None if d == -1 else d for d in s.shape] if s.is_padded_nd else None for s in specs]


def _full_shape(spec: TensorSpec, longest: Sequence[int]) -> tuple[int, ...]:
    """``spec.shape`` with its ``-1`` dimensions at ``longest``, in order."""
    it = iter(longest)
    return tuple(next(it) if d == -1 else d for d in spec.shape)


def allocate_slot(specs: Sequence[TensorSpec], max_batch_size: int, max_elements: int) -> dict[str, torch.Tensor]:
    """One staging slot, its buffers in the core's order: a ``(max_batch_size,
    *shape)`` tensor per fixed input; a flat values tensor (``max_elements``
    elements) and an int64 index (``max_batch_size + 1``) per
    variable-length input (under ``name`` and ``name + "#index"``); nothing
    for a BYTES input."""
    slot: dict[str, torch.Tensor] = {}
    for s in specs:
        if s.is_bytes:
            continue
        if s.is_padded_nd:
            slot[s.name] = torch.zeros(max_elements, dtype=s.torch_dtype)
            slot[s.name + INDEX] = torch.zeros(max_batch_size * len(s.variable_dims), dtype=torch.int64)
        elif s.is_ragged:
            unit = max(1, int(np.prod(s.inner_shape)))
            slot[s.name] = torch.zeros((max_elements // unit) * unit, dtype=s.torch_dtype)
            slot[s.name + INDEX] = torch.zeros(max_batch_size + 1, dtype=torch.int64)
        else:
            slot[s.name] = torch.zeros((max_batch_size, *s.shape), dtype=s.torch_dtype)
    return slot


def batch_inputs(specs: Sequence[TensorSpec], slot: Mapping[str, torch.Tensor], batch: _core.Batch) -> dict[str, Any]:
    """The model's inputs for a collated batch: views of its slot (and, per
    BYTES input, a numpy object array ``[B, *shape]`` of ``bytes``)."""
    rows = batch.rows
    extents = batch.extents()
    inputs: dict[str, Any] = {}
    for i, s in enumerate(specs):
        if s.is_bytes and s.is_ragged:
            inputs.update(_ragged_bytes_input(s, *batch.take_ragged_bytes(i)))
        elif s.is_bytes:
            flat = np.empty(rows * math.prod(s.shape), dtype=object)
            flat[:] = batch.take_bytes(i)
            inputs[s.name] = flat.reshape((rows, *s.shape))
        elif s.is_padded_nd:
            shape = _full_shape(s, batch.padded_extents(i))
            k = len(s.variable_dims)
            inputs[s.name] = slot[s.name][: rows * math.prod(shape)].view(rows, *shape)
            index = slot[s.name + INDEX][: rows * k]
            inputs[s.name + LENGTHS] = index if k == 1 else index.view(rows, k)
        elif s.ragged == "pad":
            unit = math.prod(s.inner_shape)
            longest = extents[i]
            inputs[s.name] = slot[s.name][: rows * longest * unit].view(rows, longest, *s.inner_shape)
            inputs[s.name + LENGTHS] = slot[s.name + INDEX][:rows]
        elif s.ragged == "jagged":
            unit = math.prod(s.inner_shape)
            total = extents[i]
            inputs[s.name] = slot[s.name][: total * unit].view(total, *s.inner_shape)
            inputs[s.name + OFFSETS] = slot[s.name + INDEX][: rows + 1]
        else:
            inputs[s.name] = slot[s.name][:rows]
    return inputs


def _ragged_bytes_input(spec: TensorSpec, elements: list[bytes], lengths: list[int]) -> dict[str, Any]:
    """A variable-length BYTES input of a batch (its elements in batch order
    and each row's length): padded with ``b""`` to ``[B, L_max, ...]`` with
    ``name + "_lengths"``, or jagged ``[sum L, ...]`` with ``name + "_offsets"``."""
    unit = int(np.prod(spec.inner_shape, dtype=np.int64))
    rows = len(lengths)
    index = torch.tensor(lengths, dtype=torch.int64)
    if spec.ragged == "jagged":
        values = np.empty(len(elements), dtype=object)
        values[:] = elements
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        torch.cumsum(index, 0, out=offsets[1:])
        return {spec.name: values.reshape((-1, *spec.inner_shape)), spec.name + OFFSETS: offsets}
    longest = max(lengths, default=0)
    padded = np.full((rows, longest * unit), b"", dtype=object)
    at = 0
    for row, n in enumerate(lengths):
        padded[row, : n * unit] = elements[at : at + n * unit]
        at += n * unit
    return {spec.name: padded.reshape((rows, longest, *spec.inner_shape)), spec.name + LENGTHS: index}


def slice_inputs(specs: Sequence[TensorSpec], inputs: Mapping[str, Any], start: int, rows: int) -> dict[str, Any]:
    """Rows ``start..start + rows`` of a batch's model inputs (as
    :func:`batch_inputs` built them), as a batch of their own: a padded input
    cut to the longest of these rows, a jagged one's offsets from 0. Failure
    isolation calls the model with such parts."""
    end = start + rows
    part: dict[str, Any] = {}
    for s in specs:
        values = inputs[s.name]
        if s.ragged == "jagged":
            offsets = inputs[s.name + OFFSETS]
            first, last = int(offsets[start]), int(offsets[end])
            part[s.name] = values[first:last]
            part[s.name + OFFSETS] = offsets[start : end + 1] - first
        elif s.is_padded_nd:
            lengths = inputs[s.name + LENGTHS][start:end]
            longest = lengths.reshape(rows, -1).amax(dim=0).tolist() if rows else [0] * len(s.variable_dims)
            ends = dict(zip(s.variable_dims, longest))
            part[s.name] = values[(slice(start, end), *(slice(0, ends.get(d)) for d in range(len(s.shape))))]
            part[s.name + LENGTHS] = lengths
        elif s.ragged == "pad":
            lengths = inputs[s.name + LENGTHS][start:end]
            longest = int(max(lengths.tolist(), default=0))
            part[s.name] = values[start:end, :longest]
            part[s.name + LENGTHS] = lengths
        else:
            part[s.name] = values[start:end]
    return part


def minimum_inputs(specs: Sequence[TensorSpec], rows: int) -> dict[str, Any]:
    """A batch of ``rows`` rows at the specs' minimum shapes, as
    :func:`batch_inputs` would give it: each ``-1`` one element long, tensors
    zero, BYTES empty. What warm-up runs a variable-length model with."""
    inputs: dict[str, Any] = {}
    for s in specs:
        row = [1 if d == -1 else d for d in s.shape]

        def zeros(shape: Sequence[int], spec: TensorSpec = s) -> Any:
            if spec.is_bytes:
                return np.full(tuple(shape), b"", dtype=object)
            return torch.zeros(tuple(shape), dtype=spec.torch_dtype)

        if s.ragged == "jagged":
            inputs[s.name] = zeros((rows, *row[1:]))
            inputs[s.name + OFFSETS] = torch.arange(rows + 1, dtype=torch.int64)
        elif s.is_ragged:
            inputs[s.name] = zeros((rows, *row))
            k = len(s.variable_dims) if s.is_padded_nd else 1
            lengths = torch.ones((rows, k) if k > 1 else (rows,), dtype=torch.int64)
            inputs[s.name + LENGTHS] = lengths
        else:
            inputs[s.name] = zeros((rows, *row))
    return inputs


def sample_rows(specs: Sequence[TensorSpec], samples: Mapping[str, Any]) -> dict[str, list[Any]]:
    """Warm-up samples of a model with BYTES or variable-length inputs, per
    input: one row (a tensor or array of the spec's shape, each ``-1`` any
    length) or a list of rows. Raises :class:`InvalidInputError` naming what
    does not match."""
    check_warmup_names(specs, samples)
    out: dict[str, list[Any]] = {}
    for s in specs:
        given = samples[s.name]
        rows = list(given) if isinstance(given, (list, tuple)) else [given]
        if not rows:
            raise InvalidInputError(f"warmup input '{s.name}': no sample")
        checked = []
        for row in rows:
            value: Any = np.asarray(row, dtype=object) if s.is_bytes else torch.as_tensor(row).cpu()
            if not s.is_bytes and value.dtype != s.torch_dtype:
                raise InvalidInputError(f"warmup input '{s.name}': expected dtype {s.dtype}, got {value.dtype}")
            shape = tuple(value.shape)
            if len(shape) != len(s.shape) or any(d not in (-1, n) for d, n in zip(s.shape, shape)):
                raise InvalidInputError(f"warmup input '{s.name}': expected a row of shape {s.shape}, got {shape}")
            checked.append(value)
        out[s.name] = checked
    return out


def sample_inputs(specs: Sequence[TensorSpec], samples: Mapping[str, list[Any]], rows: int) -> dict[str, Any]:
    """A batch of ``rows`` rows of ``samples`` (from :func:`sample_rows`,
    repeated to fill it), collated as the core collates requests and given
    to the model as :func:`batch_inputs` gives it."""
    inputs: dict[str, Any] = {}
    for s in specs:
        given = samples[s.name]
        picked = [given[i % len(given)] for i in range(rows)]
        if s.is_bytes and s.is_ragged:
            elements = [e for row in picked for e in row.reshape(-1)]
            inputs.update(_ragged_bytes_input(s, elements, [row.shape[0] for row in picked]))
        elif s.is_bytes:
            stacked = np.empty((rows, *s.shape), dtype=object)
            for i, row in enumerate(picked):
                stacked[i] = row
            inputs[s.name] = stacked
        elif s.ragged == "jagged":
            inputs[s.name] = torch.cat(picked)
            offsets = torch.tensor([0, *itertools.accumulate(row.shape[0] for row in picked)], dtype=torch.int64)
            inputs[s.name + OFFSETS] = offsets
        elif s.is_ragged:  # padded, along the first dimension or several
            dims = s.variable_dims
            lengths = [[row.shape[d] for d in dims] for row in picked]
            longest = [max(column) for column in zip(*lengths)]
            values = torch.full((rows, *_full_shape(s, longest)), s.pad_value, dtype=s.torch_dtype)
            for i, row in enumerate(picked):
                box: tuple[int | slice, ...] = (i, *(slice(0, n) for n in row.shape))
                values[box] = row
            index = torch.tensor(lengths, dtype=torch.int64)
            inputs[s.name] = values
            inputs[s.name + LENGTHS] = index if len(dims) > 1 else index[:, 0]
        else:
            inputs[s.name] = torch.stack(picked)
    return inputs


class RaggedOutput:
    """A batch's variable-length output, as the model returned it: padded
    ``values`` ``[B, L_max, ...]`` with each row's length, or jagged
    ``values`` ``[sum L, ...]`` with offsets. :meth:`request_rows` cuts a
    request's result out of it (Rust's fan-out calls it per request)."""

    __slots__ = ("values", "starts", "lengths", "padded", "pad_value")

    def __init__(
        self, values: Any, starts: list[int], lengths: list[int], padded: bool, pad_value: float | bytes
    ) -> None:
        self.values = values
        self.starts = starts  # per row: where it starts (jagged); unused when padded
        self.lengths = lengths
        self.padded = padded
        self.pad_value = pad_value

    def row(self, i: int) -> Any:
        """Row ``i``: its own length, ``[L_i, ...]`` (a tensor; a numpy object
        array for BYTES)."""
        if self.padded:
            return self.values[i, : self.lengths[i]]
        return self.values[self.starts[i] : self.starts[i] + self.lengths[i]]

    def packed(self) -> tuple[Any, list[int], list[list[int]], bytes]:
        """Every row for the native front-end's encoder: ``(values, starts,
        shapes, pad)``, the values flat (row ``i`` from element ``starts[i]``
        on, of shape ``shapes[i]``) and ``pad`` one element's bytes."""
        inner = list(self.values.shape[2 if self.padded else 1 :])
        unit = math.prod(inner)
        if self.padded:
            stride = self.values.shape[1] * unit
            starts = [i * stride for i in range(len(self.lengths))]
        else:
            starts = [s * unit for s in self.starts]
        shapes = [[n, *inner] for n in self.lengths]
        if isinstance(self.values, np.ndarray):
            return self.values.ravel(), starts, shapes, _element_bytes(self.pad_value)
        return self.values.reshape(-1), starts, shapes, _pad_bytes(self.pad_value, self.values.dtype)

    def request_rows(self, start: int, rows: int, batched: bool) -> Any:
        """One-sample request: its row, of its own length. A multi-row one:
        ``[rows, its longest, ...]``, shorter rows padded with ``pad_value``
        (``b""`` for BYTES)."""
        if not batched:
            return self.row(start)
        longest = max(self.lengths[start : start + rows], default=0)
        shape = (rows, longest, *self.values.shape[2 if self.padded else 1 :])
        out: Any
        if isinstance(self.values, np.ndarray):
            out = np.full(shape, self.pad_value, dtype=object)
        else:
            out = self.values.new_full(shape, self.pad_value)
        for j in range(rows):
            n = self.lengths[start + j]
            out[j, :n] = self.row(start + j)
        return out


class PaddedOutput:
    """A batch's output padded along several variable dimensions (or one
    not first): ``values`` ``[B, *shape at the longest]`` and each row's
    lengths along them (``[B, k]``). :meth:`request_rows` cuts a request's
    result out of it."""

    __slots__ = ("values", "lengths", "variable", "pad_value")

    def __init__(self, values: torch.Tensor, lengths: list[list[int]], variable: tuple[int, ...], pad_value: float):
        self.values = values
        self.lengths = lengths
        self.variable = variable  # positions of the -1 dimensions in a row's shape
        self.pad_value = pad_value

    def _box(self, lengths: Sequence[int]) -> tuple[slice, ...]:
        ends = dict(zip(self.variable, lengths))
        return tuple(slice(0, ends.get(d)) for d in range(self.values.dim() - 1))

    def packed(self) -> tuple[torch.Tensor, list[int], list[list[int]], bytes]:
        """Every row for the native front-end's encoder, as
        :meth:`RaggedOutput.packed`: each row cut to its own lengths."""
        rows = [self.values[i][self._box(lengths)] for i, lengths in enumerate(self.lengths)]
        starts = list(itertools.accumulate((r.numel() for r in rows), initial=0))[:-1]
        flat = torch.cat([r.reshape(-1) for r in rows]) if rows else self.values.reshape(-1)
        return flat, starts, [list(r.shape) for r in rows], _pad_bytes(self.pad_value, self.values.dtype)

    def request_rows(self, start: int, rows: int, batched: bool) -> torch.Tensor:
        """One-sample request: its row at its own lengths. A multi-row one:
        ``[rows, *its longest]``, shorter rows padded with ``pad_value``."""
        if not batched:
            return self.values[start][self._box(self.lengths[start])]
        own = self.lengths[start : start + rows]
        longest = [max(column) for column in zip(*own)]
        box = self._box(longest)
        shape = [len(range(*b.indices(n))) for b, n in zip(box, self.values.shape[1:])]
        out = self.values.new_full((rows, *shape), self.pad_value)
        for j, lengths in enumerate(own):
            cut = self._box(lengths)
            out[j][cut] = self.values[start + j][cut]
        return out


@functools.lru_cache(maxsize=256)
def _pad_bytes(value: float | bytes, dtype: torch.dtype) -> bytes:
    """One element of ``value`` in ``dtype``, as bytes (made once per pair:
    every batch of a variable-length output asks)."""
    if isinstance(value, bytes):
        raise ModelError(f"a pad of bytes for a {dtype} output")
    return torch.full((1,), value, dtype=dtype).view(torch.uint8).numpy().tobytes()


def _element_bytes(value: Any) -> bytes:
    """A BYTES pad element's bytes (``str`` as UTF-8)."""
    return value.encode() if isinstance(value, str) else bytes(value)


def _padded_output(spec: TensorSpec, named: Mapping[str, Any], rows: int) -> PaddedOutput:
    value = named[spec.name]
    values = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if not isinstance(values, torch.Tensor):
        raise ModelError(f"output '{spec.name}': expected a tensor, got {type(value).__name__}")
    if values.dtype != spec.torch_dtype:
        raise ModelError(f"output '{spec.name}': expected dtype {spec.dtype}, got {values.dtype}")
    values = values.cpu()
    fixed_ok = all(d == -1 or d == n for d, n in zip(spec.shape, values.shape[1:]))
    if values.dim() != len(spec.shape) + 1 or values.shape[0] != rows or not fixed_ok:
        raise ModelError(
            f"output '{spec.name}': expected shape ({rows}, {', '.join(map(str, spec.shape))}) (-1: any length),"
            f" got {tuple(values.shape)}"
        )
    k = len(spec.variable_dims)
    key = spec.name + LENGTHS
    raw = named.get(key)
    if raw is None:
        raise ModelError(f"output '{spec.name}' (ragged='pad') needs '{key}' beside it")
    t = torch.as_tensor(raw)
    if t.dtype.is_floating_point or tuple(t.shape) not in ((rows, k), (rows,) if k == 1 else (rows, k)):
        raise ModelError(f"output '{key}': expected integers of shape {(rows, k) if k > 1 else (rows,)}, got"
                         f" {tuple(t.shape)} {t.dtype}")  # fmt: skip
    lengths: list[list[int]] = t.reshape(rows, k).tolist()
    bounds = [values.shape[1 + d] for d in spec.variable_dims]
    if any(not 0 <= n <= b for row in lengths for n, b in zip(row, bounds)):
        raise ModelError(f"output '{key}': lengths must be within the output's shape {tuple(values.shape)}")
    return PaddedOutput(values, lengths, spec.variable_dims, spec.pad_value)


def _named(raw: Any, specs: Sequence[TensorSpec]) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    if isinstance(raw, (tuple, list)) and len(specs) > 1:
        if len(raw) != len(specs):
            raise ModelError(f"model returned {len(raw)} values, expected {len(specs)} outputs")
        return {s.name: v for s, v in zip(specs, raw)}
    if len(specs) == 1 and not specs[0].is_ragged:
        return {specs[0].name: raw}
    raise ModelError(
        f"model returned {type(raw).__name__}; a model with variable-length outputs returns a dict"
        " (with each one's _lengths or _offsets)"
    )


def _bytes_output(spec: TensorSpec, value: Any, rows: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        raise ModelError(f"output '{spec.name}': expected a numpy object array or a list of bytes, got a tensor")
    try:
        array = np.asarray(value, dtype=object)
    except Exception as exc:
        raise ModelError(f"output '{spec.name}': cannot read it as an array of bytes: {exc}") from exc
    if array.shape != (rows, *spec.shape):
        raise ModelError(f"output '{spec.name}': expected shape {(rows, *spec.shape)}, got {array.shape}")
    for element in array.flat:
        if not isinstance(element, (bytes, str)):
            raise ModelError(f"output '{spec.name}': BYTES elements must be bytes or str, got {type(element).__name__}")
    return array


def _index(spec: TensorSpec, named: Mapping[str, Any], key: str, length: int) -> list[int]:
    value = named.get(key)
    if value is None:
        raise ModelError(f"output '{spec.name}' (ragged='{spec.ragged}') needs '{key}' beside it")
    t = torch.as_tensor(value)
    if t.dim() != 1 or t.shape[0] != length or t.dtype.is_floating_point:
        raise ModelError(f"output '{key}': expected {length} integers, got {tuple(t.shape)} {t.dtype}")
    out: list[int] = t.tolist()
    return out


def _ragged_bytes_output(spec: TensorSpec, named: Mapping[str, Any], rows: int) -> RaggedOutput:
    """A variable-length BYTES output: a numpy object array (or nested
    lists) of ``bytes``/``str``, padded ``[B, L_max, ...]`` with
    ``name + "_lengths"`` or jagged ``[sum L, ...]`` with ``name + "_offsets"``."""
    value = named[spec.name]
    if isinstance(value, torch.Tensor):
        raise ModelError(f"output '{spec.name}': expected a numpy object array or a list of bytes, got a tensor")
    padded = spec.ragged == "pad"
    try:
        values = np.asarray(value, dtype=object)
    except Exception as exc:
        raise ModelError(f"output '{spec.name}': cannot read it as an array of bytes: {exc}") from exc
    lead = 2 if padded else 1
    if values.ndim != len(spec.inner_shape) + lead or tuple(values.shape[lead:]) != spec.inner_shape:
        raise ModelError(f"output '{spec.name}': expected shape {spec.shape} per row, got {values.shape}")
    for element in values.flat:
        if not isinstance(element, (bytes, str)):
            raise ModelError(f"output '{spec.name}': BYTES elements must be bytes or str, got {type(element).__name__}")
    return _cut(spec, named, values, rows, b"")


def _ragged_output(spec: TensorSpec, named: Mapping[str, Any], rows: int) -> RaggedOutput | PaddedOutput:
    if spec.is_padded_nd:
        return _padded_output(spec, named, rows)
    if spec.is_bytes:
        return _ragged_bytes_output(spec, named, rows)
    value = named[spec.name]
    values = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
    if not isinstance(values, torch.Tensor):
        raise ModelError(f"output '{spec.name}': expected a tensor, got {type(value).__name__}")
    if values.dtype != spec.torch_dtype:
        raise ModelError(f"output '{spec.name}': expected dtype {spec.dtype}, got {values.dtype}")
    values = values.cpu()
    inner = tuple(values.shape[2:] if spec.ragged == "pad" else values.shape[1:])
    if inner != spec.inner_shape or values.dim() != len(spec.inner_shape) + (2 if spec.ragged == "pad" else 1):
        raise ModelError(f"output '{spec.name}': expected shape {spec.shape} per row, got {tuple(values.shape)}")
    return _cut(spec, named, values, rows, spec.pad_value)


def _cut(spec: TensorSpec, named: Mapping[str, Any], values: Any, rows: int, pad: float | bytes) -> RaggedOutput:
    """The rows of a padded or jagged output, by its lengths or offsets."""
    if spec.ragged == "pad":
        if values.shape[0] != rows:
            raise ModelError(f"output '{spec.name}': expected leading dimension {rows} (the batch)")
        lengths = _index(spec, named, spec.name + LENGTHS, rows)
        if any(not 0 <= n <= values.shape[1] for n in lengths):
            raise ModelError(f"output '{spec.name + LENGTHS}': lengths must be within 0..{values.shape[1]}")
        return RaggedOutput(values, [], lengths, True, pad)
    offsets = _index(spec, named, spec.name + OFFSETS, rows + 1)
    if offsets[0] != 0 or offsets[-1] != values.shape[0] or any(a > b for a, b in itertools.pairwise(offsets)):
        raise ModelError(
            f"output '{spec.name + OFFSETS}': offsets must rise from 0 to {values.shape[0]} (the values' length)"
        )
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    return RaggedOutput(values, offsets[:-1], lengths, False, pad)


def normalize_variable_outputs(raw: Any, specs: Sequence[TensorSpec], rows: int) -> dict[str, Any]:
    """What a model with BYTES or variable-length outputs returned, checked:
    ``{name: tensor | numpy object array | RaggedOutput}``; anything wrong is
    a :class:`ModelError` saying what."""
    named = _named(raw, specs)
    fixed = [s for s in specs if not (s.is_bytes or s.is_ragged)]
    outputs: dict[str, Any] = (
        dict(normalize_outputs({s.name: named.get(s.name) for s in fixed}, fixed, rows)) if fixed else {}
    )
    for s in specs:
        if s.is_bytes or s.is_ragged:
            if s.name not in named:
                raise ModelError(f"model output is missing '{s.name}' (it returned {sorted(map(str, named))})")
            fixed_bytes = s.is_bytes and not s.is_ragged
            outputs[s.name] = _bytes_output(s, named[s.name], rows) if fixed_bytes else _ragged_output(s, named, rows)
    return outputs


class MergedOutput:
    """A variable-length output of a batch that failure isolation ran in
    parts: each part's output (``(start row, rows, RaggedOutput |
    PaddedOutput)``) answers its own rows; the rows of failed requests,
    which no part covers, are empty and never asked for."""

    __slots__ = ("parts", "rows", "spec")

    def __init__(self, parts: list[tuple[int, int, RaggedOutput | PaddedOutput]], rows: int, spec: TensorSpec):
        self.parts = parts
        self.rows = rows
        self.spec = spec

    def request_rows(self, start: int, rows: int, batched: bool) -> Any:
        for first, n, part in self.parts:
            if first <= start < first + n:
                return part.request_rows(start - first, rows, batched)
        raise ModelError(f"output '{self.spec.name}': row {start} belongs to no part that ran")

    def packed(self) -> tuple[Any, list[int], list[list[int]], bytes]:
        """Every row for the native front-end's encoder (see
        :meth:`RaggedOutput.packed`), the parts' values back to back."""
        chunks: list[Any] = []
        starts: list[int] = []
        shapes: list[list[int]] = []
        at = 0
        covered: dict[int, tuple[int, list[int]]] = {}
        for first, _, part in self.parts:
            values, part_starts, part_shapes, _ = part.packed()
            chunks.append(values)
            for i, (begin, shape) in enumerate(zip(part_starts, part_shapes)):
                covered[first + i] = (at + begin, shape)
            at += len(values)
        empty = [0] * len(self.spec.shape)
        for row in range(self.rows):
            begin, shape = covered.get(row, (0, empty))
            starts.append(begin)
            shapes.append(shape)
        if self.spec.is_bytes:
            flat: Any = np.concatenate(chunks) if chunks else np.empty(0, dtype=object)
            return flat, starts, shapes, _element_bytes(b"")
        flat = torch.cat(chunks) if chunks else torch.empty(0, dtype=self.spec.torch_dtype)
        return flat, starts, shapes, _pad_bytes(self.spec.pad_value, self.spec.torch_dtype)


def merge_parts(
    done: Sequence[tuple[int, int, Mapping[str, Any]]],
    rows: int,
    specs: Sequence[TensorSpec],
    version_output: str | None,
) -> dict[str, Any]:
    """One batch's outputs from the parts failure isolation ran (``(start
    row, rows, outputs)``); rows no part covers belong to failed requests and
    hold nothing that is read. With no part done, every output is empty."""
    merged: dict[str, Any] = {}
    for s in specs:
        got = [(start, n, outputs[s.name]) for start, n, outputs in done]
        if s.is_ragged:
            merged[s.name] = MergedOutput(got, rows, s)
        elif s.is_bytes:
            array = np.full((rows, *s.shape), b"", dtype=object)
            for start, n, value in got:
                array[start : start + n] = value
            merged[s.name] = array
        else:
            whole = torch.empty((rows, *s.shape), dtype=s.torch_dtype)
            for start, n, value in got:
                whole[start : start + n].copy_(value)
            merged[s.name] = whole
    if version_output is not None:
        versions = torch.zeros(rows, dtype=torch.int64)
        for start, n, outputs in done:
            versions[start : start + n] = outputs[version_output]
        merged[version_output] = versions
    return merged


def _row_of(
    specs: Sequence[TensorSpec], inputs: Mapping[str, Any], outputs: Mapping[str, Any], row: int
) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """Row ``row`` of a batch as a batch of one, and the batch's outputs
    (what the invariance sampler copies a sampled row from)."""
    return slice_inputs(specs, inputs, row, 1), outputs


def _snapshot(outputs: dict[str, Any]) -> dict[str, Any]:
    """One streamed response's outputs, copied (for requests of event
    loops, which read their rows later): the model may reuse its buffers
    (or the staging slot's) for its next response."""
    copied: dict[str, Any] = {}
    for name, out in outputs.items():
        if isinstance(out, torch.Tensor):
            out = out.clone()
        elif isinstance(out, np.ndarray):
            out = out.copy()
        elif isinstance(out, (RaggedOutput, PaddedOutput)) and isinstance(out.values, torch.Tensor):
            out.values = out.values.clone()
        copied[name] = out
    return copied


def _deserialize(data: bytes) -> list[bytes]:
    """BYTES elements serialized as Triton does (a 4-byte little-endian length
    before each)."""
    elements: list[bytes] = []
    at = 0
    while at < len(data):
        if at + 4 > len(data):
            raise ValueError("a truncated BYTES element")
        n = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + n > len(data):
            raise ValueError("a truncated BYTES element")
        elements.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return elements


def _join_rows(rows: list[Any], shapes: list[tuple[int, ...]], pad: Any, new_full: Callable[..., Any]) -> Any:
    """Rows of one request as one value ``[rows, *longest]``: shorter rows
    padded with ``pad`` (as :meth:`RaggedOutput.request_rows` does)."""
    longest = tuple(max(column) for column in zip(*shapes)) if shapes else ()
    out = new_full((len(rows), *longest), pad)
    for j, (row, shape) in enumerate(zip(rows, shapes)):
        out[(j, *(slice(0, n) for n in shape))] = row
    return out


def shared_result(
    specs: Sequence[TensorSpec], outputs: Sequence[tuple[bytearray, list[list[int]], bytes]], batched: bool
) -> dict[str, Any]:
    """A shared-memory request's result for a model with BYTES or
    variable-length outputs, from each output's ``(bytes, row shapes, pad
    element)`` as the server wrote them: what ``server.client()`` would
    give (a row at its own shape; several rows padded to their longest)."""
    if len(outputs) != len(specs):
        raise ValueError(f"the shared answer has {len(outputs)} outputs, the model {len(specs)}")
    result: dict[str, Any] = {}
    for spec, (data, raw_shapes, pad) in zip(specs, outputs):
        shapes = [tuple(s) for s in raw_shapes]
        counts = [math.prod(s) for s in shapes]
        bounds = list(itertools.accumulate(counts, initial=0))
        rows: list[Any]
        if spec.is_bytes:
            elements = _deserialize(bytes(data))
            if len(elements) != bounds[-1]:
                raise ValueError(f"output '{spec.name}': {len(elements)} elements for shapes {shapes}")
            rows = []
            for (a, b), shape in zip(itertools.pairwise(bounds), shapes):
                row = np.empty(b - a, dtype=object)
                row[:] = elements[a:b]
                rows.append(row.reshape(shape))
            if not batched:
                # A shape-() element is the bytes object itself, as server.client() gives it.
                result[spec.name] = rows[0] if shapes[0] else rows[0][()]
            elif len(set(shapes)) == 1:
                result[spec.name] = np.stack(rows) if rows else np.empty((0,), dtype=object)
            else:
                result[spec.name] = _join_rows(rows, shapes, pad, lambda shape, v: np.full(shape, v, dtype=object))
            continue
        dtype = spec.torch_dtype
        if len(data) != bounds[-1] * dtype.itemsize:
            raise ValueError(f"output '{spec.name}': {len(data)} bytes for shapes {shapes}")
        # A view of the bytearray the answer was copied into (it is the result's own).
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        rows = [flat[a:b].view(shape) for (a, b), shape in zip(itertools.pairwise(bounds), shapes)]
        if not batched:
            result[spec.name] = rows[0]
        elif len(set(shapes)) == 1:
            result[spec.name] = flat.view(len(rows), *shapes[0])
        else:
            value = torch.frombuffer(bytearray(pad), dtype=dtype)[0] if pad else 0
            result[spec.name] = _join_rows(rows, shapes, value, functools.partial(torch.full, dtype=dtype))
    return result


class VariableExecutor(CpuExecutor):
    """Runs a model with BYTES or variable-length tensors: each batch's
    inputs are built from its slot (:func:`batch_inputs`), its tensors moved
    to the instance's device (CUDA: a plain copy and a synchronous call on
    the worker thread, no stream pipelining), its outputs checked by
    :func:`normalize_variable_outputs` and brought back to the CPU. A part
    of a batch retried by failure isolation is a batch of its own
    (:func:`slice_inputs`), and the parts that ran are merged
    (:func:`merge_parts`)."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
    ) -> None:
        super().__init__(model, device, outputs)
        self.inputs = inputs
        # The batch being served: its rows, and its staging slot's storage.
        self._rows = 0
        self._staging: frozenset[int] = frozenset()

    def _call_model(self, inputs: dict[str, Any], requests: list[RequestInfo] | None) -> Any:
        return self.model(inputs) if requests is None else self.model(inputs, requests)  # type: ignore[call-arg]

    def call(
        self,
        inputs: Mapping[str, Any],
        rows: int,
        staging: frozenset[int],
        requests: list[RequestInfo] | None = None,
    ) -> dict[str, Any]:
        """The model on a batch's inputs, its outputs checked and on the CPU
        (outside the weight gate: its caller holds it, or needs none)."""
        inputs = self._on_device(inputs)
        with model_mode():
            try:
                raw = self._call_model(dict(inputs), requests)
            except RequestsFailed as failed:  # its outputs are checked as any
                raise failed.answered(self._checked(failed.outputs, rows, staging, None), 0, requests) from None
            return self._checked(raw, rows, staging, None)

    def stream(
        self,
        inputs: Mapping[str, Any],
        rows: int,
        requests: list[RequestInfo] | None,
        emit: Callable[[dict[str, Any], list[int] | None], int],
        gated: bool = True,
    ) -> None:
        """A decoupled model on a batch's inputs: each item it yields is
        checked as :meth:`call` checks outputs and handed to ``emit``, which
        says how many callers still listen; at 0 the model is closed
        (``GeneratorExit`` at its ``yield``). An item with ``only`` (the
        first rows of some requests; ``ferrobatch.triton``'s groups of one
        shape) goes to those requests, and how many of them listen is sent
        back into the generator, which decides. Runs under the weight gate
        (the whole stream: one version) unless ``gated`` is False."""
        inputs = self._on_device(inputs)
        gate = self.gated() if gated else contextlib.nullcontext()
        with model_mode(), gate as version:
            produced = self._call_model(dict(inputs), requests)
            if isinstance(produced, (Mapping, torch.Tensor, np.ndarray)) or not hasattr(produced, "__iter__"):
                raise ModelError(
                    "a decoupled model returns an iterable of outputs (a generator), one item per response;"
                    f" it returned {type(produced).__name__}"
                )
            items = iter(produced)
            feedback: int | None = None
            try:
                while True:
                    try:
                        raw = next(items) if feedback is None else items.send(feedback)
                    except StopIteration:
                        break
                    only: list[int] | None = getattr(raw, "only", None)
                    listening = emit(self._checked(raw, rows, frozenset(), version), only)
                    if only is not None:
                        feedback = listening
                    elif listening == 0:
                        break  # every caller went away
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()

    def _on_device(self, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.device.type == "cpu":
            return inputs
        # The tensors go to the model's device; BYTES stay numpy arrays.
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    def _checked(self, raw: Any, rows: int, staging: frozenset[int], version: int | None) -> dict[str, Any]:
        """A model call's result as outputs: checked, with the version
        output (``version``: a stream's), on the CPU, none aliasing the
        staging slot."""
        outputs = normalize_variable_outputs(raw, self.outputs, rows)
        self.stamp(outputs, version, rows)
        for name, out in outputs.items():
            if isinstance(out, torch.Tensor) and not out.is_cpu:
                outputs[name] = out.cpu()  # padded and jagged outputs are moved as they are cut
            elif isinstance(out, torch.Tensor) and _storage_ptr(out) in staging:
                outputs[name] = out.clone()  # the slot is reused by the next batch
            elif (
                isinstance(out, (RaggedOutput, PaddedOutput))
                and isinstance(out.values, torch.Tensor)
                and _storage_ptr(out.values) in staging
            ):
                out.values = out.values.clone()
        return outputs

    def run_alone(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The model on one row (a batch of one, as :func:`slice_inputs`
        cuts it), outside the weight gate: the invariance sampler's re-run."""
        return self.call(inputs, 1, frozenset(), [RequestInfo(1)] if self.with_requests else None)

    def warm_up_minimum(self, buckets: Sequence[int], samples: Mapping[str, list[Any]] | None = None) -> None:
        """Runs each bucket size once with every row at its minimum shape
        (:func:`minimum_inputs`), or made of ``samples`` (:func:`sample_rows`),
        under the weight gate its caller holds; raises what the model raised."""
        for rows in buckets:
            requests = [RequestInfo(1)] * rows if self.with_requests else None
            if samples is None:
                inputs = minimum_inputs(self.inputs, rows)
            else:
                inputs = sample_inputs(self.inputs, samples, rows)
            if self.decoupled:  # every item made and checked, none sent
                self.stream(inputs, rows, requests, lambda *_: 1, gated=False)
            else:
                self.call(inputs, rows, frozenset(), requests)

    # -- the Executor's hooks --------------------------------------------------------

    def stage(self, slot: Mapping[str, torch.Tensor], batch: _core.Batch) -> dict[str, Any]:
        """The batch's inputs, built from its slot (:func:`batch_inputs`)."""
        self._rows = batch.rows
        # The storages outputs may not view (they are cloned from them): the
        # slot's, unless the finish copies every answer out (then it goes after).
        self._staging = frozenset() if self._answers_copied else frozenset(_storage_ptr(t) for t in slot.values())
        return batch_inputs(self.inputs, slot, batch)

    def run(self, staged: Any, rows: int, start: int = 0) -> dict[str, Any]:
        """The model on rows ``start..start + rows`` of the staged batch; a
        part of it (failure isolation's retry) as a batch of its own."""
        part = staged if start == 0 and rows == self._rows else slice_inputs(self.inputs, staged, start, rows)
        try:
            return self.call(part, rows, self._staging, self.requests_of(start, rows))
        except PartlyAnswered as answered:  # its rows count from the part's first
            answered.failed = [(start + row, error) for row, error in answered.failed]
            raise

    def merge(self, done: list[tuple[int, int, Any]], rows: int) -> dict[str, Any]:
        return merge_parts(done, rows=rows, specs=self.outputs, version_output=self.version_output)

    def offer(self, staged: Any, outputs: Any, rows: int) -> None:
        if self.sampler is not None:
            self.sampler.offer_row(rows, functools.partial(_row_of, self.inputs, staged, outputs))

    def serve_stream(
        self, worker: _core.Worker, batch: _core.Batch, slot: Mapping[str, torch.Tensor], counters: WorkerCounters,
        started: int,
    ) -> None:  # fmt: skip
        """One batch of a decoupled model: each item it yields goes to the
        batch's callers at once (``worker.stream``), then ``finish`` with no
        outputs ends their streams, or fails them if the model raised (only those it
        names, with their own errors, if it raised :class:`RequestsFailed`)."""
        error: BaseException | None = None
        failed: list[tuple[int, BaseException]] = []
        try:
            inputs = batch_inputs(self.inputs, slot, batch)
            # An event loop reads its callers' rows later: they get a copy of
            # each response (the native front-end encodes them at once).
            copied = batch.has_loop_requests

            def emit(outputs: dict[str, Any], only: list[int] | None) -> int:
                return worker.stream(batch, _snapshot(outputs) if copied else outputs, only)

            self.stream(inputs, batch.rows, self.requests_of(0, batch.rows), emit)
        except RequestsFailed as some:  # the others' streams end as they would have
            try:
                failed = some.answered({}, 0, self.requests_of(0, batch.rows)).failed
            except ModelError as misused:
                error = misused
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: the worker survives
            error = exc
        batch.release_slot()  # the model is done with its inputs
        retried = Retried({}, None, failed, 0, 0) if failed and error is None else None
        self.complete(worker, batch, counters, started, None if error is not None else {}, error, retried)
