"""Per-rank bodies of test_stage3_patterns.py: training patterns that reach past one unit's
forward and backward at stage 3 (a gradient penalty's double backward, HF-style init at the
root, params read outside a forward), against torch.optim.AdamW on one process."""

import torch
import torch.nn as nn

import zerokern
from zerokern import FusedZeroAdam


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _shard3(model, **kw):
    for m in model:
        if isinstance(m, nn.Linear):
            zerokern.shard(m, stage=3, **kw)
    zerokern.shard(model, stage=3, **kw)
    return model


def _penalized(model, x):
    """WGAN-GP / R1: the output plus a penalty on the gradient of the output w.r.t. the input."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + ((g.norm(dim=1) - 1) ** 2).mean()


def gradient_penalty(rank, world):
    """Stage 3 (and reshard_after_forward=False) against AdamW over the full batch."""
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(4 * world, 8, generator=gen) for _ in range(3)]
    ref = _mlp()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for x in data:
        (sum(_penalized(ref, x[r * 4:(r + 1) * 4]) for r in range(world)) / world).backward()
        ropt.step()
        ropt.zero_grad()
    out = {}
    for raf in (True, False):
        model = _shard3(_mlp(), reshard_after_forward=raf)
        opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
        for x in data:
            _penalized(model, x[rank * 4:(rank + 1) * 4]).backward()
            opt.step()
            opt.zero_grad()
        full = zerokern.full_state_dict(model, rank0_only=False)
        out[raf] = {"diff": max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()),
                    "gathered_after": opt.stage3.gathered_bytes}
    return out


class HFStyle(nn.Module):
    """Root params (an input projection, a head) around blocks: the shape of an HF model, whose
    post_init applies _init_weights from the root."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x).square().mean()


def _init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)


def hf_style_init_at_root(rank, world):
    """One init (m.apply(_init_weights)) for every shard() call, the root's last: every Linear is
    initialised by it and training matches AdamW from those values. Blocks left to
    reset_parameters() with the root's init writing to them: refused at shard(), naming the param."""
    init = lambda m: m.apply(_init_weights)  # noqa: E731  the HF pattern, one object for every call
    torch.manual_seed(rank)  # the ranks need not share a seed: rank 0's values are taken
    with torch.device("meta"):
        model = HFStyle()
    for b in model.blocks:
        zerokern.shard(b, stage=3, init=init)
    zerokern.shard(model, stage=3, init=init)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    start = zerokern.full_state_dict(model, rank0_only=False)
    out = {"biases_zero": all(bool((v == 0).all()) for k, v in start.items() if k.endswith("bias")),
           "weight_stds": [round(v.std().item(), 3) for k, v in start.items() if k.endswith("weight")]}
    ref = HFStyle()
    ref.load_state_dict(start)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4 * world, 8, generator=gen)
        model(x[rank * 4:(rank + 1) * 4]).backward()
        opt.step()
        opt.zero_grad()
        (sum(ref(x[r * 4:(r + 1) * 4]) for r in range(world)) / world).backward()
        ropt.step()
        ropt.zero_grad()
    full = zerokern.full_state_dict(model, rank0_only=False)
    out["diff"] = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    with torch.device("meta"):
        other = HFStyle()
    for b in other.blocks:
        zerokern.shard(b, stage=3)  # reset_parameters()
    try:
        zerokern.shard(other, stage=3, init=init)
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
        out["left_on_meta"] = other.inp.weight.device.type == "meta"
    return out
