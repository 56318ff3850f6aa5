"""How a bound callable gets its context (``pytriton.models.model``)."""

from .._binding import inject_triton_context

#: PyTriton's name for it, which its decorator tests call.
_inject_triton_context = inject_triton_context

__all__ = ["inject_triton_context"]
