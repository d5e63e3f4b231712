"""Helpers the matrix-optimizer tests share (torch.optim.Muon and torch.optim.Adafactor under
ZeroOptimizer): the one-process set-up and training loop, a one-process reference stepping fp32
masters as zerokern keeps them, and one step of a reference beside a ZeroOptimizer."""

import torch
import torch.nn as nn

import zerokern


def batches(steps):
    """steps batches of 16 x 7 (the one-process tests' models take 7 inputs)."""
    g = torch.Generator().manual_seed(4)
    return [torch.randn(16, 7, generator=g) for _ in range(steps)]


def train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def one_process(model, cls, stage, **options):
    """ZeroOptimizer(model's params, cls) on one process. Stage 3: each nn.Linear of the Sequential a
    unit, then the root, so the params are gathered in the forward hooks of the modules that own
    them; tiny buckets, so every stage has several."""
    if stage == 3:
        for m in model:
            if isinstance(m, nn.Linear):
                zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
        return zerokern.ZeroOptimizer(model.parameters(), cls, **options)
    return zerokern.ZeroOptimizer(model.parameters(), cls, zero_stage=stage, bucket_cap_mb=1e-4, **options)


def step_both(ref, ref_opts, model, opt, x):
    """One step on batch x of the one-process reference (its torch optimizers, one per group) and of
    the ZeroOptimizer."""
    for o in ref_opts:
        o.zero_grad()
    ref(x).square().mean().backward()
    for o in ref_opts:
        o.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


class Masters:
    """One-process torch optimizers (one per group: {"params", "optimizer" (default: default), its
    options}) on fp32 masters of the params, as zerokern keeps them: the step reads the grads as
    fp32, the params are the masters rounded to nearest (fp32: the same numbers as torch's
    optimizers on the params themselves)."""

    def __init__(self, params, groups, default=torch.optim.AdamW):
        self.params = list(params)
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        master = dict(zip(map(id, self.params), self.masters))
        self.opts = [g.get("optimizer", default)([master[id(p)] for p in g["params"]],
                                                 **{k: v for k, v in g.items() if k not in ("params", "optimizer")})
                     for g in groups]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        for o in self.opts:
            o.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
