"""Triton low-bit Adam: one program per block of lowbit.BLOCK elements (a quantization block), the
tensors of a call in one launch (triton_common.tile_batch). The numbers are lowbit.py's: the maps
and cells come from there, the random bits from tl.philox, which is the reference's Philox.

Every element draws its own group's Philox words (eight elements share them), which costs eight
times the Philox of the CPU kernel; on a GPU that compute hides under the memory traffic.
"""

import torch
import triton
import triton.language as tl

from .. import lowbit
from .hyper import AdamHyper, host_constants
from . import triton_common
from .triton_common import TL_DTYPE, tensor_pointer, tile_batch, to_bf16_rne

BLOCK = lowbit.BLOCK
_STATE = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


@triton.jit
def _random16(seed, step, stream, index):
    """The 16 random bits of global element `index` (int64): [Note: reproducible rounding]."""
    group = index >> 3
    c0 = (group & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((group >> 32) & 0xFFFFFFFF).to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero + step, zero + stream)
    which = (index >> 1) & 3
    word = tl.where(which == 0, w0, tl.where(which == 1, w1, tl.where(which == 2, w2, w3)))
    return (word >> ((index & 1) * 16).to(tl.uint32)) & 0xFFFF


@triton.jit
def _round_bf16(x, r16):
    """Stochastic rounding to bf16 (lowbit.stochastic_round_bf16), as raw uint16 bits."""
    w = x.to(tl.uint32, bitcast=True)
    mag = w & 0x7FFFFFFF
    out = (w + r16) >> 16
    out = tl.where(mag == 0x7F800000, w >> 16, out)
    out = tl.where(mag > 0x7F800000, 0x7FC0, out)
    return out.to(tl.uint16)


@triton.jit
def _decode(ptr, scale_ptr, offs, mask, blk, map_ptr, STATE: tl.constexpr):
    if STATE == 2:
        codes = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        x = tl.load(map_ptr + codes) * tl.load(scale_ptr + blk)
    elif STATE == 1:
        x = tl.load(ptr + offs, mask=mask, other=0).to(tl.float32)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return tl.where(mask, x, 0.0)


@triton.jit
def _encode(ptr, scale_ptr, x, offs, mask, blk, mid_ptr, cells_ptr, seed, step, stream, index,
            STATE: tl.constexpr):
    if STATE == 2:
        absmax = tl.max(tl.abs(x), axis=0)
        inv = tl.where(absmax > 0, tl.div_rn(1.0, tl.where(absmax > 0, absmax, 1.0)), 0.0)
        y = x * inv
        c0 = tl.load(cells_ptr + (y.to(tl.uint32, bitcast=True) >> 16).to(tl.int32))
        code = c0 + (tl.load(mid_ptr + c0) < y).to(tl.int32)
        tl.store(ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + blk, absmax)
    elif STATE == 1:
        bits = _round_bf16(x, _random16(seed, step, stream, index))
        tl.store(ptr + offs, bits.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _lowbit_kernel(
    table_ptr, tile_tensor_ptr, first_tile_ptr, numel_ptr, base_ptr, n_tensors,
    smap_ptr, smid_ptr, scells_ptr, umap_ptr, umid_ptr, ucells_ptr,
    step_size, inv_bc2_sqrt, decay, inv_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2, seed, step,
    GRAD_T: tl.constexpr, PARAM_T: tl.constexpr, STATE: tl.constexpr, STATE_T: tl.constexpr,
    HAS_OUT: tl.constexpr, OUT_T: tl.constexpr, BLOCK: tl.constexpr,
):
    tile = tl.program_id(0)
    t = tl.load(tile_tensor_ptr + tile)
    blk = tile - tl.load(first_tile_ptr + t)
    numel = tl.load(numel_ptr + t)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    index = tl.load(base_ptr + t) + offs.to(tl.int64)
    p_ptr = tensor_pointer(table_ptr, 0, n_tensors, t, PARAM_T, False)
    g_ptr = tensor_pointer(table_ptr, 1, n_tensors, t, GRAD_T, False)
    m_ptr = tensor_pointer(table_ptr, 2, n_tensors, t, STATE_T, False)
    v_ptr = tensor_pointer(table_ptr, 3, n_tensors, t, STATE_T, False)
    ms_ptr = tensor_pointer(table_ptr, 4, n_tensors, t, tl.float32, False)
    vs_ptr = tensor_pointer(table_ptr, 5, n_tensors, t, tl.float32, False)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
    m = _decode(m_ptr, ms_ptr, offs, mask, blk, smap_ptr, STATE)
    v = _decode(v_ptr, vs_ptr, offs, mask, blk, umap_ptr, STATE)
    if STATE == 2:  # int8 exp_avg_sq holds its square root ([Note: the second moment as its square root])
        v = v * v
    g = g + l2 * p
    p = p * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    p = p - step_size * tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
    _encode(m_ptr, ms_ptr, m, offs, mask, blk, smid_ptr, scells_ptr, seed, step, 1, index, STATE)
    if STATE == 2:
        _encode(v_ptr, vs_ptr, tl.sqrt_rn(v), offs, mask, blk, umid_ptr, ucells_ptr, seed, step, 2, index, STATE)
    else:
        _encode(v_ptr, vs_ptr, v, offs, mask, blk, umid_ptr, ucells_ptr, seed, step, 2, index, STATE)
    if PARAM_T == tl.bfloat16:  # no master: the param itself, rounded stochastically
        bits = _round_bf16(p, _random16(seed, step, 0, index))
        tl.store(p_ptr + offs, bits.to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(p_ptr + offs, p, mask=mask)
        if HAS_OUT:
            o_ptr = tensor_pointer(table_ptr, 6, n_tensors, t, OUT_T, False)
            if OUT_T == tl.bfloat16:
                tl.store(o_ptr + offs, to_bf16_rne(p), mask=mask)
            else:
                tl.store(o_ptr + offs, p.to(OUT_T), mask=mask)


def fused_adam_lowbit_(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                       index_bases, seed, h: AdamHyper):
    """lowbit_ops validated the lists. found_inf and tensor hyper-parameters are read on the host
    (a sync); the CUDA-graph-friendly device path of fused_adam_ is future work here."""
    constants = host_constants(h) if params else None
    if constants is None:
        return
    step_size, inv_bc2_sqrt, decay, inv_scale, step, l2 = constants
    device = params[0].device
    maps = lowbit.maps(device)
    keep = [i for i, p in enumerate(params) if p.numel()]
    # one launch per grad dtype (the other formats are one per call)
    for gdt in {grads[i].dtype for i in keep}:
        idx = [i for i in keep if grads[i].dtype == gdt]
        pick = lambda lst: [lst[i] for i in idx]  # noqa: E731
        dummy = [params[i] for i in idx]  # stands in for absent lists (never read)
        lists = [pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                 pick(exp_avg_scales) if exp_avg_scales else dummy,
                 pick(exp_avg_sq_scales) if exp_avg_sq_scales else dummy,
                 pick(model_params) if model_params else dummy]
        batch = tile_batch(lists, BLOCK, device)
        bases = torch.tensor([index_bases[i] if index_bases is not None else 0 for i in idx], dtype=torch.int64,
                             device=device)
        with triton_common.device_guard(device):
            _lowbit_kernel[(batch.tiles,)](
                batch.table, batch.tile_tensor, batch.first_tile, batch.numel, bases, batch.count, *maps[:6],
                step_size, inv_bc2_sqrt, decay, inv_scale, h.beta1, h.beta2, 1.0 - h.beta1, 1.0 - h.beta2, h.eps, l2,
                seed - 2**64 if seed >= 2**63 else seed, step,
                GRAD_T=TL_DTYPE[gdt], PARAM_T=TL_DTYPE[params[0].dtype], STATE=_STATE[exp_avgs[0].dtype],
                STATE_T=tl.uint8 if exp_avgs[0].dtype == torch.uint8 else TL_DTYPE[exp_avgs[0].dtype],
                HAS_OUT=bool(model_params), OUT_T=TL_DTYPE[model_params[0].dtype] if model_params else tl.float16,
                BLOCK=BLOCK,
            )
