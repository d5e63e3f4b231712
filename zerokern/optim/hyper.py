"""Checks of Adam's hyper-parameters, with torch.optim.Adam's wording, shared by
FusedAdam and FusedZeroAdam."""

import math
import numbers

import torch


def _number(name, x):
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(x).__name__} ({x!r})")
    if not math.isfinite(x):
        raise ValueError(f"Invalid {name}: {x} (must be finite)")
    return x


def check_hyper(lr, betas, eps, weight_decay):
    lr, eps, weight_decay = _number("lr", lr), _number("eps", eps), _number("weight_decay", weight_decay)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair of numbers, got {betas!r}")
    b1, b2 = _number("betas[0]", betas[0]), _number("betas[1]", betas[1])
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {b1}")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {b2}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
