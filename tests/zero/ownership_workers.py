"""Per-rank bodies of the ownership tests (test_ownership.py): what users do to params,
grads and the optimizer after it was built, against torch.optim.AdamW on one process
over the full batch doing the same."""

import torch
import torch.nn as nn
import torch.utils.checkpoint as ckpt

import zerokern
from runtime_workers import TinyGPT, gpt, gpt_loss, max_diff, mine, tokens
from zerokern import FusedZeroAdam

LR, WD = 1e-2, 0.05


def _train(model, opt, seqs, split, after_backward=None):
    for k, seq in enumerate(seqs):
        opt.zero_grad()
        gpt_loss(model, split(seq)).backward()
        if after_backward is not None:
            after_backward(model, opt, k)
        opt.step()


def _reference(seed, steps, after_backward=None):
    model = gpt(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _train(model, opt, tokens(steps), lambda s: s, after_backward)
    return model


def moved_after_construction(rank, world, stage, how):
    """The model's params change storage after the optimizer was built; training goes on
    with the values the model holds."""
    model = gpt(0)
    if how == "assign":
        for b in model.blocks:
            zerokern.shard(b, stage=stage, bucket_cap_mb=0.002)
        zerokern.shard(model, stage=stage, bucket_cap_mb=0.002)
        opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD)
    else:
        opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, zero_stage=stage, bucket_cap_mb=0.002)
    seed = 0
    if how == "to_cpu0":
        model.to("cpu:0")  # torch 2.14 copies the params: new storage, same Parameter objects
    elif how == "to_empty":
        seed = 7
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p, q in zip(model.parameters(), gpt(seed).parameters()):
                p.copy_(q)
    elif how == "assign":
        seed = 7
        model.load_state_dict(gpt(seed).state_dict(), assign=True)
    elif how == "data":
        seed = 7
        for p, q in zip(model.parameters(), gpt(seed).parameters()):
            p.data = q.detach().clone()
    _train(model, opt, tokens(5), lambda s: mine(s, rank, world))
    return {"diff": max_diff(model, _reference(seed, 5))}


def cast_after_construction(rank, world):
    """model.to(torch.bfloat16) after the optimizer: a clear error naming the param."""
    model = gpt(0)
    opt = FusedZeroAdam(model.parameters(), lr=LR, zero_stage=2)
    model.to(torch.bfloat16)
    try:
        gpt_loss(model, mine(tokens(1)[0], rank, world)).backward()
        opt.step()
    except RuntimeError as e:
        return str(e)
    return None


def grad_set_to_none(rank, world, stage):
    """p.grad = None after backward skips that param this step, as in torch.optim."""

    def skip(model, opt, k):
        if k % 2 == 1:
            model.blocks[1].fc1.weight.grad = None
            model.ln.bias.grad = None

    model = gpt(0)
    opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, zero_stage=stage, bucket_cap_mb=0.002)
    _train(model, opt, tokens(5), lambda s: mine(s, rank, world), skip)
    return {"diff": max_diff(model, _reference(0, 5, skip)),
            "skipped_step": opt.state[model.blocks[1].fc1.weight]["step"].item()}


class Shared(nn.Module):
    """One Linear used in two reentrant checkpoint segments (ALBERT-style sharing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(6, 16)
        self.shared = nn.Linear(16, 16)
        self.other = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x)
        h = ckpt.checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        h = ckpt.checkpoint(lambda t: torch.tanh(self.other(self.shared(t))), h, use_reentrant=True)
        return self.out(h).square().mean()


def reentrant_shared_layer(rank, world, stage, overlap):
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4 * world, 6, generator=g).requires_grad_() for _ in range(4)]
    model = Shared()
    ref = Shared()
    opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, zero_stage=stage, bucket_cap_mb=1e-4,
                        overlap_comm=overlap)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x in xs:
        opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
    return {"diff": max_diff(model, ref)}


def broadcast_at_construction(rank, world):
    """Every rank builds its model with its own seed (stage 0): rank 0's params win, as with DDP."""
    model = gpt(seed=rank)
    opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, zero_stage=0)
    _train(model, opt, tokens(3), lambda s: mine(s, rank, world))
    return {"diff": max_diff(model, _reference(0, 3))}


def clip_grad_norm(rank, world, stage):
    """opt.clip_grad_norm_ between backward and step(): DDP + AdamW + torch's clip_grad_norm_."""
    norms, ref_norms = [], []
    model = gpt(0)
    opt = FusedZeroAdam(model.parameters(), lr=LR, weight_decay=WD, zero_stage=stage, bucket_cap_mb=0.002)
    _train(model, opt, tokens(4), lambda s: mine(s, rank, world),
           lambda m, o, k: norms.append(o.clip_grad_norm_(0.5).item()))
    ref = _reference(0, 4, lambda m, o, k: ref_norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(),
                                                                                           0.5).item()))
    return {"diff": max_diff(model, ref), "norms": norms, "ref_norms": ref_norms}


def frozen_then_unfrozen(rank, world):
    model = gpt(0)
    model.ln.weight.requires_grad_(False)
    opt = FusedZeroAdam(model.parameters(), lr=LR)
    model.ln.weight.requires_grad_(True)
    gpt_loss(model, mine(tokens(1)[0], rank, world)).backward()
    try:
        opt.step()
    except NotImplementedError as e:
        return str(e)
    return None


__all__ = ["TinyGPT"]
