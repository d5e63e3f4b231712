"""FusedZeroAdam's update over LowBitStores (state_precision "bf16"/"int8", or master_weights=False):
one fused_adam_lowbit_ call per (param group, step count), over each param's piece of each shard,
with the piece's block scales and the global index of its first element."""

import torch

from ..kernels import lowbit
from ..kernels.lowbit_ops import fused_adam_lowbit_, lowbit_backend


def check_lowbit_options(policy, engine, names, backend):
    """What state_precision / master_weights cannot do, refused at construction, naming the param."""
    if any(u.config.offload is not None for u in engine.units):
        raise ValueError("zerokern: offload with state_precision='bf16'/'int8' or master_weights=False is not "
                         "offered yet; use offload=None (the low-bit state is the smaller saving on the device)")
    if engine.trainable:
        lowbit_backend(backend, engine.trainable[0].device)  # one without a low-bit kernel says so here
    if policy.master_weights:
        return
    for p in engine.trainable:
        if p.dtype == torch.bfloat16:
            continue
        f, i = engine._where(p)
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


def lowbit_update(opt, had, scale, steps):
    calls = {}  # (param group, step) -> the call's lists
    int8 = opt.state_policy.precision == "int8"
    starts = opt.engine.global_starts
    for store, pieces in zip(opt.stores, opt._pieces):
        if not store.master_valid:
            store.refresh_master()
        master, grad, m, v, model = store.operands()
        scales = store.scales()
        for t, off, n, start in pieces:
            if not (had[t] and n):
                continue
            sl = slice(off, off + n)
            c = calls.setdefault((opt._group_of[t], steps[t] + 1), {k: [] for k in (
                "params", "grads", "m", "v", "model", "ms", "vs", "bases")})
            c["params"].append(master[sl])
            c["grads"].append(grad[sl])
            c["m"].append(m[sl])
            c["v"].append(v[sl])
            if model is not None:
                c["model"].append(model[sl])
            if scales is not None:
                c["ms"].append(scales["exp_avg"][block_slice(off, n)])
                c["vs"].append(scales["exp_avg_sq"][block_slice(off, n)])
            c["bases"].append(starts[t] + start)
    for (pg, step), c in calls.items():
        group = opt.param_groups[pg]
        fused_adam_lowbit_(c["params"], c["grads"], c["m"], c["v"], lr=group["lr"], beta1=group["betas"][0],
                           beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                           adam_w_mode=opt.options.adam_w_mode, bias_correction=opt.options.bias_correction,
                           grad_scale=scale, model_params=c["model"] or None,
                           exp_avg_scales=c["ms"] if int8 else None, exp_avg_sq_scales=c["vs"] if int8 else None,
                           index_bases=c["bases"], seed=opt.state_policy.seed, backend=opt.options.backend)
