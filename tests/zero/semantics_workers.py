"""Per-rank bodies of test_torch_semantics.py: what torch.optim users rely on (.grad None for
unused params, zero_grad's two modes, GradScaler at stage 3, full state dicts), each against
torch.optim.AdamW on one process over the full batch."""

import torch
import torch.nn as nn

import zerokern
from zerokern import FusedZeroAdam
from numerics import abs_diff
from models import BranchNet

STEPS = 3


def _data(world):
    g = torch.Generator().manual_seed(6)
    return [torch.randn(4 * world, 6, generator=g) for _ in range(STEPS)]


def _build(stage, world):
    model = BranchNet()
    cap = 1e-4  # buckets of a few params: params split across ranks mid-tensor
    if stage == 3:
        for m in (model.a, model.b, model.extra, model.head):
            zerokern.shard(m, stage=3, bucket_cap_mb=cap)
        zerokern.shard(model, stage=3, bucket_cap_mb=cap)
        return model, FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.1, zero_stage=stage, bucket_cap_mb=cap)


def _grad_pattern(model):
    return {n: p.grad is None for n, p in model.named_parameters()}


def unused_params_and_zero_grad(rank, world, stage, set_to_none):
    """Steps where `extra` gets no grad, after zero_grad(set_to_none): the same .grad-is-None
    pattern as torch after each backward and step, and the same params as torch AdamW."""
    data = _data(world)
    ref = BranchNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = _build(stage, world)
    ours, theirs = [], []
    for t, x in enumerate(data):
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        model(x[rank * 4:(rank + 1) * 4], use_extra=t == 0).backward()
        ref(x, use_extra=t == 0).backward()  # the mean over the full batch: the ranks' average
        ours.append(_grad_pattern(model))
        theirs.append(_grad_pattern(ref))
        opt.step()
        ref_opt.step()
        ours.append(_grad_pattern(model))
        theirs.append(_grad_pattern(ref))
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {"patterns_equal": ours == theirs, "ours": ours, "theirs": theirs,
            "diff": max(abs_diff(full[n], p) for n, p in ref.named_parameters())}


def no_zero_grad_at_stage(rank, world, stage):
    """Two steps and no zero_grad(): stages 0/1 accumulate as torch does; stages 2/3 raise on every rank."""
    data = _data(world)
    ref = BranchNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = _build(stage, world)
    try:
        for x in data[:2]:
            model(x[rank * 4:(rank + 1) * 4], use_extra=True).backward()
            ref(x, use_extra=True).backward()
            opt.step()
            ref_opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {"diff": max(abs_diff(full[n], p) for n, p in ref.named_parameters())}


def stage3_scaler_inf_in_one_element(rank, world):
    """fp16 at stage 3 with a plain torch.amp.GradScaler: an inf in one element of rank 1's local
    grad at step 1 skips that step on every rank and halves the scale, as at stage 2."""
    out = {}
    for stage in (2, 3):
        model = BranchNet().half()
        if stage == 3:
            for m in (model.a, model.b, model.extra, model.head):
                zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
            zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
            opt = FusedZeroAdam(model.parameters(), lr=1e-2)
        else:
            opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=1e-4)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scales, skipped = [], []
        for t, x in enumerate(_data(world)):
            opt.zero_grad()
            model.a.bad = float("inf") if (t == 1 and rank == 1) else 0.0  # one element's grad is inf
            loss = model(x[rank * 4:(rank + 1) * 4].half(), use_extra=True).float()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skipped.append(opt.last_step_skipped)
        out[stage] = {"scales": scales, "skipped": skipped,
                      "params": {k: v for k, v in zerokern.full_state_dict(model, rank0_only=False).items()}}
    out["equal"] = all(torch.equal(out[2]["params"][k], out[3]["params"][k]) for k in out[2]["params"])
    return out


def rank0_only_full_state_dict(rank, world, stage):
    model, opt = _build(stage, world)
    model(_data(world)[0][rank * 4:(rank + 1) * 4], use_extra=True).backward()
    opt.step()
    sd = zerokern.full_state_dict(model, rank0_only=True)
    whole = zerokern.full_state_dict(model, rank0_only=False)
    return {"keys": sorted(sd), "shapes": {k: tuple(v.shape) for k, v in whole.items()}}


class Wrapped(nn.Module):
    """Blocks wrapped by torch's activation-checkpointing wrapper, as FSDP users apply it."""

    def __init__(self, wrap):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        torch.manual_seed(7)
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)]
        self.blocks = nn.ModuleList(checkpoint_wrapper(b) if wrap else b for b in blocks)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def checkpoint_wrapper_full_state_dict(rank, world):
    """zerokern.full_state_dict of a stage-3 model whose units are inside checkpoint_wrapper:
    whole tensors, equal to the unwrapped model's after the same steps."""
    g = torch.Generator().manual_seed(8)
    data = [torch.randn(4 * world, 16, generator=g) for _ in range(2)]
    out = {}
    for wrap in (False, True):
        model = Wrapped(wrap)
        for b in model.blocks:
            zerokern.shard(b, stage=3)
        zerokern.shard(model, stage=3)
        opt = FusedZeroAdam(model.parameters(), lr=1e-2)
        for x in data:
            opt.zero_grad()
            model(x[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
        out[wrap] = zerokern.full_state_dict(model, rank0_only=False)
    plain, wrapped = out[False], out[True]
    return {"keys_equal": sorted(plain) == sorted(wrapped),
            "shapes": {k: (tuple(v.shape), tuple(wrapped[k].shape)) for k, v in plain.items() if k in wrapped},
            "equal": sorted(plain) == sorted(wrapped) and all(torch.equal(plain[k], wrapped[k]) for k in plain)}


def per_unit_options(rank, world):
    """Stage 3 with each block's own bucket size and a root that keeps its params gathered from
    forward to backward (FSDP2's usual root setting): AdamW's numbers."""
    data = _data(world)
    ref = BranchNet()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = BranchNet()
    for m, cap in ((model.a, 1e-4), (model.b, 1.0), (model.extra, 1e-4), (model.head, 2.0)):
        zerokern.shard(m, stage=3, bucket_cap_mb=cap)
    zerokern.shard(model, stage=3, reshard_after_forward=False)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        model(x[rank * 4:(rank + 1) * 4], use_extra=True).backward()
        ref(x, use_extra=True).backward()
        opt.step()
        ref_opt.step()
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {"diff": max(abs_diff(full[n], p) for n, p in ref.named_parameters())}


def stage3_cast_after_building(rank, world):
    """model.to(bf16) after the optimizer at stage 3 (it casts only the empty placeholders): zerokern's
    error naming the param at the next gather, not a silent fp32 run or torch's dtype mismatch."""
    model, opt = _build(3, world)
    model.to(torch.bfloat16)
    try:
        model(_data(world)[0][rank * 4:(rank + 1) * 4], use_extra=True).float().backward()
        opt.step()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None, "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
