"""Per-rank bodies of test_zero_muon_units.py: ZeroOptimizer with a torch.optim.Muon group and an
AdamW group at stage 3 (zerokern.shard units laid out with matrices=) and on a (replicate, shard)
mesh, every rank on the same batch, against one-process torch.optim.Muon + torch.optim.AdamW
(int8=True: the Muon group keeps its momentum in int8, the reference rounds its momentum through
the same blocks after each step, as test_zero_muon_int8.py's oracle)."""

import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern
from matrix_helpers import CountNS, RankResult, owned_whole, state_diff
from zerokern.optim.lowbit_momentum import CODES, COLUMNS, SCALES, decode_rows, encode_rows

STEPS = 20
MUON = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
ADAMW = dict(lr=3e-3, betas=(0.8, 0.9), weight_decay=0.05)


class _Layer(nn.Module):
    def __init__(self, d, h, wide):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.down = nn.Linear(h, d, bias=False)
        # wide: four matrices a block, one for each of 4 ranks (owners are balanced within a unit)
        self.gate = nn.Linear(d, h, bias=False) if wide else None
        self.mix = nn.Linear(h, h, bias=False) if wide else None

    def forward(self, x):
        h = self.up(x)
        if self.gate is not None:
            h = self.mix(h * torch.sigmoid(self.gate(x)))
        return x + self.down(torch.tanh(self.norm(h)))


class Net(nn.Module):
    """What users give Muon and AdamW: 2-D hidden weights (odd and rectangular both ways), and an
    embedding, biases, norms and a head; two blocks, each a unit at stage 3."""

    def __init__(self, wide=False):
        super().__init__()
        self.emb = nn.Embedding(11, 9)
        self.blocks = nn.ModuleList([_Layer(9, 21, wide), _Layer(9, 13, wide)])
        self.head = nn.Linear(9, 3)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).float().square().mean()


def hidden(model):
    return [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]


def _groups(model):
    mine = hidden(model)
    rest = [p for p in model.parameters() if not any(p is q for q in mine)]
    return mine, rest


def _net(dtype, wide=False):
    torch.manual_seed(5)
    return Net(wide).to(dtype)


class _Reference:
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest, on fp32 masters
    of the params as zerokern keeps them (for fp32 params, the params themselves): the step reads
    the grads as fp32, the params are the masters rounded to nearest. int8: Muon's momentum rounded
    through the int8 blocks after each step."""

    int8 = False  # subclasses that build their own optimizers keep fp32 momentum

    def __init__(self, model, int8=False):
        self.int8 = int8
        self.params = list(model.parameters())
        fp32 = self.params[0].dtype == torch.float32
        self.masters = self.params if fp32 else [p.detach().float().requires_grad_() for p in self.params]
        at = {id(p): k for k, p in enumerate(self.params)}
        mine, rest = _groups(model)
        self.opts = [torch.optim.Muon([self.masters[at[id(p)]] for p in mine], **MUON),
                     torch.optim.AdamW([self.masters[at[id(p)]] for p in rest], **ADAMW)]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, scale=None):
        """scale: the loss was multiplied by it (a GradScaler's power of 2); the grads are divided by
        it in fp32, as zerokern unscales them."""
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
        if scale is not None:
            for m in self.masters:
                m.grad.div_(scale)
        for o in self.opts:
            o.step()
        if self.int8:
            for st in self.opts[0].state.values():
                st["momentum_buffer"].copy_(decode_rows(*encode_rows(st["momentum_buffer"])))
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


def _built(stage, mesh, dtype, how, wide, int8=False):
    """A model and its ZeroOptimizer. how: "optimizer" (stages 1/2: the optimizer lays the matrices
    out), or units (each block and the root) with the matrices named to shard() by "list" (the
    param list) or "predicate"; "meta": a meta-device model, materialised by shard(), its matrices
    named by a predicate (a list made before would name the meta params). int8: the Muon group's
    momentum in int8."""
    if how == "meta":
        with torch.device("meta"):
            model = Net(wide).to(dtype)
    else:
        model = _net(dtype, wide)
    mine, _ = _groups(model)
    where = {} if mesh is None else {"mesh": mesh}
    if how != "optimizer":
        matrices = mine if how == "list" else lambda name, p: p.dim() == 2 and not name.startswith(("emb", "head"))
        meta = {"device": "cpu"} if how == "meta" else {}
        for b in model.blocks:
            zerokern.shard(b, stage=stage, bucket_cap_mb=1e-4, matrices=matrices, **where, **meta)
        zerokern.shard(model, stage=stage, bucket_cap_mb=1e-4, matrices=matrices, **where, **meta)
        kw = where
    else:
        kw = dict(zero_stage=stage, bucket_cap_mb=1e-4, **where)
    mine, rest = _groups(model)
    muon = {"params": mine, "optimizer": torch.optim.Muon, **MUON, **({"state_precision": "int8"} if int8 else {})}
    opt = zerokern.ZeroOptimizer([muon, {"params": rest, **ADAMW}], torch.optim.AdamW, **kw)
    return model, opt


def _batches():
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 11, (8, 5), generator=g) for _ in range(STEPS)]


def same_batch(rank, world, cases, split=False, int8=False):
    """cases: [(stage, mesh, dtype, how)] (how: _built's); on 4 ranks without a mesh the model is
    wide. split: each rank trains on its own share of every batch (rank r the r-th of world equal
    row blocks: the mean of the ranks' means is the whole batch's), the reference on the whole
    batch; a bool for every case, or a list of them, one a case. int8: Muon's momentum in int8
    (each owned matrix's state is checked to be its codes and scales only). Each rank checks that
    torch's Newton-Schulz ran as often as matrices_stepped counts. Per case: a
    matrix_helpers.RankResult (the state: Muon's momentum and AdamW's moments in state_dict(),
    torch's layout)."""
    out = []
    splits = split if isinstance(split, list) else [split] * len(cases)
    for (stage, mesh, dtype, how), split in zip(cases, splits, strict=True):
        wide = world == 4 and mesh is None
        model, opt = _built(stage, mesh, dtype, how, wide, int8)
        ref = _net(dtype, wide)
        if how == "meta":  # the values shard() initialised (rank 0's, broadcast)
            ref.load_state_dict(zerokern.full_state_dict(model, rank0_only=False))
        ref_opt = _Reference(ref, int8)
        share = len(_batches()[0]) // world
        ns = CountNS()
        try:
            for x in _batches():
                ref_opt.zero_grad()
                ref(x).backward()
                ref_opt.step()
                opt.zero_grad()
                model(x[rank * share:(rank + 1) * share] if split else x).backward()
                ns.step(opt.step)
        finally:
            ns.close()
        assert ns.calls == opt.matrices_stepped, f"rank {rank}: NS ran {ns.calls} times, {opt.matrices_stepped} counted"
        full = zerokern.full_state_dict(model, rank0_only=False)
        diff = max((full[n].float() - q.float()).abs().max().item() for n, q in ref.state_dict().items())
        if int8:  # between steps an owner holds its matrices' codes and scales, no fp32 momentum
            for p in hidden(model):
                assert set(opt.state[p]) <= {CODES, SCALES, COLUMNS}, sorted(opt.state[p])
                assert not opt.state[p] or opt.state[p][CODES].dtype == torch.uint8
        sd = opt.state_dict()  # a collective: each matrix's momentum from its owner in the shard group
        group = dist.get_process_group_ranks(opt.engine.comm.group)
        out.append(RankResult(diff, state_diff(sd, ref_opt.opts), opt.matrices_stepped, owned_whole(opt),
                              len(hidden(ref)), {n: v.clone() for n, v in full.items()}, group))
        del opt, model
    return out


def unlaid(rank, world, stage):
    """Units laid out by shard() without one of the matrices: the optimizer names it and the fix."""
    model = _net(torch.float32)
    mine, _ = _groups(model)
    for b in model.blocks:
        zerokern.shard(b, stage=stage, bucket_cap_mb=1e-4, matrices=mine[:1])
    zerokern.shard(model, stage=stage, bucket_cap_mb=1e-4, matrices=mine[:1])
    mine, rest = _groups(model)
    try:
        zerokern.ZeroOptimizer([{"params": mine, "optimizer": torch.optim.Muon, **MUON}, {"params": rest, **ADAMW}],
                               torch.optim.AdamW)
    except ValueError as e:
        return str(e)
    return None


def resume(rank, world, stage, how):
    """10 steps, then the model's full state dict and the optimizer's into a new model and
    optimizer built alike, 10 more: per param, whether it equals the run that was not interrupted,
    and the momentum shapes in the saved dict (torch's: whole on every rank)."""
    batches = _batches()
    straight, opt = _built(stage, None, torch.float32, how, False)
    for x in batches:
        opt.zero_grad()
        straight(x).backward()
        opt.step()
    model, opt = _built(stage, None, torch.float32, how, False)
    for x in batches[:10]:
        opt.zero_grad()
        model(x).backward()
        opt.step()
    weights, sd = zerokern.full_state_dict(model, rank0_only=False), opt.state_dict()
    shapes = {k: list(st["momentum_buffer"].shape) for k, st in sd["state"].items() if "momentum_buffer" in st}
    again, opt = _built(stage, None, torch.float32, how, False)
    again.load_state_dict(weights)
    opt.load_state_dict(sd)
    for x in batches[10:]:
        opt.zero_grad()
        again(x).backward()
        opt.step()
    a, b = zerokern.full_state_dict(straight, rank0_only=False), zerokern.full_state_dict(again, rank0_only=False)
    return {n: torch.equal(a[n], b[n]) for n in a}, shapes
