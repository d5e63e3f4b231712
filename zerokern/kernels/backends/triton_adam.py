"""Triton fused Adam: the same update as the CUDA kernel, compiled at run time.

Multi-tensor without one launch per tensor: the tensors of a call are grouped
by (grad dtype, model dtype); each group is one launch over the tiles of all
its tensors (see triton_common.tile_batch). On a machine without a GPU it runs
under TRITON_INTERPRET=1 on CPU tensors (tests only: slow).
"""

import collections
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._checks import check_adam_args, check_hyper, check_scalar_tensor
from .hyper import AdamHyper, coefficients
from . import triton_common
from .triton_common import TL_DTYPE, TileBatch, aligned16, group_nonempty, tensor_pointer, tile_batch, to_bf16_rne

BLOCK = 1024


@triton.jit
def _adam_tile(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, numel,
               step_size, inv_bc2_sqrt, decay, inv_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2,
               OUT_T: tl.constexpr, HAS_OUT: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        mask = offs < numel
    else:
        mask = None
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
        if OUT_T == tl.bfloat16:
            tl.store(o_ptr + offs, to_bf16_rne(p), mask=mask)
        else:
            tl.store(o_ptr + offs, p.to(OUT_T), mask=mask)


@triton.jit
def _adam_kernel(
    table_ptr, tile_tensor_ptr, first_tile_ptr, numel_ptr, n_tensors,
    coef_ptr, found_inf_ptr,
    step_size, inv_bc2_sqrt, decay, inv_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2,
    GRAD_T: tl.constexpr, OUT_T: tl.constexpr, HAS_OUT: tl.constexpr,
    COEF_PTR: tl.constexpr, FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    # See [Note: vector access in Triton] in triton_common.py.
    run = True
    if FOUND_INF:  # one load per program; an overflowed step skips everything
        run = tl.load(found_inf_ptr) == 0
    if run:
        tile = tl.program_id(0)
        t = tl.load(tile_tensor_ptr + tile)
        base = (tile - tl.load(first_tile_ptr + t)) * BLOCK
        numel = tl.load(numel_ptr + t)
        p_ptr = tensor_pointer(table_ptr, 0, n_tensors, t, tl.float32, ALIGNED)
        g_ptr = tensor_pointer(table_ptr, 1, n_tensors, t, GRAD_T, ALIGNED)
        m_ptr = tensor_pointer(table_ptr, 2, n_tensors, t, tl.float32, ALIGNED)
        v_ptr = tensor_pointer(table_ptr, 3, n_tensors, t, tl.float32, ALIGNED)
        if HAS_OUT:
            o_ptr = tensor_pointer(table_ptr, 4, n_tensors, t, OUT_T, ALIGNED)
        else:
            o_ptr = p_ptr  # never written
        if COEF_PTR:  # computed on the device from tensor lr/step/grad_scale (see coefficients())
            step_size = tl.load(coef_ptr)
            inv_bc2_sqrt = tl.load(coef_ptr + 1)
            decay = tl.load(coef_ptr + 2)
            inv_scale = tl.load(coef_ptr + 3)
        offs = base + tl.arange(0, BLOCK)
        if base + BLOCK <= numel:
            _adam_tile(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, numel, step_size, inv_bc2_sqrt, decay, inv_scale,
                       beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2, OUT_T, HAS_OUT, MASKED=False)
        else:
            _adam_tile(p_ptr, g_ptr, m_ptr, v_ptr, o_ptr, offs, numel, step_size, inv_bc2_sqrt, decay, inv_scale,
                       beta1, beta2, one_minus_beta1, one_minus_beta2, eps, l2, OUT_T, HAS_OUT, MASKED=True)


class _Launch(NamedTuple):
    batch: TileBatch
    grad_t: object  # tl dtypes
    out_t: object
    has_out: bool


class _Plan(NamedTuple):
    """The validated launches of one call; reused while the same tensors come back."""
    device: torch.device
    launches: list


# [Note: host cost] (csrc/torch/adam_cache.h), in Python: a call whose tensors have the number
# (tensor_lists_id: pointers, sizes, dtypes, devices, contiguity) of an earlier validated call
# reuses its plan: no per-tensor check, no grouping, no table. Without zerokern._C every call
# is validated.
_PLANS = collections.OrderedDict()
_CACHED_PLANS = 64
try:
    from ..._C import tensor_lists_id as _lists_id
except ImportError:
    def _lists_id(lists):
        return None


def _plan(params, grads, exp_avgs, exp_avg_sqs, model_params):
    device = params[0].device
    # One launch per dtype pair and alignment, so a misaligned tensor (a view at an odd offset)
    # leaves the others their vector access.
    lists = [params, grads, exp_avgs, exp_avg_sqs] + ([model_params] if model_params else [])
    keys = [(g.dtype, model_params[i].dtype if model_params else None, aligned16(lst[i] for lst in lists))
            for i, g in enumerate(grads)]
    launches = []
    for (gdt, odt, _), idx in group_nonempty(params, keys).items():
        batch = tile_batch([[lst[i] for i in idx] for lst in lists], BLOCK, device)
        launches.append(_Launch(batch, TL_DTYPE[gdt], TL_DTYPE[odt] if odt is not None else tl.float16,
                                odt is not None))
    return _Plan(device, launches)


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper, dry_run=False):
    """dry_run (bench/host_overhead.py): everything but the kernel launches."""
    compiling = torch.compiler.is_compiling()  # torch.compile traces the checks instead of a C call
    key = _lists_id((params, grads, exp_avgs, exp_avg_sqs, model_params or [])) if params and not compiling else None
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, h)
        if not params:
            return
        plan = _plan(params, grads, exp_avgs, exp_avg_sqs, model_params)
        if key is not None:
            _PLANS[key] = plan
            if len(_PLANS) > _CACHED_PLANS:
                _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
        check_hyper(h)
        for name in ("lr", "step", "grad_scale", "found_inf"):
            check_scalar_tensor(getattr(h, name), name, params[0])
    coef = coefficients(h)
    on_device = isinstance(coef, torch.Tensor)
    l2 = 0.0 if h.adam_w_mode else h.weight_decay
    if dry_run:
        return
    with triton_common.device_guard(plan.device):
        for launch in plan.launches:
            b = launch.batch
            dummy = b.table  # stands in for absent pointer arguments (never read)
            _adam_kernel[(b.tiles,)](
                b.table, b.tile_tensor, b.first_tile, b.numel, b.count,
                coef if on_device else dummy, h.found_inf if h.found_inf is not None else dummy,
                *((1.0, 1.0, 1.0, 1.0) if on_device else coef), h.beta1, h.beta2, 1.0 - h.beta1, 1.0 - h.beta2,
                h.eps, l2,
                GRAD_T=launch.grad_t, OUT_T=launch.out_t, HAS_OUT=launch.has_out,
                COEF_PTR=on_device, FOUND_INF=h.found_inf is not None, ALIGNED=b.aligned, BLOCK=BLOCK,
            )
