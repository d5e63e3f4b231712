"""Per-rank bodies of test_regressions.py: cases a review of the ZeRO runtime found, each
against torch.optim.AdamW on one process over the full batch (or a twin run)."""

import copy

import torch
import torch.nn as nn

from runtime_workers import gpt, gpt_loss, max_diff, mine, reference_step, tokens
from zerokern import FusedZeroAdam
from numerics import abs_diff


class TwoPaths(nn.Module):
    """`rare` is used on rank 0 only (a conditional layer, an MoE expert with no tokens elsewhere)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.common = nn.Linear(6, 6)
        self.rare = nn.Linear(6, 6)

    def forward(self, x, use_rare):
        h = self.common(x)
        return (self.rare(h) if use_rare else h).square().mean()


def stage0_accumulation_with_a_rank_local_param(rank, world):
    """Stage 0, two synced backwards per step (accumulation without no_sync): the second
    in-place all-reduce must keep the first one's average of `rare` (used on rank 0 only)."""
    model = TwoPaths()
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0, zero_stage=0, bucket_cap_mb=1.0)
    g = torch.Generator().manual_seed(1)
    data = [[torch.randn(4, 6, generator=g) for _ in range(2 * world)] for _ in range(3)]
    for step in data:
        opt.zero_grad()
        for micro in range(2):
            (model(step[micro * world + rank], use_rare=rank == 0) / 2).backward()
        opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for step in data:
        ref_opt.zero_grad()
        for micro in range(2):
            for r in range(world):
                (ref(step[micro * world + r], use_rare=r == 0) / (2 * world)).backward()
        ref_opt.step()
    return {"diff": max_diff(model, ref)}


def fp16_sum_overflow_in_step(rank, world, clip=False):
    """fp16 grads reduced in step() (accumulated under no_sync), or in opt.clip_grad_norm_ just
    before it: a sum that overflows fp16 where no local grad does skips the step on every rank
    instead of writing inf/nan."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8).half()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.no_sync():
        for p in model.parameters():
            p.grad = torch.full_like(p, 40000.0)  # finite here; the sum over 2 ranks is not
    if clip:
        opt.clip_grad_norm_(1.0)
    opt.step()
    after = list(model.parameters())
    return {"finite": all(torch.isfinite(p).all().item() for p in after),
            "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}


def clip_with_grad_scaler(rank, world, how):
    """fp16 + GradScaler: opt.clip_grad_norm_ and max_grad_norm clip the unscaled norm alike."""
    model = gpt(0).half()
    kw = {"max_grad_norm": 0.5} if how == "max_grad_norm" else {}
    opt = FusedZeroAdam(model.parameters(), lr=1e-3, weight_decay=0.0, zero_stage=2, **kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    norms = []
    for seq in tokens(3):
        opt.zero_grad()
        scaler.scale(gpt_loss(model, mine(seq, rank, world))).backward()
        if how == "clip_grad_norm_":
            opt.clip_grad_norm_(0.5)
        scaler.step(opt)
        scaler.update()
        norms.append(float(opt.last_grad_norm))
    return {"params": [p.detach().float().clone() for p in model.parameters()], "norms": norms}


def grad_none_with_max_grad_norm(rank, world):
    """A param whose .grad was set to None counts for nothing in the clip norm, as in torch."""
    model = gpt(0)
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=2, max_grad_norm=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    for seq in tokens(4):
        for m, o, part in ((model, opt, mine(seq, rank, world)), (ref, ref_opt, seq)):
            o.zero_grad()
            gpt_loss(m, part).backward()
            m.blocks[0].fc1.weight.grad = None
            if o is ref_opt:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            o.step()
    return {"diff": max_diff(model, ref)}


def checkpoint_before_first_step(rank, world, order):
    """bf16 params: weights loaded after the optimizer was built, and a shard state dict taken
    before the first step and loaded back, in either order (the optimizer's round trip first is
    what accelerator.prepare does): the first step trains the loaded weights."""
    model = gpt(0).bfloat16()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2)
    pretrained = gpt(7).bfloat16()
    if order == "optimizer_first":
        opt.load_state_dict(opt.state_dict())
    model.load_state_dict(pretrained.state_dict())
    if order == "model_first":
        opt.load_state_dict(opt.state_dict())
    opt.zero_grad()
    gpt_loss(model, mine(tokens(1)[0], rank, world)).backward()
    opt.step()
    return {"moved_from_pretrained": max_diff(model, pretrained)}


class RandomNet(nn.Module):
    """Layers of random widths and dtypes; each rank uses a random subset of them each step."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        dtypes = [torch.float32, torch.bfloat16]
        self.layers = nn.ModuleList()
        for k in range(6):
            n = int(torch.randint(1, 40, (1,), generator=g))
            dtype = dtypes[int(torch.randint(0, 2, (1,), generator=g))]
            torch.manual_seed(seed * 100 + k)
            self.layers.append(nn.Linear(5, n).to(dtype))

    def forward(self, x, used):
        return sum(self.layers[k](x.to(self.layers[k].weight.dtype)).float().square().mean() for k in used)


def random_unused_dtypes_buckets(rank, world, seed, steps=20):
    """Random subsets of layers unused per rank per step, a random dtype mix and bucket size,
    against AdamW on fp32 masters over the averaged grads (zeros where a rank had none; a param
    with no grad on any rank is skipped, as torch.optim skips .grad None)."""
    g = torch.Generator().manual_seed(seed)
    stage = int(torch.randint(1, 3, (1,), generator=g))
    cap = [1e-4, 1e-3, 25.0][int(torch.randint(0, 3, (1,), generator=g))]
    used = [[[k for k in range(6) if torch.rand((), generator=g) < 0.6] for _ in range(world)] for _ in range(steps)]
    xs = [[torch.randn(3, 5, generator=g) for _ in range(world)] for _ in range(steps)]
    model = RandomNet(seed)
    ref = RandomNet(seed)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01, zero_stage=stage, bucket_cap_mb=cap)
    for t in range(steps):
        opt.zero_grad()
        if used[t][rank]:
            model(xs[t][rank], used[t][rank]).backward()
        opt.step()
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW([m.requires_grad_() for m in masters], lr=1e-2, weight_decay=0.01)
    for t in range(steps):
        reference_step(ref, masters, ref_opt,
                       lambda r: used[t][r] and ref(xs[t][r], used[t][r]).backward(), world)
    worst = {str(dt): 0.0 for dt in (torch.float32, torch.bfloat16)}
    for a, b in zip(model.parameters(), ref.parameters()):
        worst[str(a.dtype)] = max(worst[str(a.dtype)], abs_diff(a, b))
    return {"worst": worst, "stage": stage, "cap": cap}
