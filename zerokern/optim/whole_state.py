"""ZeroOptimizer's matrix optimizers on shards (issue 51; docs/matrix_optimizers.md): which
params one may step whole where they are, and their state in torch's layout.

[Note: whole matrices on their owners] torch.optim.Muon orthogonalises each 2-D param's update
as a whole, so no flat slice of a matrix can stand in for it. On one process every piece is the
whole param. On several, the engine lays a Muon group's params out with matrix_layout's plan
(WholeMatrices in the ShardConfig: zero/core/flat_plan.py), so each lies whole in one rank's
shard: its owner's piece is the whole param, every other rank's piece is empty. ZeroOptimizer
hands the inner Muon the owner's piece in the param's shape (a view of the fp32 master) with the
reduced, unscaled, clipped grad, and the other ranks' empty (0, n) pieces without a grad, which
torch's Muon skips (its _init_group passes over a param whose .grad is None). So Newton-Schulz
runs once per matrix and step, on one rank, in torch's own code; the usual gather then brings
every rank the new values. opt.matrices_stepped counts the matrices this rank stepped.
zerokern.shard() units are laid out before the optimizer is known, so shard(matrices=...) names
the matrices there ([Note: whole matrices in units] in zero/core/whole_matrices.py): stage 3 then
steps the same way, the owner's slice of its bucket being the whole matrix. On a mesh the plan
is the shard group's: each replica group has one owner per matrix, so NS runs once per matrix
per replica (the replicas' updates are identical, as every update is under hybrid sharding).
Not offered: state on disk (InnerStream steps chunks).

[Note: whole state in checkpoints] The owner's state of a matrix (Muon's momentum_buffer) has
the param's shape, the others' none. state_dict() gathers it from the owners (one all-reduce of
every matrix's state over the shard group, the non-owners adding zeros): every rank's dict then
has the whole tensors, torch.optim.Muon's layout, which a one-process torch.optim.Muon loads as
it is, and which load_state_dict hands back to whichever rank owns each matrix at this world size.
"""

import torch

from ..zero.unit import unit_of


def check_whole_matrices(cls, why, params, names, sharding):
    """[Note: whole matrices on their owners]: raise, naming the culprit, unless every param of
    a matrix optimizer's groups is 2-D, there is one, and its state is in memory. Where shard()
    laid the params out, the engine checks that it kept them whole ([Note: whole matrices in units])."""
    if not params:
        raise ValueError(f"ZeroOptimizer: a {cls} param group has no params; give it the 2-D hidden weights")
    for k, p in params:
        if p.dim() != 2:  # a stage-3 param between gathers answers with its full shape
            name = f"params[{k}] ({names[p]!r})" if p in names else f"params[{k}]"
            raise ValueError(f"ZeroOptimizer: {cls} {why}, and takes 2-D params only: {name} has shape "
                             f"{list(p.shape)}. Give its param group the 2-D hidden weights only, and the other "
                             "params (embeddings, norms, biases) another optimizer")
    units = [u for u in (unit_of(p) for _, p in params) if u is not None]
    offload = units[0].config.offload if units else sharding.get("offload")
    if getattr(offload, "device", None) == "nvme":
        raise ValueError(f"ZeroOptimizer: {cls} {why}, and OffloadPolicy(device='nvme') steps chunks of the params; "
                         "use OffloadPolicy(device='cpu') or none")


@torch.no_grad()
def gather_from_owners(comm, entries):
    """[Note: whole state in checkpoints]. entries: per matrix, (state, piece, shape): its state
    dict entry (changed in place), the inner optimizer's piece (the whole param on its owner,
    empty elsewhere) and the param's shape. A collective: every rank, the same entries in order."""
    wanted = []  # (state, key, shape, owned value or None)
    for st, piece, shape in entries:
        for key in sorted(st):
            v = st[key]
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == piece.shape:
                wanted.append((st, key, tuple(shape), v if piece.numel() else None))
    if not wanted:
        return
    piece = entries[0][1]  # every piece is a view of an fp32 master: its state is fp32 too
    flat = torch.zeros(sum(torch.Size(s).numel() for _, _, s, _ in wanted), dtype=piece.dtype, device=piece.device)
    at = 0
    for _, _, shape, v in wanted:
        n = torch.Size(shape).numel()
        if v is not None:
            flat[at:at + n].copy_(v.reshape(-1))
        at += n
    shards = comm.shards  # one owner per matrix there; a mesh's replicas each hold a copy
    shards.wait(shards.all_reduce(flat, name="whole_state"))
    at = 0
    for st, key, shape, _ in wanted:
        n = torch.Size(shape).numel()
        st[key] = flat[at:at + n].view(shape).clone()
        at += n
