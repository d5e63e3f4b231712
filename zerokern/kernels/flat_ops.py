"""Flat buffers: many tensors into one 1-D buffer and back, with a dtype cast
in the same pass (fp32 <-> fp16/bf16), one kernel launch (or a few) per list.

    flat = flatten(tensors, dtype=torch.float32)        # new 1-D tensor
    outs = unflatten(flat, like)                         # new tensors shaped/typed like `like`
    unflatten_into(flat, targets)                        # cast-copy into existing tensors (views are fine)

offsets (optional, all three): where each tensor starts in the flat buffer,
increasing without overlap (a FlatLayout's bucket offsets); gaps are zeroed by
flatten. Without offsets the tensors are packed back to back and unflatten's
flat must hold exactly their elements. Inputs to flatten and targets of
unflatten_into may be non-contiguous (each such tensor costs one strided copy
instead of riding in the single multi-tensor launch).
"""

from typing import List, Optional, Sequence

import torch

from .. import _ext  # noqa: F401  loads the compiled operators, if built
from .backends.registry import resolve


def flatten(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None, *,
            offsets: Optional[Sequence[int]] = None, numel: Optional[int] = None,
            out: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """All elements of `tensors`, in order, in one new 1-D contiguous tensor of
    `dtype` (default: tensors[0]'s dtype), of `numel` elements (default: just enough).

    out: an existing 1-D buffer to write instead (its dtype wins; its gaps are
    left untouched). Reusing a buffer avoids the cost of a fresh allocation's
    first touch, which on CPUs exceeds the copy itself for large buffers."""
    tensors = list(tensors)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out is {type(out).__name__}, expected a tensor")
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype is {dtype}, out is {out.dtype}")
        resolve(backend, out.device).flatten_into(tensors, out, offsets)
        return out
    if not tensors:
        resolve(backend, torch.device("cpu"))
        return torch.zeros(numel or 0, dtype=dtype or torch.float32)
    if not isinstance(tensors[0], torch.Tensor):
        raise TypeError(f"tensors[0] is {type(tensors[0]).__name__}, expected a tensor")
    return resolve(backend, tensors[0].device).flatten(tensors, dtype or tensors[0].dtype, offsets, numel)


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor], *, offsets: Optional[Sequence[int]] = None,
              backend: str = "auto") -> List[torch.Tensor]:
    """New tensors with the shapes and dtypes of `like`, filled from `flat`."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat is {type(flat).__name__}, expected a tensor")
    return resolve(backend, flat.device).unflatten(flat, list(like), offsets)


def unflatten_into(flat: torch.Tensor, targets: Sequence[torch.Tensor], *,
                   offsets: Optional[Sequence[int]] = None, backend: str = "auto") -> None:
    """Copies flat's elements into `targets` in place, casting to each target's dtype."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"flat is {type(flat).__name__}, expected a tensor")
    resolve(backend, flat.device).unflatten_into(flat, list(targets), offsets)
