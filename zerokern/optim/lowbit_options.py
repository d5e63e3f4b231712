"""What FusedZeroAdam's low-bit state (state_precision "bf16"/"int8", or master_weights=False)
cannot do, refused at construction, and where a piece's block scales lie in a shard. The update
itself is FusedZeroAdam._update_lowbit."""

import torch

from ..kernels import lowbit
from ..kernels.lowbit_ops import lowbit_backend


def check_lowbit_options(policy, engine, names, backend):
    """What state_precision / master_weights cannot do, refused at construction, naming the param."""
    if any(u.config.offload is not None and not u.config.offload.on_disk for u in engine.units):
        raise ValueError("zerokern: OffloadPolicy(device='cpu') with state_precision='bf16'/'int8' or "
                         "master_weights=False is not offered yet; use OffloadPolicy(device='nvme', path=...) or "
                         "offload=None (the low-bit state is the smaller saving on the device)")
    if engine.trainable:
        lowbit_backend(backend, engine.trainable[0].device)  # one without a low-bit kernel says so here
    if not policy.master_weights:
        check_bf16_params(engine, names)


def check_bf16_params(engine, names):
    """master_weights=False (FusedZeroAdam's, ZeroOptimizer's) is for bf16 params: raise naming the
    first param of another dtype. The ranks agree on the dtypes, so every rank raises alike."""
    for p in engine.trainable:
        if p.dtype == torch.bfloat16:
            continue
        f, i = engine.locate(p)
        name = names.get(p, f.members[i].name)
        if p.dtype == torch.float32:
            raise ValueError(f"zerokern: {name} is float32: fp32 params are their own master weights, so "
                             "master_weights=False would save nothing. Train bf16 params (model.to(torch.bfloat16)) "
                             "or keep master_weights=True")
        raise ValueError(f"zerokern: {name} is {str(p.dtype).removeprefix('torch.')}: master_weights=False is for "
                         "bf16 params. fp16 has 5 exponent bits, so without an fp32 master small updates underflow "
                         "and the loss scale would have to reach the params; use bf16 (the same 2 bytes, fp32's "
                         "range) or keep master_weights=True")


def block_slice(off, n):
    """The block scales of elements [off, off + n) of a shard ([Note: int8 shards in blocks]: off
    is a multiple of BLOCK)."""
    first = off // lowbit.BLOCK
    return slice(first, first + lowbit.num_blocks(n))
