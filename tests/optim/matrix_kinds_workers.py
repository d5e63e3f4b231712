"""Per-rank bodies of test_zero_adafactor_units.py, test_zero_adafactor_every_param.py and
test_zero_mixed_matrix.py: ZeroOptimizer with torch.optim.Adafactor groups (1-D params too), alone
beside AdamW, holding every param, or beside a torch.optim.Muon group in one optimizer ([Note: a
cost per param] in zerokern/zero/core/whole_matrices.py), at stages 1-3 and on a (replicate, shard)
mesh, every rank on the same batch or on its own share of it, against one-process torch
optimizers. The model, batches and options are muon_units_workers.py's."""

import torch
import torch.distributed as dist

import muon_units_workers as U
import zerokern
from matrix_helpers import RankResult, owned_whole, state_diff

ADAFACTOR = dict(lr=0.02, weight_decay=0.01, d=1.5, beta2_decay=-0.7)
OPTIONS = {"muon": U.MUON, "adafactor": ADAFACTOR}
CLASSES = {"muon": "Muon", "adafactor": "Adafactor"}


def kind(scenario, name, p):
    """Which optimizer steps the param `name` (the model's name): "muon", "adafactor", or None
    (AdamW). "adafactor": every block param, the 1-D ones too; "every": every param, the embedding
    and the head too (no AdamW group); "mixed": Muon on the blocks' 2-D weights, Adafactor on their
    biases and norms and on the head's weight, AdamW on the rest."""
    if scenario == "every":
        return "adafactor"
    if name.startswith("emb") or name == "head.bias" or (scenario == "adafactor" and name.startswith("head")):
        return None
    if scenario == "mixed" and p.dim() == 2 and name.startswith("blocks."):
        return "muon"
    return "adafactor"


def _kinds(scenario, model):
    return {p: kind(scenario, n, p) for n, p in model.named_parameters()}


def _groups(scenario, model, pieces=None):
    """The param groups, Muon's first, then Adafactor's, then AdamW's if it has params (pieces: the
    reference's masters in place of the params; an empty group is refused, naming it)."""
    pieces = pieces or {p: p for p in model.parameters()}
    kinds = _kinds(scenario, model)
    out = []
    for k in ("muon", "adafactor"):
        mine = [pieces[p] for p, v in kinds.items() if v == k]
        if mine:
            out.append({"params": mine, "optimizer": getattr(torch.optim, CLASSES[k]), **OPTIONS[k]})
    rest = [pieces[p] for p, v in kinds.items() if v is None]
    return out + ([{"params": rest, **U.ADAMW}] if rest else [])


class _Reference(U._Reference):
    """One-process torch.optim.Muon, Adafactor and AdamW over fp32 masters (muon_units_workers')."""

    def __init__(self, scenario, model):
        self.params = list(model.parameters())
        fp32 = self.params[0].dtype == torch.float32
        self.masters = self.params if fp32 else [p.detach().float().requires_grad_() for p in self.params]
        groups = _groups(scenario, model, dict(zip(self.params, self.masters)))
        self.opts = [g.pop("optimizer", torch.optim.AdamW)(g.pop("params"), **g) for g in groups]


def _shard_arg(scenario, model, how):
    """shard(matrices=...) as users would write it: "dict", {param: kind} with the torch classes for
    Muon and strings for Adafactor; "predicate", fn(name, param) -> kind over each unit's own
    names (a block's "up.bias", the root's "head.weight")."""
    if how == "dict":
        return {p: torch.optim.Muon if k == "muon" else k for p, k in _kinds(scenario, model).items() if k}
    return lambda name, p: kind(scenario, name if name.startswith(("emb", "head")) else "blocks.x." + name, p)


def _built(scenario, stage, mesh, dtype, how, wide=False):
    """how: "optimizer" (stages 1/2, the optimizer lays the params out) or units from shard() with
    matrices= given by _shard_arg's "dict" or "predicate". wide: muon_units_workers' wide blocks."""
    model = U._net(dtype, wide)
    where = {} if mesh is None else {"mesh": mesh}
    if how == "optimizer":
        kw = dict(zero_stage=stage, bucket_cap_mb=1e-4, **where)
    else:
        matrices = _shard_arg(scenario, model, how)
        for b in model.blocks:
            zerokern.shard(b, stage=stage, bucket_cap_mb=1e-4, matrices=matrices, **where)
        zerokern.shard(model, stage=stage, bucket_cap_mb=1e-4, matrices=matrices, **where)
        kw = where
    return model, zerokern.ZeroOptimizer(_groups(scenario, model), torch.optim.AdamW, **kw)


def same_batch(rank, world, scenario, cases, split=False):
    """cases: [(stage, mesh, dtype, how)]. split: each rank trains on its own share of every batch
    (rank r the r-th of world equal row blocks), the reference on the whole batch; a bool for every
    case, or a list of them, one a case. Per case: a matrix_helpers.RankResult (the state: every
    class's, in state_dict())."""
    out = []
    splits = split if isinstance(split, list) else [split] * len(cases)
    for (stage, mesh, dtype, how), split in zip(cases, splits, strict=True):
        # on 4 ranks without a mesh the blocks are wide: 4 matrices a block, so that every rank owns
        # one (a block of 2 matrices and 3 small 1-D params leaves a rank of 4 without a whole param)
        wide = world == 4 and mesh is None
        model, opt = _built(scenario, stage, mesh, dtype, how, wide)
        share = len(U._batches()[0]) // world
        rows = slice(rank * share, (rank + 1) * share) if split else slice(None)
        diff, state, full, whole = against_reference(scenario, model, opt, dtype, rows, wide)
        group = dist.get_process_group_ranks(opt.engine.comm.group)
        out.append(RankResult(diff, state, opt.matrices_stepped, owned_whole(opt), whole,
                              {n: v.clone() for n, v in full.items()}, group))
        del opt, model
    return out


def against_reference(scenario, model, opt, dtype, rows=slice(None), wide=False):
    """STEPS steps of model and opt beside one-process torch optimizers on the same batches (rows:
    the ones model takes of each; the reference takes them all):
    (max |param - reference| over the full state dict, max |state - reference's| over
    opt.state_dict() (a collective), the full state dict, how many params the optimizer steps
    whole)."""
    ref = U._net(dtype, wide)
    ref_opt = _Reference(scenario, ref)
    for x in U._batches():
        ref_opt.zero_grad()
        ref(x).backward()
        ref_opt.step()
        opt.zero_grad()
        model(x[rows]).backward()
        opt.step()
    full = zerokern.full_state_dict(model, rank0_only=False)
    diff = max((full[n].float() - q.float()).abs().max().item() for n, q in ref.state_dict().items())
    state = state_diff(opt.state_dict(), ref_opt.opts)
    return diff, state, full, sum(k is not None for k in _kinds(scenario, ref).values())


def refused(rank, world, scenario, which):
    """The error each rank gets (None: none). which: "missing", the units laid out without the
    1-D Adafactor params; "muon cost", the units laid out with every 2-D param as Muon's (the
    Adafactor ones too); "differ", rank 1 lays blocks.0.up.weight out with the other class's cost."""
    model = U._net(torch.float32)
    kinds = _kinds(scenario, model)
    other = {"muon": "adafactor", "adafactor": "muon"}
    if which == "missing":
        matrices = {p: k for p, k in kinds.items() if k and p.dim() == 2}
    elif which == "muon cost":
        matrices = {p: "muon" if p.dim() == 2 else k for p, k in kinds.items() if k}
    else:
        flipped = model.blocks[0].up.weight
        matrices = {p: other[k] if rank == 1 and p is flipped else k for p, k in kinds.items() if k}
    try:
        for b in list(model.blocks) + [model]:
            zerokern.shard(b, stage=3, bucket_cap_mb=1e-4, matrices=matrices)
        zerokern.ZeroOptimizer(_groups(scenario, model), torch.optim.AdamW)
    except ValueError as e:
        return str(e)
    return None
