"""Error feedback of quantized reductions in checkpoints: the residuals of every rank folded into
one "carried gradient" at save, and put back at load (optim/state_dict.py calls both).

[Note: error feedback in checkpoints] A residual ([Note: error feedback] in zero/comm/wire.py) is
one rank's data, shaped by the world it was made in; what matters of it is what it adds to the
next reduced gradient: next reduced SUM = sum_i (g_i + r_i) (+ the chunk owner's `summed`
residual). So state_dict() saves, per param, "error_feedback": that sum of every rank's
residuals (SUM units, fp32), laid out as this rank's slice of the param like exp_avg and marked
the same way ([Note: sharded state in checkpoints]), so DCP re-shards it to any world size; and
"error_feedback_count": the bucket's reductions so far (a 0-dim tensor, alike on every rank),
which keys the rounding's random stream. The fold is one full-precision collective per quantized
bucket over the group its residuals belong to: a reduce-scatter in a flat group (the residual is
the whole bucket, the state this rank's shard), an all-reduce across the replicas with hybrid
sharding (the residual is already this rank's shard) or over the group at stage 0 (state and
residual are both the whole bucket).

Where the fold happens. It must be a collective (rank i alone does not know what the others'
rounding lost), and a collective a rank could skip hangs. Folding at every step would cost a
full-precision reduction per step, which is what quantizing saves; saving each rank's own
residuals instead (no collective) would restore bit for bit, but only into the same ranks: DCP
re-shards a tensor of one global shape, and per-rank residuals have world_size x their size. So
the fold is in state_dict() (and full_state_dict(), a collective already), which is then
collective for a quantized optimizer on several ranks. Every caller we know calls it on every rank: dcp.save of
get_optimizer_state_dict (and the template of a dcp.load), zerokern.integrations.dcp,
zerokern's Accelerate and HF Trainer integrations (Accelerate's AcceleratedOptimizer round trip
at prepare() too). The fold is an announced collective ([Note: announced collectives] in
zero/comm/check.py): with the collective check on (the default), a rank that calls state_dict()
while another does not gets an error naming "error_feedback fold" after
ZEROKERN_COLLECTIVE_TIMEOUT, not a hang (with the check off, ZEROKERN_CHECK_COLLECTIVES=0, it
waits as any collective does). Which buckets fold is fixed at construction (the quantized ones),
so the ranks never disagree on how many collectives it is. A dcp.load's template comes from
state_dict() too: a fold whose values the load overwrites, one reduction per bucket.

At load, the carried sum goes back into the residuals so that the next reduction adds it once:
- flat reduce-scatter (stages 1-3): this rank's own chunk of a bucket is never quantized, so its
  residual there is the carried slice and the rest 0: the next sum gets exactly the carried value;
- an all-reduce on more than 2 ranks (stage 0; hybrid replicas): likewise each rank puts the
  carried value of its own chunk (unquantized in the first phase); `summed` starts at 0;
- an all-reduce on 2 ranks quantizes both ranks' whole tensors: each rank's residual is
  carried / 2 (its expected contribution is exact; the rounding of it is not).
Resuming at the same world size is therefore not bit-exact: before the save, rank i rounded
g_i + r_i; after the load it rounds g_i + (its share of the carried sum), another value, so the
first reduction's rounding (and everything after it) differs by quantization noise, while the
sum of what is carried is the same (tests/optim/test_wire_checkpoint.py checks that the carried value
folded again after a load is the saved one, to bf16, at every layout). The round in progress (a
pending residual, like unreduced grads) is not saved. On one process nothing is reduced, so
nothing is quantized and the carried gradient is dropped.

What it is worth, measured (tests/optim/wire_checkpoint_effect.py: 3 steps, save, 4 steps; the largest
relative loss difference from the run that did not stop, with the residuals restored | dropped
after the load | an uninterrupted run at the loading layout, for scale):
    2 -> 2 ranks, stage 2, int8: 9.3e-04 | 6.8e-04 | 0
    2 -> 4 ranks, stage 2, int8: 6.6e-04 | 6.0e-04 | 8.9e-03
    2 -> 1 rank,  stage 2, int8: 5.7e-04 | 5.7e-04 | 1.4e-02
    2x2 mesh -> 4 flat, stage 2, int8: 1.2e-03 | 1.4e-03 | 9.2e-03
    4 flat -> 2x2 mesh, stage 3, int8: 2.3e-04 | 2.7e-04 | 1.5e-02
    2 -> 2 ranks, stage 2, int4: 5.7e-03 | 9.5e-03 | 0
    2 -> 4 ranks, stage 2, int4: 1.1e-02 | 1.4e-02 | 3.3e-02
A resumed run stays closer to the one that did not stop than a run at the other layout does
(that one's rounding differs from the first step). Restoring the residuals helps at int4 and is
within noise at int8: error feedback already bounds what dropping them costs to one reduction's
rounding, and an int8 residual is below one quantization step (1/127 of its block's largest
value).

Rules for the entry: saved only by an optimizer with reduce_precision int8/int4 on several
ranks; an optimizer without quantized reductions ignores it on load; a quantized one loading a
dict without it starts from zero residuals (and count 0). A plain dcp.load into a template that has
the entry, from a checkpoint without it, is a missing key to DCP: zerokern.integrations.dcp's
load_optimizer (and the Accelerate integration) drop the entries the checkpoint lacks.
"""

from typing import List, Optional

import torch

from ..zero.comm.wire import RESIDUAL_DTYPE, GradWire
from ..zero.core.errors import CollectiveMismatch

KEY = "error_feedback"
COUNT = "error_feedback_count"
KEYS = (KEY, COUNT)
_NAME = "error_feedback fold"


def _wire(store) -> Optional[GradWire]:
    """The store's bucket's GradWire if its grads are quantized (only those keep residuals)."""
    w = getattr(store.bucket, "wire", None)
    return w if w is not None and w.bits is not None else None


def _group(comm):
    """(comm, rank, world) of the group the residuals' collective runs on (hybrid: the replicas)."""
    c = getattr(comm, "replicas", None) or comm
    return c, c.rank, c.world_size


def _flat_scatter(opt) -> bool:
    """The residual is a whole bucket reduce-scattered in a flat group (else all-reduced in place)."""
    return getattr(opt.comm, "replicas", None) is None and opt.strategy.shards_state


def _own_chunk(n: int, rank: int, world: int):
    """This rank's chunk of an n-element all-reduce on > 2 ranks (comm/wire.py's all_reduce)."""
    c = -(-n // world)
    return min(n, rank * c), min(n, (rank + 1) * c)


def fold(opt) -> List[Optional[torch.Tensor]]:
    """Per store: the carried gradient of its shard (fp32, the store's state layout), or None for
    a store without quantized reductions. Collective ([Note: error feedback in checkpoints])."""
    try:
        return _fold(opt)
    except CollectiveMismatch as e:  # the same type (every rank raises alike), saying why this was one
        raise type(e)(f"{e}\nzerokern: this was opt.state_dict(): with reduce_precision={_precision(opt)!r} on "
                      "several ranks it folds the ranks' error feedback, a collective: call it on every rank "
                      "(dcp.save of get_optimizer_state_dict does), as full_state_dict()") from e


def _precision(opt):
    return next((w.precision for w in map(_wire, opt.stores) if w is not None), None)


@torch.no_grad()
def _fold(opt) -> List[Optional[torch.Tensor]]:
    out = []
    for s in opt.stores:
        w = _wire(s)
        if w is None:
            out.append(None)
            continue
        size = state_numel(opt, s)
        comm, rank, world = _group(opt.comm)
        if _flat_scatter(opt):
            buf = _residual(w.sent, size * world, s.bucket.device)
            carried = torch.empty(size, dtype=torch.float32, device=buf.device)
            comm.wait(comm.reduce_scatter(carried, buf, name=_NAME))
        else:
            buf = _residual(w.sent, size, s.bucket.device)
            if w.summed.committed is not None:  # the owner's loss re-encoding its chunk of the sum
                a, b = _own_chunk(size, rank, world)
                buf[a:b] += w.summed.committed.float()
            comm.wait(comm.all_reduce(buf, name=_NAME))
            carried = buf
        out.append(carried)
    return out


def state_numel(opt, store) -> int:
    """Elements of the store's state (the layout of its carried gradient): the bucket's shard
    where the state is sharded, else the whole bucket."""
    plan = store.bucket.plan
    return plan.shard_numel if opt.strategy.shards_state else plan.padded_numel


def _residual(res, numel: int, device) -> torch.Tensor:
    t = res.committed
    if t is None:
        return torch.zeros(numel, dtype=torch.float32, device=device)
    if t.numel() != numel:
        raise RuntimeError(f"zerokern internal error: a residual of {t.numel()} elements for {numel}")
    return t.to(device, torch.float32, copy=True)


def counts(opt) -> List[Optional[int]]:
    """Per store: its bucket's reductions so far (None without quantized reductions)."""
    return [None if _wire(s) is None else _wire(s).committed_count for s in opt.stores]


@torch.no_grad()
def restore(opt, carried: List[Optional[torch.Tensor]], counts: List[Optional[int]]) -> None:
    """Put each store's carried gradient (None: none saved, residuals start at 0) back into its
    bucket's residuals ([Note: error feedback in checkpoints]); counts[k]: its saved count."""
    for s, c, n in zip(opt.stores, carried, counts):
        w = _wire(s)
        if w is None:
            continue
        w.count = w.committed_count = 0 if n is None else int(n)
        w.sent.committed = w.sent.pending = w.summed.committed = w.summed.pending = None
        if c is None:
            continue
        comm, rank, world = _group(opt.comm)
        size, dev = c.numel(), s.bucket.device
        if _flat_scatter(opt):
            sent = torch.zeros(size * world, dtype=RESIDUAL_DTYPE, device=dev)
            sent[rank * size:(rank + 1) * size] = c
        elif world == 2:
            sent = (c / 2).to(dev, RESIDUAL_DTYPE)
        else:
            sent = torch.zeros(size, dtype=RESIDUAL_DTYPE, device=dev)
            a, b = _own_chunk(size, rank, world)
            sent[a:b] = c[a:b]
        w.sent.committed = sent
