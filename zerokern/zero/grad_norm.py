"""The global norm of the averaged gradient, over the reduced shards (each element counted once
at every stage), for clip_grad_norm_ and max_grad_norm."""

import torch

NORM_CHUNK = 1 << 15  # elements per partial norm (see global_norm)


@torch.no_grad()
def global_norm(comm, stores, pieces, had, norm_type: float, sharded: bool) -> torch.Tensor:
    """The norm of the averaged (still loss-scaled) gradient, computed in fp32 over the reduced
    shards of `stores`; params without a grad this step (had[t] False, e.g. .grad set to None)
    count for nothing, as in torch. sharded: each rank holds a different part (summed over
    comm.shards)."""
    if all(had):
        shards = [s.bucket.reduced_grad() for s in stores]
    else:
        shards = []
        for s, store_pieces in zip(stores, pieces):
            grad = s.bucket.reduced_grad()
            shards += [grad[pc.offset:pc.offset + pc.numel] for pc in store_pieces if had[pc.t] and pc.numel]
    device = shards[0].device if shards else torch.device("cpu")
    if not shards:
        return torch.zeros((), device=device)
    if norm_type == float("inf"):
        total = torch.stack(torch._foreach_norm(shards, norm_type, dtype=torch.float32)).max()
        if sharded:
            # the shards of one shard group cover every element once (replicas hold the same)
            comm.wait(comm.shards.all_reduce(total, op=torch.distributed.ReduceOp.MAX, name="grad_norm"))
        return total
    # One fp32 norm over a bucket of millions of elements loses about 1e-4 (relative) on a CPU,
    # which clipping then carries into every step; norms of NORM_CHUNK-element pieces, summed
    # in fp64, agree with DDP's per-param norms to about 1e-7 at any bucket size, at the same cost.
    chunks = [c for g in shards for c in g.split(NORM_CHUNK)]
    norms = torch.stack(torch._foreach_norm(chunks, norm_type, dtype=torch.float32))  # one call
    total = norms.double().pow(norm_type).sum()
    if sharded:
        comm.wait(comm.shards.all_reduce(total, name="grad_norm"))
    return total.pow(1.0 / norm_type).float()
