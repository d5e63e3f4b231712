"""The param groups the zerokern optimizers accept (checked at their boundary)."""

import torch


def validated_groups(params):
    """The param groups, checked: tensors, floating point, each tensor once, one device."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of param-group dicts, not a single tensor")
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen, device, k = {}, None, 0
    for gi, group in enumerate(groups):
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        group["params"] = ps  # (name, param) pairs stay: torch.optim makes them "param_names"
        for p in ps:
            where = f"params[{k}] (group {gi})"
            if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):  # model.named_parameters()
                where, p = f"{p[0]} (params[{k}], group {gi})", p[1]
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where} is {type(p).__name__}, expected a tensor")
            if not p.is_floating_point():
                raise TypeError(f"{where} is {p.dtype}; FusedZeroAdam trains floating-point params only")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16) and p.requires_grad:
                raise TypeError(f"{where} is {p.dtype}; expected float32, float16 or bfloat16")
            if p.device.type == "meta" and p.requires_grad:
                raise ValueError(f"{where} is on the meta device; materialise the model (to_empty() and "
                                 "initialise it) before building the optimizer")
            if id(p) in seen:
                raise ValueError(f"{where} is the same tensor as params[{seen[id(p)]}]; pass each parameter once")
            seen[id(p)] = k
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"{where} is on {p.device}, params[0] is on {device}; FusedZeroAdam needs one device")
            k += 1
    return groups
