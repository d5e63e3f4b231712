"""What FusedZeroAdam checks and decides at construction: the param groups it
accepts, and the sharding (the units' own options, or one set from its arguments)."""

import torch

from ..zero.comm import Comm
from ..zero.stage import ShardConfig, optimizer_stage


def sharding(units, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload, overlap_param_gather):
    """(Comm, ShardConfig) for the params: the units' own, or one from the arguments."""
    if units:
        configs = {u.config for u in units}
        groups = {id(u.comm.group) for u in units}
        if len(configs) > 1 or len(groups) > 1:
            raise ValueError("zerokern: the params were sharded with different options or process groups: "
                             + "; ".join(f"{u.name}: {u.config}" for u in units))
        config = units[0].config
        given = {"zero_stage": (zero_stage, config.stage), "bucket_cap_mb": (bucket_cap_mb, config.bucket_cap_mb),
                 "overlap_comm": (overlap_comm, config.overlap_comm), "offload": (offload, config.offload),
                 "overlap_param_gather": (overlap_param_gather, config.overlap_param_gather)}
        for name, (mine, theirs) in given.items():
            if mine is not None and mine != theirs:
                raise ValueError(f"zerokern: FusedZeroAdam({name}={mine!r}), but zerokern.shard() set {theirs!r} "
                                 f"for these params; pass it to shard() only")
        if process_group is not None and process_group is not units[0].comm.group:
            raise ValueError("zerokern: FusedZeroAdam got another process_group than zerokern.shard(); pass it "
                             "to shard() only")
        return units[0].comm, config
    comm = Comm(process_group)
    stage = optimizer_stage(zero_stage, comm.world_size)
    return comm, ShardConfig(stage, 25.0 if bucket_cap_mb is None else bucket_cap_mb,
                             True if overlap_comm is None else overlap_comm, offload,
                             overlap_param_gather=False if overlap_param_gather is None else overlap_param_gather)


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
