"""PyTriton's inference-callable decorators (``pytriton.decorators``).

An undecorated inference callable takes a list of requests (mappings of
input name to numpy array, each with its own leading batch dimension) and
returns one dict of numpy arrays per request. The decorators adapt other
shapes of callable to that:

- :func:`batch`: the requests' inputs concatenated into one batch, passed as
  keyword arguments; the outputs (a dict, or a list/tuple in the declared
  outputs' order) split back by each request's rows. A generator callable
  (a decoupled model's) yields such outputs, each split the same way;
- :func:`sample`: each request's inputs as keyword arguments, one call per
  request (PyTriton's non-batching models see one request per call);
- :func:`fill_optionals`: the optional inputs a request left out, filled
  with defaults (repeated to the request's rows);
- :func:`first_value`: the named inputs replaced by their first value (a
  scalar when it has one element), checking that all values are equal;
- :func:`group_by_values`: under :func:`batch`, one call per group of rows
  whose values of the named inputs are equal, joined back in row order;
- :func:`group_by_keys`, :func:`pad_batch`, :func:`triton_context`, and
  :class:`ConstantPadder` (a ``pad_fn`` for :func:`group_by_values`).

The decorators are ``wrapt`` decorators, as PyTriton's: they work on
functions, methods and callable objects, stack in any order that makes
sense, and each finds the bound model's config through the callable's
``__triton_context__`` (:func:`get_model_config`), which
:meth:`Triton.bind <ferrobatch.triton.triton.Triton.bind>` sets.
"""

from __future__ import annotations

import bisect
import inspect
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import wrapt

from ._binding import ModelConfigDict, Request, TritonContext, get_model_config, get_triton_context
from .constants import TRITON_CONTEXT_FIELD_NAME
from .exceptions import PyTritonBadParameterError, PyTritonRuntimeError, PyTritonValidationError
from .model_config.triton_model_config import TritonModelConfig

__all__ = [
    "ConstantPadder",
    "InferenceRequest",
    "InferenceRequests",
    "InferenceResult",
    "InferenceResults",
    "InputNames",
    "ModelConfigDict",
    "TritonContext",
    "batch",
    "fill_optionals",
    "first_value",
    "get_model_config",
    "get_triton_context",
    "group_by_keys",
    "group_by_values",
    "pad_batch",
    "sample",
    "triton_context",
]

F = TypeVar("F", bound=Callable[..., Any])
InferenceRequest = Request
InferenceRequests = list[Request]
InferenceResult = dict[str, np.ndarray]
InferenceResults = list[InferenceResult]
InputNames = list[str]

#: Keyword arguments that are no input (the context :func:`triton_context` adds).
_SPECIAL_KEYS = frozenset({TRITON_CONTEXT_FIELD_NAME, "__triton_context__"})

#: ``wrapt.decorator``, typed: ``wrapper(wrapped, instance, args, kwargs)``
#: becomes a decorator that keeps the decorated callable's type.
_Wrapper = Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any]
_decorator = cast(Callable[[_Wrapper], Callable[[F], F]], wrapt.decorator)


def _rows(request: Mapping[str, Any]) -> int:
    """A request's batch size: the leading dimension of its first input."""
    return int(next(iter(request.values())).shape[0])


def _requests(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Sequence[Any]]:
    """What comes before the requests (passed through), and the requests:
    the last positional argument."""
    if not args:
        raise PyTritonBadParameterError("an inference callable is called with its list of requests")
    return args[:-1], args[-1]


def convert_output(outputs: Any, model_config: TritonModelConfig | None = None) -> InferenceResult:
    """A callable's result as a dict: a list or tuple is named by the
    declared outputs, in order (which ``model_config`` gives)."""
    if isinstance(outputs, Mapping):
        return dict(outputs)
    if isinstance(outputs, (list, tuple)):
        if model_config is None:
            raise PyTritonValidationError("naming a list of outputs needs the model's config: bind the callable")
        declared = model_config.outputs or []
        if len(outputs) != len(declared):
            raise PyTritonValidationError(
                "Outputs length different than config outputs length"
                f" (the callable returned {len(outputs)} outputs; the model declares {len(declared)})"
            )
        return {str(t.name): value for t, value in zip(declared, outputs)}
    raise PyTritonValidationError(f"Unsupported output type {type(outputs)}.")


def _config_or_none(wrapped: Any, instance: Any) -> TritonModelConfig | None:
    try:
        return get_model_config(wrapped, instance)
    except (PyTritonValidationError, KeyError):
        return None


def refuse_async(outputs: Any, decorator: str) -> Any:
    """``outputs`` unless a coroutine or async generator: as PyTriton's, the
    decorators that read what their function returns call it synchronously
    (only an undecorated inference callable, or one under pass-through
    decorators, may be async)."""
    if inspect.iscoroutine(outputs) or inspect.isasyncgen(outputs):
        close = getattr(outputs, "close", None)
        if close is not None:
            close()  # no "never awaited" warning
        raise PyTritonValidationError(
            f"@{decorator} calls the function it wraps synchronously, as PyTriton's does; it returned"
            f" {type(outputs).__name__}: make that function a plain one (or a generator), or leave the async"
            " inference callable undecorated"
        )
    return outputs


def _batch(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """:func:`batch`: concatenates the requests' inputs into one batch per input and calls
    ``wrapped(**inputs)``; splits what it returns back into one response per
    request, by each request's rows. Every request must carry the same
    inputs (:func:`group_by_keys` first otherwise). A generator callable
    gives a generator of such lists of responses."""
    prefix, requests = _requests(args)
    names = list(requests[0].keys())
    for request in requests[1:]:
        if set(request.keys()) != set(names):
            raise PyTritonValidationError("Cannot batch requests with different set of inputs keys")
    inputs = {n: requests[0][n] if len(requests) == 1 else np.concatenate([r[n] for r in requests]) for n in names}
    sizes = [_rows(r) for r in requests]
    outputs = refuse_async(wrapped(*prefix, **kwargs, **inputs), "batch")

    def split(result: Any) -> InferenceResults:
        named = convert_output(result, None if isinstance(result, Mapping) else _config_or_none(wrapped, instance))
        total = sum(sizes)
        wrong = {n: tuple(np.shape(v)) for n, v in named.items() if np.ndim(v) == 0 or len(v) != total}
        if wrong:
            shapes = ", ".join(f"{n}: {shape}" for n, shape in wrong.items())
            raise ValueError(
                f"Received output tensors with different batch sizes: {shapes}. Expected batch size: {total}. "
            )
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [{n: v[lo:hi] for n, v in named.items()} for lo, hi in itertools.pairwise(bounds)]

    if inspect.isgenerator(outputs):
        generated: Iterator[Any] = outputs
        return (split(result) for result in generated)
    return split(outputs)


batch = _decorator(_batch)


def _is_batch(func: Any) -> bool:
    """Whether :func:`batch` is anywhere in ``func``'s chain of wrappers."""
    seen: set[int] = set()
    while func is not None and id(func) not in seen:
        seen.add(id(func))
        if getattr(func, "_self_wrapper", None) is _batch:
            return True
        func = getattr(func, "__wrapped__", None)
    return False


@_decorator
def sample(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls ``wrapped(**request)`` for each request and returns its result
    (a dict, or a list/tuple in the declared outputs' order) as that
    request's response."""
    prefix, requests = _requests(args)
    config = _config_or_none(wrapped, instance)
    return [
        convert_output(refuse_async(wrapped(*prefix, **{**kwargs, **request}), "sample"), config)
        for request in requests
    ]


@_decorator
def group_by_keys(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Calls ``wrapped`` once per group of requests with the same set of
    inputs, and returns the responses in the requests' order."""
    prefix, requests = _requests(args)
    keyed = sorted(enumerate(requests), key=lambda item: tuple(sorted(item[1].keys())))
    results: list[tuple[int, InferenceResult]] = []
    for _, group in itertools.groupby(keyed, key=lambda item: tuple(sorted(item[1].keys()))):
        members = list(group)
        out = refuse_async(wrapped(*prefix, [r for _, r in members], **kwargs), "group_by_keys")
        results.extend(zip((i for i, _ in members), out))
    return [r for _, r in sorted(results, key=operator.itemgetter(0))]


def fill_optionals(**defaults: Any) -> Callable[[F], F]:
    """Fills the inputs a request left out (declared ``optional=True``) with
    ``defaults`` (numpy arrays of one sample's shape and the input's dtype),
    repeated to the request's rows; a non-batching model's request gets the
    default as it is. Checked against the bound model's inputs at each call
    (:class:`PyTritonBadParameterError`)."""

    def check(config: TritonModelConfig) -> None:
        # PyTriton's checks, in its order and words.
        specs = {str(t.name): t for t in config.inputs or []}
        unknown = sorted(set(defaults) - set(specs))
        if unknown:
            raise PyTritonBadParameterError(f"Could not found {', '.join(unknown)} inputs")
        not_arrays = [f"{name}={value}" for name, value in defaults.items() if not isinstance(value, np.ndarray)]
        if not_arrays:
            raise PyTritonBadParameterError(
                f"Could not use {', '.join(not_arrays)} defaults as they are not NumPy arrays"
            )
        dtypes = [
            f"{name}: dtype={value.dtype} expected_dtype={specs[name].dtype}"
            for name, value in defaults.items()
            if value.dtype != np.dtype(specs[name].dtype)
        ]
        if dtypes:
            raise PyTritonBadParameterError(
                f"Could not use {', '.join(dtypes)} defaults as they have different than input signature dtypes"
            )

        def fits(shape: tuple[int, ...], declared: tuple[int, ...]) -> bool:
            return len(shape) == len(declared) and all(d == -1 or s == d for s, d in zip(shape, declared))

        shapes = [
            f"{name}: shape={value.shape} expected_shape={tuple(specs[name].shape)}"
            for name, value in defaults.items()
            if not fits(value.shape, tuple(specs[name].shape))
        ]
        if shapes:
            raise PyTritonBadParameterError(
                f"Could not use {', '.join(shapes)} defaults as they have different than input signature shapes"
            )

    @_decorator
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config = get_model_config(wrapped, instance)
        check(config)
        _, requests = _requests(args)
        for request in requests:
            rows = _rows(request) if config.batching and len(request) else 1
            for name, value in defaults.items():
                if name not in request:
                    request[name] = np.repeat(value[np.newaxis], rows, axis=0) if config.batching else value.copy()
        return wrapped(*args, **kwargs)

    return wrapper


def first_value(*keys: str, squeeze_single_values: bool = True, strict: bool = True) -> Callable[[F], F]:
    """Replaces the inputs ``keys`` by their first value (row 0).

    Under :func:`batch` it rewrites the keyword arguments; on an undecorated
    callable, each request. With ``squeeze_single_values`` (default) a first
    value of one element becomes a numpy scalar. With ``strict`` (default)
    all the values must be equal (:class:`PyTritonRuntimeError` otherwise).
    """
    special = sorted(set(keys) & _SPECIAL_KEYS)
    if special:
        raise PyTritonBadParameterError(
            f"The keys {', '.join(special)} are not allowed as keys for @first_value wrapper."
            f" The set of not allowed keys are {', '.join(sorted(_SPECIAL_KEYS))}"
        )

    def replace(request: Any) -> Any:
        for name in keys:
            if name not in request:
                continue
            values = request[name]
            if strict and len(values) > 1:
                uniques = np.unique(values, axis=None if values.dtype == object else 0)
                if len(uniques) > 1:
                    raise PyTritonRuntimeError(
                        f"The values on the {name!r} input are not equal. To proceed, either disable strict mode"
                        " in @first_value wrapper or ensure that the values always are consistent. The current"
                        f" values of {name!r} are {values!r}."
                    )
            first = values[0]
            if squeeze_single_values and not np.isscalar(first) and all(d == 1 for d in np.shape(first)):
                first = np.squeeze(first)[()]
            request[name] = first
        return request

    @_decorator
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config = _config_or_none(wrapped, instance)
        if config is not None and not config.batching:
            raise PyTritonRuntimeError("The @first_value decorator can only be used with models that support batching.")
        if set(kwargs) - _SPECIAL_KEYS:
            return wrapped(*args, **replace(kwargs))
        prefix, requests = _requests(args)
        return wrapped(*prefix, [replace(r) for r in requests], **kwargs)

    return wrapper


def _value_key(value: Any) -> Any:
    """A row's grouping key, as PyTriton's: a scalar row by its value (0.0
    and -0.0 one group, each NaN its own), an array row by its bytes (BYTES
    serialized length-prefixed), so groups come in the same order."""
    if not isinstance(value, np.ndarray):
        return value
    if value.dtype.kind in "OS":
        items = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in value.flat]
        body = b"".join(len(v).to_bytes(4, "little") + v for v in items)
        return len(body).to_bytes(4, "little") + body if items else b""
    return value.tobytes()


def group_by_values(
    *keys: str, pad_fn: Callable[[Sequence[InferenceResult]], Sequence[InferenceResult]] | None = None
) -> Callable[[F], F]:
    """Under :func:`batch`: splits the batch into groups of rows whose values
    of the inputs ``keys`` are equal, calls the callable once per group, and
    puts the outputs back in row order. ``pad_fn`` (e.g.
    :class:`ConstantPadder`) makes the groups' outputs one shape first."""

    @_decorator
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:  # a list of requests: this decorator sits above @batch
            raise PyTritonRuntimeError("The @group_by_values decorator must be used after the @batch decorator.")
        request = {k: v for k, v in kwargs.items() if k not in _SPECIAL_KEYS}
        other = {k: v for k, v in kwargs.items() if k in _SPECIAL_KEYS}
        rows = _rows(request)
        keyed = sorted(
            ((i, tuple(_value_key(request[k][i]) for k in keys)) for i in range(rows)),
            key=operator.itemgetter(1),
        )
        config = _config_or_none(wrapped, instance)
        groups: list[tuple[np.ndarray, InferenceResult]] = []
        for _, group in itertools.groupby(keyed, key=operator.itemgetter(1)):
            index = np.array([i for i, _ in group], dtype=np.intp)
            part = {name: value[index] for name, value in request.items()}
            produced = refuse_async(wrapped(**part, **other), "group_by_values")
            groups.append((index, convert_output(produced, config)))
        results = [r for _, r in groups]
        if pad_fn is not None:
            results = list(pad_fn(results))
        first = results[0]
        merged = {name: np.zeros((rows, *v.shape[1:]), dtype=v.dtype) for name, v in first.items()}
        for (index, _), result in zip(groups, results):
            for name, v in result.items():
                merged[name][index] = v
        return merged

    def decorate(wrapped: F) -> F:
        if _is_batch(wrapped):
            raise PyTritonRuntimeError("The @group_by_values decorator must be used after the @batch decorator.")
        return wrapper(wrapped)

    return decorate


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
                raise PyTritonRuntimeError("All input arrays for given input name must have the same dtype.")
            dtype = arrays[0].dtype
            if dtype.kind in "SU":
                dtype = max((a.dtype for a in arrays), key=lambda d: d.itemsize)
            elif any(a.dtype != dtype for a in arrays):
                raise PyTritonRuntimeError("All input arrays for given input name must have the same dtype.")
            fill = b"" if dtype.kind in "SUO" else self.pad_value
            for r in padded:
                if name in r:
                    a = r[name]
                    widths = [(0, 0)] + [(0, b - s) for s, b in zip(a.shape[1:], shape)]
                    r[name] = np.pad(a, widths, mode="constant", constant_values=fill).astype(dtype)
        return padded


@_decorator
def pad_batch(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Under :func:`batch`: repeats the last row of every input until the
    batch reaches the next preferred batch size (or ``max_batch_size``)."""
    inputs = {k: v for k, v in kwargs.items() if k not in _SPECIAL_KEYS}
    config = get_model_config(wrapped, instance)
    preferred = config.batcher.preferred_batch_size if config.batcher is not None else None
    sizes = [*sorted(preferred or []), config.max_batch_size]
    rows = _rows(inputs)
    target = sizes[min(bisect.bisect_left(sizes, rows), len(sizes) - 1)]
    for name, value in inputs.items():
        repeats = np.ones(rows, dtype=np.int64)
        repeats[-1] += max(0, target - rows)
        kwargs[name] = np.repeat(value, repeats, axis=0)
    return wrapped(*args, **kwargs)


@_decorator
def triton_context(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Passes ``triton_context`` (a :class:`TritonContext`: the bound models'
    configs, ``triton_context.model_configs[infer_func]``) as a keyword
    argument. Works on functions, methods, callable objects and classes
    (their ``__init__`` gets it)."""
    kwargs[TRITON_CONTEXT_FIELD_NAME] = get_triton_context(wrapped, instance)
    return wrapped(*args, **kwargs)
