"""Per-rank bodies of test_wire.py: grads reduced in int8/int4 (with error feedback) and bf16,
against the same run in the grads' own precision."""

import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern
from models import TanhStack

LR = 1e-2


def net():
    """The model every rank and the one-process reference build (seeded: they start alike)."""
    return TanhStack((24, 24, 24, 24), 4, seed=31, loss=False)


def _build(stage, precision, mesh=None, cap=2e-3):
    model = net()
    if stage == 3:
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=cap, mesh=mesh, reduce_precision=precision)
        zerokern.shard(model, stage=3, bucket_cap_mb=cap, mesh=mesh, reduce_precision=precision)
        kw = {}
    else:
        kw = dict(zero_stage=stage, bucket_cap_mb=cap, mesh=mesh, reduce_precision=precision)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=LR, weight_decay=0.0, **kw)


def _batches(rank, steps, seed=5):
    g = torch.Generator().manual_seed(seed + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(16, 24, generator=g)
        out.append((x, torch.sin(x[:, :4] * 2)))
    return out


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank, world, model, opt, batches, scaler=None, bad=None):
    """Mean loss over ranks per step; bad: (step, rank) whose grads get an inf."""
    losses = []
    for t, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if bad is not None and bad == (t, rank):
            loss = loss + model.head.weight.view(-1)[0] * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update(1.0)  # a fixed scale: a residual is in the units of the scale it was made at
        t_ = loss.detach().clone()
        dist.all_reduce(t_)
        losses.append(t_.item() / world)
    return losses


def _same_on_every_rank(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], e) for e in everyone)


def train(rank, world, cases, mesh=None, steps=12):
    """cases: [(stage, precision)]; each trained `steps` steps from the same start. Per case: losses,
    the params' distance to the first case's (the full-precision run), whether every rank holds the
    same params, and the error-feedback bytes."""
    out = {}
    batches = _batches(rank, steps)
    for stage, precision in cases:
        model, opt = _build(stage, precision, mesh)
        losses = _train(rank, world, model, opt, batches)
        full = zerokern.full_state_dict(model, rank0_only=False)
        params = torch.cat([full[n].reshape(-1) for n, _ in model.named_parameters()])
        out[(stage, precision)] = {"losses": losses, "params": params, "same": _same_on_every_rank(params),
                                   "error_feedback": opt.memory_report()["error_feedback"]}
    return out


def skipped_step_leaves_no_trace(rank, world, stage, precision, mesh=None):
    """A run whose step 2 has an inf in rank 1's grads (the step is skipped everywhere) against
    the same run without that batch: the same bits after, residuals and rounding included."""
    batches = _batches(rank, 5)
    runs = []
    for bad in ((2, 1), None):
        model, opt = _build(stage, precision, mesh)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        data = batches if bad else batches[:2] + batches[3:]
        _train(rank, world, model, opt, data, scaler, bad)
        full = zerokern.full_state_dict(model, rank0_only=False)  # stage 3's params are shards
        runs.append((torch.cat([full[n].reshape(-1) for n, _ in model.named_parameters()]),
                     opt.engine.last_step_skipped))
    (with_inf, _), (without, _) = runs
    return {"equal": torch.equal(with_inf, without), "diff": (with_inf - without).abs().max().item()}


def constant_grads(rank, world, cases, steps=30, n=1000):
    """[Note: error feedback] on grads that never change (rank r's: c_r, `accum` backwards a step): SGD
    at lr 1 moves w by minus the sum of the reduced grads, so w + steps * mean_r(accum * c_r) is what
    the rounding owes at the end. cases: [(stage, accum, feedback)]. Per case: that drift, and half a
    quantization step of each element's block (the mean over ranks of absmax(accum * c_r) / QMAX)."""
    import os

    from zerokern.kernels import wire
    c = torch.randn(n, generator=torch.Generator().manual_seed(10 + rank))
    out = {}
    for stage, accum, feedback in cases:
        os.environ["ZEROKERN_ERROR_FEEDBACK"] = "1" if feedback else "0"  # read when the buckets are made
        try:
            w = nn.Parameter(torch.zeros(n))
            opt = zerokern.ZeroOptimizer([w], torch.optim.SGD, lr=1.0, zero_stage=stage, reduce_precision="int4")
            for _ in range(steps):
                opt.zero_grad()
                for _ in range(accum):
                    (w * c).sum().backward()
                opt.step()
        finally:
            os.environ.pop("ZEROKERN_ERROR_FEEDBACK")
        sent = accum * c
        mean, half_step = sent.clone(), wire.scales_of(sent, 4).repeat_interleave(wire.BLOCK)[:n] / 2
        dist.all_reduce(mean)
        dist.all_reduce(half_step)
        out[(stage, accum, feedback)] = {"drift": w.detach() + steps * mean / world, "half_step": half_step / world}
    return out


def odd_sizes(rank, world, bits, n=3001, m=333):
    """comm/wire.py's collectives on sizes whose encoded bytes are not a multiple of 4 (the buffers'
    chunks are padded to 4: wire.stride): the 2-rank all-reduce and the reduce-scatter against the
    sums of wire.py's decoded bytes, in rank order (the own chunk exact); the all-reduce on more
    ranks: the same on every rank, within the rounding of the sum."""
    from zerokern.kernels import wire
    from zerokern.zero.comm import wire as comm_wire
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(n, generator=g), torch.randn(world * m, generator=g)
    xs, ys = [torch.empty_like(x) for _ in range(world)], [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(xs, x)
    dist.all_gather(ys, y)
    rt = lambda t: wire.decode(wire.encode(t, bits, 0, 0, 0, 0, stochastic=False), t.numel(), bits)  # noqa: E731
    out = {}
    got = torch.empty(m)
    comm_wire.reduce_scatter(got, y, None, rank, world, comm_wire.GradWire(f"int{bits}", "rs", rank)).wait()
    want = torch.zeros(m)
    for r in range(world):
        part = ys[r][rank * m:(rank + 1) * m]
        want += part if r == rank else rt(part)
    out["reduce_scatter"] = torch.equal(got, want)
    t = x.clone()
    comm_wire.all_reduce(t, None, rank, world, comm_wire.GradWire(f"int{bits}", "ar", rank)).wait()
    if world == 2:
        out["all_reduce"] = torch.equal(t, rt(xs[0]) + rt(xs[1]))
    else:
        exact = sum(xs)
        step = sum(wire.scales_of(v, bits).repeat_interleave(wire.BLOCK)[:n] for v in xs)
        out["all_reduce"] = bool(((t - exact).abs() <= 2 * step).all()) and _same_on_every_rank(t)
    return out


def pad_bytes(rank, world, bits, m=333):
    """What the collectives hand to gloo for other ranks, with torch.empty poisoned (0xAB, as
    leftover memory may be): each chunk's slot is stride(m) bytes, its last ones pad (int8 of 333
    values: 357 encoded, 3 pad), and every one bound for another rank must be written: the pads 0.
    {collective: whether every pad byte it sent was 0}."""
    from zerokern.kernels import wire
    from zerokern.zero.comm import wire as comm_wire
    chunk, used = wire.stride(m, bits), wire.nbytes(m, bits)
    assert chunk > used, (chunk, used)  # else this checks nothing
    sent, empty, a2a, gather = [], torch.empty, dist.all_to_all_single, comm_wire._all_gather

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(0xAB) if t.dtype == torch.uint8 else t

    def a2a_seen(recv, send, *args, **kwargs):  # slot r goes to rank r; its own stays here
        sent.append(("all_to_all", [s for r, s in enumerate(send.view(world, -1).clone()) if r != rank]))
        return a2a(recv, send, *args, **kwargs)

    def gather_seen(out, mine, *args, **kwargs):
        sent.append(("all_gather", [mine.clone()]))
        return gather(out, mine, *args, **kwargs)

    torch.empty, dist.all_to_all_single, comm_wire._all_gather = poisoned, a2a_seen, gather_seen
    try:  # every chunk m values: the reduce-scatter's, and the all-reduce's (one on 2 ranks, else world)
        y, x = torch.randn(world * m), torch.randn(m if world == 2 else world * m)
        comm_wire.reduce_scatter(torch.zeros(m), y, None, rank, world,
                                 comm_wire.GradWire(f"int{bits}", "rs", rank)).wait()
        comm_wire.all_reduce(x, None, rank, world, comm_wire.GradWire(f"int{bits}", "ar", rank)).wait()
    finally:
        torch.empty, dist.all_to_all_single, comm_wire._all_gather = empty, a2a, gather
    return {f"{i} {what}": all(s.numel() == chunk and bool((s[used:] == 0).all()) for s in slots)
            for i, (what, slots) in enumerate(sent)}


def carried_residuals(rank, world, bits, m=320):
    """A reduction that carries a residual (as a checkpoint restores one: non-zero on the rank's own
    chunk too), against wire.py by hand: each peer's chunk is the decoded bytes of grads + residual
    (one fp32 add), the own chunk is grads + residual exact, summed in rank order; the new residual
    is what the encode lost, in bf16, 0 on the own chunk. Reduce-scatter on any world; on 2 ranks
    the all-reduce too (every term decoded)."""
    from zerokern.kernels import wire
    from zerokern.zero.comm import wire as comm_wire
    g = torch.Generator().manual_seed(20 + rank)
    y = torch.randn(world * m, generator=g)
    res = (torch.randn(world * m, generator=g) * 0.05).bfloat16()
    ys, rs = [torch.empty_like(y) for _ in range(world)], [torch.empty_like(res.float()) for _ in range(world)]
    dist.all_gather(ys, y)
    dist.all_gather(rs, res.float())

    def rt(t):  # (decoded, error) of t at round to nearest, as the encode with feedback does
        buf, err = wire.encode_with_error(t, bits, 0, 0, 0, 0, stochastic=False)
        return wire.decode(buf, t.numel(), bits), err

    out = {}
    w = comm_wire.GradWire(f"int{bits}", "rs", rank)
    w.sent.committed = res.clone()
    got = torch.empty(m)
    comm_wire.reduce_scatter(got, y.clone(), None, rank, world, w).wait()
    want = torch.zeros(m)
    for r in range(world):
        part = ys[r][rank * m:(rank + 1) * m] + rs[r][rank * m:(rank + 1) * m]
        want += part if r == rank else rt(part)[0]
    mine = y + res.float()
    err = torch.cat([torch.zeros(m) if r == rank else rt(mine[r * m:(r + 1) * m])[1] for r in range(world)])
    out["reduce_scatter"] = torch.equal(got, want)
    out["reduce_scatter residual"] = torch.equal(w.sent.pending, err.bfloat16())
    if world == 2:
        w = comm_wire.GradWire(f"int{bits}", "ar", rank)
        w.sent.committed = res.clone()
        t = y.clone()
        comm_wire.all_reduce(t, None, rank, world, w).wait()
        out["all_reduce"] = torch.equal(t, rt(ys[0] + rs[0])[0] + rt(ys[1] + rs[1])[0])
        out["all_reduce residual"] = torch.equal(w.sent.pending, rt(mine)[1].bfloat16())
    return out


def mismatched_precisions(rank, world):
    """Rank 1 asks for another wire than rank 0: shard(stage=3) with another reduce_precision, and
    FusedZeroAdam at stage 2 with another gather_precision. Every rank's error text, by case."""
    out = {}
    torch.manual_seed(0)
    try:
        zerokern.shard(nn.Linear(8, 8), stage=3, reduce_precision=(None, "int8")[rank])
    except ValueError as e:
        out["shard"] = str(e)
    try:
        zerokern.FusedZeroAdam(nn.Linear(8, 8).parameters(), zero_stage=2, gather_precision=("int8", None)[rank])
    except ValueError as e:
        out["optimizer"] = str(e)
    return out
