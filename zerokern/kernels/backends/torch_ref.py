"""Plain-PyTorch fused Adam: the test oracle and the fallback that runs anywhere.

Written for clarity, not speed: one tensor at a time, the update spelled out as
in torch.optim.AdamW's single-tensor path. It reads found_inf and tensor
hyper-parameters on the host (a sync), which the kernels avoid.
"""

import torch

from .._checks import check_adam_args, check_flatten_args, check_unflatten_args
from .hyper import AdamHyper, coefficients


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper):
    check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, h)
    if h.found_inf is not None and h.found_inf.item() != 0:
        return
    coef = coefficients(h)
    step_size, inv_bc2_sqrt, decay, inv_scale = coef.tolist() if isinstance(coef, torch.Tensor) else coef
    l2 = 0.0 if h.adam_w_mode else h.weight_decay
    with torch.no_grad():
        for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
            adam_update_(p, g, m, v, step_size, inv_bc2_sqrt, decay, inv_scale, l2, h)
            if model_params:
                model_params[i].copy_(p)


def adam_update_(p, g, m, v, step_size, inv_bc2_sqrt, decay, inv_scale, l2, h: AdamHyper):
    """The reference's update of fp32 p, m, v in place (the low-bit reference runs it too)."""
    g = g.float() * inv_scale
    if l2:
        g = g + l2 * p
    p.mul_(decay)
    m.mul_(h.beta1).add_(g, alpha=1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    denom = (v.sqrt() * inv_bc2_sqrt).add_(h.eps)
    p.addcdiv_(m, denom, value=-step_size)


def flatten(tensors, dtype, offsets, numel):
    off, size, gaps = check_flatten_args(tensors, dtype, offsets, numel)
    if not gaps:
        return torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    flat = torch.zeros(size, dtype=dtype, device=tensors[0].device)
    for t, o in zip(tensors, off):
        flat[o:o + t.numel()].copy_(t.reshape(-1))
    return flat


def flatten_into(tensors, out, offsets):
    off = check_unflatten_args(out, tensors, "tensors", offsets, flat_name="out")
    with torch.no_grad():
        for t, o in zip(tensors, off):
            out[o:o + t.numel()].copy_(t.reshape(-1))


def unflatten(flat, like, offsets):
    off = check_unflatten_args(flat, like, "like", offsets)
    return [flat[o:o + t.numel()].view(t.shape).to(t.dtype, copy=True) for t, o in zip(like, off)]


def unflatten_into(flat, targets, offsets):
    off = check_unflatten_args(flat, targets, "targets", offsets)
    with torch.no_grad():
        for t, o in zip(targets, off):
            t.copy_(flat[o:o + t.numel()].view(t.shape))
