"""Per-rank bodies of test_zero_optimizer_runs.py: ZeroOptimizer stepping torch's element-wise
groups as flat runs ([Note: element-wise pieces as runs] in zerokern/optim/flat_runs.py), every
rank on the same batch, against the same torch optimizer on one process."""

import copy

import torch
import torch.nn as nn

import zerokern
from zerokern.optim.state_dict import slice_of

STEPS = 6
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2)),  # a 0-dim tensor beside step: mu_product
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3)),  # a buffer made in the first update
}


class Net(nn.Module):
    """Odd sizes, so that pieces start mid-param and some ranks hold none of a bias. `aux` and
    `side` take part in even steps only: no grad on any rank in odd ones."""

    def __init__(self):
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5)
        self.aux, self.side = nn.Linear(5, 3), nn.Linear(5, 1)

    def forward(self, x, step):
        y = self.b(self.norm(self.a(x)).tanh())
        return y.square().mean() + (self.aux(y).square().mean() + self.side(y).mean() if step % 2 == 0 else 0)


def _groups(model):
    """A: the main layers, always stepped (stays bound to its runs); B: aux, all of it skipped
    together on odd steps (unbound there, bound again after); C: b's bias, always stepped, beside
    side, skipped on odd steps (its scalars differ from then on: one by one)."""
    return [{"params": [*model.a.parameters(), *model.norm.parameters(), model.b.weight]},
            {"params": list(model.aux.parameters()), "lr": 3e-3},
            {"params": [model.b.bias, *model.side.parameters()], "weight_decay": 0.0}]


def train(rank, world, name, stage):
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(5)
    ref = Net()
    model = copy.deepcopy(ref)
    ref_opt = cls(_groups(ref), **kw)
    opt = zerokern.ZeroOptimizer(_groups(model), cls, zero_stage=stage, bucket_cap_mb=1e-4, **kw)
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(8, 7, generator=g) for _ in range(STEPS)]  # every rank the same batch
    bound = []
    for step, x in enumerate(xs):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x, step).backward()
            o.step()
        bound.append([grp.bound for runs in opt._runs for grp in runs._groups])
    opt.finish_param_gather()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    # every piece's scalars as torch's own (each param's step advanced once for each step it took)
    sd, want = opt.state_dict(), ref_opt.state_dict()
    scalars = {(i, k): (v.item(), want["state"][i][k].item()) for i, st in sd["state"].items()
               for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() == 0 and k in want["state"][i]}
    # and every piece's per-element state (marked as a slice of the param at stage >= 1) as torch's
    elements = []
    for i, st in sd["state"].items():
        for k, v in st.items():
            where = slice_of(v) if isinstance(v, torch.Tensor) else None
            if where is not None and k in want["state"][i]:
                start, n, _ = where
                elements.append(torch.equal(v, want["state"][i][k].reshape(-1)[start:start + n]))
    # a state dict's scalars are copies: dcp.load writes each entry in place
    p0 = next(iter(model.parameters()))
    live = [v for v in opt.state[p0].values() if isinstance(v, torch.Tensor) and v.dim() == 0]
    before = [v.clone() for v in live]
    for st in sd["state"].values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype.is_floating_point:
                v.fill_(99.0)
    untouched = all(torch.equal(a, b) for a, b in zip(live, before))
    return {"same": same, "diff": diff, "bound": bound, "scalars": scalars, "untouched": untouched,
            "elements": elements,
            "runs": sum(len(g.runs) for runs in opt._runs for g in runs._groups),
            "pieces": len(opt._piece)}


def _schedule(opt):
    """An lr that changes every step, as Trainer's warmup/decay does: a resumed run must step with
    the scheduler's lr, not the one its optimizer was built with."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def resume(rank, world, name, stage, save_at):
    """An uninterrupted run of STEPS steps (with an lr schedule) against one that saves opt's and
    the schedule's state dicts after save_at steps, and a fresh model and ZeroOptimizer that load
    them and take the remaining steps; and both against one-process torch."""
    cls, kw = OPTIMIZERS[name]
    torch.manual_seed(5)
    ref, whole, part = Net(), Net(), Net()
    whole.load_state_dict(ref.state_dict())
    part.load_state_dict(ref.state_dict())
    ref_opt = cls(_groups(ref), **kw)
    built = [zerokern.ZeroOptimizer(_groups(m), cls, zero_stage=stage, bucket_cap_mb=1e-4, **kw) for m in (whole, part)]
    trio = [(ref, ref_opt, _schedule(ref_opt))] + [(m, o, _schedule(o)) for m, o in zip((whole, part), built)]
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(8, 7, generator=g) for _ in range(STEPS)]

    def step(model, opt, sched, at):
        opt.zero_grad()
        model(xs[at], at).backward()
        opt.step()
        sched.step()

    for at in range(STEPS):
        for r in trio[:2] + (trio[2:] if at < save_at else []):
            step(*r, at)
    _, opt, sched = trio[2]
    opt.finish_param_gather()
    saved, saved_sched = opt.state_dict(), sched.state_dict()
    resumed = Net()
    resumed.load_state_dict(part.state_dict())  # the weights after save_at steps
    opt2 = zerokern.ZeroOptimizer(_groups(resumed), cls, zero_stage=stage, bucket_cap_mb=1e-4, **kw)
    sched2 = _schedule(opt2)
    opt2.load_state_dict(saved)
    sched2.load_state_dict(saved_sched)
    for at in range(save_at, STEPS):
        step(resumed, opt2, sched2, at)
    for o in (built[0], opt2):
        o.finish_param_gather()
    with_runs = sum(len(grp.runs) for runs in opt2._runs for grp in runs._groups)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    def diff(a, b):
        return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))

    sd, sd2 = built[0].state_dict(), opt2.state_dict()
    state_same = sd["state"].keys() == sd2["state"].keys() and all(
        st.keys() == sd2["state"][i].keys() and all(torch.equal(v, sd2["state"][i][k]) for k, v in st.items())
        for i, st in sd["state"].items())
    return {"resumed_as_whole": same(resumed, whole), "diff": diff(resumed, whole), "state_same": state_same,
            "whole_as_torch": same(whole, ref), "torch_diff": diff(whole, ref), "runs": with_runs,
            "lr": [grp["lr"] for grp in opt2.param_groups], "ref_lr": [grp["lr"] for grp in ref_opt.param_groups]}
