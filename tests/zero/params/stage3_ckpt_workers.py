"""Rank functions for tests/zero/params/test_stage3_checkpoint.py: checkpoints of stage-3 models
([Note: stage-3 model state dicts] in zerokern/zero/params/model_state.py). The batch is the same at
every world size (GLOBAL rows, split among the ranks), so a run resumed at another world size
continues the same training."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import zerokern
from param_gather_workers import T, V
from stage3_workers import CkptGPT, _loss
from zerokern.zero.params.empty import held_shape

GLOBAL = 12  # rows per step, split among 1, 2 or 4 ranks


class ScaledGPT(CkptGPT):
    """CkptGPT with a 0-d param too (a logit scale, as CLIP's)."""

    def __init__(self, layers):
        super().__init__(layers)
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, idx):
        return super().forward(idx) * self.logit_scale
BEFORE, AFTER = 3, 3  # steps before the checkpoint and after it
LAYERS = 2


def data(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, V, (GLOBAL, T + 1), generator=g)


def build(world, dtype, seed=0):
    """A stage-3 GPT (tied embedding/head, a 0-d param, blocks as units; buckets so small that
    params are split across ranks mid-row), or at world 1 the same model unsharded with FusedZeroAdam."""
    torch.manual_seed(seed)
    model = ScaledGPT(LAYERS).to(dtype)
    if world > 1:
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=0.001)
        zerokern.shard(model, stage=3, bucket_cap_mb=0.001)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)


def train(model, opt, rank, world, first, last):
    per = GLOBAL // world
    for step in range(first, last):
        opt.zero_grad()
        _loss(model, data(step)[rank * per:(rank + 1) * per]).backward()
        opt.step()


def reference(dtype=torch.float32):
    """torch.optim.AdamW on one process over the whole batch, for BEFORE + AFTER steps."""
    torch.manual_seed(0)
    model = ScaledGPT(LAYERS).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for step in range(BEFORE + AFTER):
        opt.zero_grad()
        _loss(model, data(step)).backward()
        opt.step()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def _whole(model):
    return {k: v.float() for k, v in zerokern.full_state_dict(model, rank0_only=False).items()}


def save(rank, world, path, dtype, via):
    """Train, checkpoint (DCP via the model's and optimizer's own state dicts or torch's helpers,
    plus the consolidated ones), train on: the uninterrupted run."""
    dtype = getattr(torch, dtype)
    model, opt = build(world, dtype)
    train(model, opt, rank, world, 0, BEFORE)
    before = _whole(model)
    if via == "helpers":
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    else:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(sd, checkpoint_id=path + "/dcp")
    full_model = zerokern.full_state_dict(model)
    full_optim = opt.full_state_dict()
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, path + "/full.pt")
    unchanged = all(torch.equal(a, b) for a, b in zip(before.values(), _whole(model).values()))
    train(model, opt, rank, world, BEFORE, BEFORE + AFTER)
    return {"unchanged": unchanged, "at_save": before, "final": _whole(model),
            "shapes_between": sorted({tuple(held_shape(p)) for p in model.parameters()})}


def resume(rank, world, path, dtype, via):
    """A fresh model (other initial weights) loads the checkpoint (`via`: DCP through the own state
    dicts or torch's helpers, or the consolidated file) and trains on."""
    dtype = getattr(torch, dtype)
    model, opt = build(world, dtype, seed=5)
    if via == "full":
        full = torch.load(path + "/full.pt", weights_only=True, mmap=True)
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optim"])
    elif via == "helpers":
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path + "/dcp")
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    else:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=path + "/dcp")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    loaded = _whole(model)
    steps = sorted({int(st["step"].item()) for st in opt.state.values()})
    train(model, opt, rank, world, BEFORE, BEFORE + AFTER)
    return {"loaded": loaded, "steps": steps, "final": _whole(model)}


def resume_unsharded_torch(path):
    """One process, no zerokern: the consolidated file loads into the plain model and
    torch.optim.AdamW, which train on."""
    torch.manual_seed(5)
    model = ScaledGPT(LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    full = torch.load(path + "/full.pt", weights_only=True)
    model.load_state_dict(full["model"])
    opt.load_state_dict(full["optim"])
    for step in range(BEFORE, BEFORE + AFTER):
        opt.zero_grad()
        _loss(model, data(step)).backward()
        opt.step()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def dcp_into_plain_model(path):
    """One process, no zerokern: the DCP checkpoint's model part loads into a plain model (the
    tensors have the model's own shapes)."""
    torch.manual_seed(5)
    model = ScaledGPT(LAYERS)
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path + "/dcp", no_dist=True)
    model.load_state_dict(sd["model"])
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def mistakes(rank, world, path):
    """What is refused, on every rank, with the param and the fix named."""
    model, opt = build(world, torch.float32)
    train(model, opt, rank, world, 0, 1)
    out = {}
    key = "blocks.0.fc1.weight"

    def attempt(name, call):
        try:
            call()
            out[name] = None
        except (RuntimeError, ValueError) as e:
            out[name] = str(e)

    # dcp.load into model.state_dict() and forgetting model.load_state_dict: the next forward raises
    sd = {"model": model.state_dict()}
    dcp.save(sd, checkpoint_id=path)
    dcp.load(sd, checkpoint_id=path)
    attempt("dcp load never loaded", lambda: _loss(model, data(1)[:2]))
    attempt("consolidating it", lambda: zerokern.full_state_dict(model))  # would give the old weights
    model.load_state_dict(sd["model"])  # the fix
    attempt("after loading it", lambda: _loss(model, data(1)[:2]))
    # another rank's slice (a per-rank torch.save loaded on the wrong rank)
    mine = model.state_dict()
    theirs = [None] * world
    torch.distributed.all_gather_object(theirs, {key: mine[key]})
    attempt("other rank's slice", lambda: model.load_state_dict({**mine, key: theirs[(rank + 1) % world][key]}))
    attempt("wrong shape", lambda: model.load_state_dict({**mine, key: torch.zeros(3, 3)}))
    attempt("assign", lambda: model.load_state_dict(mine, assign=True))
    # torch's full gather knows only DTensors: what it gives never loads as weights
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    torch.manual_seed(0)
    plain = ScaledGPT(LAYERS)
    attempt("torch full into plain", lambda: plain.load_state_dict(full))
    # (a fresh dict: load_state_dict(assign=True) left its flag in the metadata of `mine`)
    out["missing"] = list(model.load_state_dict(model.state_dict(), strict=False).missing_keys)
    return out
