"""The hyper-parameters of one fused Adam call, as one value."""

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
