"""The compiled backends, "cpu" (zerokern._C) and "cuda" (zerokern._C_cuda).

Both are the one dispatcher op torch.ops.zerokern.fused_adam_; the tensors'
device picks the kernel. The op validates its arguments in C++. An eager call
first tries the library's fused_adam_cached, which skips the dispatcher and the
per-tensor checks for tensors the op validated before ([Note: host cost] in
csrc/torch/adam_cache.h).
"""

import functools
import importlib

import torch

from . import selfcheck
from .hyper import AdamHyper

@functools.cache  # per device type, looked up once
def cached_call(device_type):
    """The compiled library's fused_adam_cached for tensors on `device_type`, or None."""
    module = {"cpu": "zerokern._C", "cuda": "zerokern._C_cuda"}.get(device_type)
    try:
        return getattr(importlib.import_module(module), "fused_adam_cached", None) if module else None
    except ImportError:
        return None


def _split(h: AdamHyper):
    """lr, step and grad_scale for the op, each as (number, tensor or None): a tensor's number is a
    default the op ignores."""
    out = []
    for x, default in ((h.lr, 0.0), (h.step, 1.0), (h.grad_scale, 1.0)):
        if isinstance(x, torch.Tensor):
            out += (default, x if x.dtype == torch.float32 else x.float())
        else:
            out += (float(default if x is None else x), None)
    return out


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper, dry_run=False):
    """dry_run (bench/host_overhead.py): everything but the update, on tensors the op has seen."""
    _check("adam", params)
    lr, lr_t, step, step_t, scale, scale_t = _split(h)
    # Not while torch.compile traces: it should see the op (a plain C function would break the graph).
    cached = (cached_call(params[0].device.type)
              if params and isinstance(params[0], torch.Tensor) and not torch.compiler.is_compiling() else None)
    if cached is not None and cached(
            (params, grads, exp_avgs, exp_avg_sqs, model_params or []), lr, h.beta1, h.beta2, h.eps, h.weight_decay,
            step, h.adam_w_mode, h.bias_correction, scale, lr_t, step_t, scale_t, h.found_inf, dry_run):
        return
    if dry_run:
        raise RuntimeError("dry_run needs tensors the op has validated before (call once without it)")
    torch.ops.zerokern.fused_adam_(
        params, grads, exp_avgs, exp_avg_sqs, model_params or [],
        lr=lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=step,
        adam_w_mode=h.adam_w_mode, bias_correction=h.bias_correction, grad_scale=scale,
        lr_tensor=lr_t, step_tensor=step_t, grad_scale_tensor=scale_t, found_inf=h.found_inf)


def _check(family, tensors):
    """[Note: first-call self-check] in selfcheck.py, for the CUDA kernels (the CPU ones are the oracle)."""
    if tensors and isinstance(tensors[0], torch.Tensor) and tensors[0].device.type == "cuda":
        selfcheck.ensure(family, tensors[0].device)


def _int_list(offsets):
    return None if offsets is None else [int(o) for o in offsets]


def flatten(tensors, dtype, offsets, numel):
    _check("flat", tensors)
    return torch.ops.zerokern.flatten(tensors, dtype, _int_list(offsets), numel)


def flatten_into(tensors, out, offsets):
    _check("flat", tensors)
    torch.ops.zerokern.flatten_into_(tensors, out, _int_list(offsets))


def unflatten(flat, like, offsets):
    _check("flat", [flat])
    return torch.ops.zerokern.unflatten(flat, like, _int_list(offsets))


def unflatten_into(flat, targets, offsets):
    _check("flat", [flat])
    torch.ops.zerokern.unflatten_into_(flat, targets, _int_list(offsets))


def fused_adam_lowbit_(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                       index_bases, seed, h: AdamHyper):
    """The compiled low-bit kernel (CPU tensors); lowbit_ops validated the lists. Tensor
    hyper-parameters and found_inf are read on the host here, as the CPU kernel would."""
    from .. import lowbit

    _check("lowbit", params)
    if not params or (h.found_inf is not None and h.found_inf.item() != 0):
        return
    lr, step, scale = (float(x.item()) if isinstance(x, torch.Tensor) else x for x in (h.lr, h.step, h.grad_scale))
    torch.ops.zerokern.fused_adam_lowbit_(
        params, grads, exp_avgs, exp_avg_sqs, model_params or [], exp_avg_scales or [], exp_avg_sq_scales or [],
        index_bases if index_bases is not None else [0] * len(params), lowbit.maps(params[0].device),
        seed - 2**64 if seed >= 2**63 else seed, lr=float(lr), beta1=h.beta1, beta2=h.beta2, eps=h.eps,
        weight_decay=h.weight_decay, step=float(step), adam_w_mode=h.adam_w_mode, bias_correction=h.bias_correction,
        grad_scale=1.0 if scale is None else float(scale))
