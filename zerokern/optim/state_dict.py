"""FusedZeroAdam's state dicts. Only tensors and plain Python values, so
torch.load(weights_only=True) reads them.

Shard (opt.state_dict()): torch.optim.AdamW's format, with this rank's slice of
each param (flattened) in place of the whole:
    {"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master_param"]
                       [, "error_feedback", "error_feedback_count"]}},
     "param_groups": [every key, as torch.optim],
     "zerokern": {"format": 3, "kind": "shard", "world_size", "zero_stage", "rank", "slices"}}
"error_feedback" (fp32, this rank's slice like exp_avg) and "error_feedback_count" (0-dim) are
there only with reduce_precision="int8"/"int4" on several ranks: every rank's quantization
residuals folded into the gradient they still owe, which makes state_dict() a collective there
([Note: error feedback in checkpoints] in optim/wire_checkpoint.py). A dict without them loads
into such an optimizer with zero residuals; one with them loads into any other, which ignores
them.
Full (opt.full_state_dict(), rank 0): torch.optim.AdamW's format for whole params,
plus {"zerokern_master": {index: fp32 tensor}} for fp16/bf16 params (AdamW ignores it), and
the error-feedback entries above, whole, where the shard has them.

[Note: sharded state in checkpoints] Where the state is sharded (stages 1/2 on
several ranks) each slice carries where it lies in the flattened param, as the
attributes of torch.distributed.checkpoint's CheckpointableTensor protocol
(global_shape, global_offsets, local_offsets, local_sizes). So dcp.save of
opt.state_dict() or of get_optimizer_state_dict(model, opt) writes every rank's
slice once, as pieces of one tensor of the param's numel, and dcp.load re-shards
them into any world size (1 included, where the state is whole). torch.save keeps
the attributes too, and they tell load_state_dict which slice a tensor is; the
meta block's rank and slices are used only for a copy that lost them (DCP keeps
one rank's copy of that block, harmless since the tensors it loads keep theirs).

load_state_dict takes either, or a torch.optim.AdamW state dict for the same
params: per param, a state tensor as large as the param is sliced to this
rank's part; a marked slice must be this rank's slice.
"""

import torch

from ..kernels import lowbit
from ..zero.core.dcp_marks import mark_slice
from . import wire_checkpoint

FORMAT = 3
SLICED = ("exp_avg", "exp_avg_sq", "master_param")
MOMENTS = ("exp_avg", "exp_avg_sq")
SECOND = {"exp_avg": False, "exp_avg_sq": True}  # int8 exp_avg_sq holds its square root (lowbit.encode_moment)
SCALE = "_scale"  # "exp_avg_scale": int8 codes' block scales, sliced by blocks ([Note: int8 shards in blocks])
def slice_of(t):
    """(start, n, numel) of a marked slice, else None."""
    shape, offsets = getattr(t, "global_shape", None), getattr(t, "global_offsets", None)
    if shape is None or offsets is None:
        return None
    return (offsets[0][0] if offsets else 0), t.numel(), shape[0]


def _params(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _slices(opt):
    """{global param index: (start in the flattened param, numel)} of this rank's slices."""
    index = {p: k for k, p in enumerate(_params(opt))}
    engine = opt.engine  # the layout of every store: the trainable params and this rank's pieces of them
    return {index[engine.trainable[t]]: (start, n) for pieces in engine.pieces for t, _, n, start in pieces}


def shard_state_dict(opt):
    sd = torch.optim.Optimizer.state_dict(opt)
    for s in opt.stores:
        # Masters not read from the params yet hold what the params hold now (so every state
        # dict has every key: dcp.load fills in place only the keys it is given).
        s.fill_unread_master()
    # rank and slices matter only for a copy that lost the marks (DCP keeps one rank's copy of
    # this block, which is harmless: the tensors it loads in place keep theirs)
    sd["zerokern"] = {"format": FORMAT, "kind": "shard", "world_size": opt.comm.world_size,
                      "zero_stage": opt.zero_stage, "rank": opt.comm.rank, "slices": _slices(opt)}
    add_error_feedback(opt, sd["state"])
    return sd


def add_error_feedback(opt, state):
    """Each param's "error_feedback" and "error_feedback_count" where the reductions are
    quantized ([Note: error feedback in checkpoints] in optim/wire_checkpoint.py: a collective)."""
    carried = wire_checkpoint.fold(opt)
    index = {p: k for k, p in enumerate(_params(opt))}
    for s, pieces, c, n_red in zip(opt.stores, opt.engine.pieces, carried, wire_checkpoint.counts(opt)):
        if c is None:
            continue
        for j, (t, off, n, start) in enumerate(pieces):
            shape = opt.engine.param_of(s, j)[2]  # stage 3: the param itself is empty
            k = index[opt.engine.trainable[t]]
            entry = c[off:off + n].clone()
            if opt.strategy.shards_state:
                mark_slice(entry, start, n, shape.numel())
            # a new dict: torch's state_dict() hands out opt.state's own per-param dicts
            state[k] = {**state.get(k, {}), wire_checkpoint.KEY: entry,
                        wire_checkpoint.COUNT: torch.tensor(float(n_red))}


def _gather(opt, shard, device):
    """A bucket's full tensor from every rank's shard (a collective when sharded), gathered on
    `device` (the bucket's: an offloaded store's CPU tensors travel through it)."""
    if not opt.strategy.shards_state:
        return shard
    part = shard.to(device)
    full = part.new_empty(part.numel() * opt.comm.world_size)
    opt.comm.wait(opt.comm.all_gather(full, part, name="optimizer state_dict"))
    return full.to(shard.device)


def _groups_meta(opt):
    sd = torch.optim.Optimizer.state_dict(opt)
    return sd["param_groups"]


def full_state_dict(opt):
    """Collective: every rank calls it; rank 0 gets the dict, the others None."""
    index = {p: k for k, p in enumerate(_params(opt))}
    state, masters = {}, {}
    carried, counts = wire_checkpoint.fold(opt), wire_checkpoint.counts(opt)  # quantized reductions only
    for s, c, n_red in zip(opt.stores, carried, counts):
        dev = s.bucket.device
        c = None if c is None else _gather(opt, c, dev)
        scales = s.scales() if hasattr(s, "scales") else None
        moments = {key: (_gather(opt, s.state[key], dev), _gather(opt, scales[key], dev) if scales else None)
                   for key in MOMENTS}
        w = _gather(opt, s.master, dev) if s.separate_master and s.master_valid else None
        if not opt.comm.leads:
            continue
        for i in s.bucket.plan.tensors:
            p, slot, shape = s.flat.params[i], s.flat.layout.slots[i], s.flat.members[i].shape  # stage 3: p is empty
            k = index[p]
            sl = slice(slot.offset, slot.offset + slot.numel)
            step = int(opt.state[p]["step"].item())
            if step > 0:  # torch.optim.AdamW's format: fp32, whole (low-bit state decoded)
                state[k] = {"step": torch.tensor(float(step))}
                for key, (full, full_scales) in moments.items():
                    state[k][key] = _decoded(full[sl], full_scales, slot.offset, SECOND[key]).view(shape)
                if c is not None:  # whole, as the moments ([Note: error feedback in checkpoints])
                    state[k][wire_checkpoint.KEY] = c[sl].view(shape).clone()
                    state[k][wire_checkpoint.COUNT] = torch.tensor(float(n_red))
            if w is not None and (s.low_precision or s.holds_gathered):  # not the params' values: kept
                masters[k] = w[sl].view(shape).clone()
    if not opt.comm.leads:
        return None
    out = {"state": state, "param_groups": _groups_meta(opt)}
    if masters:
        out["zerokern_master"] = masters
    return out


def _decoded(codes, scales, offset, second):
    """fp32 values of a param's state (a copy): int8 codes decoded with their blocks' scales
    (the param's blocks start at `offset`, a multiple of BLOCK), bf16 widened."""
    if codes.dtype == torch.uint8:
        first = offset // lowbit.BLOCK
        return lowbit.decode_moment(codes, scales[first:first + lowbit.num_blocks(codes.numel())], second)
    return codes.to(torch.float32, copy=True)


def by_position(sd, saved):
    """`saved` (sd["state"], or a dict keyed alike) keyed by param position. As torch.optim: the
    state is keyed by what the saved param groups list (indices, or names from
    torch.distributed.checkpoint's get_optimizer_state_dict), matched to our params by position."""
    position = {key: k for k, key in enumerate(key for g in sd["param_groups"] for key in g["params"])}
    out = {}
    for key, v in saved.items():
        if key not in position:
            raise ValueError(f"the state dict has state for param {key!r}, which none of its param groups lists")
        out[position[key]] = v
    return out


def check_groups(opt, saved):
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


def _check_shard(meta):
    if meta.get("kind") == "elsewhere":
        raise ValueError(f"this is a note, not optimizer state: the state was saved with "
                         f"torch.distributed.checkpoint into '{meta.get('path')}' next to it (accelerator.save_state "
                         "with zerokern.integrations.accelerate.attach); load it with accelerator.load_state")
    if meta.get("format") != FORMAT:
        raise ValueError(f"this shard is format {meta.get('format')}, this zerokern reads format {FORMAT}; "
                         "load a full_state_dict() (or a torch.distributed.checkpoint) instead")


@torch.no_grad()
def load_state_dict(opt, sd):
    meta = sd.get("zerokern") if isinstance(sd, dict) else None
    if meta is not None and meta.get("kind") in ("shard", "elsewhere"):
        _check_shard(meta)
    params = _params(opt)
    # Every check first (sizes, param groups), so a refused dict changes nothing.
    check_groups(opt, sd["param_groups"])
    state, masters = by_position(sd, sd["state"]), by_position(sd, sd.get("zerokern_master", {}))
    slices = _slices(opt)
    # An unmarked tensor of a slice's size is taken as this rank's slice only if the dict says
    # it was saved by this rank with these slices (a copy lost the marks: tensor.to("cpu:0")).
    mine_too = (meta is not None and meta.get("rank") == opt.comm.rank and meta.get("slices") == slices
                and meta.get("world_size") == opt.comm.world_size)
    # the params' own sizes (a stage-3 param is empty between steps)
    shapes = {s.flat.params[i]: s.flat.members[i].shape for s in opt.stores for i in s.bucket.plan.tensors}
    copies = []  # (destination, source or None for zeros)
    steps = []
    master_src = {}  # id(master view) -> the slice loaded into it
    for k, p in enumerate(params):
        if p not in opt.state or k not in slices:
            continue
        mine, theirs = opt.state[p], state.get(k, {})
        start, n = slices[k]

        def part(t, key):
            return _my_slice(t, shapes[p], start, n, k, key, opt.comm.rank, mine_too)

        for key in MOMENTS:
            copies += _moment_copies(mine, theirs, key, shapes[p], start, n, k, opt.comm.rank, mine_too)
        steps.append((mine["step"], float(theirs.get("step", 0))))
        master = theirs.get("master_param", masters.get(k))
        if "master_param" in mine and master is not None:
            master_src[id(mine["master_param"])] = part(master, "master_param")
            copies.append((mine["master_param"], master_src[id(mine["master_param"])]))
    # A separate master becomes valid when the dict has every one of the store's, unless they
    # are what state_dict() filled in, unchanged (a round trip, as Accelerate's prepare does):
    # then it is still read from the params at the next step, so weights loaded into the model
    # after this are the ones trained.
    valid = {}
    for s in opt.stores:
        if s.separate_master:
            views = [opt.state[s.flat.params[i]]["master_param"] for i in s.bucket.plan.tensors]
            given = [master_src.get(id(v)) for v in views]
            valid[s] = all(g is not None for g in given) and not s.is_round_trip(views, given)
    carried, counts = saved_error_feedback(opt, state, shapes, mine_too)
    _load_groups(opt, sd["param_groups"])
    wire_checkpoint.restore(opt, carried, counts)
    for dst, src in copies:
        dst.zero_() if src is None else dst.copy_(src)
    for dst, value in steps:
        dst.fill_(value)
    for s, ok in valid.items():
        s.master_valid = ok


def saved_error_feedback(opt, state, shapes, mine_too):
    """Per store: the carried gradient of its shard from the saved "error_feedback" entries
    (None where none of its params has one, or its reductions are not quantized: the entry is
    then ignored), and the saved count ([Note: error feedback in checkpoints])."""
    index = {p: k for k, p in enumerate(_params(opt))}
    carried, counts = [], []
    for s, pieces, mine in zip(opt.stores, opt.engine.pieces, wire_checkpoint.counts(opt)):
        c, n_red = None, None
        for j, (t, off, n, start) in enumerate(pieces):
            k = index[opt.engine.trainable[t]]
            theirs = state.get(k, {})
            if mine is None or wire_checkpoint.KEY not in theirs:
                continue
            p = opt.engine.trainable[t]
            part = _my_slice(theirs[wire_checkpoint.KEY], shapes[p], start, n, k, wire_checkpoint.KEY,
                             opt.comm.rank, mine_too)
            if c is None:  # the params without an entry carry nothing
                c = torch.zeros(wire_checkpoint.state_numel(opt, s), dtype=torch.float32, device=s.bucket.device)
            c[off:off + n] = part.to(c.device, torch.float32)
            if wire_checkpoint.COUNT in theirs:
                n_red = max(n_red or 0, int(float(theirs[wire_checkpoint.COUNT])))
        carried.append(c)
        counts.append(n_red)
    return carried, counts


def _moment_copies(mine, theirs, key, shape, start, n, k, rank, mine_too):
    """(destination, source) pairs that load saved moment `key` of param k into this rank's state,
    converting between formats: int8 codes (with their block scales), bf16 or fp32, either way."""
    dst = mine[key]
    second = SECOND[key]
    if key not in theirs:
        value = None
    elif theirs[key].dtype == torch.uint8:
        if key + SCALE not in theirs:
            raise ValueError(f"state[{k}]['{key}'] holds int8 codes, but the state dict has no '{key}{SCALE}' "
                             "(their block scales) for it")
        codes = _my_slice(theirs[key], shape, start, n, k, key, rank, mine_too)
        blocks = lowbit.num_blocks
        scales = _my_slice(theirs[key + SCALE], torch.Size([blocks(shape.numel())]), start // lowbit.BLOCK,
                           blocks(n), k, key + SCALE, rank, mine_too)
        if dst.dtype == torch.uint8:
            return [(dst, codes), (mine[key + SCALE], scales)]
        value = lowbit.decode_moment(codes, scales, second)
    else:
        value = _my_slice(theirs[key], shape, start, n, k, key, rank, mine_too)
    if dst.dtype != torch.uint8:
        return [(dst, value)]
    codes, scales = lowbit.encode_moment(torch.zeros(n) if value is None else value.float(), second)
    return [(dst, codes), (mine[key + SCALE], scales)]


def _my_slice(t, shape, start, n, k, key, rank, mine_too):
    """This rank's part of a saved state tensor: a whole one (p's shape, or flattened) sliced,
    a marked slice that is exactly this rank's, or an unmarked one from this rank's shard."""
    numel = shape.numel()
    if t.dim() > 1 and tuple(t.shape) != tuple(shape):  # same numel, another shape: torch refuses it too
        raise ValueError(f"state[{k}]['{key}'] has shape {list(t.shape)}, but param {k} has shape {list(shape)}")
    where = slice_of(t)
    if where is not None and where[2] == numel and where[:2] == (start, n):
        return t.reshape(-1)
    if where is None and t.numel() == numel:
        return t.reshape(-1)[start:start + n]
    if where is None and mine_too and t.numel() == n:
        return t.reshape(-1)
    got = (f"is the slice [{where[0]}, {where[0] + where[1]}) of {where[2]} elements" if where is not None
           else f"has {t.numel()} elements")
    raise ValueError(
        f"state[{k}]['{key}'] {got}, but param {k} has {numel} elements and this rank (rank "
        f"{rank}) holds [{start}, {start + n}) of them. A shard from opt.state_dict() loads only into the "
        "same rank at the same world size and bucket layout; to re-shard, save with torch.distributed.checkpoint "
        "(dcp.save of get_optimizer_state_dict) or opt.full_state_dict()")


