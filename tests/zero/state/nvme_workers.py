"""Per-rank bodies of test_nvme_offload.py: FusedZeroAdam with OffloadPolicy(device="nvme") against
the same run in memory."""

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from zero_workers import BATCH, DIN, DOUT, batches, loss_fn, make_model
import zerokern
from zerokern import FusedZeroAdam, OffloadPolicy
from zerokern.zero.state import swap

# 1024 fp32 (4 KB) chunks and 2 buffer sets: every shard takes several chunks, and the ring wraps
SMALL = dict(chunk_mb=4096 / 2**20, buffer_count=2, io_threads=2)


def nvme(path, **kw):
    return OffloadPolicy(device="nvme", path=path, **{**SMALL, **kw})


def model_of(dtype, seed=0, width=96):
    """zero_workers' shapes, wider: shards of a few thousand elements, several chunks each."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(DIN, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                            torch.nn.Tanh(), torch.nn.Linear(width, DOUT))
    return m.to(dtype)


# Low-bit state streams in chunks of 262,144 elements at the least ([Note: low-bit chunks on disk]): a
# width of 800 and one bucket make each rank's shard about 350,000 elements at 2 ranks, 2 chunks.
LOWBIT = dict(width=800, bucket_cap_mb=4)


def build(dtype, stage, offload, seed=0, width=96, bucket_cap_mb=0.02, **state):
    """state: FusedZeroAdam's state_precision / master_weights."""
    model = model_of(dtype, seed=seed, width=width)
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 3e-3,
               "weight_decay": 0.0}]
    opt = FusedZeroAdam(groups, lr=1e-2, weight_decay=0.05, bucket_cap_mb=bucket_cap_mb, zero_stage=stage,
                        offload=offload, **state)
    return model, opt


def train(model, opt, rank, world, first, last, skip_grad=None):
    per = BATCH // world
    for k, (x, y) in enumerate(batches(last)[first:], first):
        opt.zero_grad()
        loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        if skip_grad is not None and k == first:  # a param without a grad this step: its state must stay
            model[0].bias.grad = None
            if skip_grad == "layer":  # and a bucket without any (model[0].weight has one of its own)
                model[0].weight.grad = None
        opt.step()


def state_of(opt):
    return [t.detach().clone() for st in opt.state.values() for k, t in sorted(st.items()) if k != "step"]


def matches_in_memory(rank, world, stage, dtype, path, kw=None, steps=4):
    """The same training in memory and on disk: params and every state tensor bit for bit. kw:
    build()'s (LOWBIT and a state_precision / master_weights)."""
    kw = kw or {}
    ref_model, ref_opt = build(dtype, stage, None, **kw)
    model, opt = build(dtype, stage, nvme(path), **kw)
    train(ref_model, ref_opt, rank, world, 0, steps, skip_grad=True)
    train(model, opt, rank, world, 0, steps, skip_grad=True)
    same_params = all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    a, b = state_of(ref_opt), state_of(opt)
    report = opt.memory_report()
    return {"params": same_params, "state": len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
            "n_state": len(a), "streams": all(getattr(s, "streams", False) for s in opt.stores),
            "chunks": max(-(-s.n // s.swap.chunk) for s in opt.stores), "report": report,
            "files_left": os.listdir(path)}


def dcp_save(rank, world, path, ckpt, kw=None, inner=None):
    """inner: ZeroOptimizer with this inner optimizer (INNER), not FusedZeroAdam, on fp32 params (its
    state dict has no fp32 masters of bf16 params, so a bf16 resume is not bit for bit, on disk or not)."""
    kw = kw or {}
    model, opt = (build(torch.bfloat16, 2, nvme(path), **kw) if inner is None else
                  build_zero_optimizer(torch.float32, 2, nvme(path), inner))
    train(model, opt, rank, world, 0, 3)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    train(model, opt, rank, world, 3, 5)
    return [p.detach().float() for p in model.parameters()]


def dcp_resume(rank, world, path, ckpt, offload, kw=None, inner=None):
    """A fresh model and optimizer (state on disk, or in memory) load the checkpoint and go on."""
    kw = kw or {}
    offload = nvme(path) if offload else None
    model, opt = (build(torch.bfloat16, 2, offload, seed=7, **kw) if inner is None else
                  build_zero_optimizer(torch.float32, 2, offload, inner, seed=7))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    train(model, opt, rank, world, 3, 5)
    return [p.detach().float() for p in model.parameters()]


def io_error(rank, world, path, fail_rank, op, kw=None):
    """An I/O error on one rank mid-step: every rank raises, and the params and state are unchanged;
    once the disk works again training goes on as if that step had been skipped. kw: build()'s, the
    params' dtype (fp32 if not given) and fail_at, the I/O call that fails (3 if not given)."""
    kw = dict(kw or {})
    dtype, fail_at = kw.pop("dtype", torch.float32), kw.pop("fail_at", 3)
    ref_model, ref_opt = build(dtype, 2, None, **kw)
    model, opt = build(dtype, 2, nvme(path), **kw)
    train(ref_model, ref_opt, rank, world, 0, 2)
    train(model, opt, rank, world, 0, 2)
    before = [p.detach().clone() for p in model.parameters()], state_of(opt)
    real = getattr(swap, op)
    calls = []

    def failing(fd, view, offset):
        calls.append(offset)
        if len(calls) == fail_at:  # a few chunks in: some were read, updated and written already
            raise OSError(5, "Input/output error")
        return real(fd, view, offset)
    if rank == fail_rank:
        setattr(swap, op, failing)
    x, y = batches(3)[2]
    per = BATCH // world
    opt.zero_grad()
    loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    try:
        opt.step()
        error = None
    except zerokern.zero.state.swap.NvmeOffloadError as e:
        error = str(e)
    finally:
        setattr(swap, op, real)
    unchanged = (all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
                 and all(torch.equal(a, b) for a, b in zip(before[1], state_of(opt))))
    ref_opt.zero_grad()  # the reference skips that step too
    train(ref_model, ref_opt, rank, world, 3, 5)
    train(model, opt, rank, world, 3, 5)
    same = all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))
    return {"error": error, "unchanged": unchanged, "then_same": same}


def bad_path(rank, world, paths):
    model = make_model(torch.float32)
    try:
        FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, offload=nvme(paths[rank]))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def in_mapping(t, swapfile):
    """Does t's memory lie in the swap file's mapping?"""
    base = swapfile.tensor(0, 1).data_ptr()
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + swapfile.nbytes


def stage3_model(dtype, offload, seed=0, width=96, bucket_cap_mb=0.02, shard_kw=None):
    """Stage 3: each Linear a unit, then the root."""
    model = model_of(dtype, seed=seed, width=width)
    for layer in (model[0], model[2], model[4]):
        zerokern.shard(layer, stage=3, bucket_cap_mb=bucket_cap_mb, offload=offload, **(shard_kw or {}))
    zerokern.shard(model, stage=3, bucket_cap_mb=bucket_cap_mb, offload=offload, **(shard_kw or {}))
    return model


def stage3_matches_in_memory(rank, world, dtype, path, kw=None, steps=4, params=False):
    """Stage 3: the state of this rank's param shards on disk (params=True: the shards too).
    kw: a width, bucket_cap_mb, state_precision (shard()'s and FusedZeroAdam's) and master_weights."""
    state = dict(kw or {})
    width, bucket_cap_mb = state.pop("width", 96), state.pop("bucket_cap_mb", 0.02)
    shard_kw = {"state_precision": state["state_precision"]} if "state_precision" in state else {}
    runs, advised = [], []
    real = swap.SwapFile.advise

    def advise(self, offset, nbytes, need):
        advised.append(need)
        return real(self, offset, nbytes, need)
    swap.SwapFile.advise = advise
    for offload in (None, nvme(path, params=params)):
        model = stage3_model(dtype, offload, width=width, bucket_cap_mb=bucket_cap_mb, shard_kw=shard_kw)
        opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, **state)
        train(model, opt, rank, world, 0, steps)
        x, _ = batches(steps + 1)[steps]
        with torch.no_grad():
            out = model(x.to(dtype))
        runs.append((model, opt, out))
    (a, oa, outa), (b, ob, outb) = runs
    sa, sb = state_of(oa), state_of(ob)
    shards = [s.param_shard() for s in ob.stores]
    return {"streams": all(getattr(s, "streams", False) for s in ob.stores),
            "chunks": max(-(-s.n // s.swap.chunk) for s in ob.stores),
            "params": all(torch.equal(x.param_shard(), y.param_shard()) for x, y in zip(oa.stores, ob.stores)),
            "outputs": torch.equal(outa, outb),
            "state": len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb)), "n_state": len(sa),
            # params=True: every slice is a view of the swap file's mapping, not memory of its own
            "shards_in_file": all(in_mapping(t, ob.stores[0].swap) for t in shards),
            "report": ob.memory_report(), "ref_report": oa.memory_report(),
            "prefetched": advised.count(True), "released": advised.count(False)}


def stage3_dcp_save(rank, world, path, ckpt):
    model = stage3_model(torch.bfloat16, nvme(path, params=True))
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    train(model, opt, rank, world, 0, 3)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt)
    train(model, opt, rank, world, 3, 5)
    return [s.param_shard().float().clone() for s in opt.stores]


def stage3_dcp_resume(rank, world, path, ckpt, on_disk):
    """A fresh stage-3 model (param shards on disk, or in memory) loads the checkpoint and goes on."""
    model = stage3_model(torch.bfloat16, nvme(path, params=True) if on_disk else None, seed=7)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    train(model, opt, rank, world, 3, 5)
    return [s.param_shard().float().clone() for s in opt.stores]


def full_disk(rank, world, path):
    """State that does not fit the filesystem at `path`: every rank raises, naming the bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    try:
        FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, offload=nvme(path))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


# --- ZeroOptimizer: its inner torch optimizer's state on disk ([Note: inner state on disk]) ---

INNER = {"AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.05)),
         "SGD": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.05))}


def build_zero_optimizer(dtype, stage, offload, inner, seed=0):
    """ZeroOptimizer(inner) over model_of's params, two param groups; stage 3 in zerokern.shard units."""
    model = model_of(dtype, seed=seed)
    cls, kw = INNER[inner]
    if stage == 3:
        for layer in (model[0], model[2], model[4]):
            zerokern.shard(layer, stage=3, bucket_cap_mb=0.02, offload=offload)
        zerokern.shard(model, stage=3, bucket_cap_mb=0.02, offload=offload)
        sharding = {}
    else:
        sharding = dict(zero_stage=stage, bucket_cap_mb=0.02, offload=offload)
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 3e-3,
               "weight_decay": 0.0}]
    return model, zerokern.ZeroOptimizer(groups, cls, **sharding, **kw)


def zero_optimizer_state(opt):
    return [t.detach().clone() for st in opt.state.values() for k, t in sorted(st.items())
            if isinstance(t, torch.Tensor)]


def same(xs, ys):
    xs, ys = list(xs), list(ys)
    return len(xs) == len(ys) and all(torch.equal(x, y) for x, y in zip(xs, ys))


def zero_optimizer_matches_in_memory(rank, world, stage, dtype, path, inner, steps=4, params=False):
    """ZeroOptimizer(inner) in memory and on disk (params=True: stage 3's param shards too): params and
    every state tensor (the step counts too) bit for bit, after steps with a param without a grad;
    then each loads the in-memory one's state dict and trains on alike."""
    ref_model, ref_opt = build_zero_optimizer(dtype, stage, None, inner)
    model, opt = build_zero_optimizer(dtype, stage, nvme(path, params=params), inner)
    train(ref_model, ref_opt, rank, world, 0, steps, skip_grad="layer" if stage != 3 else None)
    train(model, opt, rank, world, 0, steps, skip_grad="layer" if stage != 3 else None)
    params = same([s.param_shard() for s in ref_opt.stores], [s.param_shard() for s in opt.stores])
    a, b = zero_optimizer_state(ref_opt), zero_optimizer_state(opt)
    sd = opt.state_dict()["state"]  # its per-element state: views of the swap file's current slot
    files = {t.untyped_storage().data_ptr() for s in opt.stores for t in s.state.values()}
    on_disk = [t for st in sd.values() for k, t in st.items() if k in opt.stores[0].state_keys and t.numel()]
    sd = ref_opt.state_dict()
    opt.load_state_dict(sd)
    ref_opt.load_state_dict(sd)
    train(ref_model, ref_opt, rank, world, steps, steps + 2)
    train(model, opt, rank, world, steps, steps + 2)
    return {"params": params, "state": same(a, b), "n_state": len(a),
            "streams": all(getattr(s, "streams", False) for s in opt.stores),
            "chunks": max(-(-s.n // s.swap.chunk) for s in opt.stores),
            "report": opt.memory_report(), "keys": opt.stores[0].state_keys,
            "shards_in_file": all(in_mapping(s.param_shard(), s.swap) for s in opt.stores),
            "views_of_file": bool(on_disk) and all(t.untyped_storage().data_ptr() in files for t in on_disk),
            "loaded": same([s.param_shard() for s in ref_opt.stores], [s.param_shard() for s in opt.stores])
            and same(zero_optimizer_state(ref_opt), zero_optimizer_state(opt))}


def zero_optimizer_io_error(rank, world, path, fail_rank, op, stage):
    """io_error's case for ZeroOptimizer(AdamW): every rank raises, nothing changed, then trains on."""
    ref_model, ref_opt = build_zero_optimizer(torch.bfloat16, stage, None, "AdamW")
    model, opt = build_zero_optimizer(torch.bfloat16, stage, nvme(path), "AdamW")
    train(ref_model, ref_opt, rank, world, 0, 2)
    train(model, opt, rank, world, 0, 2)
    before = [s.param_shard().clone() for s in opt.stores], zero_optimizer_state(opt)
    real = getattr(swap, op)
    calls = []

    def failing(fd, view, offset):
        calls.append(offset)
        if len(calls) == 3:  # a few chunks in: some were read, updated and written already
            raise OSError(5, "Input/output error")
        return real(fd, view, offset)
    if rank == fail_rank:
        setattr(swap, op, failing)
    x, y = batches(3)[2]
    per = BATCH // world
    opt.zero_grad()
    loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    try:
        opt.step()
        error = None
    except zerokern.zero.state.swap.NvmeOffloadError as e:
        error = str(e)
    finally:
        setattr(swap, op, real)
    unchanged = same(before[0], [s.param_shard() for s in opt.stores]) and same(before[1], zero_optimizer_state(opt))
    ref_opt.zero_grad()  # the reference skips that step too
    train(ref_model, ref_opt, rank, world, 3, 5)
    train(model, opt, rank, world, 3, 5)
    then = same([s.param_shard() for s in ref_opt.stores], [s.param_shard() for s in opt.stores])
    return {"error": error, "unchanged": unchanged, "then_same": then and same(zero_optimizer_state(ref_opt),
                                                                               zero_optimizer_state(opt))}
