"""Per-rank bodies of test_wire_checkpoint.py: error feedback of quantized reductions through DCP
checkpoints, at the same world size and across world sizes and meshes."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import zerokern
from zerokern.integrations.dcp import load_optimizer, save_optimizer
from zerokern.optim import wire_checkpoint
from zerokern.optim.state_dict import slice_of
import dist_harness
from models import TanhStack

ROWS = 8  # one global batch, split among the ranks: the mean loss is the same at every world size


def net():
    """The model every rank and the one-process reference build (seeded: they start alike)."""
    return TanhStack((16, 16, 16, 16), 4, seed=31, loss=True)


def data(steps, seed=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, 16, generator=g) for _ in range(steps)]


def build(stage, precision, mesh=None, kind="fused"):
    """kind: "fused" (FusedZeroAdam) or "sgd" (ZeroOptimizer over torch.optim.SGD)."""
    model = net()
    if stage == 3:
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=1e-3, mesh=mesh, reduce_precision=precision)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-3, mesh=mesh, reduce_precision=precision)
        kw = dict(mesh=mesh, reduce_precision=precision)
    else:
        kw = dict(zero_stage=stage, bucket_cap_mb=1e-3, mesh=mesh, reduce_precision=precision)
    if kind == "sgd":
        return model, zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, **kw)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, **kw)


def steps(rank, world, model, opt, batches):
    losses = []
    rows = ROWS // world
    for x in batches:
        opt.zero_grad()
        loss = model(x[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def save(model, opt, path):
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path + "/model")
    save_optimizer(model, opt, path + "/optim")


def load(model, opt, path):
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path + "/model")
    set_model_state_dict(model, sd["model"])
    load_optimizer(model, opt, path + "/optim")


def carried(opt):
    """This rank's folded error feedback, by param index: (values, (start, n, numel) or None
    where whole) (a collective)."""
    sd = opt.state_dict()
    return {k: (st[wire_checkpoint.KEY].clone(), slice_of(st[wire_checkpoint.KEY]))
            for k, st in sd["state"].items() if wire_checkpoint.KEY in st}


def save_run(rank, world, path, stage, precision, mesh, n, m, kind="fused"):
    """Train n steps, save, train m more (the uninterrupted run's last m losses)."""
    batches = data(n + m)
    model, opt = build(stage, precision, mesh, kind)
    steps(rank, world, model, opt, batches[:n])
    save(model, opt, path)
    folded = carried(opt)
    after = steps(rank, world, model, opt, batches[n:])
    return {"after": after, "folded": folded,
            "ef_bytes": opt.memory_report()["error_feedback"]}


def load_run(rank, world, path, stage, precision, mesh, n, m, forget=False, kind="fused"):
    """A fresh model and optimizer load the checkpoint and train the same m steps (forget: with
    the residuals dropped after loading, to measure what restoring them is worth)."""
    batches = data(n + m)
    model, opt = build(stage, precision, mesh, kind)
    load(model, opt, path)
    if forget:
        wire_checkpoint.restore(opt, [None] * len(opt.stores), wire_checkpoint.counts(opt))
    folded = carried(opt) if world > 1 else {}  # the carried value as restored, folded again
    counts = wire_checkpoint.counts(opt)
    resumed = steps(rank, world, model, opt, batches[n:])
    return {"resumed": resumed, "folded": folded, "counts": counts}


def uninterrupted(rank, world, stage, precision, mesh, n, m):
    """n + m steps without stopping: the last m losses."""
    model, opt = build(stage, precision, mesh)
    return steps(rank, world, model, opt, data(n + m))[n:]


def skipped_fold(rank, world):
    """Rank 0 asks for a quantized optimizer's state_dict, rank 1 does not: the error rank 0 gets."""
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "2"
    model, opt = build(2, "int8")
    steps(rank, world, model, opt, data(1))
    err = None
    if rank == 0:
        try:
            opt.state_dict()
        except RuntimeError as e:
            err = str(e)
        finally:
            dist_harness.tell_ranks("rank 0 is past state_dict()")
    else:
        dist_harness.wait_for("rank 0 is past state_dict()")  # busy elsewhere (not gone) until the check gives up
    return err


def full_round_trip(rank, world, stage, precision, n):
    """Train n steps; a fresh optimizer loads opt.full_state_dict() (handed to every rank): this
    rank's folded error feedback before and after, and the whole entry's shape (rank 0)."""
    model, opt = build(stage, precision)
    steps(rank, world, model, opt, data(n))
    before = carried(opt)
    full = [opt.full_state_dict()]
    shape = None if full[0] is None else tuple(full[0]["state"][0][wire_checkpoint.KEY].shape)
    dist.broadcast_object_list(full, src=0)
    model2, opt2 = build(stage, precision)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(full[0])
    return {"before": before, "after": carried(opt2), "counts": wire_checkpoint.counts(opt2), "shape": shape}


def _recipe(stage):
    """docs/checkpoints.md's DCP recipe as written: (imports, save lines, load lines). Stage 3 has
    its own block (model.state_dict(), and load_state_dict after dcp.load); its imports are the
    first block's."""
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "checkpoints.md")).read()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    first = blocks[0].split("\n\n")
    imports, save_lines, load_lines = first[0], first[1], first[2]
    if stage == 3:
        third = next(b for b in blocks if "model.load_state_dict(sd[\"model\"])" in b).split("\n\n")
        save_lines, load_lines = third[0], third[1]
    return imports, save_lines, load_lines


def recipe_run(rank, world, path, stage, precision, phase, n, m):
    """Train n steps and save (phase "save"), or build anew, load and train m steps (phase "load"),
    with docs/checkpoints.md's recipe, executed as the page has it."""
    batches = data(n + m)
    model, opt = build(stage, precision)
    imports, save_lines, load_lines = _recipe(stage)
    scope = {"model": model, "opt": opt, "path": path, "rank": rank}
    exec(imports, scope)
    if phase == "save":
        steps(rank, world, model, opt, batches[:n])
        exec(save_lines, scope)
        return {"after": steps(rank, world, model, opt, batches[n:])}
    exec(load_lines, scope)
    counts = wire_checkpoint.counts(opt)  # as loaded
    return {"resumed": steps(rank, world, model, opt, batches[n:]), "counts": counts}
