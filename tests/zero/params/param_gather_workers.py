"""Rank functions for tests/zero/params/test_param_gather.py: the all-gather of updated params left running
after step() and waited for in the next forward ([Note: gather behind forward])."""

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import zerokern
from stage2_workers import poison_pool
from zerokern.zero.unit import unit_of
from numerics import abs_diff

V, D, T, BATCH = 48, 16, 6, 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(D)
        self.fc1, self.fc2 = torch.nn.Linear(D, 2 * D), torch.nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TinyGPT(torch.nn.Module):
    """Tied head; the root's forward reads the weight of a submodule it never calls (wpe, as
    FSDP2 allows within a unit) and a Parameter of its own (shift)."""

    def __init__(self, layers):
        super().__init__()
        self.wte = torch.nn.Embedding(V, D)
        self.wpe = torch.nn.Embedding(T, D)
        self.shift = torch.nn.Parameter(torch.randn(D) * 0.1)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight
        self.skip = set()  # blocks the forward leaves out (a param unused this step)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]] + self.shift
        for k, b in enumerate(self.blocks):
            if k not in self.skip:
                x = b(x)
        return self.head(self.ln_f(x))


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))


def _data(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (BATCH * world, T + 1), generator=g)


class _Later:
    def __init__(self, run):
        self.run = run


class LateGather:
    """The optimizer's Comm, but an all-gather completes only when it is waited for: until then
    the slices it brings hold NaN, so a read that did not wait sees NaN, and it sends what its
    input held at launch, so a write that did not wait is undone (on CPUs the real gather of a
    small bucket is over before the next forward starts: a missing wait would win its race
    and go unseen)."""

    def __init__(self, comm):
        self.inner = comm

    def all_gather(self, output, input, name="all_gather"):
        n, r = input.numel(), self.inner.rank
        output[:r * n].fill_(float("nan"))
        output[(r + 1) * n:].fill_(float("nan"))
        sent = input.clone()  # what it sends is read at launch, as a collective on a stream may

        def run():
            input.copy_(sent)
            self.inner.wait(self.inner.all_gather(output, input, name))
        return _Later(run)

    def wait(self, work):
        work.run()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _sharded(stage, cap_mb, overlap, layers):
    torch.manual_seed(0)
    model = TinyGPT(layers)
    for b in model.blocks:
        zerokern.shard(b, stage=stage, bucket_cap_mb=cap_mb, overlap_param_gather=overlap)
    zerokern.shard(model, stage=stage, bucket_cap_mb=cap_mb, overlap_param_gather=overlap)
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    opt.param_gather.comm = LateGather(opt.comm)
    poison_pool(opt)
    return model, opt


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def against_waiting_and_adamw(rank, world, stage, cap_mb, steps=6, layers=3):
    """The same training with the gather waited for in step() and left to the next forward: the
    same bits at every step, and torch.optim.AdamW on one process over the full batch. Between
    steps the params are read through each API that must wait: model.state_dict(), a block's
    state_dict(), DCP's get_model_state_dict(), load_state_dict(), finish_param_gather()."""
    runs = {name: _sharded(stage, cap_mb, overlap, layers) for name, overlap in (("wait", False), ("overlap", True))}
    torch.manual_seed(0)
    ref = TinyGPT(layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    out = {"losses": {n: [] for n in runs}, "reads_equal": [], "pending_after_step": [], "last_block_at_first": []}
    model, opt = runs["overlap"]
    last_unit = unit_of(model.blocks[-1].fc1.weight)
    last = [k for k, s in enumerate(opt.param_gather.stores) if unit_of(s.flat.params[0]) is last_unit]
    seen = []
    # after the hooks of zerokern: what block 0 sees of the last block's gathers when it runs
    model.blocks[0].ln.register_forward_pre_hook(
        lambda *_: seen.append([opt.param_gather.buckets[k].state.name for k in last]))
    for step in range(steps):
        idx = _data(step, world)
        mine = idx[rank * BATCH:(rank + 1) * BATCH]
        for name, (m, o) in runs.items():
            o.zero_grad()
            loss = _loss(m, mine)
            loss.backward()
            o.step()
            out["losses"][name].append(loss.item())
        out["pending_after_step"].append(opt.param_gather.pending)
        ref_opt.zero_grad()
        _loss(ref, idx).backward()
        ref_opt.step()
        waited, overlapped = runs["wait"][0], runs["overlap"][0]
        read = step % 5
        if read == 0:
            a, b = waited.state_dict(), overlapped.state_dict()
        elif read == 1:
            a, b = waited.blocks[1].state_dict(), overlapped.blocks[1].state_dict()
        elif read == 2:
            a, b = get_model_state_dict(waited), get_model_state_dict(overlapped)
        elif read == 3:
            runs["overlap"][1].finish_param_gather()
            a, b = _params(waited), _params(overlapped)
        else:  # both load new values (a pending gather must not overwrite them after the load)
            new = {k: v + 0.01 for k, v in waited.state_dict().items()}
            waited.load_state_dict(new)
            overlapped.load_state_dict(new)
            a, b = _params(waited), _params(overlapped)
        out["reads_equal"].append(all(torch.equal(a[k], b[k]) for k in a))
        if read == 4:  # the reference takes the same new values
            with torch.no_grad():
                for k, p in ref.named_parameters():
                    p.copy_(new[k])
    out["last_block_at_first"] = seen
    runs["overlap"][1].finish_param_gather()  # a direct read after step(): the contract
    final = _params(runs["overlap"][0])
    out["final_equal"] = all(torch.equal(final[k], v) for k, v in _params(runs["wait"][0]).items())
    out["max_diff_ref"] = max(abs_diff(final[k], v) for k, v in _params(ref).items())
    return out


def unused_block_and_replaced_param(rank, world, stage):
    """A block that some steps skip (its gather stays pending into the next step()), and a
    param replaced by a new Parameter while its gather runs: the same bits as with the gather
    waited for in step()."""
    runs = {name: _sharded(stage, 0.001, overlap, 3) for name, overlap in (("wait", False), ("overlap", True))}
    losses = {n: [] for n in runs}
    for step in range(6):
        idx = _data(step, world)[rank * BATCH:(rank + 1) * BATCH]
        for name, (m, o) in runs.items():
            o.zero_grad()
            m.skip = {1} if step % 2 == 1 else set()
            loss = _loss(m, idx)
            loss.backward()
            o.step()
            if step == 3:  # a new Parameter put in while the gather runs: the next forward adopts it
                w = m.blocks[2].fc1.weight
                m.blocks[2].fc1.weight = torch.nn.Parameter(torch.linspace(-0.1, 0.1, w.numel()).view(w.shape))
            losses[name].append(loss.item())
    runs["overlap"][1].finish_param_gather()  # a direct read after step(): the contract
    finals = {n: _params(m) for n, (m, _) in runs.items()}
    return {"losses_equal": losses["wait"] == losses["overlap"],
            "final_equal": all(torch.equal(finals["wait"][k], v) for k, v in finals["overlap"].items())}
