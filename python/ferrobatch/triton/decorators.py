"""PyTriton's inference-callable decorators (``pytriton.decorators``).

An undecorated inference callable takes a list of requests (mappings of
input name to numpy array, each with its own leading batch dimension) and
returns one dict of numpy arrays per request. The decorators adapt other
shapes of callable to that:

- :func:`batch`: the requests' inputs concatenated into one batch, passed as
  keyword arguments; the outputs (a dict, or a list/tuple in the declared
  outputs' order) split back by each request's rows;
- :func:`sample`: each request's inputs as keyword arguments, one call per
  request (PyTriton's non-batching models see one request per call);
- :func:`first_value`: the named inputs replaced by their first value (a
  scalar when it has one element), checking that all values are equal;
- :func:`group_by_values`: under :func:`batch`, one call per group of rows
  whose values of the named inputs are equal, joined back in row order;
- :func:`group_by_keys`, :func:`pad_batch`, :func:`triton_context`, and
  :class:`ConstantPadder` (a ``pad_fn`` for :func:`group_by_values`).

A method works as well as a function: the requests are the last positional
argument, whatever comes before them (``self``) is passed through.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ._binding import TritonModelConfig, current_context, current_model_config
from .exceptions import PyTritonBadParameterError, PyTritonRuntimeError, PyTritonValidationError

__all__ = [
    "ConstantPadder",
    "batch",
    "first_value",
    "group_by_keys",
    "group_by_values",
    "pad_batch",
    "sample",
    "triton_context",
]

F = TypeVar("F", bound=Callable[..., Any])
InferenceRequest = Mapping[str, np.ndarray]
InferenceResult = dict[str, np.ndarray]

#: Keyword arguments that are no input (added by :func:`triton_context`).
_SPECIAL_KEYS = frozenset({"triton_context"})


def _rows(request: InferenceRequest) -> int:
    """A request's batch size: the leading dimension of its first input."""
    return int(next(iter(request.values())).shape[0])


def _split(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Sequence[Any]]:
    """``(self...,)`` and the requests: the last positional argument."""
    if not args:
        raise PyTritonBadParameterError("an inference callable is called with its list of requests")
    return args[:-1], args[-1]


def _config() -> TritonModelConfig:
    config = current_model_config()
    if config is None:
        raise PyTritonValidationError("this decorator needs the model's config: call the callable through Triton.bind")
    return config


def convert_output(outputs: Any, model_config: TritonModelConfig | None = None) -> InferenceResult:
    """A callable's result as a dict: a list or tuple is named by the
    declared outputs, in order."""
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, (list, tuple)):
        config = model_config or _config()
        if len(outputs) != len(config.outputs):
            raise PyTritonValidationError(
                f"the callable returned {len(outputs)} outputs; the model declares {len(config.outputs)}"
            )
        return {str(t.name): value for t, value in zip(config.outputs, outputs)}
    raise PyTritonValidationError(f"unsupported output type {type(outputs).__name__}; return a dict of numpy arrays")


def _is_batch(func: Any) -> bool:
    """Whether :func:`batch` is anywhere in ``func``'s chain of wrappers."""
    while func is not None:
        if getattr(func, "_ferrobatch_batch", False):
            return True
        func = getattr(func, "__wrapped__", None)
    return False


def batch(wrapped: F) -> F:
    """Concatenates the requests' inputs into one batch per input and calls
    ``wrapped(**inputs)``; splits what it returns back into one response per
    request, by each request's rows. Every request must carry the same
    inputs (:func:`group_by_keys` first otherwise)."""

    @functools.wraps(wrapped)
    def wrapper(*args: Any, **kwargs: Any) -> list[InferenceResult]:
        prefix, requests = _split(args)
        names = list(requests[0].keys())
        for request in requests[1:]:
            if set(request.keys()) != set(names):
                raise PyTritonValidationError("cannot batch requests with different sets of inputs")
        inputs = {n: requests[0][n] if len(requests) == 1 else np.concatenate([r[n] for r in requests]) for n in names}
        outputs = convert_output(wrapped(*prefix, **kwargs, **inputs))
        sizes = [_rows(r) for r in requests]
        total = sum(sizes)
        wrong = {n: tuple(v.shape) for n, v in outputs.items() if np.ndim(v) == 0 or v.shape[0] != total}
        if wrong:
            raise ValueError(f"outputs with a batch size other than the requests' {total}: {wrong}")
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [{n: v[lo:hi] for n, v in outputs.items()} for lo, hi in itertools.pairwise(bounds)]

    wrapper._ferrobatch_batch = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def sample(wrapped: F) -> F:
    """Calls ``wrapped(**request)`` for each request and returns its result
    (a dict, or a list/tuple in the declared outputs' order) as that
    request's response."""

    @functools.wraps(wrapped)
    def wrapper(*args: Any, **kwargs: Any) -> list[InferenceResult]:
        prefix, requests = _split(args)
        return [convert_output(wrapped(*prefix, **{**kwargs, **request})) for request in requests]

    return wrapper  # type: ignore[return-value]


def group_by_keys(wrapped: F) -> F:
    """Calls ``wrapped`` once per group of requests with the same set of
    inputs, and returns the responses in the requests' order."""

    @functools.wraps(wrapped)
    def wrapper(*args: Any, **kwargs: Any) -> list[InferenceResult]:
        prefix, requests = _split(args)
        keyed = sorted(enumerate(requests), key=lambda item: tuple(sorted(item[1].keys())))
        results: list[tuple[int, InferenceResult]] = []
        for _, group in itertools.groupby(keyed, key=lambda item: tuple(sorted(item[1].keys()))):
            members = list(group)
            out = wrapped(*prefix, [r for _, r in members], **kwargs)
            results.extend(zip((i for i, _ in members), out))
        return [r for _, r in sorted(results, key=operator.itemgetter(0))]

    return wrapper  # type: ignore[return-value]


def first_value(*keys: str, squeeze_single_values: bool = True, strict: bool = True) -> Callable[[F], F]:
    """Replaces the inputs ``keys`` by their first value (row 0).

    Under :func:`batch` it rewrites the keyword arguments; on an undecorated
    callable, each request. With ``squeeze_single_values`` (default) a first
    value of one element becomes a numpy scalar. With ``strict`` (default)
    all the values must be equal (:class:`PyTritonRuntimeError` otherwise).
    """
    special = sorted(set(keys) & _SPECIAL_KEYS)
    if special:
        raise PyTritonBadParameterError(f"the keys {', '.join(special)} are not allowed in @first_value")

    def replace(request: Any) -> Any:
        for name in keys:
            if name not in request:
                continue
            values = request[name]
            if strict and len(values) > 1:
                uniques = np.unique(values, axis=None if values.dtype == object else 0)
                if len(uniques) > 1:
                    raise PyTritonRuntimeError(
                        f"the values of input {name!r} are not all equal; disable strict in @first_value or"
                        f" send equal values. They are {values!r}."
                    )
            first = values[0]
            if squeeze_single_values and not np.isscalar(first) and all(d == 1 for d in np.shape(first)):
                first = np.squeeze(first)[()]
            request[name] = first
        return request

    def decorator(wrapped: F) -> F:
        @functools.wraps(wrapped)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            config = current_model_config()
            if config is not None and not config.batching:
                raise PyTritonRuntimeError("@first_value can only be used with models that batch")
            if set(kwargs) - _SPECIAL_KEYS:
                return wrapped(*args, **replace(kwargs))
            prefix, requests = _split(args)
            return wrapped(*prefix, [replace(r) for r in requests], **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


def _value_key(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "OSU":
            return (value.shape, tuple(bytes(v) if isinstance(v, (bytes, np.bytes_)) else str(v) for v in value.flat))
        return (value.shape, value.tobytes())
    if isinstance(value, bytes):
        return value
    return str(value) if isinstance(value, (np.str_, str)) else np.asarray(value).tobytes()


def group_by_values(
    *keys: str, pad_fn: Callable[[Sequence[InferenceResult]], Sequence[InferenceResult]] | None = None
) -> Callable[[F], F]:
    """Under :func:`batch`: splits the batch into groups of rows whose values
    of the inputs ``keys`` are equal, calls the callable once per group, and
    puts the outputs back in row order. ``pad_fn`` (e.g.
    :class:`ConstantPadder`) makes the groups' outputs one shape first."""

    def decorator(wrapped: F) -> F:
        if _is_batch(wrapped):
            raise PyTritonRuntimeError("@group_by_values must come after (below) @batch")

        @functools.wraps(wrapped)
        def wrapper(*args: Any, **kwargs: Any) -> InferenceResult:
            request = {k: v for k, v in kwargs.items() if k not in _SPECIAL_KEYS}
            other = {k: v for k, v in kwargs.items() if k in _SPECIAL_KEYS}
            rows = _rows(request)
            keyed = sorted(
                ((i, tuple(_value_key(request[k][i]) for k in keys)) for i in range(rows)),
                key=operator.itemgetter(1),
            )
            groups: list[tuple[np.ndarray, InferenceResult]] = []
            for _, group in itertools.groupby(keyed, key=operator.itemgetter(1)):
                index = np.array([i for i, _ in group], dtype=np.intp)
                part = {name: value[index] for name, value in request.items()}
                groups.append((index, convert_output(wrapped(*args, **part, **other))))
            results = [r for _, r in groups]
            if pad_fn is not None:
                results = list(pad_fn(results))
            first = results[0]
            merged = {name: np.zeros((rows, *v.shape[1:]), dtype=v.dtype) for name, v in first.items()}
            for (index, _), result in zip(groups, results):
                for name, v in result.items():
                    merged[name][index] = v
            return merged

        return wrapper  # type: ignore[return-value]

    return decorator


class ConstantPadder:
    """A ``pad_fn`` for :func:`group_by_values`: pads each output of every
    group to the largest shape among the groups, with ``pad_value`` (``b""``
    for bytes and strings; their itemsize grows to the longest)."""

    def __init__(self, pad_value: Any = 0) -> None:
        self.pad_value = pad_value

    def __call__(self, results: Sequence[InferenceResult]) -> list[InferenceResult]:
        names = list(dict.fromkeys(n for r in results for n in r))
        padded: list[InferenceResult] = [dict(r) for r in results]
        for name in names:
            arrays = [r[name] for r in results if name in r]
            shape = tuple(np.max([a.shape[1:] for a in arrays], axis=0)) if arrays[0].ndim > 1 else ()
            kinds = {a.dtype.kind for a in arrays}
            if len(kinds) > 1:
                raise PyTritonRuntimeError(f"output {name!r} has arrays of different dtypes: {kinds}")
            dtype = arrays[0].dtype
            if dtype.kind in "SU":
                dtype = max((a.dtype for a in arrays), key=lambda d: d.itemsize)
            elif any(a.dtype != dtype for a in arrays):
                raise PyTritonRuntimeError(f"output {name!r} has arrays of different dtypes")
            fill = b"" if dtype.kind in "SUO" else self.pad_value
            for r in padded:
                if name in r:
                    a = r[name]
                    widths = [(0, 0)] + [(0, b - s) for s, b in zip(a.shape[1:], shape)]
                    r[name] = np.pad(a, widths, mode="constant", constant_values=fill).astype(dtype)
        return padded


def pad_batch(wrapped: F) -> F:
    """Under :func:`batch`: repeats the last row of every input until the
    batch reaches the next preferred batch size (or ``max_batch_size``)."""

    @functools.wraps(wrapped)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        inputs = {k: v for k, v in kwargs.items() if k not in _SPECIAL_KEYS}
        config = _config()
        preferred = config.batcher.preferred_batch_size if config.batcher is not None else None
        sizes = [*sorted(preferred or []), config.max_batch_size]
        rows = _rows(inputs)
        target = sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]
        for name, value in inputs.items():
            repeats = np.ones(rows, dtype=np.int64)
            repeats[-1] += max(0, target - rows)
            kwargs[name] = np.repeat(value, repeats, axis=0)
        return wrapped(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def triton_context(wrapped: F) -> F:
    """Passes ``triton_context`` (a :class:`TritonContext`: the bound models'
    configs, ``triton_context.model_configs[infer_func]``) as a keyword
    argument."""

    @functools.wraps(wrapped)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        context = current_context()
        if context is None:
            raise PyTritonValidationError("@triton_context needs the callable to be called through Triton.bind")
        kwargs["triton_context"] = context
        return wrapped(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
