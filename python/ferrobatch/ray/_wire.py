"""How tensors cross a Ray hop.

Ray pickles what a handle call takes and returns. A torch tensor pickles
through ``torch.save`` (about 0.3 ms for a 1 KiB row, and a row that is a
view pickles its whole batch's storage); a numpy array pickles in a few
microseconds, out of band, with only its own bytes. So rows travel as numpy
arrays (views of the tensors: no copy on this side), and as torch tensors
only for dtypes numpy lacks (bfloat16), cloned so only their rows go.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["to_wire"]


def to_wire(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: numpy array}`` sharing memory with ``tensors`` (CPU tensors),
    or a compact torch tensor where numpy has no such dtype. Other values
    (already arrays) pass as they are."""
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, torch.Tensor):
            try:
                out[name] = value.numpy()
            except TypeError:  # no numpy dtype (bfloat16): send the rows alone
                out[name] = value.clone()
        else:
            out[name] = value
    return out
