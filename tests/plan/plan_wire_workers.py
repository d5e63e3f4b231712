"""Per-rank bodies of test_plan_wire.py: a quantized run's counted bytes between hosts and its
error feedback's memory, for the planner to be checked against."""

import torch
import torch.nn as nn

import zerokern


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 50), nn.Tanh(), nn.Linear(50, 30))  # 3,580 params, one bucket


def counted(rank, world, cases):
    """cases: [(stage, reduce_precision, mesh or None)]. Per case, after a second step (the first
    leaves no committed residual): what this rank counted as sent to other hosts in that step,
    its error feedback after backward (committed + pending) and after step, and the bucket's
    padded size and shard (the params the layout reduces)."""
    out = {}
    for stage, precision, mesh in cases:
        model = _model()
        kw = dict(bucket_cap_mb=100, mesh=mesh, reduce_precision=precision)
        if stage == 3:
            zerokern.shard(model, stage=3, **kw)
            opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3, mesh=mesh)
        else:
            opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3, zero_stage=stage, **kw)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            before = getattr(opt.comm, "inter_host_bytes", 0)
            opt.zero_grad()
            model(torch.randn(4, 40, generator=g)).square().mean().backward()
            peak = opt.memory_report()["error_feedback"]
            opt.step()
        (bucket,) = [s.bucket.plan for s in opt.engine.stores]
        out[(stage, precision, mesh)] = {
            "sent": getattr(opt.comm, "inter_host_bytes", 0) - before, "peak": peak,
            "between": opt.memory_report()["error_feedback"], "padded": bucket.padded_numel}
    return out
