"""Per-rank bodies of test_dcp.py: torch.distributed.checkpoint with FusedZeroAdam,
saved at one world size and resumed at another."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from zero_workers import BATCH, batches, loss_fn, make_model
from zerokern import FusedZeroAdam

STEPS_BEFORE, STEPS_AFTER = 4, 3


def build(world, dtype, seed=0):
    model = make_model(dtype, seed=seed)
    # stage 2 on several ranks (sharded state), small buckets: params split across ranks
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, bucket_cap_mb=0.001,
                        zero_stage=2 if world > 1 else 0)
    return model, opt


def train(model, opt, rank, world, first, last):
    per = BATCH // world
    for x, y in batches(last)[first:]:
        opt.zero_grad()
        loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()]
            + [t.clone() for st in opt.state.values() for t in st.values()])


def save(rank, world, path, dtype, via):
    """Train, save with DCP (`via` torch's state-dict helpers or opt.state_dict()), then go on
    training: the uninterrupted run. Also: getting the state dicts changed nothing."""
    model, opt = build(world, dtype)
    train(model, opt, rank, world, 0, STEPS_BEFORE)
    before = snapshot(model, opt)
    if via == "helpers":
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    else:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))
    dcp.save(sd, checkpoint_id=path)
    full = opt.full_state_dict()  # collective; rank 0 gets the whole state
    train(model, opt, rank, world, STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    return {"unchanged": unchanged, "params": [p.detach().float() for p in model.parameters()], "full": full}


def resume(rank, world, path, dtype, via):
    """A fresh model (other initial weights) and optimizer load the checkpoint and continue."""
    model, opt = build(world, dtype, seed=5)
    if via == "helpers":
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
    else:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    steps = sorted({int(st["step"].item()) for st in opt.state.values()})
    full = opt.full_state_dict()
    train(model, opt, rank, world, STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    return {"steps": steps, "params": [p.detach().float() for p in model.parameters()], "full": full}


def save_without_protocol(rank, world, path):
    """As on torch before 2.14 (no CheckpointableTensor in DCP): dcp.save of sharded state is a
    clear error on every rank instead of keeping one rank's slices."""
    from zerokern.zero.core import dcp_marks
    dcp_marks.HAS_PROTOCOL = False
    model, opt = build(world, torch.float32)
    train(model, opt, rank, world, 0, 1)
    try:
        dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001  DCP wraps the ranks' errors in a CheckpointException (a BaseException)
        return str(e)
    return None
