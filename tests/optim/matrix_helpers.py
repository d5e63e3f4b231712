"""Helpers the matrix-optimizer tests share (torch.optim.Muon and torch.optim.Adafactor under
ZeroOptimizer): the one-process set-up and training loop, a one-process reference stepping fp32
masters as zerokern keeps them, one step of a reference beside a ZeroOptimizer, and what the
multi-rank tests assert of each rank's results (check_ranks); CountNS counts torch's Newton-Schulz
calls."""

from typing import NamedTuple

import torch
import torch.nn as nn

import zerokern
from zerokern.optim.state_dict import slice_of


def batches(steps):
    """steps batches of 16 x 7 (the one-process tests' models take 7 inputs)."""
    g = torch.Generator().manual_seed(4)
    return [torch.randn(16, 7, generator=g) for _ in range(steps)]


def train(model, opt, xs):
    for x in xs:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def one_process(model, cls, stage, **options):
    """ZeroOptimizer(model's params, cls) on one process. Stage 3: each nn.Linear of the Sequential a
    unit, then the root, so the params are gathered in the forward hooks of the modules that own
    them; tiny buckets, so every stage has several."""
    if stage == 3:
        for m in model:
            if isinstance(m, nn.Linear):
                zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
        return zerokern.ZeroOptimizer(model.parameters(), cls, **options)
    return zerokern.ZeroOptimizer(model.parameters(), cls, zero_stage=stage, bucket_cap_mb=1e-4, **options)


def step_both(ref, ref_opts, model, opt, x):
    """One step on batch x of the one-process reference (its torch optimizers, one per group) and of
    the ZeroOptimizer."""
    for o in ref_opts:
        o.zero_grad()
    ref(x).square().mean().backward()
    for o in ref_opts:
        o.step()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


class Masters:
    """One-process torch optimizers (one per group: {"params", "optimizer" (default: default), its
    options}) on fp32 masters of the params, as zerokern keeps them: the step reads the grads as
    fp32, the params are the masters rounded to nearest (fp32: the same numbers as torch's
    optimizers on the params themselves)."""

    def __init__(self, params, groups, default=torch.optim.AdamW):
        self.params = list(params)
        self.masters = [p.detach().float().requires_grad_() for p in self.params]
        master = dict(zip(map(id, self.params), self.masters))
        self.opts = [g.get("optimizer", default)([master[id(p)] for p in g["params"]],
                                                 **{k: v for k, v in g.items() if k not in ("params", "optimizer")})
                     for g in groups]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
        for o in self.opts:
            o.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)


class CountNS:
    """Counts the calls of torch's Newton-Schulz (the function torch.optim.Muon's step calls once
    per param it updates) while `on` is set: zerokern's steps, not the reference's."""

    def __init__(self):
        import torch.optim._muon as torch_muon  # here: torch before 2.9 has none, and the Adafactor tests run there

        self._module = torch_muon
        self.on, self.calls, self._real = False, 0, torch_muon._zeropower_via_newtonschulz
        torch_muon._zeropower_via_newtonschulz = self._counted

    def _counted(self, *args, **kwargs):
        self.calls += self.on
        return self._real(*args, **kwargs)

    def step(self, step):
        """Run step() (the optimizer's step, or scaler.step(opt)) and return the NS calls it made."""
        before, self.on = self.calls, True
        try:
            step()
        finally:
            self.on = False
        return self.calls - before

    def close(self):
        self._module._zeropower_via_newtonschulz = self._real


class RankResult(NamedTuple):
    """What a rank reports of one multi-rank case, for check_ranks."""
    diff: float  # max |param - one-process reference| over the full model state dict
    state: float  # max |optimizer state - the reference's| over state_dict() (torch's layout)
    stepped: int  # opt.matrices_stepped: whole-param steps this rank took
    owned: int  # whole params this rank owns
    whole: int  # whole params the optimizer steps (Muon's and Adafactor's)
    full: dict  # the full model state dict
    group: list  # the ranks of this rank's shard group


def owned_whole(opt):
    """How many params this rank steps whole (its pieces of the whole params that are not empty)."""
    return sum(1 for t, piece in opt._piece.items() if t in opt._whole and piece.numel())


def state_diff(sd, ref_opts):
    """max |a - b| over every tensor of a ZeroOptimizer's state_dict() against one-process torch
    optimizers over the same params in the same order (the dict's keys: the params of its groups
    counted in order; each torch optimizer counts from 0). A key either side lacks fails. An
    element-wise param's state is compared on this rank's slice (whole params' state is whole on
    every rank, gathered from its owner)."""
    ref, base = {}, 0
    for o in ref_opts:
        for k, st in o.state_dict()["state"].items():
            ref[base + k] = st
        base += sum(len(g["params"]) for g in o.param_groups)
    worst = 0.0
    for k, theirs in ref.items():
        mine = sd["state"][k]
        assert set(mine) == set(theirs), f"state[{k}]: keys {sorted(mine)}, torch's {sorted(theirs)}"
        for key, v in theirs.items():
            if isinstance(v, torch.Tensor):
                m = mine[key]
                where = slice_of(m)  # an element-wise param's state: this rank's slice of it, flattened
                if where is not None:
                    v = v.reshape(-1)[where[0]:where[0] + where[1]]
                elif m.shape != v.shape:  # whole on this rank, flattened as the flat buckets hold it
                    assert m.dim() == 1 and m.numel() == v.numel(), (k, key, list(m.shape), list(v.shape))
                    v = v.reshape(-1)
                worst = max(worst, (m.float() - v.float()).abs().max().item() if v.numel() else 0.0)
            else:
                assert mine[key] == v, (k, key, mine[key], v)
    return worst


def same_bits(dtype):
    """check_ranks' bars where every rank trains on the same batch: the ranks reduce the same grads
    (a sum of equal terms over a power of two ranks is exact), so each optimizer sees one process's
    inputs and must give its bits, params and state (bf16 params: the reference steps fp32 masters
    rounded to nearest, as zerokern keeps them)."""
    return 0.0, 0.0


def check_ranks(out, cases, world, shard_size, steps, bars):
    """Asserts of the multi-rank matrix tests. out: per rank, a RankResult per case (stage, mesh,
    dtype, how); bars(dtype) -> (param bar, state bar). Each rank's params and optimizer state within
    the bars of one process's; each rank stepped its own whole params once a step; each shard group
    (a mesh's replicas each step every param: hybrid sharding) stepped every whole param once a step,
    no rank idle; every rank's params bit-identical to rank 0's."""
    for k, (stage, mesh, dtype, how) in enumerate(cases):
        case = f"stage {stage}, mesh {mesh}, {dtype}, {how}"
        bar, state_bar = bars(dtype)
        per_group = {}
        for rank, o in enumerate(out):
            r = o[k]
            print(f"{case}, rank {rank}: params {r.diff:.3g}, state {r.state:.3g} from one process")
            assert r.diff <= bar, f"{case}, rank {rank}: params {r.diff} from one-process torch (bar {bar})"
            assert r.state <= state_bar, f"{case}, rank {rank}: state {r.state} from one-process torch's ({state_bar})"
            assert r.stepped == steps * r.owned, f"{case}, rank {rank}: {r.stepped} whole steps for {r.owned} owned"
            assert len(r.group) == shard_size
            per_group.setdefault(tuple(r.group), []).append(r.stepped)
        assert len(per_group) == world // shard_size
        whole = out[0][k].whole
        for group, stepped in per_group.items():
            assert sum(stepped) == steps * whole, f"{case}, shard group {group}: {stepped} for {whole} params"
            assert all(stepped), f"{case}, shard group {group}: a rank owns no whole param"
        first = out[0][k].full
        for rank, o in enumerate(out):
            for name, v in o[k].full.items():
                assert torch.equal(v, first[name]), f"{case}: rank {rank}'s {name} differs from rank 0's"
