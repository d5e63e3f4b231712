"""Rank bodies of test_zero_muon_checkpoint.py: a Muon + AdamW ZeroOptimizer at stage 2 saved
with torch.distributed.checkpoint on 4 ranks, resumed on 2 and on one process (plain torch)."""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zerokern

SAVE_AT, STEPS = 3, 5
MUON = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
ADAMW = dict(lr=3e-3, betas=(0.8, 0.9), weight_decay=0.05)


class Net(nn.Module):
    """Five hidden matrices of odd, rectangular shapes (more than the 4 ranks, so owners differ
    between 4 and 2 ranks), and an embedding, biases, a norm and a head for AdamW."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb = nn.Embedding(11, 9)
        self.hidden = nn.ModuleList([nn.Linear(9, 21), nn.Linear(21, 13, bias=False), nn.Linear(13, 17),
                                     nn.Linear(17, 5, bias=False), nn.Linear(5, 9)])
        self.norm = nn.LayerNorm(9)
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = self.emb(x)
        for lin in self.hidden:
            h = torch.tanh(lin(h))
        return self.head(self.norm(h)).square().mean()


def split(model):
    """(Muon's params, AdamW's): the hidden weights, and everything else, in model order."""
    hidden = [lin.weight for lin in model.hidden]
    return hidden, [p for p in model.parameters() if not any(p is q for q in hidden)]


def batches():
    """Every rank trains on the same batch ([Note: one batch on every rank] in the test)."""
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 11, (8, 5), generator=g) for _ in range(STEPS)]


def build():
    model = Net()
    hidden, rest = split(model)
    opt = zerokern.ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, **MUON}, {"params": rest}],
                                 torch.optim.AdamW, zero_stage=2, bucket_cap_mb=1e-3, **ADAMW)
    return model, opt


def train(model, opts, xs):
    for x in xs:
        for o in opts:
            o.zero_grad()
        model(x).backward()
        for o in opts:
            o.step()


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def save(rank, world, path):
    """SAVE_AT steps, dcp.save of docs/checkpoints.md's recipe, then the rest: the uninterrupted
    run's params, and what this rank holds of each matrix's momentum (elements)."""
    model, opt = build()
    xs = batches()
    train(model, [opt], xs[:SAVE_AT])
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.save(sd, checkpoint_id=path)
    held = [st["momentum_buffer"].numel() for st in sd["optim"]["state"].values() if "momentum_buffer" in st]
    train(model, [opt], xs[SAVE_AT:])
    return weights(model), held, opt.matrices_stepped


def resume(rank, world, path):
    """A fresh model and ZeroOptimizer at this world size load the checkpoint, then the rest."""
    model, opt = build()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    train(model, [opt], batches()[SAVE_AT:])
    return weights(model), opt.matrices_stepped


def resume_plain(path, file):
    """One process, no zerokern: the checkpoint consolidated by torch's dcp_to_torch_save, loaded
    into torch.optim.Muon (the hidden weights) and torch.optim.AdamW (the rest), then the rest,
    on one thread as the ranks (a matmul's sums depend on how it is split over threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _resume_plain(path, file)
    finally:
        torch.set_num_threads(threads)


def _resume_plain(path, file):
    dcp_to_torch_save(path, file)
    sd = torch.load(file, weights_only=False)
    model = Net()
    model.load_state_dict(sd["model"])
    hidden, rest = split(model)
    muon, adamw = torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)
    params = [p for g in (hidden, rest) for p in g]  # the ZeroOptimizer's param order: group by group
    state = {int(k): v for k, v in sd["optim"]["state"].items()}
    for opt, group, first in ((muon, hidden, 0), (adamw, rest, len(hidden))):
        own = {}
        for i in range(len(group)):
            # zerokern's sharded AdamW state is saved flattened (a slice of the flat param per
            # rank: [Note: sharded state in checkpoints]); torch's AdamW keeps the param's shape
            own[i] = {k: (v.view(params[first + i].shape) if v.dim() == 1 and v.numel() == params[first + i].numel()
                          else v) for k, v in state[first + i].items()}
        opt.load_state_dict({"state": own, "param_groups": [{**opt.param_groups[0], "params": list(range(len(group)))}]})
    train(model, [muon, adamw], batches()[SAVE_AT:])
    return weights(model)
