"""fused_adam_lowbit_: Adam/AdamW over low-bit state, in one pass per tensor.

    fused_adam_lowbit_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                       weight_decay, step, adam_w_mode=True, bias_correction=True,
                       grad_scale=None, found_inf=None, model_params=None,
                       exp_avg_scales=None, exp_avg_sq_scales=None, index_bases=None, seed=0,
                       backend="auto")

What each list may hold (one format per call, read from the first tensor of each list):
- params: fp32 master weights (model_params, if given, receive them rounded to nearest), or
  bf16 params updated in place without a master, stochastically rounded.
- exp_avgs / exp_avg_sqs: fp32; bf16 (stochastically rounded); or uint8 codes with one fp32
  scale per block of lowbit.BLOCK elements in exp_avg_scales / exp_avg_sq_scales, requantized
  with new scales in the same pass ([Note: blockwise 8-bit state] in lowbit.py).
- index_bases: for each tensor, the global index of its first element (ints), which keys the
  random stream ([Note: reproducible rounding]); needed where anything is rounded stochastically.
found_inf non-zero: nothing changes, codes and scales included.

The plain-PyTorch backend defines the numbers; the update itself is the fp32 kernel's
(ops.fused_adam_), on dequantized moments.
"""

from typing import Optional, Sequence

import torch

from .backends import torch_lowbit  # the reference's low-bit op, beside torch_ref
from .backends.hyper import AdamHyper, Scalar
from ._checks import check_lowbit_args
from .backends.registry import BACKENDS, PREFERENCE, resolve
from .ops import _f32_scalars

_NATIVE_LOWBIT = ("cuda", "cpu", "triton")  # backends with a low-bit kernel of their own; "auto" uses the reference elsewhere


def fused_adam_lowbit_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: Optional[Scalar] = None,
    found_inf: Optional[torch.Tensor] = None,
    model_params: Optional[Sequence[torch.Tensor]] = None,
    exp_avg_scales: Optional[Sequence[torch.Tensor]] = None,
    exp_avg_sq_scales: Optional[Sequence[torch.Tensor]] = None,
    index_bases: Optional[Sequence[int]] = None,
    seed: int = 0,
    backend: str = "auto",
) -> None:
    params, grads, exp_avgs, exp_avg_sqs = (list(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
    seed = int(seed)
    lr, step, grad_scale = _f32_scalars(lr, step, grad_scale)
    hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale, found_inf)
    args = (params, grads, exp_avgs, exp_avg_sqs, list(model_params) if model_params else None,
            list(exp_avg_scales) if exp_avg_scales is not None else None,
            list(exp_avg_sq_scales) if exp_avg_sq_scales is not None else None,
            list(index_bases) if index_bases is not None else None, seed, hyper)
    check_lowbit_args(*args)  # every backend's rules, here once
    device = params[0].device if params else torch.device("cpu")
    lowbit_backend(backend, device).fused_adam_lowbit_(*args)


def lowbit_backend(backend: str, device: torch.device):
    """The module whose fused_adam_lowbit_ runs for `backend` on `device`: "auto" takes the first
    usable backend with a low-bit kernel in the device's preference order, else the reference."""
    if backend == "auto":
        for name in PREFERENCE.get(device.type, ()):
            if name in _NATIVE_LOWBIT and BACKENDS[name].why_not() is None:
                return resolve(name, device)
        return torch_lowbit
    module = resolve(backend, device)  # an unknown or unusable backend says so first
    if backend == "torch":
        return torch_lowbit
    if backend not in _NATIVE_LOWBIT:
        raise NotImplementedError(f"backend {backend!r} has no low-bit Adam kernel yet; use backend='torch' "
                                  "or 'auto'")
    return module
