"""zerokern.ZeroOptimizer(params, torch.optim.Muon) on 2 ranks at stages 1 and 2 ([Note: whole
matrices on their owners] in zerokern/optim/whole_state.py): each matrix laid out whole in one
rank's shard, stepped there by torch's own Muon, once per step; with every rank on the same batch
the params equal one-process torch.optim.Muon's (same thread count: the harness's one), every
rank alike bit for bit; the counter sums to the matrices x steps, under no_sync too; the state
dict is torch's layout both ways."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import dist_harness
import matrix_helpers as H
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

STEPS = 4
OPTIONS = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
# both ranks reduce the same grads: the average is each one's grad exactly, so Muon's own code sees
# one process's inputs, and the params match to 1e-6 (the bar). bf16 params: the
# reference keeps fp32 masters as zerokern does (_Masters), so the same bits are expected.
TOL = {torch.float32: 1e-6, torch.bfloat16: 0.0}


def _model(dtype):
    torch.manual_seed(3)
    # 2-D only, odd and rectangular both ways; six matrices over two ranks, small buckets
    sizes = [7, 33, 12, 5, 19, 9, 4]
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b, bias=False), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _batches(dtype, n):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(16, 7, generator=g).to(dtype) for _ in range(n)]


def _train(model, opt, batches, accumulate):
    """accumulate micro-batches a step, the ones before the last under opt.no_sync() (when given)."""
    for k in range(0, len(batches), accumulate):
        opt.zero_grad()
        for j, x in enumerate(batches[k:k + accumulate]):
            last = j == accumulate - 1
            ctx = opt.no_sync() if hasattr(opt, "no_sync") and not last else _nothing()
            with ctx:
                (model(x).float().square().mean() / accumulate).backward()
        opt.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _Masters(H.Masters):
    """torch.optim.Muon on fp32 masters of bf16 params, as zerokern keeps them."""

    def __init__(self, model):
        super().__init__(model.parameters(), [{"params": list(model.parameters()), "optimizer": torch.optim.Muon,
                                               **OPTIONS}])

    def state_dict(self):
        return self.opts[0].state_dict()


def _same_batch(rank, world, stage, dtype, accumulate):
    ref = _model(dtype)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Muon(ref.parameters(), **OPTIONS) if dtype == torch.float32 else _Masters(ref)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, zero_stage=stage, bucket_cap_mb=1e-3,
                                 **OPTIONS)
    owned = [t for t, piece in opt._piece.items() if piece.numel()]
    batches = _batches(dtype, STEPS * accumulate)
    _train(ref, ref_opt, batches, accumulate)
    _train(model, opt, batches, accumulate)
    diff = max((p.float() - q.float()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    sd = opt.state_dict()  # a collective: the momentum gathered from the owners
    mom = max((sd["state"][k]["momentum_buffer"] - st["momentum_buffer"]).abs().max().item()
              for k, st in ref_opt.state_dict()["state"].items())
    return (diff, mom, opt.matrices_stepped, owned, [p.detach().clone() for p in model.parameters()],
            len(opt.stores))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_on_one_batch_are_one_process_muon(stage, dtype, accumulate):
    out = dist_harness.values(dist_harness.run(_same_batch, 2, stage, dtype, accumulate, timeout=180))
    matrices = sum(isinstance(m, nn.Linear) for m in _model(dtype))
    for rank, (diff, mom, stepped, owned, _, stores) in enumerate(out):
        assert diff <= TOL[dtype], f"rank {rank}: params {diff} from one-process Muon"
        assert mom <= TOL[torch.float32], f"rank {rank}: momentum {mom} from one-process Muon's"
        assert stepped == STEPS * len(owned), f"rank {rank}: {stepped} matrix steps for {len(owned)} owned"
        assert stores > 1, "several buckets"
    assert sorted(t for o in out for t in o[3]) == list(range(matrices)), "every matrix owned by one rank"
    assert all(o[3] for o in out), "both ranks own matrices"
    assert sum(o[2] for o in out) == STEPS * matrices, "Newton-Schulz once per matrix and step, over the ranks"
    for p, q in zip(out[0][4], out[1][4]):
        assert torch.equal(p, q), "every rank's params bit for bit"


def _checkpoint(rank, world, stage):
    """After 2 steps on 2 ranks: torch.optim.Muon on one process loads the state dict (whole
    momentum, gathered from the owners), and a new 2-rank ZeroOptimizer loads torch's; the three
    then take the same 2 next steps as the run that was not interrupted."""
    batches = _batches(torch.float32, 4)
    model = _model(torch.float32)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, zero_stage=stage, bucket_cap_mb=1e-3,
                                 **OPTIONS)
    _train(model, opt, batches[:2], 1)
    sd = opt.state_dict()
    one = copy.deepcopy(model)
    one_opt = torch.optim.Muon(one.parameters(), **OPTIONS)
    one_opt.load_state_dict(copy.deepcopy(sd))  # as torch between two optimizers: it keeps what it is given
    again = copy.deepcopy(model)
    again_opt = zerokern.ZeroOptimizer(again.parameters(), torch.optim.Muon, zero_stage=stage, bucket_cap_mb=1e-3,
                                       **OPTIONS)
    again_opt.load_state_dict(one_opt.state_dict())  # torch's layout in, each rank takes what it owns
    for m, o in ((model, opt), (one, one_opt), (again, again_opt)):
        _train(m, o, batches[2:], 1)
    shapes = [list(st["momentum_buffer"].shape) for st in sd["state"].values()]
    return (shapes, [torch.equal(p, q) for p, q in zip(model.parameters(), one.parameters())],
            [torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters())])


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_is_torch_muons_both_ways(stage):
    model = _model(torch.float32)
    for shapes, one, again in dist_harness.values(dist_harness.run(_checkpoint, 2, stage, timeout=180)):
        assert shapes == [list(p.shape) for p in model.parameters()], "the whole momentum on every rank"
        assert all(one), "torch.optim.Muon resumed from it"
        assert all(again), "a 2-rank ZeroOptimizer resumed from torch's"


class _Block(nn.Module):
    """What users give Muon and AdamW: 2-D hidden weights, and biases, a norm and an embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 9)
        self.up = nn.Linear(9, 21)
        self.norm = nn.LayerNorm(21)
        self.down = nn.Linear(21, 9, bias=False)
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        return self.head(self.down(torch.tanh(self.norm(self.up(self.emb(x))))))


def _mixed_groups(model, muon_class):
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and n.split(".")[0] in ("up", "down")]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return [{"params": hidden, "optimizer": muon_class, **OPTIONS}, {"params": rest, "lr": 3e-3, "betas": (0.8, 0.9)}]


def _mixed(rank, world, stage):
    torch.manual_seed(5)
    ref = _Block()
    model = copy.deepcopy(ref)
    groups = _mixed_groups(ref, None)
    ref_opts = [torch.optim.Muon(groups[0]["params"], **OPTIONS),
                torch.optim.AdamW(groups[1]["params"], lr=3e-3, betas=(0.8, 0.9), weight_decay=0.05)]
    opt = zerokern.ZeroOptimizer(_mixed_groups(model, torch.optim.Muon), torch.optim.AdamW, weight_decay=0.05,
                                 zero_stage=stage, bucket_cap_mb=1e-3)
    g = torch.Generator().manual_seed(6)
    for _ in range(STEPS):
        H.step_both(ref, ref_opts, model, opt, torch.randint(0, 11, (8, 5), generator=g))
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    sd = opt.state_dict()
    classes = [grp["optimizer"] for grp in sd["param_groups"][:1]]
    return diff, opt.matrices_stepped, [p.detach().clone() for p in model.parameters()], classes


@pytest.mark.parametrize("stage", [1, 2])
def test_muon_and_adamw_groups_are_one_process_muon_and_adamw(stage):
    out = dist_harness.values(dist_harness.run(_mixed, 2, stage, timeout=180))
    for rank, (diff, _, _, classes) in enumerate(out):
        assert diff <= TOL[torch.float32], f"rank {rank}: {diff} from one-process Muon + AdamW"
        assert classes == [torch.optim.Muon]
    assert sum(o[1] for o in out) == STEPS * 2, "the two hidden matrices, once a step, over the ranks"
    for p, q in zip(out[0][2], out[1][2]):
        assert torch.equal(p, q), "every rank's params bit for bit"


def _bad_group(rank, world, which):
    torch.manual_seed(5)
    model = _Block()
    groups = _mixed_groups(model, torch.optim.Muon)
    if which == "1-D":
        named = dict(model.named_parameters())  # (name, param) pairs: torch keeps the names as "param_names"
        groups[0]["params"] = [(n, named[n]) for n in ("up.weight", "down.weight", "up.bias")]
        groups[1]["params"] = [(n, p) for n, p in named.items() if n not in ("up.weight", "down.weight", "up.bias")]
    else:
        groups[0]["params"] = []
    before = [p.data_ptr() for p in model.parameters()]
    try:
        zerokern.ZeroOptimizer(groups, torch.optim.AdamW, zero_stage=2)
    except ValueError as e:
        return str(e), before == [p.data_ptr() for p in model.parameters()]
    return None, None


@pytest.mark.parametrize("which, message", [
    ("1-D", r"Muon orthogonalises .* takes 2-D params only: params\[2\] \('up.bias'\) has shape \[21\]"),
    ("empty", r"param group 0 \(Muon\) has no params")])
def test_a_bad_muon_group_is_refused_on_every_rank_by_name(which, message):
    for text, untouched in dist_harness.values(dist_harness.run(_bad_group, 2, which, timeout=120)):
        assert text is not None and re.search(message, text), text
        assert untouched, "refused before the engine took the params"
