"""Per-rank bodies of test_stage3_patterns.py: training patterns that reach past one unit's
forward and backward at stage 3 (a gradient penalty's double backward, HF-style init at the
root, params read outside a forward), against torch.optim.AdamW on one process."""

import copy
import gc

import torch
import torch.nn as nn

import zerokern
from param_gather_workers import BATCH, TinyGPT, _data, _loss
from zerokern import FusedZeroAdam
from zerokern.zero.params.empty import held_shape


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
        "head mT": lambda: (model(x) @ model.head.weight.mT).sum().backward(),
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
    # the allowed uses still work between gathers: shapes (the full ones, [Note: shapes between
    # gathers]), state_dict, a no-op to(), repr, and training
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    out["held"] = [tuple(held_shape(p)) for p in model.parameters()]
    model.to(torch.float32)
    out["keys"] = sorted(model.state_dict())
    out["repr"] = repr(model.head.weight)
    (model.head(model(x)).square().mean()).backward()
    opt.step()
    out["trained"] = all(t.isfinite().all() for u in opt.units for f in u.flat for t in f.param_shards)
    return out


def compiled_matches_eager(rank, world):
    """torch.compile over a stage-3 model: dynamo traces the units' hooks and inspects the params
    while they are sharded (their swapped class, [Note: reads between gathers])."""
    return _losses_eager_and_compiled(_mlp, rank)


def _losses_eager_and_compiled(make, rank, **compile_kwargs):
    """{False: eager losses, True: compiled losses} of 3 training steps of make() at stage 3."""
    losses = {}
    for compiled in (False, True):
        model = _shard3(make())
        opt = FusedZeroAdam(model.parameters(), lr=1e-2)
        run = torch.compile(model, **compile_kwargs) if compiled else model
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
    losses = _losses_eager_and_compiled(lambda: _blocks(n), rank, backend=counter)
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

class ReadsHeadShape(nn.Module):
    """A forward that reads the head's shape before calling it (n_vocab = head.weight.shape[0]),
    where the head's unit is still sharded, and runs two units twice (shared weights)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        w = self.head.weight
        bias = x.new_full((w.shape[0],), w.numel() / (w.size(-1) * w.dim() * len(w)))  # 0.5 from [4, 4]
        return self.head(self.mid(torch.tanh(self.body(x)))) * 0.5 + self.mid(torch.tanh(self.body(x))) + bias


def compiled_reads_shapes(rank, world):
    """torch.compile and eager, one process unsharded: the same losses with a forward that reads a
    sharded param's shape (the compiled code reads it outside the graph, where it is the full one)."""
    gen = torch.Generator().manual_seed(1 + rank)
    data = [torch.randn(4, 8, generator=gen) for _ in range(3)]
    torch.manual_seed(0)
    ref = ReadsHeadShape()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    out = {"ref": []}
    for x in data:  # this rank's batch only: the first loss is comparable, the rest are for the record
        loss = ref(x).square().mean()
        out["ref"].append(loss.item())
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for compiled in (False, True):
        model = opt = None
        gc.collect()  # the eager run's units are gone: the runtime drops them while dynamo traces its hooks
        torch.manual_seed(0)
        model = ReadsHeadShape()
        for m in (model.body, model.mid, model.head, model):
            zerokern.shard(m, stage=3)
        opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
        run = torch.compile(model) if compiled else model
        out[compiled] = []
        for x in data:
            loss = run(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out[compiled].append(loss.item())
    return out


def _nanogpt_groups(model, weight_decay):
    """nanoGPT's configure_optimizers: matrices decay, vectors do not; it prints the counts."""
    param_dict = {pn: p for pn, p in model.named_parameters() if p.requires_grad}
    decay = [n for n, p in param_dict.items() if p.dim() >= 2]
    nodecay = [n for n, p in param_dict.items() if p.dim() < 2]
    groups = [{"params": [param_dict[n] for n in decay], "weight_decay": weight_decay},
              {"params": [param_dict[n] for n in nodecay], "weight_decay": 0.0}]
    seen = {"decay": decay, "no_decay": nodecay, "decay_numel": sum(param_dict[n].numel() for n in decay),
            "count": sum(p.numel() for p in model.parameters())}
    return groups, seen


def _nanogpt_sharded(lr):
    torch.manual_seed(0)
    model = TinyGPT(2)
    before = _nanogpt_groups(model, 0.5)[1]
    for b in model.blocks:
        zerokern.shard(b, stage=3)
    zerokern.shard(model, stage=3)
    groups, after = _nanogpt_groups(model, 0.5)
    return model, zerokern.ZeroOptimizer(groups, torch.optim.AdamW, lr=lr), before, after


def _step(model, opt, idx):
    opt.zero_grad()
    _loss(model, idx).backward()
    opt.step()


def nanogpt_decay_groups(rank, world, steps=3):
    """nanoGPT's decay groups picked by p.dim() after shard(stage=3), ZeroOptimizer(AdamW), against
    torch.optim.AdamW with the same groups on one process over the full batch; then a state dict
    round trip (model and optimizer) into a model sharded anew."""
    lr = 1e-2
    torch.manual_seed(0)
    ref = TinyGPT(2)
    ref_groups, ref_seen = _nanogpt_groups(ref, 0.5)
    ref_opt = torch.optim.AdamW(ref_groups, lr=lr)
    model, opt, before, after = _nanogpt_sharded(lr)
    out = {"ref": ref_seen, "before": before, "after": after, "wd": [g["weight_decay"] for g in opt.param_groups]}
    out["shapes"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    out["ref_shapes"] = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    out["held"] = sorted({tuple(held_shape(p)) for p in model.parameters()})
    for step in range(steps):
        idx = _data(step, world)
        _step(model, opt, idx[rank * BATCH:(rank + 1) * BATCH])
        ref_opt.zero_grad()
        _loss(ref, idx).backward()
        ref_opt.step()
    full = zerokern.full_state_dict(model, rank0_only=False)
    out["diff"] = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    out["shapes_after"] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # round trip: this rank's model and optimizer state dicts into a model sharded anew, one more step each
    sd_model, sd_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    idx = _data(steps, world)[rank * BATCH:(rank + 1) * BATCH]
    _step(model, opt, idx)
    model2, opt2, _, _ = _nanogpt_sharded(lr)
    out["load"] = str(model2.load_state_dict(sd_model))
    opt2.load_state_dict(sd_opt)
    _step(model2, opt2, idx)
    a, b = zerokern.full_state_dict(model, rank0_only=False), zerokern.full_state_dict(model2, rank0_only=False)
    out["resumed_equal"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return out
