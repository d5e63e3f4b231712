"""FusedZeroAdam's state dicts. Only tensors and plain Python values, so
torch.load(weights_only=True) reads them.

Shard (opt.state_dict()): torch.optim.AdamW's format, with this rank's slice of
each param (flattened) in place of the whole, plus where the slices lie:
    {"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master_param"]}},
     "param_groups": [every key, as torch.optim],
     "zerokern": {"format": 2, "kind": "shard", "rank", "world_size", "zero_stage", "param_numels",
                  "layout", "slices": {index: (start, numel)}}}
Full (opt.full_state_dict(), rank 0): torch.optim.AdamW's format for whole params,
plus {"zerokern_master": {index: fp32 tensor}} for fp16/bf16 params (AdamW ignores it).

load_state_dict takes either, or a torch.optim.AdamW state dict for the same
params: per param, a state tensor as large as the param is sliced to this
rank's part; one as large as this rank's slice is taken as that slice.
"""

import torch

FORMAT = 2
_KEYS = ("exp_avg", "exp_avg_sq", "master_param")


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _layout_signature(opt):
    return [s.bucket.plan.padded_numel for s in opt.stores]


def _slices(opt):
    """{global param index: (start in the flattened param, numel)} of this rank's slices."""
    index = {p: k for k, p in enumerate(_params(opt))}
    return {index[opt._trainable[t]]: (start, n) for pieces in opt._pieces for t, _, n, start in pieces}


def shard_state_dict(opt):
    sd = torch.optim.Optimizer.state_dict(opt)
    index = {p: k for k, p in enumerate(_params(opt))}
    for s in opt.stores:
        if s.separate_master and not s.master_valid:
            # Not read from the params yet (that happens at the first step): leave it out, so
            # loading this dict reads it from the params then too.
            for i in s.bucket.plan.tensors:
                k = index[s.flat.params[i]]
                sd["state"][k] = {key: v for key, v in sd["state"][k].items() if key != "master_param"}
    sd["zerokern"] = {
        "format": FORMAT, "kind": "shard", "rank": opt.comm.rank, "world_size": opt.comm.world_size,
        "zero_stage": opt.zero_stage, "param_numels": [p.numel() for p in _params(opt)],
        "layout": _layout_signature(opt), "slices": _slices(opt),
    }
    return sd


def _gather(opt, shard, device):
    """A bucket's full tensor from every rank's shard (a collective when sharded), gathered on
    `device` (the bucket's: an offloaded store's CPU tensors travel through it)."""
    if not (opt.comm.distributed and opt.zero_stage >= 1):
        return shard
    part = shard.to(device)
    full = part.new_empty(part.numel() * opt.comm.world_size)
    opt.comm.wait(opt.comm.all_gather(full, part, name="gather_state"))
    return full.to(shard.device)


def _groups_meta(opt):
    sd = torch.optim.Optimizer.state_dict(opt)
    return sd["param_groups"]


def full_state_dict(opt):
    """Collective: every rank calls it; rank 0 gets the dict, the others None."""
    index = {p: k for k, p in enumerate(_params(opt))}
    state, masters = {}, {}
    for s in opt.stores:
        dev = s.bucket.device
        m, v = _gather(opt, s.exp_avg, dev), _gather(opt, s.exp_avg_sq, dev)
        w = _gather(opt, s.master, dev) if s.separate_master and s.master_valid else None
        if opt.comm.rank != 0:
            continue
        for i in s.bucket.plan.tensors:
            p, slot = s.flat.params[i], s.flat.layout.slots[i]
            k = index[p]
            sl = slice(slot.offset, slot.offset + slot.numel)
            step = int(opt.state[p]["step"].item())
            if step > 0:
                state[k] = {"step": torch.tensor(float(step)), "exp_avg": m[sl].view(p.shape).clone(),
                            "exp_avg_sq": v[sl].view(p.shape).clone()}
            if w is not None and s.low_precision:
                masters[k] = w[sl].view(p.shape).clone()
    if opt.comm.rank != 0:
        return None
    out = {"state": state, "param_groups": _groups_meta(opt)}
    if masters:
        out["zerokern_master"] = masters
    return out


def _check_groups(opt, saved):
    if len(saved) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(saved)} param groups, the optimizer {len(opt.param_groups)}")
    for i, (mine, theirs) in enumerate(zip(opt.param_groups, saved)):
        if len(theirs["params"]) != len(mine["params"]):
            raise ValueError(f"param group {i}: the state dict has {len(theirs['params'])} params, "
                             f"the optimizer {len(mine['params'])}")


def _load_groups(opt, saved):
    for mine, theirs in zip(opt.param_groups, saved):
        # As torch.optim: every saved key (lr, initial_lr, ...) replaces ours; the params stay.
        for key, value in theirs.items():
            if key != "params":
                mine[key] = tuple(value) if key == "betas" else value


def _check_shard(opt, meta):
    if meta.get("format") != FORMAT:
        raise ValueError(f"this shard is format {meta.get('format')}, this zerokern reads format {FORMAT}; "
                         "load a full_state_dict() instead")
    here = {"rank": opt.comm.rank, "world_size": opt.comm.world_size, "zero_stage": opt.zero_stage,
            "layout": _layout_signature(opt)}
    for key, value in here.items():
        if meta.get(key) != value:
            raise ValueError(f"this shard was saved with {key}={meta.get(key)!r}, but this optimizer has "
                             f"{key}={value!r}; a shard loads only into the same rank, world size, stage and bucket "
                             "layout (load a full_state_dict() to re-shard)")
    if meta["param_numels"] != [p.numel() for p in _params(opt)]:
        raise ValueError("this shard was saved for parameters of other sizes")


@torch.no_grad()
def load_state_dict(opt, sd):
    meta = sd.get("zerokern") if isinstance(sd, dict) else None
    if meta is not None and meta.get("kind") == "shard":
        _check_shard(opt, meta)
    params = _params(opt)
    index = {p: k for k, p in enumerate(params)}
    state = {int(k): v for k, v in sd["state"].items()}
    masters = {int(k): v for k, v in sd.get("zerokern_master", {}).items()}
    slices = _slices(opt)
    for k in state:
        if not 0 <= k < len(params):
            raise ValueError(f"the state dict has state for param {k}; the optimizer has {len(params)} params")
    # Every check first (sizes, param groups), so a refused dict changes nothing.
    _check_groups(opt, sd["param_groups"])
    copies = []  # (destination, source or None for zeros)
    steps = []
    for k, p in enumerate(params):
        if p not in opt.state or k not in slices:
            continue
        mine, theirs = opt.state[p], state.get(k, {})
        start, n = slices[k]
        for key in ("exp_avg", "exp_avg_sq"):
            copies.append((mine[key], _my_slice(theirs[key], p, start, n, k, key) if key in theirs else None))
        steps.append((mine["step"], float(theirs.get("step", 0))))
        master = theirs.get("master_param", masters.get(k))
        if "master_param" in mine and master is not None:
            copies.append((mine["master_param"], _my_slice(master, p, start, n, k, "master_param")))
    _load_groups(opt, sd["param_groups"])
    for dst, src in copies:
        dst.zero_() if src is None else dst.copy_(src)
    for dst, value in steps:
        dst.fill_(value)
    for s in opt.stores:
        # A separate master comes from the state dict when it has every one of the store's; else
        # it is read from the params at the next step.
        if s.separate_master:
            ks = [index[s.flat.params[i]] for i in s.bucket.plan.tensors]
            s.master_valid = all(("master_param" in state.get(k, {})) or k in masters for k in ks)
    opt._steps = [int(opt.state[p]["step"].item()) for p in opt._trainable]
    opt._uniform_steps = len(set(opt._steps)) <= 1


def _my_slice(t, p, start, n, k, key):
    flat = t.reshape(-1)
    if flat.numel() == p.numel():
        return flat[start:start + n]
    if flat.numel() == n:
        return flat
    raise ValueError(f"state[{k}]['{key}'] has {flat.numel()} elements; param {k} has {p.numel()} and this rank's "
                     f"slice of it {n}")
