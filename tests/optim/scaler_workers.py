"""Per-rank bodies of test_grad_scaler.py: GradScaler with FusedZeroAdam when an inf/nan
shows up in one rank's local grads only (issue 12, case 4)."""

import torch
import torch.nn as nn

import zerokern
from runtime_workers import max_diff, reference_step
from zerokern import FusedZeroAdam

STEPS, BAD_STEP, MICRO = 4, 1, 2


def net(dtype):
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).to(dtype)


def data(world):
    g = torch.Generator().manual_seed(4)
    return [[[torch.randn(3, 6, generator=g) for _ in range(world)] for _ in range(MICRO)] for _ in range(STEPS)]


def loss_of(model, x, bad):
    """`bad` puts an inf into the grad of one element of the first weight only."""
    loss = model(x.to(model[0].weight.dtype)).float().square().mean() / MICRO
    return loss + model[0].weight.view(-1)[0].float() * bad if bad else loss


def overflow_on_one_rank(rank, world, dtype, scaler_kind, pattern, stage=2):
    """Step BAD_STEP has an inf in rank 1's grads only. pattern: "synced" (every backward
    synced), "accumulate" (no_sync, then a synced last micro-batch) or "no_sync" (every
    backward under no_sync; the reduction happens in step()). Returns every step's scale,
    whether each step changed the params, and the diff against AdamW with that step skipped."""
    model, ref = net(dtype), net(dtype)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01, zero_stage=stage, bucket_cap_mb=1e-4)
    Scaler = zerokern.GradScaler if scaler_kind == "zerokern" else torch.amp.GradScaler
    scaler = Scaler("cpu", init_scale=1024.0)
    xs = data(world)
    log = []
    try:
        for t in range(STEPS):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            for m in range(MICRO):
                bad = float("inf") if (t == BAD_STEP and rank == 1 and m == 0) else 0.0
                synced = pattern == "synced" or (pattern == "accumulate" and m == MICRO - 1)
                if synced:
                    scaler.scale(loss_of(model, xs[t][m][rank], bad)).backward()
                else:
                    with opt.no_sync():
                        scaler.scale(loss_of(model, xs[t][m][rank], bad)).backward()
            scaler.step(opt)
            scaler.update()
            log.append((scaler.get_scale(), any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))))
    except RuntimeError as e:
        return {"error": str(e), "log": log}
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    for t in range(STEPS):
        if t != BAD_STEP:
            reference_step(ref, masters, ref_opt,
                           lambda r: sum(loss_of(ref, xs[t][m][r], 0.0) for m in range(MICRO)).backward(), world)
    return {"error": None, "log": log, "diff": max_diff(model, ref)}


def different_scales(rank, world):
    """Scalers that start from different scales on the ranks: a clear error on every rank."""
    model = net(torch.float32)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0 * (rank + 1))
    try:
        scaler.scale(loss_of(model, torch.ones(2, 6), 0.0)).backward()
        scaler.step(opt)
    except RuntimeError as e:
        return str(e)
    return None


def synced_then_partial_no_sync(rank, world, scaler_kind):
    """Stage 2: a synced backward, then a no_sync backward in which rank 0 reaches every param and
    rank 1 only the first layer (so rank 0's .grad holds no placeholder any more, rank 1's does),
    then scaler.step. The ranks must run the same collectives (found by review: agreeing on the
    overflow flag only when a placeholder was asked for put one all-reduce on rank 1 only)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=1e-4)
    Scaler = zerokern.GradScaler if scaler_kind == "zerokern" else torch.amp.GradScaler
    scaler = Scaler("cpu", init_scale=1024.0)
    x = torch.randn(3, 4)
    scales = []
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        with opt.no_sync():
            y = model(x) if rank == 0 else model[0](x)
            scaler.scale(y.square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "params": [p.detach().clone() for p in model.parameters()]}


def overflow_checks_without_a_scaler(rank, world):
    """fp32 at stage 2 without a GradScaler: the inf/nan agreement after backward (a pass over the
    shards and a collective) runs until the first step() shows there is no scaler, then no more."""
    model = net(torch.float32)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=1e-4)
    calls, real = [], opt.engine.agreement.agreed_overflow
    opt.engine.agreement.agreed_overflow = lambda *a: calls.append(1) or real(*a)
    per_step = []
    for t, xs in enumerate(data(world)[:3]):
        opt.zero_grad()
        loss_of(model, xs[0][rank], 0.0).backward()
        opt.step()
        per_step.append(len(calls))
    return {"calls_after_each_step": per_step}
