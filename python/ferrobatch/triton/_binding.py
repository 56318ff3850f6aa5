"""How a PyTriton inference callable runs as a ferrobatch model: a batch cut
into the requests it holds, the callable called with them, and the
responses checked and joined back into the batch's outputs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, cast

import numpy as np

from .._executor import RequestsFailed
from .._requests import RequestInfo
from ..specs import TensorSpec
from .constants import TRITON_CONTEXT_ATTRIBUTE
from .exceptions import PyTritonModelConfigError, PyTritonValidationError, UnrecoverableError
from .model_config import DeviceKind, ModelConfig, Tensor
from .model_config.triton_model_config import TensorSpec as TritonTensorSpec
from .model_config.triton_model_config import TritonModelConfig

__all__ = [
    "BoundModel",
    "ModelConfigDict",
    "Request",
    "TritonContext",
    "collect_outputs",
    "get_model_config",
    "get_triton_context",
    "inject_triton_context",
]

log = logging.getLogger("ferrobatch.triton")

Parameters = dict[str, str | int | float | bool]


class Request(dict[str, np.ndarray]):
    """One request as an inference callable sees it: a dict of input name to
    a numpy array whose leading dimension is the request's own rows, with
    ``parameters`` (its v2 ``parameters`` and forwarded headers). ``data``
    is the dict itself (PyTriton's ``Request.data``).

    The arrays belong to the callable (a copy of the batch's inputs):
    changing or keeping them affects nothing else.
    """

    __slots__ = ("parameters", "requested_output_names", "span")

    def __init__(
        self,
        data: Mapping[str, np.ndarray],
        parameters: Parameters | None = None,
        requested_output_names: list[str] | None = None,
    ) -> None:
        super().__init__(data)
        self.parameters: Parameters = {} if parameters is None else parameters
        self.requested_output_names = requested_output_names
        self.span: Any = None  # PyTriton's telemetry span: no tracing here

    @property
    def data(self) -> dict[str, np.ndarray]:
        return self

    def __repr__(self) -> str:
        shapes = {name: tuple(v.shape) for name, v in self.items()}
        return f"Request({shapes}, parameters={self.parameters})"


class ToSome(dict[str, Any]):
    """One response of a decoupled model's batch for some of its requests
    only: those whose first rows are ``only``."""

    def __init__(self, outputs: Mapping[str, Any], only: list[int]) -> None:
        super().__init__(outputs)
        self.only = only


class ModelConfigDict(MutableMapping[Any, TritonModelConfig]):
    """Model configs by inference callable. A callable is keyed by its
    ``str`` (a wrapper and what it wraps share it); a bound ``__call__`` by
    its object, so ``configs[model]`` and ``configs[model.__call__]`` are
    one entry. A lookup that misses tries what the key belongs to or wraps,
    then the model whose callable this thread runs."""

    def __init__(self) -> None:
        self._configs: dict[str, tuple[Any, TritonModelConfig]] = {}

    @staticmethod
    def _get_model_config_key(key: Any) -> str:
        if inspect.ismethod(key) and key.__name__ == "__call__":
            return str(key.__self__)
        return str(key)

    def __getitem__(self, key: Any) -> TritonModelConfig:
        seen: set[int] = set()
        while key is not None and id(key) not in seen:
            seen.add(id(key))
            found = self._configs.get(self._get_model_config_key(key))
            if found is not None:
                return found[1]
            owner = getattr(key, "__self__", None)
            if owner is not None and (found := self._configs.get(self._get_model_config_key(owner))) is not None:
                return found[1]
            key = getattr(key, "__wrapped__", None)
        current = current_model_config()
        if current is not None:
            return current
        raise KeyError("no model is bound to this callable")

    def __setitem__(self, key: Any, config: TritonModelConfig) -> None:
        self._configs[self._get_model_config_key(key)] = (key, config)

    def __delitem__(self, key: Any) -> None:
        del self._configs[self._get_model_config_key(key)]

    def __iter__(self) -> Iterator[Any]:
        return (key for key, _ in self._configs.values())

    def __len__(self) -> int:
        return len(self._configs)


@dataclasses.dataclass
class TritonContext:
    """PyTriton's ``TritonContext``: the model configs of the bound callables
    (``triton_context.model_configs[infer_func]``)."""

    model_configs: ModelConfigDict = dataclasses.field(default_factory=ModelConfigDict)


_local = threading.local()


def current_model_config() -> TritonModelConfig | None:
    """The config of the model whose callable this thread is running, if any."""
    config: TritonModelConfig | None = getattr(_local, "config", None)
    return config


def current_context() -> TritonContext | None:
    context: TritonContext | None = getattr(_local, "context", None)
    return context


def inject_triton_context(context: TritonContext, model_callable: Any) -> Any:
    """Gives ``model_callable`` its ``__triton_context__`` (a bound method's
    object gets it; a ``wrapt`` decorator passes it to what it wraps), where
    the decorators find it; returns the callable. :meth:`Triton.bind` does
    this for every callable it binds."""
    target = model_callable.__self__ if inspect.ismethod(model_callable) else model_callable
    try:
        setattr(target, TRITON_CONTEXT_ATTRIBUTE, context)
    except (AttributeError, TypeError):
        pass  # a callable without attributes: found through the thread running it
    return model_callable


def get_triton_context(wrapped: Any, instance: Any) -> TritonContext:
    """The context of a bound callable, from inside a decorator: the
    ``__triton_context__`` of the object it is a method of, or of the
    callable itself, or that of the model this thread runs."""
    for owner in (instance, wrapped):
        context = getattr(owner, TRITON_CONTEXT_ATTRIBUTE, None) if owner is not None else None
        if context is not None:
            return cast(TritonContext, context)
    context = current_context()
    if context is not None:
        return context
    raise PyTritonValidationError(
        "Wrapped function or object must bound with triton to get  __triton_context__ (Triton.bind sets it)"
    )


def get_model_config(wrapped: Any, instance: Any) -> TritonModelConfig:
    """The config of the bound model a decorated callable belongs to."""
    configs = get_triton_context(wrapped, instance).model_configs
    try:
        return configs[wrapped]
    except KeyError:
        if instance is None:
            raise
        return configs[instance]


#: A tensor of a binding, as declared (``Tensor``) or as the callables see it (``TensorSpec``).
AnyTensor = Tensor | TritonTensorSpec


def tensor_spec(tensor: AnyTensor, name: str) -> TensorSpec:
    """The ferrobatch spec of a PyTriton tensor (named ``name``): ``np.bytes_``
    / ``object`` is BYTES, a ``-1`` dimension is variable-length, batched
    padded (``ragged="pad"``)."""
    kind = np.dtype(tensor.dtype).kind
    dtype: Any = "bytes" if kind in "SUO" else np.dtype(tensor.dtype)
    try:
        return TensorSpec(
            name, dtype, tensor.shape, ragged="pad" if is_variable(tensor) else None, optional=tensor.optional
        )
    except ValueError as exc:
        raise PyTritonModelConfigError(f"tensor '{name}': {exc}") from None


def is_variable(tensor: AnyTensor) -> bool:
    """Variable-length along some dimension (``shape=(-1,)``, ``(3, -1)``)."""
    return -1 in tensor.shape


def variable_dims(tensor: AnyTensor) -> list[int]:
    """The positions of a tensor's ``-1`` dimensions in one row's shape."""
    return [i for i, d in enumerate(tensor.shape) if d == -1]


def numpy_dtype(tensor: AnyTensor) -> np.dtype[Any]:
    """The numpy dtype a tensor is carried in (object for BYTES)."""
    dtype = np.dtype(tensor.dtype)
    return np.dtype(object) if dtype.kind in "SUO" else dtype


#: The suffix of the lengths that come with a variable-length tensor (``ragged="pad"``).
LENGTHS = "_lengths"

#: Request parameters of the protocol itself, which Triton keeps from its models.
RESERVED_PARAMETERS = frozenset(
    {"timeout", "priority", "binary_data_output", "sequence_id", "sequence_start", "sequence_end"}
)


InferFunc = Callable[[list[Request]], Any]


class BoundModel:
    """One instance of a bound model, as a ferrobatch model callable.

    The batch's inputs are copied out of the staging slot once, cut into one
    :class:`Request` per caller (each with its own rows and parameters), and
    the callable's responses are checked and joined back into the batch's
    outputs, in request order. ``on_unrecoverable`` is called (from the
    worker thread) when the callable raises :class:`UnrecoverableError`.
    A request's parameters are its v2 ``parameters`` and forwarded headers,
    without the protocol's own (``timeout``, ``priority``,
    ``binary_data_output``...), as Triton passes them to its models.
    """

    def __init__(
        self,
        infer_func: InferFunc,
        config: TritonModelConfig,
        context: TritonContext,
        *,
        strict: bool,
        on_unrecoverable: Callable[[UnrecoverableError], None],
    ) -> None:
        self.infer_func = infer_func
        self.config = config
        #: Every declared output, in order: what a request that named none asked for.
        self._output_names = [str(t.name) for t in config.outputs or []]
        self.context = context
        self.strict = strict
        self.on_unrecoverable = on_unrecoverable
        from .decorators import _batch, _is_batch  # imported here: decorators imports this module

        # A callable with @batch in its chain concatenates its requests: as
        # behind Triton's batcher, it is called once per shape in a batch.
        self._one_shape_per_call = _is_batch(infer_func)

        # A callable whose outermost decorator is @batch concatenates the
        # requests' inputs, which are already one batch here: it is called
        # on the batch as it is (and its outputs checked once), when that is
        # what @batch would have built.
        self._whole_batch: Callable[..., Any] | None = None
        if config.batching and getattr(infer_func, "_self_wrapper", None) is _batch:
            self._whole_batch = infer_func.__wrapped__  # type: ignore[attr-defined]

    def __call__(
        self, inputs: Mapping[str, Any], requests: Sequence[RequestInfo]
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        batch = {str(t.name): _owned_array(inputs[str(t.name)]) for t in self.config.inputs or []}
        # A variable-length input comes padded to the batch's longest row:
        # each request gets its rows cut to its own longest.
        # ``[B]`` for one variable dimension, ``[B, k]`` for several.
        lengths: dict[str, tuple[np.ndarray, list[int]]] = {}
        for t in filter(is_variable, self.config.inputs or []):
            name = str(t.name)
            lengths[name] = (np.asarray(inputs[name + LENGTHS]).reshape(len(batch[name]), -1), variable_dims(t))
        rows = [r.rows for r in requests]
        if self._whole_batch is not None and _as_batch_would_build(requests, lengths):
            return self._call_whole(batch, sum(rows))
        split = []
        shapes: list[tuple[Any, ...]] = []  # each request's own shape of every input
        start = 0
        for r in requests:
            end = start + r.rows
            if lengths:
                data = {name: _cut_rows(a, start, end, lengths.get(name)) for name, a in batch.items()}
            else:
                data = {name: a[start:end] for name, a in batch.items()}
            params = {k: v for k, v in r.parameters.items() if k not in RESERVED_PARAMETERS} if r.parameters else {}
            for name in r.absent:  # optional inputs it left out: absent from its request, as in PyTriton
                data.pop(name, None)
            if not self.config.batching:  # one sample, shaped as declared: no batch dimension
                data = {name: a[0] for name, a in data.items()}
            split.append(Request(data, params, self._asked_names(r)))
            if lengths:
                shapes.append(tuple((name, a.shape[1:]) for name, a in sorted(data.items())))
            start = end
        groups = _same_shapes(shapes) if lengths and self._one_shape_per_call else [list(range(len(split)))]
        if self.config.decoupled:
            if len(groups) > 1:
                return self._stream_groups(split, rows, groups)
            return self._stream(self._call(split), rows)
        asked = [r.requested_outputs for r in requests]
        if len(groups) == 1:
            return self._collected(self._call(split), rows, asked)
        # As Triton's batcher: the callable never gets requests of different
        # shapes in one call (@batch could not concatenate them).
        responses: list[Any] = [None] * len(split)
        for group in groups:
            answered = self._call([split[i] for i in group])
            if not isinstance(answered, (list, tuple)) or len(answered) != len(group):
                return self._collected(answered, [rows[i] for i in group])  # says what is wrong with it
            for i, response in zip(group, answered):
                responses[i] = response
        return self._collected(responses, rows, asked)

    def _asked_names(self, request: RequestInfo) -> list[str]:
        """The outputs a request asked for, in declared order (every output
        when it named none, as Triton tells PyTriton's callables)."""
        asked = request.requested_outputs
        if asked is None:
            return list(self._output_names)  # the callable's own list
        return [n for n in self._output_names if n in asked]

    def _call_whole(self, batch: dict[str, np.ndarray], rows: int) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """The @batch callable's own function on the whole batch: one
        response of ``rows`` rows (a decoupled one's every yield too)."""
        from .decorators import convert_output, refuse_async

        assert self._whole_batch is not None
        with self._context_set():
            produced = refuse_async(self._whole_batch(**batch), "batch")
        if self.config.decoupled:
            if inspect.isgenerator(produced):
                return self._stream(([convert_output(item, self.config)] for item in produced), [rows])
            return self._stream(iter([[convert_output(produced, self.config)]]), [rows])
        return self._collected([convert_output(produced, self.config)], [rows])

    def _collected(
        self, responses: Any, rows: list[int], asked: Sequence[frozenset[str] | None] | None = None
    ) -> dict[str, Any]:
        if not self.config.batching and isinstance(responses, (list, tuple)):
            responses = [_with_batch_dim(r) for r in responses]
        return collect_outputs(responses, rows, self.config, strict=self.strict, asked=asked)

    def _stream(self, produced: Any, rows: list[int], joined: bool = True) -> Iterator[Any]:
        """A decoupled callable's responses: each list it yields (one
        response per request) joined into the batch's outputs (``joined``;
        else as it is). A callable that returns its responses instead of
        yielding them gives one response, as in PyTriton."""
        if not inspect.isgenerator(produced) and not isinstance(produced, Iterator):
            produced = iter([produced])
        try:
            while True:
                with self._context_set():
                    try:
                        responses = next(produced)
                    except StopIteration:
                        return
                yield self._collected(responses, rows) if joined else responses
        finally:  # closed early (every caller went away): the callable's generator too
            close = getattr(produced, "close", None)
            if close is not None:
                with self._context_set():
                    close()

    def _stream_groups(
        self, split: list[Request], rows: list[int], groups: list[list[int]]
    ) -> Iterator[dict[str, Any]]:
        """A decoupled callable on a batch of requests of different shapes:
        one call per group of one shape, in turn (as Triton's batcher would
        make them separate batches). Each response goes to its group's
        requests only (:class:`ToSome`); a group none of whose callers
        listens any more (what the executor sends back) is closed. A group
        whose call raises fails its own requests, as its own batch would,
        once every group has run; the other groups stream on."""
        starts = list(itertools.accumulate(rows, initial=0))[:-1]
        errors: dict[int, BaseException] = {}
        for group in groups:
            try:
                produced = self._call([split[i] for i in group])
                for responses in self._stream(produced, [rows[i] for i in group], joined=False):
                    full = [self._nothing(n) for n in rows]
                    for i, response in zip(group, responses):
                        full[i] = response
                    listening = yield ToSome(self._collected(full, rows), [starts[i] for i in group])
                    if listening == 0:
                        break  # closes this group's generator (the finally of _stream)
            except UnrecoverableError:
                raise  # it stops the server, whatever group raised it
            except Exception as exc:  # noqa: BLE001 - this group's failure, not the others'
                errors.update((i, exc) for i in group)
        if errors:
            raise RequestsFailed(None, errors)

    def _nothing(self, rows: int) -> dict[str, np.ndarray]:
        """A response that fills the rows of a request of another group:
        every output empty along its variable dimensions."""
        out = {}
        for t in self.config.outputs or []:
            shape = (rows, *(0 if d == -1 else d for d in t.shape))
            dtype = numpy_dtype(t)
            out[str(t.name)] = np.full(shape, b"", dtype=object) if dtype.kind == "O" else np.zeros(shape, dtype)
        return out

    def _call(self, requests: list[Request]) -> Any:
        with self._context_set():
            return _awaited(self.infer_func(requests))

    @contextlib.contextmanager
    def _context_set(self) -> Iterator[None]:
        """The callable's model config and context for this thread (what
        ``get_model_config`` and ``get_triton_context`` read) while it runs;
        an :class:`UnrecoverableError` it raises stops the server."""
        _local.config, _local.context = self.config, self.context
        try:
            yield
        except UnrecoverableError as exc:
            log.error("model '%s': unrecoverable error, shutting down: %s", self.config.model_name, exc)
            self.on_unrecoverable(exc)
            raise
        finally:
            _local.config = _local.context = None


def _thread_loop() -> asyncio.AbstractEventLoop:
    """This worker thread's event loop for async inference callables: one
    per thread, kept across batches (``asyncio.run`` would build and close
    one per batch)."""
    loop: asyncio.AbstractEventLoop | None = getattr(_local, "loop", None)
    if loop is None or loop.is_closed():
        loop = _local.loop = asyncio.new_event_loop()
    return loop


def _awaited(produced: Any) -> Any:
    """What an inference callable returned, a coroutine awaited and an async
    generator made a generator, on this thread's loop (PyTriton takes
    coroutine and async generator callables)."""
    if inspect.iscoroutine(produced):
        return _thread_loop().run_until_complete(produced)
    if inspect.isasyncgen(produced):
        return _iterated(produced)
    return produced


def _iterated(produced: Any) -> Iterator[Any]:
    """An async generator's items, each awaited on this thread's loop;
    closing this generator (a stream whose callers went away) closes it."""
    try:
        while True:
            try:
                yield _thread_loop().run_until_complete(produced.__anext__())
            except StopAsyncIteration:
                return
    finally:
        _thread_loop().run_until_complete(produced.aclose())


def _same_shapes(shapes: Sequence[tuple[Any, ...]]) -> list[list[int]]:
    """The requests' indices grouped by their inputs' shapes, each group in
    request order, groups in the order of their first request."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, shape in enumerate(shapes):
        groups.setdefault(shape, []).append(i)
    return list(groups.values())


def _as_batch_would_build(requests: Sequence[RequestInfo], lengths: Mapping[str, tuple[np.ndarray, list[int]]]) -> bool:
    """Whether @batch, given the batch's requests one by one, would build
    the batch as it is: every request carries every input, and every row of
    a variable-length input has the batch's length (requests of other
    lengths go one by one: @batch refuses them, as PyTriton's does)."""
    if any(r.absent for r in requests):
        return False
    return all(bool((own == own[:1]).all()) for own, _ in lengths.values())


def _with_batch_dim(response: Any) -> Any:
    """A non-batching model's response with the one row the batch holds it as."""
    if not isinstance(response, Mapping):
        return response  # collect_outputs says what is wrong with it
    return {name: np.expand_dims(np.asarray(value), 0) for name, value in response.items()}


def _cut_rows(array: np.ndarray, start: int, end: int, lengths: tuple[np.ndarray, list[int]] | None) -> np.ndarray:
    """A request's rows of a batch input, each variable dimension cut to the
    request's own longest (its rows share their lengths over the wire)."""
    rows = array[start:end]
    if lengths is None:
        return rows
    own, dims = lengths
    longest = own[start:end].max(axis=0, initial=0)
    box = [slice(None)] * rows.ndim
    for j, d in enumerate(dims):
        box[1 + d] = slice(0, int(longest[j]))
    return rows[tuple(box)]


def _owned_array(value: Any) -> np.ndarray:
    """A copy of one input's batch as a numpy array (the staging slot it
    views is reused once the model returns)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    array: np.ndarray = value.numpy().copy()
    return array


def collect_outputs(
    responses: Any,
    rows: Sequence[int],
    config: TritonModelConfig,
    *,
    strict: bool,
    asked: Sequence[frozenset[str] | None] | None = None,
) -> dict[str, np.ndarray]:
    """The batch's outputs from one response per request (``rows[i]`` rows
    each), checked as PyTriton checks them: a list of dicts of numpy arrays,
    one per request. With ``strict``, every returned output must be declared,
    of its dtype and shape (``-1``: any length); without, undeclared ones
    are dropped and numbers and bools are cast to the declared dtype, as
    PyTriton's ``astype`` does (strings and numbers are refused). Either way
    each declared output must come back with the request's rows, unless
    ``asked[i]`` (the outputs request ``i`` asked for; None: every one)
    leaves it out: it is never sent, and stands as zeros (empty rows).
    Raises :class:`PyTritonValidationError` saying what was wrong."""
    if not isinstance(responses, (list, tuple)):
        raise PyTritonValidationError(
            "the inference callable must return a list of dicts of numpy arrays,"
            f" one per request; it returned {type(responses).__name__}"
        )
    if len(responses) != len(rows):
        raise PyTritonValidationError(
            f"the inference callable returned {len(responses)} responses for {len(rows)} requests"
        )
    declared = {str(t.name): t for t in config.outputs or []}
    parts: dict[str, list[np.ndarray]] = {n: [] for n in declared}
    for i, (response, n) in enumerate(zip(responses, rows)):
        if not isinstance(response, (dict, Mapping)):  # dict first: no ABC check for the common case
            raise PyTritonValidationError(
                f"response {i} is a {type(response).__name__}, expected a dict of numpy arrays"
            )
        if strict:
            unknown = sorted(str(k) for k in response if k not in declared)
            if unknown:
                raise PyTritonValidationError(
                    f"the inference callable returned outputs {unknown} that are not declared"
                    f" (outputs: {sorted(declared)})"
                )
        wanted = None if asked is None else asked[i]
        for out_name, tensor in declared.items():
            if out_name not in response:
                if wanted is not None and out_name not in wanted:
                    parts[out_name].append(_unsent(tensor, n))
                    continue
                raise PyTritonValidationError(
                    f"response {i} has no output '{out_name}' (it has {sorted(map(str, response))}): ferrobatch"
                    " sends every output a request asks for (every declared one when it names none), so"
                    " the response must hold them (PyTriton sends only those a response holds)"
                )
            parts[out_name].append(_checked(response[out_name], tensor, n, strict))
    outputs: dict[str, np.ndarray] = {}
    for out_name, arrays in parts.items():
        if is_variable(declared[out_name]):
            outputs[out_name], outputs[out_name + LENGTHS] = _padded(arrays, variable_dims(declared[out_name]))
        else:
            outputs[out_name] = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return outputs


def _padded(arrays: Sequence[np.ndarray], dims: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each request's ``[rows, *shape]`` joined into one batch padded to the
    longest along each variable dimension (``dims``, positions in a row's
    shape), and each row's lengths along them (``[B]`` for one, ``[B, k]``)."""
    longest = [max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim)]
    total = sum(a.shape[0] for a in arrays)
    first = arrays[0]
    pad: Any = b"" if first.dtype == object else 0  # BYTES pad with empty strings
    joined = np.full((total, *longest), pad, dtype=first.dtype)
    lengths = np.empty((total, len(dims)), dtype=np.int64)
    start = 0
    for a in arrays:
        box = (slice(start, start + a.shape[0]), *(slice(0, n) for n in a.shape[1:]))
        joined[box] = a
        lengths[start : start + a.shape[0]] = [a.shape[1 + d] for d in dims]
        start += a.shape[0]
    return joined, lengths[:, 0] if len(dims) == 1 else lengths


def _unsent(tensor: AnyTensor, rows: int) -> np.ndarray:
    """Rows of an output the request did not ask for: zeros (empty along a
    variable dimension, empty bytes for BYTES), never sent."""
    shape = (rows, *(0 if d == -1 else d for d in tensor.shape))
    want = numpy_dtype(tensor)
    if want.kind == "O":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, dtype=want)


def _checked(value: Any, tensor: AnyTensor, rows: int, strict: bool) -> np.ndarray:
    if (
        type(value) is np.ndarray
        and value.dtype == tensor.dtype
        and value.shape[1:] == tensor.shape
        and value.shape[:1] == (rows,)
    ):
        return value  # the common case: exactly as declared
    name = tensor.name
    if not isinstance(value, np.ndarray):
        raise PyTritonValidationError(f"output '{name}' is a {type(value).__name__}, expected a numpy array")
    array: np.ndarray = value
    want = numpy_dtype(tensor)
    if array.dtype.kind not in "biufOSU":
        raise PyTritonValidationError(
            f"output '{name}' has dtype {array.dtype}; only bool, numeric and bytes arrays are served"
        )
    if array.dtype != want:
        strings = array.dtype.kind in "OSU"
        if strict and not strings:
            raise PyTritonValidationError(
                f"output '{name}' has an invalid dtype: returned {array.dtype}, declared {want}"
            )
        if strings != (want.kind == "O"):
            raise PyTritonValidationError(
                f"output '{name}' has an invalid dtype: returned {array.dtype}, declared {want}"
                " (strings and numbers do not cast to each other)"
            )
        # Not strict: numbers and bools cast to the declared dtype whatever
        # they lose (float64 1.7 -> int32 1), as PyTriton's astype does.
        if array.dtype.kind == "U":  # BYTES carries bytes: text is sent UTF-8
            array = np.char.encode(array, "utf-8")
        array = np.asarray(array, dtype=want)
    shape = tuple(array.shape)
    if not shape or shape[0] != rows:
        raise PyTritonValidationError(
            f"output '{name}' has shape {shape}; expected {rows} rows (the request's batch dimension) first"
        )
    sample = shape[1:]
    if len(sample) != len(tensor.shape) or any(d != want_d != -1 for d, want_d in zip(sample, tensor.shape)):
        raise PyTritonValidationError(
            f"output '{name}' has an invalid shape: returned {sample} per row, declared {tensor.shape}"
        )
    return array


def model_config_of(
    model_name: str,
    model_version: int,
    config: ModelConfig,
    inputs: Sequence[Tensor],
    outputs: Sequence[Tensor],
    instances: int,
) -> TritonModelConfig:
    """The :class:`TritonModelConfig` of a binding, with every tensor named
    (``INPUT_<i>`` / ``OUTPUT_<i>`` from 1 when unnamed, as PyTriton does)."""

    def named(tensors: Sequence[Tensor], prefix: str) -> list[TritonTensorSpec]:
        return [
            TritonTensorSpec(t.name or f"{prefix}_{i}", tuple(t.shape), t.dtype, t.optional)
            for i, t in enumerate(tensors, 1)
        ]

    return TritonModelConfig(
        model_name=model_name,
        model_version=model_version,
        max_batch_size=config.max_batch_size if config.batching else 0,
        batching=config.batching,
        batcher=config.batcher,
        instance_group={DeviceKind.KIND_CPU: instances},
        decoupled=config.decoupled,
        inputs=named(inputs, "INPUT"),
        outputs=named(outputs, "OUTPUT"),
        response_cache=config.response_cache,
    )
