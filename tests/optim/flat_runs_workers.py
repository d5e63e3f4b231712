"""Per-rank bodies of test_zero_optimizer_runs.py: ZeroOptimizer stepping torch's element-wise
groups as flat runs ([Note: element-wise pieces as runs] in zerokern/optim/flat_runs.py), every
rank on the same batch, against the same torch optimizer on one process."""

import copy

import torch
import torch.nn as nn

import zerokern
from zerokern.optim.state_dict import slice_of
from zerokern.optim import zero_optimizer

zero_optimizer.FLAT_RUNS = True  # off by default (a Trainer resume differs with them); these tests step them

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
