"""Per-rank bodies of test_wire_gather.py: a tiny model trained with gather_precision="int8" (or
None, the reference) at stages 1, 2 and 3, what each rank's params are, and how far the held
params are from the exact masters at every step."""

import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern
from models import TanhStack

QMAX = 127
BLOCK = 256


def net():
    """The model every rank and the one-process reference build (seeded: they start alike)."""
    return TanhStack((8, 40, 40), 2, seed=5, loss=False)


def _build(stage, precision, dtype, mesh=None, **opt_kw):
    model = net().to(dtype)
    cap = 2e-3  # ~500 fp32 elements a bucket: several buckets, shards not a multiple of the 256-element block
    if stage == 3:
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=cap, gather_precision=precision, mesh=mesh)
        zerokern.shard(model, stage=3, bucket_cap_mb=cap, gather_precision=precision, mesh=mesh)
        kw = {}
    else:
        kw = dict(zero_stage=stage, bucket_cap_mb=cap, gather_precision=precision, mesh=mesh)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01, **kw, **opt_kw)


def _block_scales(delta):
    """Per element: (absmax of its 256-element block, counted from the shard's first element) / 127."""
    n = delta.numel()
    pad = -n % BLOCK
    a = torch.nn.functional.pad(delta.abs(), (0, pad)).view(-1, BLOCK).amax(dim=1) / QMAX
    return a.repeat_interleave(BLOCK)[:n]


def _gathered(model, opt, stage):
    """This rank's full params, flat, as forward computes with them (stage 3: gathered for it)."""
    if stage != 3:
        return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    out = []
    for up in opt.engine.stage3.units:  # every rank, the same order: collectives
        up.unshard()
        out += [buf.detach().float().clone() for f in up.flats for buf in f.param_bufs.buffers]
        up.reshard()
    return torch.cat(out)


def _same_on_every_rank(x, world):
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    return all(torch.equal(e.view(torch.int32), x.view(torch.int32)) for e in everyone)  # bit for bit, NaN too


def train(rank, world, stage, precision, dtype, steps, mesh=None):
    """Losses (averaged over ranks), whether every rank's params are bit-identical at the end, and
    at stages 1/2 the held params' distance from the masters after each step, against the bound."""
    model, opt = _build(stage, precision, dtype, mesh)
    g = torch.Generator().manual_seed(50 + rank)
    losses, worst_ratio, worst_abs, violations, bound_excess = [], 0.0, 0.0, 0, 0.0
    half_ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8  # of |held|: the add's (or bf16's) rounding
    stores = opt.engine.stores
    for _ in range(steps):
        x = torch.randn(16, 8, generator=g).to(dtype)
        y = torch.stack([x[:, 0].float().sin(), x[:, 1:3].float().sum(1).cos()], 1)
        loss = nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        held_before = [s.param_shard().float().clone() for s in stores] if stage != 3 else []
        opt.step()
        if stage != 3 and precision is not None:
            for s, before in zip(stores, held_before):
                held, master = s.param_shard().float(), s.master.float()
                scale = _block_scales(master - before)  # the delta this step's gather sent
                err = (master - held).abs()
                bound = scale + half_ulp * held.abs()
                violations += int((err > bound).sum())
                bound_excess = max(bound_excess, float((err - bound).max()) if err.numel() else 0.0)
                nz = scale > 0
                if nz.any():
                    worst_ratio = max(worst_ratio, float((err[nz] / scale[nz]).max()))
                worst_abs = max(worst_abs, float(err.max()) if err.numel() else 0.0)
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    full = _gathered(model, opt, stage)
    regathered = _gathered(model, opt, stage)  # stage 3: the same step's key, so the same weights again
    out = dict(losses=losses, same=_same_on_every_rank(full, world), regathered=torch.equal(full, regathered),
               worst_ratio=worst_ratio, worst_abs=worst_abs,
               violations=violations, bound_excess=bound_excess, report=opt.memory_report(),
               holds=[getattr(s, "holds_gathered", None) for s in stores])
    if stage != 3:  # the masters (exact) against the params every rank holds
        out["master_gap"] = max(float((s.master.float() - s.param_shard().float()).abs().max()) for s in stores)
    else:  # the gathered copy against the exact slices: one int8 step of the slice's block at most
        ratio, over = 0.0, 0
        for up in opt.engine.stage3.units:
            up.unshard()
            for f in up.flats:
                for b, buf in enumerate(f.param_bufs.buffers):
                    start, end = f.layout.rank_range(f.rank, b)
                    shard = f.param_shards[b].float()
                    err, scale = (buf[start:end].float() - shard).abs(), _block_scales(shard)
                    over += int((err > scale + half_ulp * shard.abs()).sum())
                    ratio = max(ratio, float((err / scale.clamp_min(1e-30)).max()))
            up.reshard()
        out["weight_ratio"], out["weight_violations"] = ratio, over
    return out


def compare(rank, world, stage, dtype, ref_steps, steps):
    """train() without quantization (ref_steps) and with int8 gathers (steps), one group."""
    return dict(ref=train(rank, world, stage, None, dtype, ref_steps), int8=train(rank, world, stage, "int8", dtype,
                                                                                  steps))


def with_mesh(rank, world, stage):
    """A (2, world / 2) mesh: gather_precision="int8" leaves the gathers (inside a host) exact."""
    mesh = (2, world // 2)
    return dict(ref=train(rank, world, stage, None, torch.float32, 5, mesh=mesh),
                int8=train(rank, world, stage, "int8", torch.float32, 5, mesh=mesh))


def refused(rank, world):
    """bf16 params without masters cannot hold gathered values apart from what is trained."""
    try:
        _build(2, "int8", torch.bfloat16, master_weights=False)
    except ValueError as e:
        return str(e)
    return None


def nonfinite_both(rank, world, stage):
    return {p: nonfinite(rank, world, stage, p) for p in (None, "int8")}


def nonfinite(rank, world, stage, precision):
    """An inf in one grad of rank 0 (no GradScaler): where the params end up non-finite, on every rank."""
    model, opt = _build(stage, precision, torch.float32)
    g = torch.Generator().manual_seed(7)
    poison = [False]

    def hook(grad):  # a grad hook: an edit of .grad after backward would be refused
        if poison[0]:
            grad = grad.clone()
            grad[0, 3] = float("inf")
        return grad
    model.head.weight.register_hook(hook)
    for k in range(2):  # the second step's update is inf/nan in one element of rank 0's grads
        x = torch.randn(8, 8, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        poison[0] = k == 1 and rank == 0
        loss.backward()
        opt.step()
    full = _gathered(model, opt, stage)
    return dict(same=_same_on_every_rank(full, world), nonfinite=(~torch.isfinite(full)).nonzero().flatten().tolist(),
                numel=full.numel(), head=(~torch.isfinite(model.head.weight)).sum().item() if stage != 3 else None)


def _variant(variant, precision):
    torch.manual_seed(0)
    model = net()
    kw = dict(zero_stage=2, bucket_cap_mb=2e-3, gather_precision=precision)
    if variant == "overlap_param_gather":
        for b in model.blocks:
            zerokern.shard(b, stage=2, bucket_cap_mb=2e-3, gather_precision=precision, overlap_param_gather=True)
        zerokern.shard(model, stage=2, bucket_cap_mb=2e-3, gather_precision=precision, overlap_param_gather=True)
        return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2)
    if variant == "offload":
        return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, offload=zerokern.OffloadPolicy(), **kw)
    if variant == "ZeroOptimizer":
        return model, zerokern.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, **kw)
    if variant == "int8_state":
        return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, state_precision="int8", **kw)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, **kw)  # "state_dict_round_trip"


def variants(rank, world, names):
    """Stage 2 with int8 gathers and each of `names` against the same without: losses, every rank's
    params, and the largest |master - held params| at the end."""
    out = {}
    for name in names:
        for precision in (None, "int8"):
            model, opt = _variant(name, precision)
            g = torch.Generator().manual_seed(3 + rank)
            losses, masters = [], None  # masters: the params full_state_dict() saves masters of (rank 0)
            for k in range(20):
                x = torch.randn(16, 8, generator=g)
                y = torch.stack([x[:, 0].sin(), x[:, 1:3].sum(1).cos()], 1)
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if name == "state_dict_round_trip" and k == 9:  # the masters and the params, saved and loaded
                    sd, msd = opt.state_dict(), {key: v.clone() for key, v in model.state_dict().items()}
                    full = opt.full_state_dict()  # rank 0's: the masters too where they are not the params
                    masters = None if full is None else sorted(full.get("zerokern_master", {}))
                    opt.load_state_dict(sd)
                    model.load_state_dict(msd)
                losses.append(loss.item())
            opt.engine.finish_param_gather()
            full = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[(name, precision)] = dict(
                losses=losses, same=_same_on_every_rank(full, world), masters=masters,
                gap=max(float((s.master.float() - s.param_shard().float()).abs().max()) for s in opt.engine.stores))
    return out
