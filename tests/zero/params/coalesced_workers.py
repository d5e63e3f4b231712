"""Rank bodies for tests/zero/params/test_coalesced_gather.py: the param gathers after the update
coalesced into one collective per group of buckets ([Note: coalesced param gathers]) against
one gather per bucket, in one rank process."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern
from zerokern.zero.params import coalesced

WIDTHS = [9, 21, 17, 13, 11, 9, 15, 12, 10, 9]  # nine hidden matrices: several buckets at 4 ranks
ADAMW = dict(lr=3e-3, betas=(0.8, 0.9), weight_decay=0.05)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.head = nn.Linear(WIDTHS[-1], 3)

    def forward(self, x):
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x)


def _optimizer(model, kind, stage, dtype):
    if kind == "adam":
        return zerokern.FusedZeroAdam(model.parameters(), zero_stage=stage, bucket_cap_mb=1e-3, **ADAMW)
    hidden = [m.weight for m in model.hidden]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return zerokern.ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, "lr": 0.02},
                                   {"params": rest}], torch.optim.AdamW, zero_stage=stage, bucket_cap_mb=1e-3,
                                  **ADAMW)


class CountBroadcasts:
    """The broadcasts and all-gathers torch.distributed launches (gloo gathers a bucket as one
    broadcast per rank: [Note: gather as broadcasts])."""

    def __init__(self):
        self.calls = 0
        self._saved = dist.broadcast, dist.all_gather_into_tensor

    def __enter__(self):
        def counted(fn):
            def call(*args, **kwargs):
                self.calls += 1
                return fn(*args, **kwargs)
            return call
        dist.broadcast, dist.all_gather_into_tensor = map(counted, self._saved)
        return self

    def __exit__(self, *exc):
        dist.broadcast, dist.all_gather_into_tensor = self._saved


def same_bits(rank, world, kind, stage, dtype, limit):
    """The same training with coalesced gathers (at `limit` bytes a group) and with one gather a
    bucket: params equal bit for bit on every step; the gathers launched by each."""
    torch.manual_seed(3)
    base = Net().to(dtype)
    runs = {}
    saved = coalesced.LIMIT_BYTES
    for name, cap in (("coalesced", limit), ("alone", 0)):
        coalesced.LIMIT_BYTES = cap  # read when the optimizer is built
        try:
            model = copy.deepcopy(base)
            runs[name] = (model, _optimizer(model, kind, stage, dtype))
        finally:
            coalesced.LIMIT_BYTES = saved
    g = torch.Generator().manual_seed(4 + rank)  # each rank its own batch
    out = {"equal": [], "launched": {n: [] for n in runs}, "buckets": len(runs["alone"][1].param_gather.buckets),
           "groups": [len(getattr(grp, "buckets", [None])) for grp in runs["coalesced"][1].param_gather.groups]}
    for step in range(4):
        x = torch.randn(8, WIDTHS[0], generator=g).to(dtype)
        for name, (model, opt) in runs.items():
            opt.zero_grad()
            model(x).float().square().mean().backward()
            with CountBroadcasts() as c:
                opt.step()
            out["launched"][name].append(c.calls)
        a, b = (dict(runs[n][0].named_parameters()) for n in ("coalesced", "alone"))
        out["equal"].append(all(torch.equal(a[k], b[k]) for k in a))
    out["params"] = [p.detach().clone() for p in runs["coalesced"][0].parameters()]
    return out
