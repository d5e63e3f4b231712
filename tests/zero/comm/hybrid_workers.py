"""Per-rank bodies of test_hybrid.py: hybrid sharding over a (replicate, shard) mesh against AdamW
on one process over the full batch, checkpoints across mesh shapes, and bad meshes."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import zerokern
from numerics import abs_diff
from models import TanhStack

STEPS = 3
LR, WD = 1e-2, 0.1


def net():
    """The model every rank and the one-process reference build (seeded: they start alike)."""
    return TanhStack((12, 12, 12, 12), 1, seed=21, loss=True)


def _data(world, steps=STEPS, seed=22):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 * world, 12, generator=g) for _ in range(steps)]


def _build(stage, mesh, optimizer="fused", cap=1e-4):
    model = net()
    if stage == 3:
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=cap, mesh=mesh)
        zerokern.shard(model, stage=3, bucket_cap_mb=cap, mesh=mesh)
        kw = dict(mesh=mesh)  # the units' mesh again: accepted (another one would be refused)
    else:
        kw = dict(zero_stage=stage, bucket_cap_mb=cap, mesh=mesh)
    if optimizer == "sgd":
        return model, zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9, **kw)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=0.5, **kw)


def _steps(rank, world, model, opt, data):
    losses = []
    for x in data:
        opt.zero_grad()
        loss = model(x[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _reference(world, data, optimizer="fused"):
    ref = net()
    if optimizer == "sgd":
        opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for x in data:
        opt.zero_grad()
        loss = ref(x)
        loss.backward()
        if optimizer != "sgd":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return ref, losses


def train(rank, world, mesh, cases):
    """cases: [(stage, optimizer)]: each trained STEPS steps on `mesh` against one process."""
    if mesh == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    data = _data(world)
    out = {}
    for stage, optimizer in cases:
        ref, ref_losses = _reference(world, data, optimizer)
        model, opt = _build(stage, mesh, optimizer)
        losses = _steps(rank, world, model, opt, data)
        full = zerokern.full_state_dict(model, rank0_only=False)
        out[(stage, optimizer)] = {
            "losses": losses, "ref_losses": ref_losses,
            "diff": max(abs_diff(full[n], p) for n, p in ref.named_parameters()),
            "shard_world": opt.comm.world_size, "dp_size": opt.comm.dp_size,
            "adam_state": opt.memory_report()["adam_state"], "numel": sum(p.numel() for p in ref.parameters()),
        }
    return out


def checkpoint(rank, world, path, stage, save_mesh, load_mesh):
    """Train 2 steps at save_mesh, save with DCP, train 2 more; a fresh model and optimizer at
    load_mesh load the checkpoint and train the same 2 steps."""
    data = _data(world, 4)
    model, opt = _build(stage, save_mesh)
    _steps(rank, world, model, opt, data[:2])
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    after = _steps(rank, world, model, opt, data[2:])
    model2, opt2 = _build(stage, load_mesh)
    sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model2, sd["model"])
    set_optimizer_state_dict(model2, opt2, sd["optim"])
    # the same state saved again from load_mesh, for the test to compare what each wrote
    dcp.save({"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)},
             checkpoint_id=path + "-again")
    resumed = _steps(rank, world, model2, opt2, data[2:])
    return {"after": after, "resumed": resumed, "shard_world": opt2.comm.world_size}


def bad_mesh(rank, world, case):
    """The error each rank raises for a bad mesh (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = {"not_dividing": lambda: (3, 2),
            "no_names": lambda: init_device_mesh("cpu", (2, 2)),
            "other_names": lambda: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            "differs": lambda: (2, 2) if rank == 0 else (1, 4),
            "one_flat": lambda: None if rank == 0 else (2, 2)}[case]()
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "30"
    try:
        model, opt = _build(2, mesh)
        _steps(rank, world, model, opt, _data(world, 1))
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def one_rank_raises(rank, world, mesh):
    """Rank 1 reads a stage-3 param outside its unit's forward at step 1 (refused on that rank
    only) and leaves; the others must raise too, not wait or fail with a bare socket error."""
    model, opt = _build(3, mesh)
    for step, x in enumerate(_data(world)):
        opt.zero_grad()
        loss = model(x[2 * rank:2 * rank + 2])
        if rank == 1 and step == 1:
            loss = loss + model.blocks[0].weight.sum()
        loss.backward()
        opt.step()
    return "finished"
