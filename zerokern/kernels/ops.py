"""zerokern's kernels as functions: one signature, several backends.

fused_adam_ is below; flatten, unflatten and unflatten_into live in flat_ops.py.

    fused_adam_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps,
                weight_decay, step, adam_w_mode=True, bias_correction=True,
                grad_scale=None, found_inf=None, model_params=None, backend="auto")

backend: "auto" (the fastest usable for the tensors' device), "cuda", "triton",
"cpu" or "torch" (plain PyTorch: the reference). available_backends() says
which run here; unavailable_backends() says why the others do not.
"""

from typing import Optional, Sequence

import torch

from .. import _ext  # noqa: F401  loads the compiled operators, if built
from .backends.hyper import AdamHyper, Scalar
from .backends.registry import BackendUnavailableError, available_backends, resolve, unavailable_backends
from .flat_ops import flatten, unflatten, unflatten_into

__all__ = ["fused_adam_", "flatten", "unflatten", "unflatten_into", "available_backends", "unavailable_backends",
           "BackendUnavailableError", "AdamHyper"]


def _f32_scalars(*scalars):
    """lr, step, grad_scale: one-element tensors of other dtypes (an int64 step counter, a float64
    lr) become float32, which every kernel reads; numbers and None pass as they are."""
    out = []
    for x in scalars:
        out.append(x.to(torch.float32) if isinstance(x, torch.Tensor) and x.dtype != torch.float32 else x)
    return out


def fused_adam_(
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
    backend: str = "auto",
) -> None:
    """One Adam (adam_w_mode=False) or AdamW step over lists of tensors, in place, in one pass.

    params, exp_avgs, exp_avg_sqs: fp32, contiguous. grads: fp32, fp16 or bf16
    (mixed within the list is fine), unscaled by grad_scale when given (multiplied
    by 1/grad_scale, as torch.amp.GradScaler does: exact for power-of-two scales).
    model_params: fp16/bf16 tensors that receive the updated params, rounded to
    nearest even, in the same pass (params are then the fp32 master weights).
    found_inf: a one-element float32 tensor; non-zero makes the call change nothing.
    step is the 1-based number of the update being made. lr, step and
    grad_scale may be one-element tensors on the params' device (no host sync).
    """
    # Lists, which the backends' cached paths read directly (a copy only where it is not one already).
    params, grads, exp_avgs, exp_avg_sqs = [x if type(x) is list else list(x) for x in (params, grads, exp_avgs,
                                                                                      exp_avg_sqs)]
    model_params = (model_params if type(model_params) is list else list(model_params)) if model_params else None
    lr, step, grad_scale = _f32_scalars(lr, step, grad_scale)
    hyper = AdamHyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale, found_inf)
    if not params:
        resolve(backend, torch.device("cpu"))  # still reject an unknown backend name
        return
    if not isinstance(params[0], torch.Tensor):
        raise TypeError(f"params[0] is {type(params[0]).__name__}, expected a tensor")
    resolve(backend, params[0].device).fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model_params, hyper)
