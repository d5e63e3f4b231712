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


def hf_generate_at_stage3(rank, world, synced):
    """A tiny GPT-2 sharded per block at stage 3; the ranks generate different numbers of tokens
    (rank 1 more), then train a step. synced None: generate's default (zerokern turns
    synced_gpus on); False: the caller's choice kept, so the ranks' gathers part ways."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerokern.zero.comm.check import CollectiveMismatch
    import os
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "30"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=32, n_embd=16, n_layer=2, n_head=2))
    for block in model.transformer.h:
        zerokern.shard(block, stage=3)
    zerokern.shard(model, stage=3)
    opt = FusedZeroAdam(model.parameters(), lr=1e-3)
    prompt = torch.tensor([[1, 2, 3]])
    kwargs = {} if synced is None else {"synced_gpus": synced}
    try:
        model.eval()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=2 + 3 * rank, min_new_tokens=2 + 3 * rank,
                                 do_sample=False, pad_token_id=0, **kwargs)
        model.train()
        ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(ids, labels=ids).loss.backward()
        opt.step()
        full = zerokern.full_state_dict(model, rank0_only=False)
    except CollectiveMismatch as e:
        return {"error": str(e)}
    return {"error": None, "new_tokens": out.shape[1] - 3,
            "checksum": sum(v.double().sum().item() for v in full.values())}


class Heads(nn.Module):
    """Three ways of reading params outside a forward: a method that is not a forward (hidden
    states), a head unit never called (its weight used directly), an L2 term over the params."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return torch.tanh(self.body(x))

    def hidden(self, x):
        return torch.tanh(x @ self.body.weight.t() + self.body.bias)


def params_read_outside_forward(rank, world):
    torch.manual_seed(0)
    model = Heads()
    zerokern.shard(model.body, stage=3)
    zerokern.shard(model.head, stage=3)
    zerokern.shard(model, stage=3)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8)
    reads = {
        "hidden": lambda: model.hidden(x),
        "head weight": lambda: (model(x) @ model.head.weight.t()).sum().backward(),
        "l2": lambda: (model(x).sum() + 1e-2 * sum(p.square().sum() for p in model.parameters())).backward(),
    }
    out = {}
    for what, read in reads.items():
        try:
            read()
            out[what] = None
        except RuntimeError as e:
            out[what] = str(e)
        opt.zero_grad()
    # the allowed uses still work between gathers: shapes, state_dict, a no-op to(), repr, and training
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    model.to(torch.float32)
    out["keys"] = sorted(model.state_dict())
    repr(model.head.weight)
    (model.head(model(x)).square().mean()).backward()
    opt.step()
    out["trained"] = all(t.isfinite().all() for u in opt.units for f in u.flat for t in f.param_shards)
    return out


def compiled_matches_eager(rank, world):
    """torch.compile over a stage-3 model: dynamo traces the units' hooks and inspects the params
    while they are sharded (their swapped class, [Note: reads between gathers])."""
    losses = {}
    for compiled in (False, True):
        model = _shard3(_mlp())
        opt = FusedZeroAdam(model.parameters(), lr=1e-2)
        run = torch.compile(model) if compiled else model
        gen = torch.Generator().manual_seed(1 + rank)
        losses[compiled] = []
        for _ in range(3):
            loss = run(torch.randn(4, 8, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    return losses


def _blocks(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(n)], nn.Linear(8, 1))


def compiled_frames(rank, world, n):
    """Frames dynamo compiles for 3 training steps of a compiled n-block model at stage 3
    ([Note: hooks under torch.compile]), and its losses against the same model run eagerly."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    counter = CompileCounter()
    losses = {}
    for compiled in (False, True):
        model = _shard3(_blocks(n))
        opt = FusedZeroAdam(model.parameters(), lr=1e-2)
        run = torch.compile(model, backend=counter) if compiled else model
        gen = torch.Generator().manual_seed(1 + rank)
        losses[compiled] = []
        for _ in range(3):
            loss = run(torch.randn(4, 8, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
    return {"frames": counter.frame_count, "losses": losses}


def compiled_training_step(rank, world):
    """forward, backward() and opt.step() in one compiled function at stage 3, against the same
    steps run eagerly: the weights after 4 steps (every rank's, gathered) and the losses."""
    import torch._dynamo
    torch._dynamo.reset()
    out = {}
    for compiled in (False, True):
        model = _shard3(_blocks(4))
        opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01)

        def step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        run = torch.compile(step, backend="eager") if compiled else step
        gen = torch.Generator().manual_seed(1 + rank)
        losses = [run(torch.randn(4, 8, generator=gen)).item() for _ in range(4)]
        out[compiled] = (losses, zerokern.full_state_dict(model, rank0_only=False))
    (eager_losses, eager_sd), (losses, sd) = out[False], out[True]
    return {"losses": losses, "eager_losses": eager_losses,
            "max_diff": max((sd[k] - eager_sd[k]).abs().max().item() for k in eager_sd), "keys": len(sd)}
