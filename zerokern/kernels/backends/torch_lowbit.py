"""Plain-PyTorch low-bit Adam: the reference that defines fused_adam_lowbit_'s numbers, and the
fallback that runs anywhere. The update is torch_ref.fused_adam_'s, op for op, on fp32 copies of
the moments and params; what differs is only how state and params are read and written
(lowbit.py). It reads found_inf and tensor hyper-parameters on the host."""

import torch

from .. import lowbit
from . import torch_ref
from .hyper import AdamHyper, host_constants


def _read(state, scales, second):
    if state.dtype == torch.uint8:
        return lowbit.decode_moment(state, scales, second).view(state.shape)
    return state if state.dtype == torch.float32 else state.float()


def _write(state, value, scales, second, seed, step, stream, base):
    """value (fp32) back into state: in place already (fp32), stochastically rounded (bf16), or
    requantized with new block scales (uint8)."""
    if state.dtype == torch.float32:
        return
    if state.dtype == torch.uint8:
        codes, new_scales = lowbit.encode_moment(value, second)
        state.copy_(codes.view(state.shape))
        scales.copy_(new_scales)
        return
    rand = lowbit.random16(seed, step, stream, lowbit.element_index(base, value.numel(), value.device))
    state.copy_(lowbit.stochastic_round_bf16(value.reshape(-1), rand).view(state.shape))


def fused_adam_lowbit_(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                       index_bases, seed, h: AdamHyper):
    constants = host_constants(h) if params else None
    if constants is None:
        return
    step_size, inv_bc2_sqrt, decay, inv_scale, step, l2 = constants
    with torch.no_grad():
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.numel() == 0:
                continue
            base = index_bases[i] if index_bases is not None else 0
            ms = exp_avg_scales[i] if exp_avg_scales is not None else None
            vs = exp_avg_sq_scales[i] if exp_avg_sq_scales is not None else None
            p32 = p if p.dtype == torch.float32 else p.float()
            m, v = _read(exp_avgs[i], ms, False), _read(exp_avg_sqs[i], vs, True)
            torch_ref.adam_update_(p32, g, m, v, step_size, inv_bc2_sqrt, decay, inv_scale, l2, h)
            _write(exp_avgs[i], m, ms, False, seed, step, lowbit.STREAM_EXP_AVG, base)
            _write(exp_avg_sqs[i], v, vs, True, seed, step, lowbit.STREAM_EXP_AVG_SQ, base)
            if p.dtype != torch.float32:  # no master: the bf16 param itself, rounded stochastically
                _write(p, p32, None, None, seed, step, lowbit.STREAM_PARAM, base)
            elif model_params:
                model_params[i].copy_(p32)
