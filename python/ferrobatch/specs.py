"""Tensor specs: the name, dtype and per-sample shape of a model input or output."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from . import _core

__all__ = ["TensorSpec"]

#: The numeric dtypes by canonical name (the core's table; BYTES apart).
_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name, _, _ in _core.dtypes() if name != "bytes"}
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}


#: Spellings of BYTES (PyTriton's ``np.bytes_`` and ``object``, numpy's
#: fixed-width ``S`` dtypes, Triton's name).
_BYTES_NAMES = {"bytes", "bytes_", "object", "object_", "BYTES", "TYPE_STRING"}


def dtype_name(dtype: Any) -> str:
    """Canonical name ("float32") of a dtype given as a string, torch or numpy
    dtype; ``"bytes"`` for BYTES (``"bytes"``, ``bytes``, ``np.bytes_``,
    ``object``, a numpy object or ``S`` dtype)."""
    if dtype is bytes or dtype is object or dtype is np.bytes_ or dtype is np.object_:
        return "bytes"
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        name = str(getattr(dtype, "name", dtype))  # numpy dtype or scalar type
        if name.startswith("<class"):
            name = getattr(dtype, "__name__", name)
    name = _ALIASES.get(name, name)
    if name in _BYTES_NAMES or (isinstance(dtype, np.dtype) and dtype.kind in "OS"):
        return "bytes"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}, bytes")
    return name


_RAGGED_MODES = ("pad", "jagged")
#: The most elements one row of a tensor may hold (2**40: 4 TiB of float32).
MAX_ROW_ELEMENTS = 1 << 40
#: The image layouts an input may declare (Triton's ``FORMAT_NHWC``, ``FORMAT_NCHW``).
_IMAGE_FORMATS = ("NHWC", "NCHW")
#: Labels of one output, at most: one per class of the most elements a
#: classified batch entry may have (Triton's bound).
MAX_LABELS = 1_000_000
#: Characters of one label, at most.
MAX_LABEL_LENGTH = 4096
_MAX_VARIABLE_DIMS = 4  # as the core's MAX_VARIABLE_DIMS


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: ``TensorSpec("x", "float32", (256,))``.

    ``shape`` is the shape of one sample, without the batch dimension. ``dtype``
    may be a string ("float32"), a ``torch.dtype`` or a numpy dtype; it is
    stored as its canonical name. Inputs are never cast: a request of another
    dtype is refused with :class:`~ferrobatch.InvalidInputError`.

    ``dtype="bytes"`` (also ``bytes``, ``np.bytes_``, ``object``): each
    element a byte string (``str`` is encoded UTF-8); the model sees numpy
    object arrays of ``bytes``.

    A shape with ``-1`` is variable-length along that dimension
    (``(-1,)``, ``(-1, 4)``), with ``ragged="pad"`` (the model gets the batch
    padded to its longest row with ``pad_value``, and ``name + "_lengths"``,
    int64 ``[B]``) or ``ragged="jagged"`` (the rows' values concatenated,
    ``[sum of lengths, ...]``, and ``name + "_offsets"``, int64 ``[B + 1]``).
    An output with ``-1`` is returned by the model the same way, and each
    caller gets its own row's length. A BYTES tensor may be variable-length
    too: padded with ``b""`` (numpy object arrays ``[B, L_max, ...]``) or
    jagged (``[sum of lengths, ...]``). With ``ragged="pad"``, any
    dimensions may be ``-1`` (``(3, -1)``, ``(-1, -1)``): the batch is padded
    to its longest along each, and ``name + "_lengths"`` is int64 ``[B, k]``
    for ``k`` variable dimensions (``[B]`` for one).

    ``optional=True`` (an input, among a model's first 64): a request may
    leave it out. The model gets zeros in its rows (empty rows for a
    variable-length input, empty strings for BYTES), and a model built
    ``with_requests`` finds the inputs each request left out in
    :attr:`RequestInfo.absent <ferrobatch.RequestInfo.absent>`.

    ``labels`` (an output): the name of each class, by index, as Triton's
    ``label_filename`` lists them (one label per line there). A request
    asking for the output as its top classes (Triton's classification
    extension, ``InferRequestedOutput(name, class_count=k)``) gets
    ``"<value>:<index>:<label>"`` for a class with a label.

    ``format="NCHW"`` or ``"NHWC"`` (an input of three dimensions): how an
    image is laid out, as Triton's model configuration says it
    (``FORMAT_NCHW``); its image clients read it to shape what they send.
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    ragged: str | None = None
    pad_value: float = 0
    optional: bool = False
    labels: tuple[str, ...] | None = None
    format: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        shape = tuple(self.shape)
        for dim in shape:
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < -1:
                raise ValueError(
                    f"TensorSpec {self.name!r}: dimensions must be non-negative ints or -1 (a variable length),"
                    f" got {shape}"
                )
        elements = math.prod(d for d in shape if d > 0)
        if elements > MAX_ROW_ELEMENTS:
            raise ValueError(
                f"TensorSpec {self.name!r}: shape {shape} holds {elements} elements per row, over {MAX_ROW_ELEMENTS}"
            )
        object.__setattr__(self, "shape", shape)
        variable = -1 in shape
        if self.ragged is not None and self.ragged not in _RAGGED_MODES:
            raise ValueError(f"TensorSpec {self.name!r}: ragged must be 'pad' or 'jagged', got {self.ragged!r}")
        if (variable and shape.index(-1) != 0) or shape.count(-1) > 1:
            if self.ragged == "jagged":
                raise ValueError(
                    f"TensorSpec {self.name!r}: ragged='jagged' takes one variable dimension, the first"
                    f" ((-1, ...)); shape {shape} needs ragged='pad'"
                )
            if self.dtype == "bytes":
                raise ValueError(
                    f"TensorSpec {self.name!r}: a BYTES tensor may be variable along its first dimension only,"
                    f" got {shape}"
                )
            if shape.count(-1) > _MAX_VARIABLE_DIMS:
                raise ValueError(
                    f"TensorSpec {self.name!r}: at most {_MAX_VARIABLE_DIMS} dimensions may be -1, got {shape}"
                )
        if variable and self.ragged is None:
            raise ValueError(
                f"TensorSpec {self.name!r}: shape {shape} has a variable-length dimension; "
                "say how a batch holds it: ragged='pad' or ragged='jagged'"
            )
        if self.ragged is not None and not variable:
            raise ValueError(f"TensorSpec {self.name!r}: ragged={self.ragged!r} needs a -1 in its shape")
        if self.format is not None:
            if self.format not in _IMAGE_FORMATS:
                raise ValueError(f"TensorSpec {self.name!r}: format must be 'NCHW' or 'NHWC', got {self.format!r}")
            if len(shape) != 3:
                raise ValueError(
                    f"TensorSpec {self.name!r}: format {self.format} needs three dimensions (without the batch), "
                    f"got {shape}"
                )
        if self.labels is not None:
            labels = tuple(self.labels)
            if len(labels) > MAX_LABELS or not all(isinstance(label, str) for label in labels):
                raise ValueError(f"TensorSpec {self.name!r}: labels must be at most {MAX_LABELS} strings")
            if any(len(label) > MAX_LABEL_LENGTH or "\n" in label for label in labels):
                raise ValueError(
                    f"TensorSpec {self.name!r}: a label is one line of at most {MAX_LABEL_LENGTH} characters"
                )
            object.__setattr__(self, "labels", labels)
        if not isinstance(self.pad_value, (int, float)):
            raise ValueError(f"TensorSpec {self.name!r}: pad_value must be a number, got {self.pad_value!r}")
        self._check_pad_value()

    def _check_pad_value(self) -> None:
        """Refuses a ``pad_value`` the dtype cannot hold as it is (it would be
        wrapped, truncated or refused later, differently on each way in)."""
        value = self.pad_value
        if self.is_bytes:
            if value != 0:
                raise ValueError(f"TensorSpec {self.name!r}: a BYTES tensor pads with b'', pad_value must be 0")
            return
        dtype = self.torch_dtype
        problem = None
        if dtype == torch.bool:
            problem = None if value in (0, 1) else "bool holds 0 and 1 only"
        elif not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            if isinstance(value, float) and not value.is_integer():
                problem = f"{dtype} holds whole numbers only"
            elif not info.min <= value <= info.max:
                problem = f"{dtype} holds {info.min} to {info.max}"
        elif not (isinstance(value, float) and not math.isfinite(value)) and abs(value) > torch.finfo(dtype).max:
            problem = f"{dtype} holds at most {torch.finfo(dtype).max:g} in magnitude (or inf, or nan)"
        if problem is not None:
            raise ValueError(f"TensorSpec {self.name!r}: pad_value {value!r} does not fit: {problem}")

    @property
    def is_bytes(self) -> bool:
        """A BYTES tensor (numpy object arrays of ``bytes``)."""
        return self.dtype == "bytes"

    @property
    def is_ragged(self) -> bool:
        """Variable-length along its first dimension."""
        return self.ragged is not None

    @property
    def is_padded_nd(self) -> bool:
        """Variable-length along a dimension other than the first, or several:
        padded along each (``ragged="pad"``), with ``[B, k]`` lengths."""
        return self.is_ragged and (self.shape.count(-1) > 1 or self.shape[0] != -1)

    @property
    def variable_dims(self) -> tuple[int, ...]:
        """The positions of the ``-1`` dimensions in the shape."""
        return tuple(i for i, d in enumerate(self.shape) if d == -1)

    @property
    def inner_shape(self) -> tuple[int, ...]:
        """The shape after a variable-length first dimension (the whole shape otherwise)."""
        return self.shape[1:] if self.is_ragged and not self.is_padded_nd else self.shape

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.is_bytes:
            raise TypeError(f"TensorSpec {self.name!r}: BYTES has no torch dtype (it is a numpy object array)")
        return _DTYPES[self.dtype]

    @property
    def row_nbytes(self) -> int:
        """Bytes of one sample (of one position of a variable-length one)."""
        n = self.torch_dtype.itemsize
        if self.is_padded_nd:
            return n  # one element: the rows vary along several dimensions
        for dim in self.inner_shape:
            n *= dim
        return n


def example_specs(raw: Any, exclude: Collection[str] = ()) -> list[TensorSpec]:
    """The output specs of what a model returned for a batch of one sample:
    ``"output"`` for a tensor, ``"output_0"``... for a tuple or list, the keys
    of a dict or TensorDict (nested ones joined as ``"a.b"``) except
    ``exclude`` (the inputs a TensorDict module passes through)."""
    named: dict[str, Any]
    if isinstance(raw, torch.Tensor):
        named = {"output": raw}
    elif isinstance(raw, (tuple, list)):
        named = {f"output_{i}": v for i, v in enumerate(raw)}
    elif isinstance(raw, Mapping):
        named = {}
        flatten_into(named, raw, "")
    else:
        raise TypeError(f"the model returned {type(raw).__name__}; expected a tensor, a tuple or a dict of tensors")
    specs = []
    for name, value in named.items():
        if name in exclude:
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != 1:
            raise TypeError(f"output {name!r}: expected a tensor with a leading batch dimension of 1, got {value!r}")
        specs.append(TensorSpec(name, dtype_name(value.dtype), tuple(value.shape[1:])))
    if not specs:
        raise TypeError("the model returned no outputs besides its inputs")
    return specs


def nested_key(name: str) -> str | tuple[str, ...]:
    """The TensorDict key of a spec name: ``"a.b"`` is the nested key ``("a", "b")``."""
    return tuple(name.split(".")) if "." in name else name


def flatten_into(out: dict[str, Any], mapping: Mapping[Any, Any], prefix: str) -> None:
    """Adds ``mapping``'s leaves to ``out`` under spec names: a nested key
    (``("a", "b")``, or a Mapping inside the Mapping) is named ``"a.b"``."""
    for key, value in mapping.items():
        name = prefix + (".".join(key) if isinstance(key, tuple) else str(key))
        if isinstance(value, Mapping):
            flatten_into(out, value, name + ".")
        else:
            out[name] = value
