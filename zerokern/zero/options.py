"""The sharding options of one optimizer's params, resolved once: those zerokern.shard() gave
its units (which must agree, naming what differs and where), or those the optimizer was given."""

import dataclasses

import torch

from .comm.factory import comm_for
from .comm.hybrid import resolve_mesh
from .core.stage import ShardConfig, optimizer_stage


def sharding(units, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload, overlap_param_gather,
             align=None, mesh=None, device_type="cpu", reduce_precision=None, gather_precision=None):
    """(Comm, ShardConfig) for the params: the units' own, or one from the arguments. align: the
    element multiple the state needs its shards in (int8 state: its blocks), or None."""
    if units:
        # Bucket size, reshard_after_forward and matrices are each unit's own (a root often keeps its
        # params gathered, as FSDP2's reshard_after_forward=False; each unit names its own matrices:
        # [Note: whole matrices in units]); the rest is one engine's, so alike.
        differ = _differences(units)
        if differ:
            raise ValueError("zerokern: the params were sharded with different options (only bucket_cap_mb, "
                             "reshard_after_forward and matrices may differ per unit); pass the same to every "
                             "shard() call: " + "; ".join(differ))
        config = units[0].config
        given = {"zero_stage": (zero_stage, config.stage), "bucket_cap_mb": (bucket_cap_mb, config.bucket_cap_mb),
                 "overlap_comm": (overlap_comm, config.overlap_comm), "offload": (offload, config.offload),
                 "overlap_param_gather": (overlap_param_gather, config.overlap_param_gather),
                 "reduce_precision": (reduce_precision, config.reduce_precision),
                 "gather_precision": (gather_precision, config.gather_precision)}
        for name, (mine, theirs) in given.items():
            if mine is not None and mine != theirs:
                raise ValueError(f"zerokern: FusedZeroAdam({name}={mine!r}), but zerokern.shard() set {theirs!r} "
                                 f"for these params; pass it to shard() only")
        unaligned = [u for u in units if align is not None and u.config.align % align]
        if unaligned:
            raise ValueError(f"zerokern: unit '{unaligned[0].name}' was laid out for fp32 or bf16 state; int8 state "
                             f"keeps one scale per block of {align} elements, so the shards must align to them: "
                             "pass state_precision='int8' to zerokern.shard() too")
        if process_group is not None and process_group is not units[0].comm.group:
            raise ValueError("zerokern: FusedZeroAdam got another process_group than zerokern.shard(); pass it "
                             "to shard() only")
        if mesh is not None and resolve_mesh(mesh, process_group, device_type).get_group("shard") is not \
                units[0].comm.group:
            raise ValueError("zerokern: FusedZeroAdam got another mesh than zerokern.shard(); pass it to shard() "
                             "only")
        return units[0].comm, config
    comm = comm_for(process_group, mesh, device_type)
    stage = optimizer_stage(zero_stage, comm.world_size)
    return comm, ShardConfig(stage, 25.0 if bucket_cap_mb is None else bucket_cap_mb,
                             True if overlap_comm is None else overlap_comm, offload,
                             **({} if align is None else {"align": align}),
                             overlap_param_gather=False if overlap_param_gather is None else overlap_param_gather,
                             reduce_precision=reduce_precision, gather_precision=gather_precision)


def _differences(units):
    """What differs between the units' sharding, beyond the per-unit options: per field, which
    units have which value ("process group: ranks [0, 1] (blocks.0); mesh (2, 2) (root, head)")."""
    per_field = {f.name: [getattr(u.config, f.name) for u in units] for f in dataclasses.fields(units[0].config)
                 if f.name not in ("bucket_cap_mb", "reshard_after_forward", "matrices")}
    groups = {}  # the units' groups, in order of first use, told apart by identity
    for u in units:
        groups.setdefault(id(u.comm.group), (len(groups), u.comm))
    many = len(groups) > 1
    per_field["process group"] = [_describe_comm(*groups[id(u.comm.group)], many) for u in units]
    out = []
    for field, values in per_field.items():
        distinct = list(dict.fromkeys(map(str, values)))
        if len(distinct) > 1 or (field == "process group" and many):
            which = {v: [u.name for u, w in zip(units, values) if str(w) == v] for v in distinct}
            out.append(f"{field}: " + ", ".join(f"{v} ({', '.join(names)})" for v, names in which.items()))
    return out


def _describe_comm(k, comm, numbered):
    desc = getattr(comm, "description", None)  # a HybridComm's mesh
    if desc is not None:
        what = f"mesh {desc[1]}"
    elif comm.group is None:
        what = "no process group"
    else:
        what = f"ranks {torch.distributed.get_process_group_ranks(comm.group)}"
    return f"group #{k} over {what}" if numbered else what
