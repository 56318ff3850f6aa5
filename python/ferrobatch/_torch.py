"""Everything that touches torch on the worker side: devices, staging memory,
input coercion, running a model on a collated batch and checking its outputs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils.dlpack

from .errors import InvalidInputError, ModelError
from .specs import TensorSpec

Model = Callable[[dict[str, torch.Tensor]], Any]


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


def pinned_memory_available() -> bool:
    return torch.cuda.is_available()


def allocate_slot(
    specs: Sequence[TensorSpec], max_batch_size: int, pin: bool
) -> list[torch.Tensor]:
    """One staging slot: a (max_batch_size, *shape) tensor per input, pinned if asked."""
    pin = pin and pinned_memory_available()
    return [
        torch.empty((max_batch_size, *s.shape), dtype=s.torch_dtype, pin_memory=pin)
        for s in specs
    ]


def make_coerce(specs: Sequence[TensorSpec]) -> Callable[[Any, int, bool], torch.Tensor]:
    """The slow-path converter the Rust side calls for inputs that are neither a
    torch tensor nor a C-contiguous buffer: DLPack objects, strided buffers."""

    def coerce(value: Any, index: int, batched: bool) -> torch.Tensor:
        spec = specs[index]
        if hasattr(value, "__dlpack__"):
            tensor = torch.utils.dlpack.from_dlpack(value)
        else:
            try:
                view = memoryview(value)
            except TypeError:
                raise InvalidInputError(
                    f"input '{spec.name}': expected a torch tensor, numpy array, or an object "
                    f"with the buffer protocol or __dlpack__, got {type(value).__name__}"
                ) from None
            import numpy as np

            tensor = torch.from_numpy(np.ascontiguousarray(np.asarray(view)))
        return tensor

    return coerce


def normalize_outputs(
    raw: Any, specs: Sequence[TensorSpec], rows: int
) -> dict[str, torch.Tensor]:
    """Checks what the model returned and maps it to ``{name: (rows, *shape) tensor}``.

    The model may return a dict, a single tensor (one output) or a tuple/list in
    spec order. Anything else is a :class:`ModelError` saying what was wrong.
    """
    if isinstance(raw, torch.Tensor):
        if len(specs) != 1:
            raise ModelError(
                f"model returned one tensor but {len(specs)} outputs are declared: "
                f"{', '.join(repr(s.name) for s in specs)}; return a dict or a tuple"
            )
        named: Mapping[str, Any] = {specs[0].name: raw}
    elif isinstance(raw, Mapping):
        named = raw
    elif isinstance(raw, (tuple, list)):
        if len(raw) != len(specs):
            raise ModelError(f"model returned {len(raw)} values, expected {len(specs)} outputs")
        named = {s.name: v for s, v in zip(specs, raw)}
    else:
        raise ModelError(
            f"model returned {type(raw).__name__}; expected a dict, a tensor or a tuple of tensors"
        )
    outputs: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.name not in named:
            raise ModelError(
                f"model output is missing '{spec.name}' (it returned {sorted(map(str, named))})"
            )
        value = named[spec.name]
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"output '{spec.name}': expected a tensor, got {type(value).__name__}")
        if value.dtype != spec.torch_dtype:
            raise ModelError(
                f"output '{spec.name}': expected dtype {spec.dtype}, got {value.dtype}"
            )
        if value.dim() == 0 or value.shape[0] != rows:
            got = tuple(value.shape)
            raise ModelError(
                f"output '{spec.name}': expected leading dimension {rows} (the batch), got shape {got}"
            )
        if tuple(value.shape[1:]) != spec.shape:
            raise ModelError(
                f"output '{spec.name}': expected shape ({rows}, {', '.join(map(str, spec.shape))}),"
                f" got {tuple(value.shape)}"
            )
        outputs[spec.name] = value
    return outputs


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class CpuExecutor:
    """Runs the model straight on the staging slot (no copy); the slot is freed
    once outputs no longer alias it."""

    def __init__(self, model: Model, device: torch.device, outputs: Sequence[TensorSpec]):
        self.model = model
        self.device = device
        self.outputs = outputs

    def run(
        self, staged: dict[str, torch.Tensor], rows: int, release: Callable[[], None]
    ) -> dict[str, torch.Tensor]:
        try:
            with torch.inference_mode():
                outputs = normalize_outputs(self.model(staged), self.outputs, rows)
            staging = {_storage_ptr(t) for t in staged.values()}
            for name, out in outputs.items():
                if out.device.type != "cpu":
                    out = out.cpu()
                if _storage_ptr(out) in staging:
                    out = out.clone()  # the slot is reused by the next batch
                outputs[name] = out
            return outputs
        finally:
            release()


class CudaExecutor:
    """Copies the staged batch to the device on the instance's own stream, runs
    the model there and copies the outputs back into pinned host memory. Waits
    happen on CUDA events, whose synchronize releases the GIL."""

    def __init__(self, model: Model, device: torch.device, outputs: Sequence[TensorSpec]):
        self.model = model
        self.device = device
        self.outputs = outputs
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def run(
        self, staged: dict[str, torch.Tensor], rows: int, release: Callable[[], None]
    ) -> dict[str, torch.Tensor]:
        released = False
        try:
            with torch.cuda.stream(self.stream), torch.inference_mode():
                on_device = {k: v.to(self.device, non_blocking=True) for k, v in staged.items()}
                copied_in = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied_in.record(self.stream)
                outputs = normalize_outputs(self.model(on_device), self.outputs, rows)
                host = {}
                for name, out in outputs.items():
                    buf = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                    buf.copy_(out, non_blocking=True)
                    host[name] = buf
                copied_out = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied_out.record(self.stream)
            # The slot may be rewritten once its host-to-device copy completed.
            copied_in.synchronize()
            release()
            released = True
            copied_out.synchronize()
            return host
        finally:
            if not released:
                # An exception on the way: nothing more will read the slot
                # once the stream has drained.
                self.stream.synchronize()
                release()


def make_executor(model: Model, device: torch.device, outputs: Sequence[TensorSpec]) -> Any:
    if device.type == "cuda":
        return CudaExecutor(model, device, outputs)
    return CpuExecutor(model, device, outputs)
