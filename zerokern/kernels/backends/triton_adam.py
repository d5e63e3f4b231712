"""Triton fused Adam: the same update as the CUDA kernel, compiled at run time.

Multi-tensor without one launch per tensor: the tensors of a call are grouped
by (grad dtype, model dtype); each group is one launch over the tiles of all
its tensors (see triton_common.tile_batch). On a machine without a GPU it runs
under TRITON_INTERPRET=1 on CPU tensors (tests only: slow).
"""

import torch
import triton
import triton.language as tl

from .._checks import check_adam_args
from .hyper import AdamHyper, coefficients
from . import triton_common
from .triton_common import TL_DTYPE, find_tensor, group_nonempty, tile_batch, to_bf16_rne

BLOCK = 1024


@triton.jit
def _adam_kernel(
    table_ptr, first_tile_ptr, numel_ptr, n_tensors,
    coef_ptr, found_inf_ptr,
    step_size, inv_bc2_sqrt, decay, inv_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2,
    GRAD_T: tl.constexpr, OUT_T: tl.constexpr, HAS_OUT: tl.constexpr,
    COEF_PTR: tl.constexpr, FOUND_INF: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    t = find_tensor(first_tile_ptr, n_tensors, tile, SEARCH_STEPS)
    numel = tl.load(numel_ptr + t)
    offs = (tile - tl.load(first_tile_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if FOUND_INF:
        # Every lane reads the flag (one cached address): a step skipped on overflow.
        mask = mask & (tl.load(found_inf_ptr + offs * 0) == 0)

    p_ptr = tl.load(table_ptr + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(GRAD_T))
    m_ptr = tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))

    if COEF_PTR:  # computed on the device from tensor lr/step/grad_scale (see coefficients())
        step_size = tl.load(coef_ptr)
        inv_bc2_sqrt = tl.load(coef_ptr + 1)
        decay = tl.load(coef_ptr + 2)
        inv_scale = tl.load(coef_ptr + 3)

    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * inv_scale
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    g = g + l2 * p
    p = p * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    # IEEE-rounded sqrt and division (tl.sqrt and / may be approximate on GPUs),
    # as the C++ kernels compute them.
    p = p - step_size * tl.div_rn(m, tl.sqrt_rn(v) * inv_bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        o_ptr = tl.load(table_ptr + 4 * n_tensors + t).to(tl.pointer_type(OUT_T))
        if OUT_T == tl.bfloat16:
            tl.store(o_ptr + offs, to_bf16_rne(p), mask=mask)
        else:
            tl.store(o_ptr + offs, p.to(OUT_T), mask=mask)


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper):
    check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, h)
    device = params[0].device if params else None
    coef = coefficients(h)
    on_device = isinstance(coef, torch.Tensor)
    l2 = 0.0 if h.adam_w_mode else h.weight_decay
    keys = [(g.dtype, model_params[i].dtype if model_params else None) for i, g in enumerate(grads)]
    with triton_common.device_guard(device):
        for (gdt, odt), idx in group_nonempty(params, keys).items():
            lists = [params, grads, exp_avgs, exp_avg_sqs] + ([model_params] if odt is not None else [])
            b = tile_batch([[lst[i] for i in idx] for lst in lists], BLOCK, device)
            dummy = b.table  # stands in for absent pointer arguments (never read)
            _adam_kernel[(b.tiles,)](
                b.table, b.first_tile, b.numel, b.count,
                coef if on_device else dummy, h.found_inf if h.found_inf is not None else dummy,
                *((1.0, 1.0, 1.0, 1.0) if on_device else coef), h.beta1, h.beta2, 1.0 - h.beta1, 1.0 - h.beta2,
                h.eps, l2,
                GRAD_T=TL_DTYPE[gdt], OUT_T=TL_DTYPE[odt] if odt is not None else tl.float16, HAS_OUT=odt is not None,
                COEF_PTR=on_device, FOUND_INF=h.found_inf is not None,
                SEARCH_STEPS=b.search_steps, BLOCK=BLOCK,
            )
