"""Workers for tests/zero/grads/test_stage2.py (run on gloo ranks by dist_harness)."""

import contextlib
import math

import torch

from regression_workers import RandomNet
from runtime_workers import gpt, gpt_loss, mine, reference_step, tokens
from zerokern import FusedZeroAdam
from zerokern.zero.grads.placeholder import ShardedGrad
from zerokern.zero.grads.pool import IN_FLIGHT_BUCKETS
from numerics import abs_diff


def held_grad_memory(rank, world, stage, cap_mb):
    """Full grad buffers and reduced shards held during and after a synced backward."""
    model = gpt()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=stage, bucket_cap_mb=cap_mb)
    buckets = opt.schedule.buckets
    bucket_bytes = max(b.plan.padded_numel for b in buckets) * 4
    shard_bytes = sum(b.shard.numel() * 4 for b in buckets)
    full_bytes = sum(b.plan.padded_numel * 4 for b in buckets)
    live = []  # full grad bytes held, sampled at every grad hook of the backward

    def sample(p):
        live.append(sum(b.full.numel() * 4 for b in buckets if b.full is not None))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters()]
    rounds = []
    for seq in tokens(3):
        opt.zero_grad()
        opt.schedule.pool.reset_peak()
        live.clear()
        gpt_loss(model, mine(seq, rank, world)).backward()
        rep = opt.memory_report()
        rounds.append({"grads_after_backward": rep["grads"], "live_peak": max(live),
                       "pool_peak": opt.schedule.pool.peak_bytes,
                       "placeholders": sum(isinstance(p.grad, ShardedGrad) for p in model.parameters())})
        opt.step()
    for h in hooks:
        h.remove()
    return {"rounds": rounds, "bucket_bytes": bucket_bytes, "shard_bytes": shard_bytes, "full_bytes": full_bytes,
            "buckets": len(buckets), "params": len(list(model.parameters())), "in_flight": IN_FLIGHT_BUCKETS}


def _apply(op, model, layer, value_seed):
    """The same grad operation on zerokern's model and on torch's (identical on every rank)."""
    params = list(model.layers[layer].parameters())
    if op == "drop":
        for p in params:
            p.grad = None
    elif op == "zero":
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
    elif op == "replace":
        g = torch.Generator().manual_seed(value_seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def poison_pool(opt):
    """Pooled grad buffers handed out unzeroed come filled with NaN, so a slot that is read
    before it is written ([Note: zeroing on demand]) shows in the results."""
    pool = opt.schedule.pool
    acquire = pool.acquire

    def poisoned(numel, dtype, device, zero=True):
        buf = acquire(numel, dtype, device, zero)
        if not zero:
            buf.fill_(float("nan"))
        return buf
    pool.acquire = poisoned


def random_accumulation(rank, world, stage, seed, steps=12, ops=None, collective=None):
    """Each step: 1-3 micro-batches, each synced or under no_sync(), each rank using a random subset
    of layers; between them, on every rank alike, a layer's grads dropped (.grad = None), zeroed
    (stage 2, right after a synced backward) or replaced by hand. Against torch's semantics for the
    same operations on one process per rank, averaged (zeros for a rank without a grad), AdamW."""
    g = torch.Generator().manual_seed(seed)
    cap = [1e-4, 1e-3, 25.0][int(torch.randint(0, 3, (1,), generator=g))]
    ops_allowed = ops or ["none", "none", "drop", "replace"] + (["zero"] if stage == 2 else [])
    plan = []
    for t in range(steps):
        micro = []
        for m in range(int(torch.randint(1, 4, (1,), generator=g))):
            synced = bool(torch.rand((), generator=g) < 0.6)
            used = [[k for k in range(6) if torch.rand((), generator=g) < 0.6] for _ in range(world)]
            xs = [torch.randn(3, 5, generator=g) for _ in range(world)]
            op = ops_allowed[int(torch.randint(0, len(ops_allowed), (1,), generator=g))]
            if op == "zero" and not synced:
                op = "none"  # zero_() of pending local grads after a reduction raises (tested elsewhere)
            micro.append((synced, used, xs, op, int(torch.randint(0, 6, (1,), generator=g)), seed * 1000 + t))
        plan.append(micro)
    model, ref = RandomNet(seed), RandomNet(seed)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01, zero_stage=stage, bucket_cap_mb=cap)
    poison_pool(opt)
    if collective == "across_hosts":  # [Note: collectives across hosts]: the first half of the ranks one host
        opt.comm.place([2 * r // world for r in range(world)])
    elif collective is not None:  # gloo picks its fastest; NCCL's path (reduce_scatter) is tested here too
        opt.comm.prefers_all_reduce = collective == "all_reduce"
        opt.comm.exchange_reduce = collective == "exchange"
    norms = []
    for micro in plan:
        opt.zero_grad()
        for synced, used, xs, op, layer, vs in micro:
            with contextlib.nullcontext() if synced else opt.no_sync():
                if used[rank]:
                    model(xs[rank], used[rank]).backward()
                elif synced:  # a synced backward must run on every rank: use no layer's output
                    (model.layers[0].weight.sum() * 0).backward()
            _apply(op, model, layer, vs)
        # the norm reads the whole reduced shards, padding included ([Note: zeroing on demand])
        norms.append(float(opt.clip_grad_norm_(float("inf"))))
        opt.step()
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW([m.requires_grad_() for m in masters], lr=1e-2, weight_decay=0.01)
    for micro in plan:
        def on_rank(r):
            for synced, used, xs, op, layer, vs in micro:
                if used[r]:
                    ref(xs[r], used[r]).backward()
                elif synced:
                    (ref.layers[0].weight.sum() * 0).backward()
                _apply(op, ref, layer, vs)
        reference_step(ref, masters, ref_opt, on_rank, world)
    worst = {str(dt): 0.0 for dt in (torch.float32, torch.bfloat16)}
    for a, b in zip(model.parameters(), ref.parameters()):
        worst[str(a.dtype)] = max(worst[str(a.dtype)], abs_diff(a, b))
    from zerokern.zero.comm import gloo
    # relayed: whether a collective ran host by host ([Note: the relay thread]: a thread per group)
    return {"worst": worst, "cap": cap, "norms_finite": all(math.isfinite(n) for n in norms),
            "relayed": bool(gloo._RELAYS)}


def placeholder_behaviour(rank, world):
    """What .grad is and does at stage 2 on several ranks ([Note: stage-2 .grad])."""
    model = gpt()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=0.002)
    seq = tokens(1)[0]
    out = {}
    gpt_loss(model, mine(seq, rank, world)).backward()
    g = model.blocks[0].fc1.weight.grad
    out["type"], out["repr"] = type(g).__name__, repr(g)
    out["shape_ok"] = g.shape == model.blocks[0].fc1.weight.shape and g.dtype == torch.float32
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["clip"] = None
    except RuntimeError as e:
        out["clip"] = str(e)
    try:
        model.ln.weight.grad.sum().item()
        out["read"] = None
    except RuntimeError as e:
        out["read"] = str(e)
    opt.step()
    # torch still holds the grads after step(); here they are freed ([Note: grads after step])
    out["consumed_after_step"] = all(type(p.grad).__name__ == "ShardedGrad" and p.grad.kind == "consumed"
                                     for p in model.parameters())
    # pending local grads edited after a reduction of the same round: refused in step(), on every rank
    opt.zero_grad()
    gpt_loss(model, mine(seq, rank, world)).backward()
    with opt.no_sync():
        gpt_loss(model, mine(seq, rank, world)).backward()
    model.ln.weight.grad.mul_(0.5)
    try:
        opt.step()
        out["pending_edit"] = None
    except RuntimeError as e:
        out["pending_edit"] = str(e)
    return out


def gather_bits(rank, world):
    """Comm.all_gather of a param buffer's own slice ([Note: gather as broadcasts] on gloo) against
    torch's all_gather_into_tensor, bit for bit: -0.0, NaN payloads, infs, subnormals, randoms."""
    import torch.distributed as dist

    from zerokern.zero.comm.factory import make_comm

    comm = make_comm()
    probe = torch.empty(4 * world)
    out = {"by_broadcast": comm._gathers_by_broadcast(probe, probe[4 * rank:4 * (rank + 1)])}
    for dtype, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        n = 48
        g = torch.Generator().manual_seed(rank)
        mine = torch.randn(n, generator=g).to(dtype)
        special = torch.tensor([-0.0, float("inf"), -float("inf"), 1e-40, -1e-40], dtype=torch.float32).to(dtype)
        mine[:5] = special
        nan = torch.tensor([0x7FC00123 if dtype == torch.float32 else 0x7FC3], dtype=bits).view(dtype)
        mine[5] = nan[0]
        buf = torch.full((n * world,), 7.0, dtype=dtype)
        buf[rank * n:(rank + 1) * n] = mine
        comm.wait(comm.all_gather(buf, buf[rank * n:(rank + 1) * n]))
        ref = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(ref, mine)
        out[str(dtype)] = bool(torch.equal(buf.view(bits), ref.view(bits)))
    return out


def exchange_bits(rank, world):
    """Comm.reduce_scatter on 2 gloo ranks ([Note: reduce-scatter as an exchange]) against torch's
    reduce_scatter_tensor, bit for bit, with the input left as it was."""
    import torch.distributed as dist

    from zerokern.zero.comm.factory import make_comm

    comm = make_comm()
    out = {"exchanged": comm.exchange_reduce, "input_kept": True}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(rank)
        full = (torch.randn(64 * world, generator=g) * 10 ** torch.randint(-3, 4, (64 * world,), generator=g)).to(dtype)
        before = full.clone()
        mine = torch.empty(64, dtype=dtype)
        comm.wait(comm.reduce_scatter(mine, full))
        ref = torch.empty(64, dtype=dtype)
        dist.reduce_scatter_tensor(ref, before.clone())
        out[str(dtype)] = bool(torch.equal(mine, ref))
        out["input_kept"] = out["input_kept"] and bool(torch.equal(full, before))
    return out
