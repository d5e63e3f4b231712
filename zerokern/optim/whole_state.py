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
Not offered: zerokern.shard() units (laid out before the optimizer is known, so stage 3 too), a
mesh (its replicas would each need the plan), state on disk (InnerStream steps chunks), and Muon
and Adafactor groups in one optimizer (the plan balances one cost).

[Note: whole state in checkpoints] The owner's state of a param (Muon's momentum_buffer,
Adafactor's step, row_var and col_var, or variance) is torch's, the others' none. state_dict()
gathers it from the owners (one all-reduce of every such param's state, the non-owners adding
zeros; the keys and shapes come from state_layout, so every rank knows them): every rank's dict
then has torch's layout, which a one-process torch optimizer loads as it is, and which
load_state_dict hands back to whichever rank owns each param at this world size.
"""

import torch
import torch.distributed as dist

from . import inner_state
from ..zero.unit import unit_of


def check_whole_matrices(cls, why, params, names, sharding, two_d=True):
    """[Note: whole matrices on their owners]: raise, naming the culprit, unless there is a param,
    each is 2-D where two_d (Muon's; Adafactor takes any shape), and the layout can hold them
    whole: params this optimizer buckets itself (no shard() units on several processes), no mesh,
    in memory.
    Returns whether the params are sharded over several processes (the matrix layout is needed)."""
    if not params:
        raise ValueError(f"ZeroOptimizer: the {cls} param group has no trainable params (each has requires_grad "
                         "False); give it the params it should step, or leave the group out")
    for k, p in params:
        if two_d and p.dim() != 2:
            name = f"params[{k}] ({names[p]!r})" if p in names else f"params[{k}]"
            raise ValueError(f"ZeroOptimizer: {cls} {why}, and takes 2-D params only: {name} has shape "
                             f"{list(p.shape)}. Give its param group the 2-D hidden weights only, and the other "
                             "params (embeddings, norms, biases) another optimizer")
    units = [u for u in (unit_of(p) for _, p in params) if u is not None]
    if units:
        world, offload, mesh = units[0].comm.world_size, units[0].config.offload, None
    else:
        group, offload, mesh = sharding.get("process_group"), sharding.get("offload"), sharding.get("mesh")
        world = dist.get_world_size(group) if group is not None or (dist.is_available() and dist.is_initialized()) \
            else 1
    if mesh is not None:
        raise ValueError(f"ZeroOptimizer: {cls} {why}. On a mesh each replica group would need the matrix-whole "
                         "layout (zerokern/zero/core/matrix_layout.py), not wired in yet (issue 51); use "
                         "process_group= (stages 1 and 2)")
    if units and world > 1:
        raise ValueError(f"ZeroOptimizer: {cls} {why}, so on {world} processes its params are laid out whole in one "
                         f"rank's shard each, but unit '{units[0].name}' was laid out by zerokern.shard() before the "
                         "optimizer was known (stage 3 needs such units: not offered yet, issue 51). Pass the params "
                         "without shard(), at zero_stage 1 or 2")
    if getattr(offload, "device", None) == "nvme":
        raise ValueError(f"ZeroOptimizer: {cls} {why}, and OffloadPolicy(device='nvme') steps chunks of the params; "
                         "use OffloadPolicy(device='cpu') or none")
    return world > 1 and not units


def state_layout(cls, options, shape):
    """{key: (shape, dtype, on the param's device)} of the tensors `cls` (with these param group
    options) keeps for a param of `shape` before its first update: its own _init_group run on a
    meta tensor, so no memory ([Note: whole state in checkpoints]). Adafactor's step is on the
    CPU (torch keeps it there), the rest on the param's device."""
    x = torch.zeros(shape, device="meta")
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
    comm.wait(comm.all_reduce(flat, name="whole_state"))
    at = 0
    for st, key, shape, dtype, here, _ in wanted:
        n = torch.Size(shape).numel()
        st[key] = flat[at:at + n].view(shape).to(device if here else "cpu", dtype, copy=True)
        at += n
