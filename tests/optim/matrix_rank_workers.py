"""Rank bodies for tests/optim/test_zero_matrix_ranks.py: ZeroOptimizer with a whole-tensor
optimizer (torch.optim.Muon or torch.optim.Adafactor) for the hidden matrices and AdamW for the
rest, against one-process torch optimizers run in the same rank process (so with the same thread
count: the harness's one)."""

import copy

import torch
import torch.nn as nn

import zerokern
from matrix_helpers import Masters

STEPS = 20
BATCH = 16  # the global batch: each rank's share of it when the ranks take different batches
WIDTHS = [9, 21, 17, 13, 11, 9]  # five hidden matrices, odd and rectangular both ways
INNER = {"Muon": dict(lr=0.02, weight_decay=0.01, momentum=0.9),
         "Adafactor": dict(lr=0.02, weight_decay=0.01, d=1.5, beta2_decay=-0.7)}
ADAMW = dict(lr=3e-3, betas=(0.8, 0.9), weight_decay=0.05)


class Net(nn.Module):
    """Hidden matrices with biases, a norm and a head: what users give Muon/Adafactor and AdamW."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.norm = nn.LayerNorm(WIDTHS[-1])
        self.head = nn.Linear(WIDTHS[-1], 3)

    def forward(self, x):
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def net(dtype):
    torch.manual_seed(3)
    return Net().to(dtype)


def hidden_of(model):
    return [layer.weight for layer in model.hidden]


def groups(model, cls, everything=False):
    """[{hidden matrices, cls}, {the rest, AdamW}]; everything: every param in cls's group (torch's
    Adafactor takes 1-D params too: an unfactored variance)."""
    if everything:
        return [{"params": list(model.parameters()), "optimizer": cls, **INNER[cls.__name__]}]
    hidden = hidden_of(model)
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return [{"params": hidden, "optimizer": cls, **INNER[cls.__name__]}, {"params": rest, **ADAMW}]


def reference(model, cls, everything):
    """One-process torch optimizers on fp32 masters of the params, as zerokern keeps them."""
    return Masters(model.parameters(), groups(model, cls, everything))


def batches(dtype):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(BATCH, WIDTHS[0], generator=g).to(dtype) for _ in range(STEPS)]


def _train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _run(rank, world, cls, stage, dtype, split, everything):
    """(max param diff from the one-process run, this rank's matrix steps, the params). split: each
    rank takes its share of every batch, the reference the whole batch (the mean of the ranks'
    means is the whole batch's mean: equal shares)."""
    ref = net(dtype)
    model = copy.deepcopy(ref)
    opt = zerokern.ZeroOptimizer(groups(model, cls, everything), torch.optim.AdamW, zero_stage=stage,
                                 bucket_cap_mb=1e-3, **ADAMW)
    xs = batches(dtype)
    share = BATCH // world
    _train(ref, reference(ref, cls, everything), xs)
    _train(model, opt, [x[rank * share:(rank + 1) * share] for x in xs] if split else xs)
    diff = max((p.float() - q.float()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return diff, opt.matrices_stepped, [p.detach().clone() for p in model.parameters()]


def against_one_process(rank, world, cls_name, stage, dtype, same=True):
    """Every rank on the same batch, every rank on its own share of it, and (Adafactor) every param
    in the Adafactor group: each against the one-process run. same=False: the share only."""
    cls = getattr(torch.optim, cls_name)
    out = {"split": _run(rank, world, cls, stage, dtype, True, False)}
    if same:
        out["same"] = _run(rank, world, cls, stage, dtype, False, False)
    if same and cls_name == "Adafactor":
        out["everything"] = _run(rank, world, cls, stage, dtype, False, True)
    return out


def bad_groups(rank, world, cls_name, which):
    """The error each rank gets (None: none) and whether the params were left alone."""
    cls = getattr(torch.optim, cls_name)
    model = net(torch.float32)
    named = dict(model.named_parameters())
    hidden = [n for n in named if n.startswith("hidden.") and n.endswith(".weight")]
    if which == "empty":
        gs = [{"params": [], "optimizer": cls}, {"params": list(named.values())}]
    else:  # "differ": rank 1 puts the last hidden matrix in the AdamW group
        mine = hidden[:-1] if rank == 1 else hidden
        gs = [{"params": [(n, named[n]) for n in mine], "optimizer": cls, **INNER[cls_name]},
              {"params": [(n, p) for n, p in named.items() if n not in mine]}]
    before = [p.data_ptr() for p in model.parameters()]
    try:
        zerokern.ZeroOptimizer(gs, torch.optim.AdamW, zero_stage=2)
    except ValueError as e:
        return str(e), before == [p.data_ptr() for p in model.parameters()]
    return None, None


def checkpoint(rank, world, cls_name, stage):
    """After 2 steps with every param in cls's group (so the whole state dict is torch's layout):
    cls on one process loads the state dict (gathered from the owners), and a new ZeroOptimizer on
    these ranks loads torch's; the three then take the same 2 next steps as the run that was not
    interrupted. Returns (state shapes and steps, same as the one-process resume, same as the
    ZeroOptimizer resume)."""
    cls = getattr(torch.optim, cls_name)
    xs = batches(torch.float32)[:4]
    model = net(torch.float32)
    opt = zerokern.ZeroOptimizer(groups(model, cls, True), torch.optim.AdamW, zero_stage=stage, bucket_cap_mb=1e-3)
    _train(model, opt, xs[:2])
    sd = opt.state_dict()
    one = copy.deepcopy(model)
    one_opt = cls(one.parameters(), **INNER[cls_name])
    one_opt.load_state_dict(copy.deepcopy(sd))  # as torch between two optimizers: it keeps what it is given
    again = copy.deepcopy(model)
    again_opt = zerokern.ZeroOptimizer(groups(again, cls, True), torch.optim.AdamW, zero_stage=stage,
                                       bucket_cap_mb=1e-3)
    again_opt.load_state_dict(one_opt.state_dict())  # torch's layout in, each rank takes what it owns
    for m, o in ((model, opt), (one, one_opt), (again, again_opt)):
        _train(m, o, xs[2:])
    layout = [{k: (list(v.shape), v.item() if v.dim() == 0 else None) for k, v in st.items()}
              for _, st in sorted(sd["state"].items())]
    return (layout, [torch.equal(p, q) for p, q in zip(model.parameters(), one.parameters())],
            [torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters())])


def several(rank, world, configs):
    """against_one_process for each (class name, stage, params' dtype, same) in one process group
    (spawning the ranks costs more than these tiny runs)."""
    return [against_one_process(rank, world, cls_name, stage, dtype, same) for cls_name, stage, dtype, same in configs]
