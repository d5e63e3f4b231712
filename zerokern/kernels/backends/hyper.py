"""The hyper-parameters of one fused Adam call, as one value."""

import math
import struct
from typing import NamedTuple, Optional, Union

import torch

Scalar = Union[float, torch.Tensor]


class AdamHyper(NamedTuple):
    """lr, step and grad_scale are numbers or one-element float32 tensors on the
    params' device (so a CUDA graph can capture a step); found_inf is None or a
    one-element float32 tensor: non-zero means the call changes nothing."""

    lr: Scalar
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: Scalar
    adam_w_mode: bool = True
    bias_correction: bool = True
    grad_scale: Optional[Scalar] = None
    found_inf: Optional[torch.Tensor] = None


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def coefficients(h: AdamHyper):
    """The per-call constants of the update: (step_size, inv_bc2_sqrt, decay, inv_grad_scale).

    step_size = lr / (1 - beta1^step), inv_bc2_sqrt = 1 / sqrt(1 - beta2^step)
    (both 1 without bias correction), decay = 1 - lr * weight_decay (AdamW; 1
    for Adam), inv_grad_scale = 1 / grad_scale (grad_scale rounded to float32).
    Computed in float64 as torch.optim does (1 - beta2^step cancels badly in
    float32), with lr rounded to float32 first as the C++ kernels do. Python
    floats when lr, step and grad_scale are numbers; otherwise one float32
    tensor of four on their device, computed there (no host sync).
    """
    tensors = [x for x in (h.lr, h.step, h.grad_scale) if isinstance(x, torch.Tensor)]
    if not tensors:
        lr, step = _f32(float(h.lr)), float(h.step)
        scale = 1.0 if h.grad_scale is None else float(h.grad_scale)
        bc1 = 1.0 - h.beta1**step if h.bias_correction else 1.0
        bc2 = 1.0 - h.beta2**step if h.bias_correction else 1.0
        decay = 1.0 - lr * h.weight_decay if h.adam_w_mode else 1.0
        return lr / bc1, 1.0 / math.sqrt(bc2), decay, 1.0 / _f32(scale)

    device = tensors[0].device

    def f64(x, default=None):
        if isinstance(x, torch.Tensor):
            return x.reshape(()).to(torch.float64)
        # A fill on the device, not torch.tensor(x, device=...): that one copies from the host, which
        # blocks the host and cannot be captured in a CUDA graph.
        return torch.full((), float(default if x is None else x), dtype=torch.float64, device=device)

    lr, step, scale = f64(h.lr).float().double(), f64(h.step), f64(h.grad_scale, 1.0).float().double()
    one = torch.ones((), dtype=torch.float64, device=device)
    bc1 = 1.0 - torch.pow(h.beta1, step) if h.bias_correction else one
    bc2 = 1.0 - torch.pow(h.beta2, step) if h.bias_correction else one
    decay = 1.0 - lr * h.weight_decay if h.adam_w_mode else one
    return torch.stack([lr / bc1, bc2.rsqrt(), decay, 1.0 / scale]).to(torch.float32)


def host_constants(h: AdamHyper):
    """For kernels that take plain numbers (the low-bit ones): None when found_inf says to skip the
    step (a host read), else (step_size, inv_bc2_sqrt, decay, inv_grad_scale, step as an int, l2)."""
    if h.found_inf is not None and h.found_inf.item() != 0:
        return None
    coef = coefficients(h)
    step_size, inv_bc2_sqrt, decay, inv_scale = coef.tolist() if isinstance(coef, torch.Tensor) else coef
    step = int(h.step.item() if isinstance(h.step, torch.Tensor) else h.step)
    return step_size, inv_bc2_sqrt, decay, inv_scale, step, 0.0 if h.adam_w_mode else h.weight_decay
