"""Rank functions for tests/optim/test_lowbit_optim.py: FusedZeroAdam with low-bit state on gloo ranks."""

import torch

import zerokern

SHAPES = [(1500,), (70, 3), (5,), (300,), (2, 129)]  # one param split across ranks, blocks cut short


class Block(torch.nn.Module):
    def __init__(self, shapes, dtype):
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes)

    def forward(self, cs):
        return sum((p.float() * c).sum() for p, c in zip(self.ps, cs))


class Nice(torch.nn.Module):
    """loss = sum(p * c): every rank's grad of p is exactly c, chosen so that any sum of up to four of
    them is exact in bf16. The averaged grad is then c at every world size and stage, and what the
    optimizer does with it must be too."""

    def __init__(self, dtype, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = torch.nn.ModuleList([Block(SHAPES[:3], dtype), Block(SHAPES[3:], dtype)])
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=dtype))

    def forward(self, step):
        cs = [[_c(s, step, k) for k, s in enumerate(b_shapes)] for b_shapes in (SHAPES[:3], SHAPES[3:])]
        return sum(b(c) for b, c in zip(self.blocks, cs)) + (self.scale.float() * _c((3,), step, 9)).sum()


def _c(shape, step, k):
    n = torch.Size(shape).numel()
    idx = torch.arange(n)
    return (((idx * 7 + step * 13 + k * 5) % 121 - 60) / 256.0).view(shape)  # |c| <= 60/256: 3c exact in bf16


def nice(stage, precision, master_weights, dtype_name, seed=0):
    dtype = getattr(torch, dtype_name)
    model = Nice(dtype, seed)
    for b in model.blocks:
        zerokern.shard(b, stage=stage, state_precision=precision, bucket_cap_mb=0.001)
    zerokern.shard(model, stage=stage, state_precision=precision)
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, state_precision=precision,
                                 master_weights=master_weights, rounding_seed=5)
    return model, opt


def train_nice(model, opt, first, last):
    for step in range(first, last):
        opt.zero_grad()
        model(step).backward()
        opt.step()


def bits(model):
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {k: v.view(torch.int16 if v.element_size() == 2 else torch.int32).clone() for k, v in full.items()}


def nice_bits(rank, world, precision, master_weights, dtype_name, steps=4):
    """{stage: {name: the params' bits after `steps`}} for stages 0-3 on this group."""
    out = {}
    for stage in (0, 1, 2, 3):
        model, opt = nice(stage, precision, master_weights, dtype_name)
        train_nice(model, opt, 0, steps)
        out[stage] = bits(model)
    return out


def ckpt_save(rank, world, path, stage, precision, master_weights, dtype_name):
    """3 steps, dcp.save of the model's and the optimizer's state dicts, 3 more: the uninterrupted
    run's bits, and the optimizer's full state dict (AdamW's format) at the save."""
    import torch.distributed.checkpoint as dcp

    model, opt = nice(stage, precision, master_weights, dtype_name)
    train_nice(model, opt, 0, 3)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    full = opt.full_state_dict()
    train_nice(model, opt, 3, 6)
    return {"bits": bits(model), "full": full}


def ckpt_resume(rank, world, path, stage, precision, master_weights, dtype_name):
    """Other initial weights, the checkpoint loaded, the same 3 steps."""
    import torch.distributed.checkpoint as dcp

    model, opt = nice(stage, precision, master_weights, dtype_name, seed=1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    full = opt.full_state_dict()
    train_nice(model, opt, 3, 6)
    return {"bits": bits(model), "full": full}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(24, 40), torch.nn.Linear(40, 40), torch.nn.Linear(40, 3)])

    def forward(self, x):
        for k, b in enumerate(self.blocks):
            x = b(x)
            if k < 2:
                x = torch.tanh(x)
        return x


def _batch(step):
    """A batch of a fixed regression task (a random linear teacher), 16 samples; step 99: eval."""
    g = torch.Generator().manual_seed(100 + step % 4 if step != 99 else 99)
    x = torch.randn(16, 24, generator=g)
    teacher = torch.randn(24, 3, generator=torch.Generator().manual_seed(7)) / 5
    return x, x @ teacher


def train_mlp(rank, world, stage, precision, steps=8):
    """(losses, the final params, the eval loss) of the MLP trained on this rank's part of the batch
    (the whole batch on one process), with low-bit state."""
    model = MLP()
    if stage == 3:
        for b in model.blocks:
            zerokern.shard(b, stage=3, state_precision=precision)
        zerokern.shard(model, stage=3, state_precision=precision)
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=3e-2, state_precision=precision,
                                 **({} if stage == 3 else {"zero_stage": stage}))
    per = 16 // world
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = _batch(99)
        ev = torch.nn.functional.mse_loss(model(x), y).item()
    full = zerokern.full_state_dict(model, rank0_only=False) if stage == 3 else {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "eval": ev, "params": full}
