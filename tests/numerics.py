"""How far apart two tensors are, for tolerance checks that a NaN must fail."""

import torch


def abs_diff(a, b) -> float:
    """max |a - b| over the elements; inf if either side holds a NaN or an inf (a tolerance check
    must fail then, and Python's max() would silently drop a NaN: max(0.0, nan) is 0.0)."""
    d = (a.detach().float() - b.detach().float()).abs()
    if d.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(d).all()):
        return float("inf")
    return d.max().item()
