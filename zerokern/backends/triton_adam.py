"""Triton fused Adam: the same update as the CUDA kernel, compiled at run time.

Multi-tensor without one launch per tensor: the tensors of a call are grouped
by (grad dtype, model dtype); each group is one launch over the tiles of all
its tensors. A program finds its tensor by binary search over the tiles'
prefix sums and its pointers in an int64 table, so a GPT-sized list of
hundreds of tensors is one or two launches. The table is built on the host and
copied to the device per call (unlike the CUDA backend, so this path is not
CUDA-graph capturable). On a machine without a GPU it runs under
TRITON_INTERPRET=1 on CPU tensors (tests only: slow).
"""

import math

import torch
import triton
import triton.language as tl

from .._checks import check_adam_args
from .hyper import AdamHyper

BLOCK = 1024
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _adam_kernel(
    table_ptr, first_tile_ptr, numel_ptr, n_tensors,
    lr_ptr, step_ptr, scale_ptr, found_inf_ptr,
    lr_value, step_value, scale_value, beta1, beta2, eps, weight_decay,
    GRAD_T: tl.constexpr, OUT_T: tl.constexpr, HAS_OUT: tl.constexpr,
    LR_PTR: tl.constexpr, STEP_PTR: tl.constexpr, SCALE_PTR: tl.constexpr, FOUND_INF: tl.constexpr,
    ADAM_W: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    # Which tensor holds this tile: first_tile[t] <= tile < first_tile[t + 1].
    lo = tl.zeros((), tl.int32)
    hi = n_tensors - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(first_tile_ptr + mid) <= tile
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    t = lo
    numel = tl.load(numel_ptr + t)
    offs = (tile - tl.load(first_tile_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if FOUND_INF:
        mask = mask & (tl.load(found_inf_ptr) == 0)

    p_ptr = tl.load(table_ptr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(GRAD_T))
    m_ptr = tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))

    lr = tl.load(lr_ptr) if LR_PTR else lr_value
    step = tl.load(step_ptr) if STEP_PTR else step_value
    scale = tl.load(scale_ptr) if SCALE_PTR else scale_value
    if BIAS_CORRECTION:
        bc1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        bc2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    else:
        bc1 = 1.0
        bc2 = 1.0
    step_size = lr / bc1
    bc2_sqrt = tl.sqrt(bc2 + tl.zeros((), tl.float32))

    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) / scale
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if ADAM_W:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / bc2_sqrt + eps))
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        o_ptr = tl.load(table_ptr + 4 * n_tensors + t).to(tl.pointer_type(OUT_T))
        if OUT_T == tl.bfloat16:
            # Round to nearest even by hand: same bits as torch's .to(bfloat16)
            # everywhere, including under TRITON_INTERPRET, whose cast truncates.
            bits = p.to(tl.uint32, bitcast=True)
            r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            tl.store(o_ptr + offs, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(o_ptr + offs, p.to(OUT_T), mask=mask)


def _groups(params, grads, model_params):
    """Indices of non-empty tensors keyed by (grad dtype, model dtype)."""
    groups = {}
    for i, p in enumerate(params):
        if p.numel():
            key = (grads[i].dtype, model_params[i].dtype if model_params else None)
            groups.setdefault(key, []).append(i)
    return groups


def _scalar(x, default):
    """(pointer argument, value argument, is-a-pointer) for a number-or-tensor."""
    if isinstance(x, torch.Tensor):
        return x, 0.0, True
    return None, float(default if x is None else x), False


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper):
    check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, h)
    device = params[0].device if params else None
    lr = _scalar(h.lr, None)
    step = _scalar(h.step, None)
    scale = _scalar(h.grad_scale, 1.0)
    for (gdt, odt), idx in _groups(params, grads, model_params).items():
        lists = [params, grads, exp_avgs, exp_avg_sqs] + ([model_params] if odt is not None else [])
        table = [lst[i].data_ptr() for lst in lists for i in idx]
        numel = [params[i].numel() for i in idx]
        first_tile = [0]
        for n in numel:
            first_tile.append(first_tile[-1] + triton.cdiv(n, BLOCK))
        meta = torch.tensor(table + first_tile + numel, dtype=torch.int64).to(device, non_blocking=True)
        k = len(idx)
        table_t = meta[: len(table)]
        first_t = meta[len(table): len(table) + k + 1]
        numel_t = meta[len(table) + k + 1:]
        dummy = meta  # stands in for absent pointer arguments (never read)
        _adam_kernel[(first_tile[-1],)](
            table_t, first_t, numel_t, k,
            lr[0] if lr[2] else dummy, step[0] if step[2] else dummy,
            scale[0] if scale[2] else dummy, h.found_inf if h.found_inf is not None else dummy,
            lr[1], step[1], scale[1], h.beta1, h.beta2, h.eps, h.weight_decay,
            GRAD_T=_TL[gdt], OUT_T=_TL[odt] if odt is not None else tl.float16, HAS_OUT=odt is not None,
            LR_PTR=lr[2], STEP_PTR=step[2], SCALE_PTR=scale[2], FOUND_INF=h.found_inf is not None,
            ADAM_W=h.adam_w_mode, BIAS_CORRECTION=h.bias_correction,
            SEARCH_STEPS=max(1, math.ceil(math.log2(k))) if k > 1 else 0, BLOCK=BLOCK,
        )
