"""ZeroOptimizer's matrix optimizers on shards (issue 51; docs/matrix_optimizers.md): which
params one may step whole where they are, and their state in torch's layout.

[Note: whole matrices on their owners] torch.optim.Muon orthogonalises each 2-D param's update
as a whole, and torch.optim.Adafactor reads each param whole (row and column statistics, the
param's RMS, the update's RMS), so no flat slice of a param can stand in for it. On one process
every piece is the whole param. On several, the engine lays such a group's params out with
matrix_layout's plan (WholeMatrices in the ShardConfig: zero/core/flat_plan.py), so each lies
whole in one rank's shard: its owner's piece is the whole param, every other rank's piece is
empty. ZeroOptimizer hands the inner optimizer the owner's piece in the param's shape (a view of
the fp32 master) with the reduced, unscaled, clipped grad, and the other ranks' empty (0, ...)
pieces without a grad and without state, which torch's Muon and Adafactor skip (their
_init_group passes over a param whose .grad is None). So the update runs once per param and
step, on one rank, in torch's own code; the usual gather then brings every rank the new values.
opt.matrices_stepped counts the params this rank stepped whole. A Muon group takes 2-D params
only (torch's Muon refuses others); an Adafactor group takes any shape, as torch's does (a 1-D
param gets an unfactored variance), each whole on one owner, its cost its numel.
Muon and Adafactor groups may share one optimizer: each param is balanced by its own class's
cost ([Note: a cost per param] in zero/core/whole_matrices.py). zerokern.shard() units are laid
out before the optimizer is known, so shard(matrices=...) names the params and their classes'
costs there ([Note: whole matrices in units]): stage 3 then steps the same way, the owner's slice
of its bucket being the whole param. On a mesh the plan is the shard group's: each replica group
has one owner per param, so NS runs once per matrix per replica (the replicas' updates are
identical, as every update is under hybrid sharding). Not offered: state on disk (InnerStream
steps chunks).

[Note: whole state in checkpoints] The owner's state of a param (Muon's momentum_buffer,
Adafactor's step, row_var and col_var, or variance) is torch's, the others' none. state_dict()
gathers it from the owners (one all-reduce of every such param's state over the shard group,
the non-owners adding zeros; the keys and shapes come from state_layout, so every rank knows
them): every rank's dict then has torch's layout, which a one-process torch optimizer loads as
it is, and which load_state_dict hands back to whichever rank owns each param at this world size.
"""

import torch

from . import inner_state
from ..zero.unit import unit_of


def check_whole_matrices(cls, why, params, names, sharding, two_d=True):
    """[Note: whole matrices on their owners]: raise, naming the culprit, unless every param of
    a matrix optimizer's groups is 2-D where two_d (Muon's; Adafactor takes any shape), there is
    one, and its state is in memory.
    Where shard() laid the params out, the engine checks that it kept them whole ([Note: whole
    matrices in units] in zero/core/whole_matrices.py)."""
    if not params:
        raise ValueError(f"ZeroOptimizer: the {cls} param group has no trainable params (each has requires_grad "
                         "False); give it the params it should step, or leave the group out")
    for k, p in params:
        if two_d and p.dim() != 2:  # a stage-3 param between gathers answers with its full shape
            name = f"params[{k}] ({names[p]!r})" if p in names else f"params[{k}]"
            raise ValueError(f"ZeroOptimizer: {cls} {why}, and takes 2-D params only: {name} has shape "
                             f"{list(p.shape)}. Give its param group the 2-D hidden weights only, and the other "
                             "params (embeddings, norms, biases) another optimizer")
    units = [u for u in (unit_of(p) for _, p in params) if u is not None]
    offload = units[0].config.offload if units else sharding.get("offload")
    if getattr(offload, "device", None) == "nvme":
        raise ValueError(f"ZeroOptimizer: {cls} {why}, and OffloadPolicy(device='nvme') steps chunks of the params; "
                         "use OffloadPolicy(device='cpu') or none")


def state_layout(cls, options, shape, dtype=torch.float32):
    """{key: (shape, dtype, on the param's device)} of the tensors `cls` (with these param group
    options) keeps for a param of `shape` and `dtype` (the piece's: bf16 without masters) before its
    first update: its own _init_group run on a meta tensor, so no memory ([Note: whole state in
    checkpoints]). Adafactor's step is on the CPU (torch keeps it there), the rest on the param's
    device."""
    x = torch.zeros(shape, device="meta", dtype=dtype)
    probe = cls([{**options, "params": [x]}])
    inner_state.make_initial_state(probe, [x])
    return {k: (tuple(v.shape), v.dtype, v.device.type == "meta") for k, v in probe.state[x].items()
            if isinstance(v, torch.Tensor)}


@torch.no_grad()
def gather_from_owners(comm, entries, device):
    """[Note: whole state in checkpoints]. entries: per whole param, (state, owned, layout): its
    state dict entry (changed in place), whether this rank owns it, and its state_layout. A
    collective: every rank, the same entries in order; device: the params' (fp32 masters')."""
    wanted = [(st, key, shape, dtype, here, owned) for st, owned, layout in entries
              for key, (shape, dtype, here) in sorted(layout.items())]
    if not wanted:
        return
    flat = torch.zeros(sum(torch.Size(w[2]).numel() for w in wanted), dtype=torch.float32, device=device)
    at = 0
    for st, key, shape, _, _, owned in wanted:
        n = torch.Size(shape).numel()
        if owned and key in st:
            flat[at:at + n].copy_(st[key].reshape(-1))
        at += n
    shards = comm.shards  # one owner per param there; a mesh's replicas each hold a copy
    shards.wait(shards.all_reduce(flat, name="whole_state"))
    at = 0
    for st, key, shape, dtype, here, _ in wanted:
        n = torch.Size(shape).numel()
        st[key] = flat[at:at + n].view(shape).to(device if here else "cpu", dtype, copy=True)
        at += n
