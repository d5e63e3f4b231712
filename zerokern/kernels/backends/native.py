"""The compiled backends, "cpu" (zerokern._C) and "cuda" (zerokern._C_cuda).

Both are the one dispatcher op torch.ops.zerokern.fused_adam_; the tensors'
device picks the kernel. The op validates its arguments in C++.
"""

import torch

from .hyper import AdamHyper


def _split(x, default):
    """A number or a tensor -> (number for the op, tensor or None)."""
    if isinstance(x, torch.Tensor):
        return default, (x if x.dtype == torch.float32 else x.float())
    return float(default if x is None else x), None


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper):
    lr, lr_t = _split(h.lr, 0.0)
    step, step_t = _split(h.step, 1.0)
    scale, scale_t = _split(h.grad_scale, 1.0)
    torch.ops.zerokern.fused_adam_(
        params, grads, exp_avgs, exp_avg_sqs, model_params or [],
        lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=step,
        adam_w_mode=h.adam_w_mode, bias_correction=h.bias_correction, grad_scale=scale,
        lr_tensor=lr_t, step_tensor=step_t, grad_scale_tensor=scale_t, found_inf=h.found_inf)


def _int_list(offsets):
    return None if offsets is None else [int(o) for o in offsets]


def flatten(tensors, dtype, offsets, numel):
    return torch.ops.zerokern.flatten(tensors, dtype, _int_list(offsets), numel)


def flatten_into(tensors, out, offsets):
    torch.ops.zerokern.flatten_into_(tensors, out, _int_list(offsets))


def unflatten(flat, like, offsets):
    return torch.ops.zerokern.unflatten(flat, like, _int_list(offsets))


def unflatten_into(flat, targets, offsets):
    torch.ops.zerokern.unflatten_into_(flat, targets, _int_list(offsets))
