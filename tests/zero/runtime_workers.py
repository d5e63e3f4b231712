"""Per-rank bodies of the ZeRO runtime tests (test_zero_runtime.py), run by dist_harness.

Each compares against torch.optim.AdamW on one process over the full batch:
the ranks split every batch evenly, so the average of their per-rank mean
losses is the full-batch mean loss."""

import copy
import gc
import weakref

import torch
import torch.nn as nn

import zerokern
from zerokern import FusedZeroAdam
from numerics import abs_diff

VOCAB, D, CTX, BATCH = 29, 24, 6, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TinyGPT(nn.Module):
    """Tied embedding/head, a few blocks, a final norm: the shape of a real model."""

    def __init__(self, layers=3):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln = nn.LayerNorm(D)

    def forward(self, idx):
        x = self.tok(idx)
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()


def gpt(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()


def tokens(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(VOCAB, (BATCH, CTX + 1), generator=g) for _ in range(steps)]


def gpt_loss(model, seq):
    logits = model(seq[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def mine(seq, rank, world):
    per = seq.shape[0] // world
    return seq[rank * per:(rank + 1) * per]


def max_diff(a, b):
    return max(abs_diff(x, y) for x, y in zip(a.parameters(), b.parameters()))


def reference_step(ref, masters, ref_opt, backward_on_rank, world):
    """One torch.optim.AdamW step on fp32 masters over the ranks' averaged grads (a rank without a
    grad adds zeros; None where no rank had one, which AdamW skips), written back into ref's params
    (which may be bf16)."""
    grads = [None] * len(masters)
    for r in range(world):
        ref.zero_grad()
        backward_on_rank(r)
        for i, p in enumerate(ref.parameters()):
            if p.grad is not None:
                grads[i] = (0 if grads[i] is None else grads[i]) + p.grad.float() / world
    for m, g in zip(masters, grads):
        m.grad = g
    ref_opt.step()
    with torch.no_grad():
        for m, p in zip(masters, ref.parameters()):
            p.copy_(m)


def adamw_reference(steps, lr=1e-2, wd=0.05, seed=0):
    model = gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    for seq in tokens(steps):
        opt.zero_grad()
        gpt_loss(model, seq).backward()
        opt.step()
    return model


def module_units(rank, world, stage, steps=8):
    """zerokern.shard on each block and the root, then FusedZeroAdam over model.parameters()."""
    model = gpt()
    for b in model.blocks:
        zerokern.shard(b, stage=stage, bucket_cap_mb=0.002)
    zerokern.shard(model, stage=stage, bucket_cap_mb=0.002)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    for seq in tokens(steps):
        opt.zero_grad()
        gpt_loss(model, mine(seq, rank, world)).backward()
        opt.step()
    root = model._zerokern_unit
    order = [b.name for b in opt.schedule.buckets]
    return {"diff": max_diff(model, adamw_reference(steps)), "units": len(model.zero_units()),
            "root_buckets": len(root.buckets), "first": order[0], "last": order[-1], "stage": opt.zero_stage}


def gradient_sync_off_accumulates(rank, world):
    """set_requires_gradient_sync(False) on the model (what Accelerate drives): two micro-batches,
    the first unsynced, equal one full batch under AdamW."""
    model = gpt()
    for b in model.blocks:
        zerokern.shard(b, stage=2, bucket_cap_mb=0.002)
    zerokern.shard(model, stage=2, bucket_cap_mb=0.002)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    launches = []
    for b in opt.schedule.buckets:
        real = b.launch
        b.launch = lambda real=real: (launches.append(1), real())[1]
    for seq in tokens(4):
        part = mine(seq, rank, world)
        half = part.shape[0] // 2
        opt.zero_grad()
        model.set_requires_gradient_sync(False)
        (gpt_loss(model, part[:half]) / 2).backward()
        model.set_requires_gradient_sync(True)
        (gpt_loss(model, part[half:]) / 2).backward()
        opt.step()
    return {"diff": max_diff(model, adamw_reference(4)), "launches": len(launches),
            "buckets": len(opt.schedule.buckets)}


class Boom(torch.autograd.Function):
    """Identity whose backward raises while `armed`: a backward interrupted part-way."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("boom: simulated out-of-memory in backward")
        return g


class BoomGPT(TinyGPT):
    def forward(self, idx):
        x = self.tok(idx)
        for k, b in enumerate(self.blocks):
            x = b(x)
            if k == 0:
                x = Boom.apply(x)  # blocks 1.. and the head get grads before it raises
        return self.ln(x) @ self.tok.weight.t()


def _interrupted_run(model, opt, seqs, split, zero_after_failure):
    """Steps over `seqs`; the backward of step 1 raises part-way and is caught."""
    for k, seq in enumerate(seqs):
        opt.zero_grad()
        if k == 1:
            Boom.armed = True
            try:
                gpt_loss(model, split(seq)).backward()
            except RuntimeError as e:
                assert "boom" in str(e)
            Boom.armed = False
            if zero_after_failure:
                opt.zero_grad()
        gpt_loss(model, split(seq)).backward()
        opt.step()


def interrupted_backward(rank, world, stage, zero_after_failure):
    """An exception caught mid-backward, then training goes on: the same numbers as AdamW
    doing the same (with zero_grad() after the failure, the partial grads are dropped;
    without it they stay, as torch accumulates them)."""
    torch.manual_seed(0)
    model = BoomGPT()
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=stage, bucket_cap_mb=0.001)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    seqs = tokens(5)
    _interrupted_run(model, opt, seqs, lambda s: mine(s, rank, world), zero_after_failure)
    _interrupted_run(ref, ref_opt, seqs, lambda s: s, zero_after_failure)
    return {"diff": max_diff(model, ref), "state": opt.schedule.state.value}


def released_buffers_die(rank, world):
    """Stage 2: after step() no full grad buffer survives outside the optimizer's small pool (weak
    references to every buffer the hooks saw die or are the pool's free buffers), at any world size."""
    model = gpt()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=0.002)
    seen = {}

    def look(p):
        for b in opt.schedule.buckets:
            if b.full is not None:
                seen[id(b.full)] = weakref.ref(b.full)
                base = getattr(b, "_base", None)
                if base is not None:
                    seen[id(base)] = weakref.ref(base)

    hooks = [p.register_post_accumulate_grad_hook(look) for p in model.parameters()]
    seq = tokens(1)[0]
    alive_after, pooled, allocations = [], [], []
    for _ in range(2):
        opt.zero_grad()
        gpt_loss(model, mine(seq, rank, world)).backward()
        opt.step()
        gc.collect()
        alive = [r() for r in seen.values() if r() is not None]
        free = list(opt.schedule.pool._free)
        alive_after.append(len([t for t in alive if not any(t is f for f in free)]))
        pooled.append(sum(t.numel() * t.element_size() for t in free))
        allocations.append(opt.schedule.pool.allocations)
    for h in hooks:
        h.remove()
    return {"alive": alive_after, "refs": len(seen), "pooled": pooled, "allocations": allocations,
            "kept": len(opt.schedule.pool._free), "keep": opt.schedule.pool.keep,
            "pool_peak": opt.schedule.pool.peak_bytes,
            "grads_bytes": opt.memory_report()["grads"], "shard_bytes": sum(
                b.shard.numel() * b.shard.element_size() for b in opt.schedule.buckets if b.shard is not None),
            # torch keeps each grad after step(); at stage 2 it is a placeholder without storage
            # ([Note: grads after step] in zerokern/zero/grads/placeholder.py)
            "grad_none": all(p.grad is None or (type(p.grad).__name__ == "ShardedGrad" and p.grad.kind == "consumed")
                             for p in model.parameters())}


def state_dict_helpers(rank, world, stage):
    """torch's get_optimizer_state_dict sees per-param state and changes nothing."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = gpt()
    twin = copy.deepcopy(model)
    opts = [FusedZeroAdam(m.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=stage, bucket_cap_mb=0.002)
            for m in (model, twin)]
    seqs = tokens(6)
    results = {}
    for k, seq in enumerate(seqs):
        for m, o in zip((model, twin), opts):
            o.zero_grad()
            gpt_loss(m, mine(seq, rank, world)).backward()
            if k == 3 and o is opts[0]:
                before = {n: (st["step"].item(), st["exp_avg"].clone()) for n, st in
                          ((n, o.state[p]) for n, p in model.named_parameters())}
                osd = get_optimizer_state_dict(model, o)
                after = {n: (o.state[p]["step"].item(), o.state[p]["exp_avg"]) for n, p in model.named_parameters()}
                results["keys"] = sorted(osd["state"])
                results["fields"] = sorted(osd["state"]["blocks.0.fc1.weight"])
                results["unchanged"] = all(before[n][0] == after[n][0] and torch.equal(before[n][1], after[n][1])
                                           for n in before)
                results["steps"] = {osd["state"][n]["step"].item() for n in osd["state"]}
            o.step()
    results["twin_identical"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    results["names"] = sorted(n for n, _ in model.named_parameters())
    return results


class Router(nn.Module):
    """fp32 router, bf16 experts; expert 1 gets no grad on the last rank (as an MoE rank with no tokens for it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.router = nn.Linear(8, 2)
        self.e0 = nn.Linear(8, 8).to(torch.bfloat16)
        self.e1 = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x, use_e1):
        w = self.router(x).softmax(-1)
        y = w[:, :1] * self.e0(x.bfloat16()).float()
        if use_e1:
            y = y + w[:, 1:] * self.e1(x.bfloat16()).float()
        return y.square().mean()


def mixed_dtypes_unused_on_one_rank(rank, world, overlap):
    """One collective order across dtypes ([Note: one collective order]): the bf16 and fp32 buckets
    reduce in the same order on every rank although one rank has no grad for a bf16 layer."""
    model = Router()
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0, zero_stage=2, bucket_cap_mb=1e-4, overlap_comm=overlap)
    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4], use_e1=rank != world - 1).backward()
        opt.step()
    # Reference: the average of the ranks' grads (zeros for the missing e1 grad), in fp32 masters.
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        reference_step(ref, masters, ref_opt, lambda r: ref(x[r * 4:(r + 1) * 4], use_e1=r != world - 1).backward(),
                       world)
    return {"diff": max_diff(model, ref)}


def grad_edit_after_backward(rank, world, stage, how):
    """Editing .grad between backward and step(): masking, or torch's clip_grad_norm_. Where
    .grad holds the averaged grad (stage 0, or one process) the result is DDP + AdamW's doing the
    same; where it holds the local grad (stage 1 on several ranks) step() raises on every rank; where it
    is a placeholder (stage 2 on several ranks) the edit raises on the rank that makes it."""
    model = gpt()
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=stage, bucket_cap_mb=0.002)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    for seq in tokens(4):
        for m, o, part in ((model, opt, mine(seq, rank, world)), (ref, ref_opt, seq)):
            o.zero_grad()
            gpt_loss(m, part).backward()
            try:  # stage 1 raises in step(); stage 2 ([Note: stage-2 .grad]) at the edit itself
                if how == "mask":
                    m.blocks[1].fc1.weight.grad[:, :5] = 0  # in place, through the .grad view
                    m.ln.weight.grad.mul_(0.5)
                else:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
            except RuntimeError as e:
                return {"error": str(e)}
    return {"diff": max_diff(model, ref), "error": None}
