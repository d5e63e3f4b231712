"""Per-rank bodies of test_zero_optimizer.py: zerokern.ZeroOptimizer over a torch optimizer at
stages 1-3, against the same torch optimizer on one process over the full batch."""

import copy

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import zerokern
from numerics import abs_diff
from models import ThreeLayers

STEPS = 4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def _groups(model):
    """Two param groups with their own keys: weights, and biases at another lr without decay."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 0.02, "weight_decay": 0.0}]


def _data(world):
    g = torch.Generator().manual_seed(12)
    return [torch.randn(4 * world, 6, generator=g) for _ in range(STEPS)], torch.randn(8, 6, generator=g)


def train(rank, world, name, stage):
    cls, kw = OPTIMIZERS[name]
    data, held_out = _data(world)
    ref = ThreeLayers()
    ref_opt = cls(_groups(ref), **kw)
    model = ThreeLayers()
    if stage == 3:
        for m in (model.a, model.b, model.head):
            zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
        opt = zerokern.ZeroOptimizer(_groups(model), cls, **kw)
    else:
        opt = zerokern.ZeroOptimizer(_groups(model), cls, zero_stage=stage, bucket_cap_mb=1e-4, **kw)
    losses, ref_losses = [], []
    for x in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = model(x[rank * 4:(rank + 1) * 4])
        loss.backward()
        ref_loss = ref(x)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        both = torch.stack([loss.detach()])
        torch.distributed.all_reduce(both)
        losses.append(both.item() / world)
        ref_losses.append(ref_loss.item())
    with torch.no_grad():
        eval_loss, ref_eval = model(held_out).item(), ref(held_out).item()
    full = zerokern.full_state_dict(model, rank0_only=False)
    sd = opt.state_dict()
    # the same world size: this rank's state loads back and training goes on alike
    twin_model = copy.deepcopy(ref) if stage != 3 else None
    return {"losses": losses, "ref_losses": ref_losses, "eval": eval_loss, "ref_eval": ref_eval,
            "diff": max(abs_diff(full[n], p) for n, p in ref.named_parameters()),
            "state_keys": sorted({k for st in sd["state"].values() for k in st}),
            "lr": [g["lr"] for g in opt.param_groups], "twin": twin_model is not None}


def resume(rank, world, stage):
    """state_dict() after 2 steps, loaded into a fresh ZeroOptimizer: the next 2 steps are
    bitwise those of the uninterrupted run; a whole (one-process) torch state dict loads too."""
    cls, kw = OPTIMIZERS["adamw"]
    data, _ = _data(world)

    def build():
        model = ThreeLayers()
        return model, zerokern.ZeroOptimizer(_groups(model), cls, zero_stage=stage, bucket_cap_mb=1e-4, **kw)

    def run(model, opt, xs):
        for x in xs:
            opt.zero_grad()
            model(x[rank * 4:(rank + 1) * 4]).backward()
            opt.step()

    model, opt = build()
    run(model, opt, data[:2])
    sd, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    run(model, opt, data[2:])
    model2, opt2 = build()
    model2.load_state_dict(weights)
    opt2.load_state_dict(sd)
    run(model2, opt2, data[2:])
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    # the same torch optimizer's whole state (one process, full batch) loads into the shards
    ref = ThreeLayers()
    ref_opt = cls(_groups(ref), **kw)
    for x in data[:2]:
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    model3, opt3 = build()
    model3.load_state_dict(ref.state_dict())
    opt3.load_state_dict(ref_opt.state_dict())
    run(model3, opt3, data[2:])
    for x in data[2:]:
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    return {"same": same, "from_torch": max(abs_diff(a, b) for a, b in zip(model3.parameters(), ref.parameters()))}


# Inner optimizers for the checkpoint tests (issue 39): momentum SGD creates its buffer at a param's
# first step (a clone of the grad), Adam and centered RMSprop at their first step too.
CKPT_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd_dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, centered=True, momentum=0.5, weight_decay=0.01)),
}


def _build(world, name, stage):
    cls, kw = CKPT_OPTIMIZERS[name]
    model = ThreeLayers()
    if stage == 3:
        for m in (model.a, model.b, model.head):
            zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
        return model, zerokern.ZeroOptimizer(_groups(model), cls, **kw)
    return model, zerokern.ZeroOptimizer(_groups(model), cls, zero_stage=stage if world > 1 else 0,
                                         bucket_cap_mb=1e-4, **kw)


def _run(model, opt, rank, xs):
    for x in xs:
        opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4]).backward()
        opt.step()


def _weights(model, stage):
    if stage == 3:  # each rank holds slices: the whole weights (a collective)
        return zerokern.full_state_dict(model, rank0_only=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dcp_save(model, opt, via, path):
    if via == "dcp":  # docs/checkpoints.md's recipe
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    else:  # torch's helpers
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=path)


def _dcp_load(model, opt, via, path):
    if via == "dcp":
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    else:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])


def checkpoint_resume(rank, world, name, stage, via, path, save_at):
    """Train STEPS steps; after save_at of them save with DCP (`via` "dcp": model.state_dict() and
    opt.state_dict(); "helpers": torch's get_/set_*_state_dict) and go on: the uninterrupted run.
    Then a fresh model and ZeroOptimizer load the checkpoint and train the remaining steps.
    via "round_trip": no file; after save_at steps torch's helpers take the optimizer's state dict
    and load it back into the same optimizer, against a run without that round trip."""
    data, _ = _data(world)
    model, opt = _build(world, name, stage)
    _run(model, opt, rank, data[:save_at])
    if via == "round_trip":
        before = len(opt.inner.state)
        set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt))
        after = len(opt.inner.state)
    else:
        _dcp_save(model, opt, via, path)
    _run(model, opt, rank, data[save_at:])
    model2, opt2 = _build(world, name, stage)
    if via == "round_trip":
        _run(model2, opt2, rank, data)  # uninterrupted
    else:
        _dcp_load(model2, opt2, via, path)
        before = after = None
        _run(model2, opt2, rank, data[save_at:])
    a, b = _weights(model, stage), _weights(model2, stage)
    return {"same": a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a),
            "diff": max(abs_diff(a[n], b[n]) for n in a), "inner_before": before, "inner_after": after,
            "weights": a}


def resume_elsewhere(rank, world, name, stage, path, save_at):
    """A fresh model and ZeroOptimizer at this world size load a checkpoint saved by
    checkpoint_resume (via "dcp") at another one and train the remaining steps."""
    data, _ = _data(2)  # the saving run's 2-rank batches: each rank takes its part of the same batch
    per = 8 // world
    model, opt = _build(world, name, stage)
    _dcp_load(model, opt, "dcp", path)
    for x in data[save_at:]:
        opt.zero_grad()
        model(x[rank * per:(rank + 1) * per]).backward()
        opt.step()
    return _weights(model, stage)
