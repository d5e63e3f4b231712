"""FusedZeroAdam's state dicts: this rank's shard, the gathered full state in
torch.optim.AdamW's format, and loading either (re-sharding a full one to the
current world size). Only tensors and plain Python values, so
torch.load(weights_only=True) reads them.

Shard:  {"state": {}, "param_groups": [...], "zerokern": {"kind": "shard", "rank", "world_size",
         "zero_stage", "param_numels", "layout", "steps", "groups": [{"buckets": [{"exp_avg",
         "exp_avg_sq", "master"}]}]}}
Full:   {"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...],
         "zerokern_master": {index: fp32 tensor}}   (AdamW ignores the extra key)
"""

import torch

FORMAT = 1
_HYPER = ("lr", "betas", "eps", "weight_decay")


def _groups_meta(opt):
    out, k = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        meta = {key: (list(g[key]) if key == "betas" else g[key]) for key in _HYPER}
        meta.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                    params=list(range(k, k + n)))
        out.append(meta)
        k += n
    return out


def _layout_signature(opt):
    return [[b.padded_numel for b in g.layout.buckets] for g in opt.groups]


def shard_state_dict(opt):
    return {
        "state": {},
        "param_groups": _groups_meta(opt),
        "zerokern": {
            "format": FORMAT, "kind": "shard", "rank": opt.comm.rank, "world_size": opt.comm.world_size,
            "zero_stage": opt.zero_stage, "param_numels": [p.numel() for g in opt.param_groups for p in g["params"]],
            "layout": _layout_signature(opt), "steps": list(opt._steps),
            "groups": [{"buckets": [{"exp_avg": g.exp_avg[b].clone(), "exp_avg_sq": g.exp_avg_sq[b].clone(),
                                     "master": None if g.master[b] is None else g.master[b].clone()}
                                    for b in range(len(g.layout.buckets))]} for g in opt.groups],
        },
    }


def _gather_bucket(opt, g, shard):
    """The full bucket from every rank's shard (a collective)."""
    if not (opt.comm.distributed and g.stage >= 1):
        return shard
    full = shard.new_empty(shard.numel() * opt.comm.world_size)
    opt.comm.wait(opt.comm.all_gather(full, shard, name="gather_state"))
    return full


def full_state_dict(opt):
    """Collective: every rank calls it; rank 0 gets the dict, the others None."""
    state, masters = {}, {}
    shapes = {i: p.shape for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for g in opt.groups:
        has_master = g.low_precision and all(m is not None for m in g.master)
        for b, bucket in enumerate(g.layout.buckets):
            m = _gather_bucket(opt, g, g.exp_avg[b])
            v = _gather_bucket(opt, g, g.exp_avg_sq[b])
            w = _gather_bucket(opt, g, g.master[b]) if has_master else None
            if opt.comm.rank != 0:
                continue
            for li in bucket.tensors:
                gi, s = g.indices[li], g.layout.slots[li]
                sl = slice(s.offset, s.offset + s.numel)
                if opt._steps[gi] > 0:
                    state[gi] = {"step": torch.tensor(float(opt._steps[gi])), "exp_avg": m[sl].view(shapes[gi]).clone(),
                                 "exp_avg_sq": v[sl].view(shapes[gi]).clone()}
                if w is not None:
                    masters[gi] = w[sl].view(shapes[gi]).clone()
    if opt.comm.rank != 0:
        return None
    out = {"state": state, "param_groups": _groups_meta(opt)}
    if masters:
        out["zerokern_master"] = masters
    return out


def _load_groups(opt, saved):
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(saved)} param groups, the optimizer {len(opt.param_groups)}")
    for i, (mine, theirs) in enumerate(zip(opt.param_groups, saved)):
        if len(theirs["params"]) != len(mine["params"]):
            raise ValueError(f"param group {i}: the state dict has {len(theirs['params'])} params, "
                             f"the optimizer {len(mine['params'])}")
        for key in _HYPER:
            if key in theirs:
                mine[key] = tuple(theirs[key]) if key == "betas" else theirs[key]


def load_state_dict(opt, sd):
    meta = sd.get("zerokern") if isinstance(sd, dict) else None
    if meta is not None and meta.get("kind") == "shard":
        _load_shard(opt, sd, meta)
    else:
        _load_full(opt, sd)
    _load_groups(opt, sd["param_groups"])
    opt._piece_cache.clear()


def _load_shard(opt, sd, meta):
    here = {"rank": opt.comm.rank, "world_size": opt.comm.world_size, "zero_stage": opt.zero_stage,
            "layout": _layout_signature(opt)}
    for key, value in here.items():
        if meta.get(key) != value:
            raise ValueError(f"this shard was saved with {key}={meta.get(key)!r}, but this optimizer has "
                             f"{key}={value!r}; a shard loads only into the same rank, world size, stage and bucket "
                             "layout (load a full_state_dict() to re-shard)")
    numels = [p.numel() for g in opt.param_groups for p in g["params"]]
    if meta["param_numels"] != numels:
        raise ValueError("this shard was saved for parameters of other sizes")
    opt._steps = list(meta["steps"])
    for g, saved in zip(opt.groups, meta["groups"]):
        for b, bucket in enumerate(saved["buckets"]):
            g.exp_avg[b].copy_(bucket["exp_avg"])
            g.exp_avg_sq[b].copy_(bucket["exp_avg_sq"])
            g.master[b] = None if bucket["master"] is None else bucket["master"].clone().to(g.device)


def _load_full(opt, sd):
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {int(k): v for k, v in sd["state"].items()}
    masters = {int(k): v for k, v in sd.get("zerokern_master", {}).items()}
    for i, st in state.items():
        if not 0 <= i < len(params):
            raise ValueError(f"the state dict has state for param {i}; the optimizer has {len(params)} params")
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].numel() != params[i].numel():
                raise ValueError(f"state[{i}]['{key}'] has {st[key].numel()} elements, param {i} has "
                                 f"{params[i].numel()}")
    opt._steps = [int(float(state[i]["step"])) if i in state else 0 for i in range(len(params))]
    for g in opt.groups:
        have_all_masters = g.low_precision and all(gi in masters for gi in g.indices)
        for b in range(len(g.layout.buckets)):
            g.exp_avg[b].zero_()
            g.exp_avg_sq[b].zero_()
            master = g.param_shard(b).float() if have_all_masters else None
            for pc in g.layout.rank_pieces(g.rank, b):
                gi = g.indices[pc.index]
                src = slice(pc.tensor_start, pc.tensor_start + pc.numel)
                dst = slice(pc.shard_offset, pc.shard_offset + pc.numel)
                if gi in state:
                    g.exp_avg[b][dst].copy_(state[gi]["exp_avg"].reshape(-1)[src])
                    g.exp_avg_sq[b][dst].copy_(state[gi]["exp_avg_sq"].reshape(-1)[src])
                if master is not None:
                    master[dst].copy_(masters[gi].reshape(-1)[src])
            # No saved master: made from the (then current) params at the next step.
            g.master[b] = master
