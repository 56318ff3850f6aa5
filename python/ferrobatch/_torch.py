"""Everything that touches torch on the worker side: devices, staging memory,
input coercion, batch buckets and warm-up batches, running a model on a
collated batch and checking its outputs. What every executor shares is in
``_executor``; the CUDA executor is in ``_cuda``."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from ._executor import Executor, RequestsFailed
from ._requests import RequestInfo
from .errors import InvalidInputError, ModelError
from .specs import TensorSpec, nested_key

Model = Callable[[dict[str, torch.Tensor]], Any]
Outputs = dict[str, torch.Tensor]

log = logging.getLogger("ferrobatch")


def resolve_device(model: Model, device: str | torch.device | None) -> torch.device:
    """The device a model instance runs on: the one given, else its parameters'."""
    if device is not None:
        return torch.device(device)
    if isinstance(model, torch.nn.Module):
        for param in model.parameters():
            return param.device
        for buffer in model.buffers():
            return buffer.device
    return torch.device("cpu")


def resolve_instances(
    model: Model | Sequence[Model],
    device: str | torch.device | None | Sequence[str | torch.device | None],
) -> tuple[list[Model], list[torch.device]]:
    """The model instances and the device of each.

    ``model`` may be one callable or a list (one per instance); ``device`` one
    device for every instance or a list (one per instance). With one model and
    a list of devices, a ``torch.nn.Module`` is copied once per distinct device
    (instances on the same device share one copy, each with its own stream);
    another callable is shared as is. A module is moved to a device given
    explicitly.
    """
    models: list[Model] = list(model) if isinstance(model, (list, tuple)) else [model]  # type: ignore[list-item]
    if not models or not all(callable(m) for m in models):
        raise TypeError("model must be a callable or a non-empty list of callables")
    if isinstance(device, (list, tuple)):
        devices: list[str | torch.device | None] = list(device)
        if not devices:
            raise ValueError("device must not be an empty list")
        if len(models) == 1:
            models = models * len(devices)
        elif len(models) != len(devices):
            raise ValueError(f"{len(models)} models but {len(devices)} devices; give one device per model")
    else:
        devices = [device] * len(models)  # type: ignore[list-item]
    resolved = [resolve_device(m, d) for m, d in zip(models, devices)]
    for dev in resolved:
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {dev} was asked for, but CUDA is not available here")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {dev} was asked for, but there are {torch.cuda.device_count()} GPUs")
    # One copy of a shared module per device it is asked to run on.
    placed: dict[tuple[int, torch.device], Model] = {}
    for i, (m, wanted, dev) in enumerate(zip(models, devices, resolved)):
        if not isinstance(m, torch.nn.Module) or wanted is None:
            continue
        key = (id(m), dev)
        if key not in placed:
            first_use = all(k[0] != id(m) for k in placed)
            placed[key] = (m if first_use else copy.deepcopy(m)).to(dev)
        models[i] = placed[key]
    return models, resolved


def pinned_memory_available() -> bool:
    return torch.cuda.is_available()


def allocate_slot(specs: Sequence[TensorSpec], max_batch_size: int, pin: bool) -> list[torch.Tensor]:
    """One staging slot: a (max_batch_size, *shape) tensor per input, pinned if
    asked and CUDA is there. Zeroed, so rows past a batch (padding up to a
    bucket) always hold valid inputs: zeros or an earlier request's."""
    pin = pin and pinned_memory_available()
    return [torch.zeros((max_batch_size, *s.shape), dtype=s.torch_dtype, pin_memory=pin) for s in specs]


def batch_buckets(max_batch_size: int, preferred_batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """The batch sizes a padded batch is rounded up to (CUDA graphs, ``compile``):
    the preferred sizes if any, else the powers of two below ``max_batch_size``;
    and ``max_batch_size`` itself, so every batch has a bucket."""
    if preferred_batch_sizes:
        sizes = set(preferred_batch_sizes)
    else:
        sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size}
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def padding_table(buckets: Sequence[int]) -> list[int]:
    """``table[rows]``: the smallest bucket that holds ``rows`` rows."""
    table = [0] * (max(buckets) + 1)
    it = iter(sorted(buckets))
    bucket = next(it)
    for rows in range(1, len(table)):
        while bucket < rows:
            bucket = next(it)
        table[rows] = bucket
    return table


WarmupBatch = Callable[[int], dict[str, torch.Tensor]]


def check_warmup_names(specs: Sequence[TensorSpec], samples: Any) -> None:
    """``InvalidInputError`` unless ``samples`` maps exactly the model's inputs."""
    if not isinstance(samples, Mapping):
        raise InvalidInputError(f"warmup must be a dict of input name to sample(s), got {type(samples).__name__}")
    names = [s.name for s in specs]
    extra = sorted(set(map(str, samples)) - set(names))
    if extra:
        raise InvalidInputError(f"warmup has unexpected inputs {extra}; the model takes {names}")
    missing = [name for name in names if name not in samples]
    if missing:
        raise InvalidInputError(f"warmup is missing input '{missing[0]}'")


def warmup_batches(specs: Sequence[TensorSpec], samples: Mapping[str, Any] | None) -> WarmupBatch:
    """A function ``rows -> {input: (rows, *shape) CPU tensor}`` for warm-up.

    With ``samples=None`` every input is zeros. Otherwise ``samples`` maps each
    input to one sample (the spec's shape) or to ``n`` samples (leading
    dimension ``n``), which are repeated to fill the batch. Raises
    :class:`InvalidInputError` if a sample does not match its spec.
    """
    if samples is None:

        def zeros(rows: int) -> dict[str, torch.Tensor]:
            return {s.name: torch.zeros((rows, *s.shape), dtype=s.torch_dtype) for s in specs}

        return zeros
    check_warmup_names(specs, samples)
    base: dict[str, torch.Tensor] = {}
    for spec in specs:
        value = torch.as_tensor(samples[spec.name]).cpu()
        if value.dtype != spec.torch_dtype:
            raise InvalidInputError(f"warmup input '{spec.name}': expected dtype {spec.dtype}, got {value.dtype}")
        if tuple(value.shape) == spec.shape:
            value = value.unsqueeze(0)
        if tuple(value.shape[1:]) != spec.shape or value.shape[0] == 0:
            raise InvalidInputError(
                f"warmup input '{spec.name}': expected shape {spec.shape} or (n, *{spec.shape}),"
                f" got {tuple(value.shape)}"
            )
        base[spec.name] = value.contiguous()

    def repeated(rows: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in base.items():
            index = torch.arange(rows) % value.shape[0]
            out[name] = value.index_select(0, index)
        return out

    return repeated


def fill_slot(slot: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> None:
    """Writes a warm-up batch into the first rows of a staging slot."""
    for name, t in slot.items():
        t[: batch[name].shape[0]].copy_(batch[name])


def compile_model(model: Model, options: bool | Mapping[str, Any]) -> Model:
    """``torch.compile(model, **options)``, or the model itself when ``options`` is False."""
    if options is False:
        return model
    kwargs = dict(options) if isinstance(options, Mapping) else {}
    compiled: Model = torch.compile(model, **kwargs)
    return compiled


def make_coerce(specs: Sequence[TensorSpec]) -> Callable[[Any, int, bool], Any]:
    """The slow-path converter the Rust side calls for inputs that are neither a
    torch tensor nor a buffer-protocol object: DLPack producers.

    Returns a CPU or CUDA torch tensor, or a numpy array, viewing the
    producer's memory (the Rust side checks its dtype, device and shape, then
    copies it); raises :class:`InvalidInputError` naming the input otherwise.
    """

    def coerce(value: Any, index: int, batched: bool) -> Any:
        name = specs[index].name
        if not isinstance(value, type):
            try:
                # A buffer the Rust side cannot take: a 0-d one (no shape),
                # a numpy scalar array among them (which has __dlpack__ too).
                view = memoryview(value)
            except Exception:  # noqa: BLE001 - not a buffer
                pass
            else:
                import numpy as np

                array = np.array(view, copy=True)
                if not array.dtype.isnative:  # as the Rust side words it for larger arrays
                    endian = "big" if array.dtype.byteorder == ">" else "little"
                    raise InvalidInputError(
                        f"input '{name}': expected dtype {specs[index].dtype}, got {endian}-endian"
                        f" {array.dtype.newbyteorder('=').name} (non-native byte order;"
                        f" convert with .astype('={array.dtype.char}'))"
                    )
                return torch.from_numpy(array)
        if isinstance(value, type) or not hasattr(value, "__dlpack__"):
            what = f"the class {value.__qualname__}" if isinstance(value, type) else type(value).__name__
            raise InvalidInputError(
                f"input '{name}': expected a torch tensor, numpy array, or an object "
                f"with the buffer protocol or __dlpack__, got {what}"
            )
        try:
            return torch.utils.dlpack.from_dlpack(value)
        except Exception as torch_error:
            # torch cannot view some layouts (negative strides): numpy can.
            import numpy as np

            try:
                return np.from_dlpack(value)
            except Exception:  # noqa: BLE001
                pass
            raise InvalidInputError(
                f"input '{name}': reading it through __dlpack__ failed: {type(torch_error).__name__}: {torch_error}"
            ) from torch_error

    return coerce


def normalize_outputs(raw: Any, specs: Sequence[TensorSpec], rows: int) -> dict[str, torch.Tensor]:
    """Checks what the model returned and maps it to ``{name: (rows, *shape) tensor}``.

    The model may return a dict, a single tensor (one output) or a tuple/list in
    spec order; any tensor may also be a numpy array (taken without a copy
    where numpy and torch can share it). Anything else is a
    :class:`ModelError` saying what was wrong.
    """
    if type(raw) is dict:  # the usual answer, before the slower Mapping check
        named: Mapping[str, Any] = raw
    elif isinstance(raw, (torch.Tensor, np.ndarray)):
        if len(specs) != 1:
            raise ModelError(
                f"model returned one tensor but {len(specs)} outputs are declared: "
                f"{', '.join(repr(s.name) for s in specs)}; return a dict or a tuple"
            )
        named = {specs[0].name: raw}
    elif isinstance(raw, Mapping):
        named = raw
    elif isinstance(raw, (tuple, list)):
        if len(raw) != len(specs):
            raise ModelError(f"model returned {len(raw)} values, expected {len(specs)} outputs")
        named = {s.name: v for s, v in zip(specs, raw)}
    else:
        raise ModelError(f"model returned {type(raw).__name__}; expected a dict, a tensor or a tuple of tensors")
    outputs: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name not in named:
            raise ModelError(f"model output is missing '{spec.name}' (it returned {sorted(map(str, named))})")
        value = named[spec.name]
        if isinstance(value, np.ndarray):
            value = _from_numpy(spec, value)
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"output '{spec.name}': expected a tensor, got {type(value).__name__}")
        if value.dtype != spec.torch_dtype:
            raise ModelError(f"output '{spec.name}': expected dtype {spec.dtype}, got {value.dtype}")
        shape = value.shape  # read once: each read is a call into torch, per output per batch
        if not shape or shape[0] != rows:
            raise ModelError(
                f"output '{spec.name}': expected leading dimension {rows} (the batch), got shape {tuple(shape)}"
            )
        if shape[1:] != spec.shape:
            raise ModelError(
                f"output '{spec.name}': expected shape ({rows}, {', '.join(map(str, spec.shape))}),"
                f" got {tuple(value.shape)}"
            )
        outputs[spec.name] = value
    return outputs


def _from_numpy(spec: TensorSpec, array: np.ndarray) -> torch.Tensor:
    """A model's numpy output as a tensor, sharing its memory when it can (a
    read-only array is copied: torch tensors are always writable)."""
    if not array.flags.writeable:
        array = array.copy()
    try:
        return torch.from_numpy(array)
    except TypeError:  # a dtype torch has no tensor for (object, strings...)
        raise ModelError(f"output '{spec.name}': numpy dtype {array.dtype} has no torch equivalent") from None


def _tensordict_module_base() -> type | None:
    """``tensordict.nn.TensorDictModuleBase`` if tensordict is imported (a
    model cannot be one otherwise), else None."""
    if "tensordict" not in sys.modules:
        return None
    try:
        from tensordict.nn import TensorDictModuleBase
    except ImportError:  # pragma: no cover - a broken tensordict install
        return None
    base: type = TensorDictModuleBase
    return base


def call_style(model: Any, inputs: Sequence[TensorSpec]) -> str:
    """How a model is called with a batch:

    - ``"tensordict"``: a ``tensordict.nn.TensorDictModuleBase`` (a
      ``TensorDictModule``, ``TensorDictSequential``...) gets a ``TensorDict``
      of batch size ``[rows]``; a spec named ``"a.b"`` is its nested key
      ``("a", "b")``;
    - ``"tensor"``: any other ``torch.nn.Module`` with a single input gets that
      tensor, unless its ``forward`` annotates its first parameter as a dict
      or Mapping;
    - ``"dict"``: everything else gets ``{input name: tensor}``.
    """
    # torch.compile's wrapper forwards (*args, **kwargs): ask the module it wraps.
    model = getattr(model, "_orig_mod", model)
    td_base = _tensordict_module_base()
    if td_base is not None and isinstance(model, td_base):
        return "tensordict"
    if isinstance(model, torch.nn.Module) and len(inputs) == 1:
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):
            return "dict"
        if not params or params[0].kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            return "dict"
        annotation = params[0].annotation
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
        if any(word in str(text) for word in ("dict", "Dict", "Mapping", "TensorDict")):
            return "dict"
        return "tensor"
    return "dict"


def adapt_model(model: Model, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> Model:
    """``model`` as a callable taking ``{input name: batch}`` (see
    :func:`call_style`). A model that returns a ``TensorDict`` has its outputs
    read from it by key (``"a.b"``: nested)."""
    style = call_style(model, inputs)
    if style == "dict":
        return model
    if style == "tensor":
        (name,) = (s.name for s in inputs)

        def call_tensor(batch: dict[str, torch.Tensor]) -> Any:
            return model(batch[name])  # type: ignore[arg-type]

        return call_tensor
    from tensordict import TensorDict, TensorDictBase

    in_keys = [(s.name, nested_key(s.name)) for s in inputs]
    out_keys = [(s.name, nested_key(s.name)) for s in outputs]

    def call_tensordict(batch: dict[str, torch.Tensor]) -> Any:
        rows = next(iter(batch.values())).shape[0]
        td = TensorDict({key: batch[name] for name, key in in_keys}, batch_size=[rows])
        result = model(td)
        if isinstance(result, TensorDictBase) and out_keys:
            present = set(result.keys(include_nested=True, leaves_only=True))
            return {name: result.get(key) for name, key in out_keys if key in present}
        return result

    return call_tensordict


def model_mode() -> contextlib.AbstractContextManager[Any]:
    """What a model runs under: ``torch.no_grad()``, unless gradients are off
    already (worker threads turn them off once; entering it again costs
    microseconds per batch). Not inference mode: callers get rows of the
    outputs, and an inference tensor can be neither changed in place nor
    used beside autograd outside it, which an RL learner does with actions.
    A model that wants inference mode may enter it itself."""
    return torch.no_grad() if torch.is_grad_enabled() else _ALREADY


_ALREADY: contextlib.AbstractContextManager[None] = contextlib.nullcontext()  # stateless: shared


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """``n`` rows of ``t`` from ``start``: a view, or a copy padded with
    zeros where ``t`` ends first."""
    if start + n <= t.shape[0]:
        return t[start : start + n]
    padded = t.new_zeros((n, *t.shape[1:]))
    padded[: t.shape[0] - start] = t[start:]
    return padded


class StagedViews:
    """The model's inputs for a batch of ``n`` rows in one staging slot: views
    of the slot's first ``n`` rows, made once and reused batch after batch.

    Slicing is a torch op, and torch's bindings release the GIL around every
    op; on a worker each release hands the GIL to the busy event loop and
    costs a wait for its next iteration to get it back. Reused views make no
    torch call. They are checked before each use, so a model that changed
    one in place (``unsqueeze_``, ``set_``...) gets fresh ones.
    """

    __slots__ = ("slot", "views", "layout", "storage_ptrs")

    def __init__(self, slot: Mapping[str, torch.Tensor], n: int) -> None:
        self.slot = slot  # held, so the id() it is cached under stays its own
        self.views = {name: t[:n] for name, t in slot.items()}
        self.layout = [(v, v.shape, v.stride(), v.data_ptr()) for v in self.views.values()]
        self.storage_ptrs = frozenset(_storage_ptr(t) for t in slot.values())

    def intact(self) -> bool:
        for v, shape, stride, ptr in self.layout:  # a loop, not all(...): once per batch, on the worker
            if v.shape != shape or v.stride() != stride or v.data_ptr() != ptr:
                return False
        return True


def merge_rows(
    done: Sequence[tuple[int, int, Outputs]], rows: int, specs: Sequence[TensorSpec], version_output: str | None
) -> Outputs:
    """One batch of ``rows`` rows from the parts in ``done``; rows no part
    covers are left uninitialised (they belong to failed requests). With no
    part done (every request failed alone) the outputs ``specs`` declare
    (and ``version_output``), all uninitialised: each sink still finds every
    output it reads, and answers each request with its own error."""
    if not done:
        empty: Outputs = {s.name: torch.empty((rows, *s.shape), dtype=s.torch_dtype) for s in specs}
        if version_output is not None:
            empty[version_output] = torch.zeros(rows, dtype=torch.int64)
        return empty
    merged: Outputs = {}
    for name, t in done[0][2].items():
        whole = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        for start, n, outputs in done:
            whole[start : start + n].copy_(outputs[name])
        merged[name] = whole
    return merged


class CpuExecutor(Executor):
    """Runs the model straight on the staging slot (no copy). Outputs that
    view the slot (an identity model's) are cloned, so the slot may be reused
    as soon as :meth:`run` returns, unless the batch's finish copies every
    answer out (``Batch.copies_outputs``: native and shared-memory callers);
    :meth:`~ferrobatch._executor.Executor.serve` then gives the slot back
    after the finish instead.

    With ``pad_to`` (``compile=True``), a batch runs padded up to its bucket,
    so a compiled model only ever sees the bucket sizes it was warmed with.
    The weight gate, failure isolation (retries on the staging slot),
    sampling and the worker loop are :class:`~ferrobatch._executor.Executor`'s.
    """

    def __init__(
        self,
        model: Model,
        device: torch.device,
        outputs: Sequence[TensorSpec],
        pad_to: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.outputs = outputs
        self.pad_to = pad_to
        self._views: dict[tuple[int, int], StagedViews] = {}

    def _staged(self, slot: Mapping[str, torch.Tensor], n: int) -> StagedViews:
        key = (id(slot), n)
        staged = self._views.get(key)
        if staged is None or staged.slot is not slot or not staged.intact():
            staged = self._views[key] = StagedViews(slot, n)
        return staged

    def warm_up(self, batch_for: WarmupBatch, buckets: Sequence[int], slot: Mapping[str, torch.Tensor]) -> None:
        """Runs each bucket size once through :meth:`run`, from ``slot`` (a
        staging slot the caller owns), just as requests will; raises what the
        model raised."""
        for rows in buckets:
            fill_slot(slot, batch_for(rows))
            self.run(slot, rows)
        self._views.clear()  # views of the warm-up slot: requests use the ring's

    def run(self, slot: Mapping[str, torch.Tensor], rows: int, start: int = 0) -> dict[str, torch.Tensor]:
        """The outputs for ``rows`` rows of the staging slot from ``start``."""
        n = self.pad_to[rows] if self.pad_to else rows
        requests = self.requests_of(start, rows)
        if start == 0:
            staged = self._staged(slot, n)
            views = dict(staged.views)
            staging = staged.storage_ptrs
        else:  # a retry of part of a batch (failure isolation): not cached
            views = {name: _rows(t, start, n) for name, t in slot.items()}
            staging = frozenset(_storage_ptr(t) for t in slot.values())
        failures: RequestsFailed | None = None
        with model_mode():
            try:
                raw = self.model(views) if requests is None else self.model(views, requests)  # type: ignore[call-arg]
            except RequestsFailed as failed:  # its outputs are checked as any
                raw, failures = failed.outputs, failed
            outputs = normalize_outputs(raw, self.outputs, n)
        for name, out in outputs.items():
            if n != rows:
                out = out[:rows]
            if not out.is_cpu:
                out = out.cpu()
            if not self._answers_copied and _storage_ptr(out) in staging:
                out = out.clone()  # the slot is reused by the next batch, and the callers read views
            outputs[name] = out
        if failures is not None:
            raise failures.answered(outputs, start, requests)
        return outputs

    def merge(self, done: list[tuple[int, int, Any]], rows: int) -> Outputs:
        return merge_rows(done, rows, self.outputs, self.version_output)

    def run_alone(self, inputs: Mapping[str, Any]) -> Outputs:
        """The model on one row (``{name: tensor [1, ...]}``), outside the
        weight gate: the invariance sampler's re-run (see ``_invariance``)."""
        with model_mode():
            if self.with_requests:
                return normalize_outputs(self.model(dict(inputs), [RequestInfo(1)]), self.outputs, 1)  # type: ignore[call-arg]
            return normalize_outputs(self.model(dict(inputs)), self.outputs, 1)
