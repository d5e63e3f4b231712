"""Triton flatten / unflatten: one multi-tensor cast-copy launch per
(src dtype, dst dtype) pair (see triton_common.tile_batch); non-contiguous
tensors take torch's strided copy instead."""

import torch
import triton
import triton.language as tl

from .._checks import check_flatten_args, check_unflatten_args
from . import triton_common
from .triton_common import TL_DTYPE, aligned16, group_nonempty, tensor_pointer, tile_batch, to_bf16_rne

BLOCK = 2048


@triton.jit
def _cast_tile(src, dst, offs, numel, SRC_T: tl.constexpr, DST_T: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    x = tl.load(src + offs, mask=mask)
    if SRC_T == DST_T:
        y = x
    elif DST_T == tl.bfloat16:
        y = to_bf16_rne(x.to(tl.float32))
    else:
        y = x.to(DST_T)
    tl.store(dst + offs, y, mask=mask)


@triton.jit
def _cast_kernel(table_ptr, tile_tensor_ptr, first_tile_ptr, numel_ptr, n_tensors,
                 SRC_T: tl.constexpr, DST_T: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    # See [Note: vector access in Triton] in triton_common.py.
    tile = tl.program_id(0)
    t = tl.load(tile_tensor_ptr + tile)
    base = (tile - tl.load(first_tile_ptr + t)) * BLOCK
    numel = tl.load(numel_ptr + t)
    src = tensor_pointer(table_ptr, 0, n_tensors, t, SRC_T, ALIGNED)
    dst = tensor_pointer(table_ptr, 1, n_tensors, t, DST_T, ALIGNED)
    offs = base + tl.arange(0, BLOCK)
    if base + BLOCK <= numel:
        _cast_tile(src, dst, offs, numel, SRC_T, DST_T, MASKED=False)
    else:
        _cast_tile(src, dst, offs, numel, SRC_T, DST_T, MASKED=True)


def _copy(flat, tensors, offsets, to_flat):
    """Contiguous tensors ride in one launch per dtype pair; the others take torch's strided copy."""
    fast = []
    for t, o in zip(tensors, offsets):
        if t.numel() == 0:
            continue
        view = flat[o:o + t.numel()]
        if t.is_contiguous():
            fast.append((t, view))
        elif to_flat:
            view.view(t.shape).copy_(t)
        else:
            t.copy_(view.view(t.shape))
    srcs = [t if to_flat else v for t, v in fast]
    dsts = [v if to_flat else t for t, v in fast]
    with triton_common.device_guard(flat.device):
        keys = [(s.dtype, d.dtype, aligned16((s, d))) for s, d in zip(srcs, dsts)]  # see triton_adam._plan
        for (sdt, ddt, _), idx in group_nonempty(srcs, keys).items():
            b = tile_batch([[srcs[i] for i in idx], [dsts[i] for i in idx]], BLOCK, flat.device)
            _cast_kernel[(b.tiles,)](b.table, b.tile_tensor, b.first_tile, b.numel, b.count, SRC_T=TL_DTYPE[sdt],
                                     DST_T=TL_DTYPE[ddt], ALIGNED=b.aligned, BLOCK=BLOCK)


def flatten(tensors, dtype, offsets, numel):
    off, size, gaps = check_flatten_args(tensors, dtype, offsets, numel)
    flat = (torch.zeros if gaps else torch.empty)(size, dtype=dtype, device=tensors[0].device)
    _copy(flat, tensors, off, to_flat=True)
    return flat


def flatten_into(tensors, out, offsets):
    off = check_unflatten_args(out, tensors, "tensors", offsets, flat_name="out")
    _copy(out, tensors, off, to_flat=True)


def unflatten(flat, like, offsets):
    off = check_unflatten_args(flat, like, "like", offsets)
    out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
    _copy(flat, out, off, to_flat=False)
    return out


def unflatten_into(flat, targets, offsets):
    off = check_unflatten_args(flat, targets, "targets", offsets)
    _copy(flat, targets, off, to_flat=False)
