"""Per-rank bodies of the FusedZeroAdam multi-process tests (run by dist_harness)."""

import copy

import torch
import torch.distributed as dist

from zerokern import FusedZeroAdam
from numerics import abs_diff

BATCH, DIN, DHID, DOUT = 24, 13, 37, 7  # odd sizes: numel not divisible by the world size


def make_model(dtype=torch.float32, seed=0, device="cpu"):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(DIN, DHID), torch.nn.Tanh(), torch.nn.Linear(DHID, DHID),
                            torch.nn.Tanh(), torch.nn.Linear(DHID, DOUT))
    return m.to(device=device, dtype=dtype)


def batches(steps, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, DIN, generator=g).to(device), torch.randn(BATCH, DOUT, generator=g).to(device))
            for _ in range(steps)]


def loss_fn(model, x, y):
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).square().mean()


def reference(dtype, steps, lr=1e-2, wd=0.05, adam_w=True, device="cpu"):
    """One process, full batch: torch.optim.AdamW on fp32 weights (master copies
    for fp16/bf16 models, written back after each step)."""
    model = make_model(dtype, device=device)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    opt = cls(masters, lr=lr, weight_decay=wd)
    for x, y in batches(steps, device=device):
        model.zero_grad()
        loss_fn(model, x, y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return model


def train_sharded(rank, world, dtype, stage, overlap, bucket_cap_mb, steps, adam_w=True, device="cpu", backend=None):
    if device == "cuda":
        device = f"cuda:{torch.cuda.current_device()}"
    model = make_model(dtype, device=device)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=stage, overlap_comm=overlap,
                        bucket_cap_mb=bucket_cap_mb, adam_w_mode=adam_w, **({"backend": backend} if backend else {}))
    per = BATCH // world
    for x, y in batches(steps, device=device):
        opt.zero_grad()
        loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    ref = reference(dtype, steps, adam_w=adam_w, device=device)
    diff = max(abs_diff(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    scale = max(b.float().abs().max().item() for b in ref.parameters())
    flat = opt.units[0].flat[0]
    return {"diff": diff, "scale": scale, "buckets": len(flat.layout.buckets),
            "report": opt.memory_report(), "numel": sum(p.numel() for p in model.parameters()),
            "padded_numel": flat.layout.padded_numel}


def no_sync_equals_big_batch(rank, world):
    """Two micro-batches under no_sync() and one synced: the reduced gradient
    equals the full-batch gradient (compared shard by shard in the bucket layout)."""
    from zerokern.ops import flatten

    model = make_model()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, bucket_cap_mb=0.001)
    (x, y), = batches(1)
    per = BATCH // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    thirds = [slice(0, per // 3), slice(per // 3, 2 * per // 3), slice(2 * per // 3, per)]
    with opt.no_sync():
        for sl in thirds[:2]:
            (loss_fn(model, xs[sl], ys[sl]) * len(xs[sl]) / per).backward()
    sl = thirds[2]
    (loss_fn(model, xs[sl], ys[sl]) * len(xs[sl]) / per).backward()  # reduces at the end
    ref = make_model()
    loss_fn(ref, x, y).backward()
    f = opt.units[0].flat[0]
    ref_grads = [p.grad for p in ref.parameters()][::-1]  # the unit holds params in backward order
    worst = 0.0
    for b, bucket in enumerate(f.layout.buckets):
        full = flatten([ref_grads[i] for i in bucket.tensors], offsets=f.layout.offsets(b), numel=bucket.padded_numel)
        start, end = f.layout.rank_range(f.rank, b)
        worst = max(worst, abs_diff(f.buckets[b].reduced_grad(), full[start:end]))
    opt.step()
    return worst


class Partial(torch.nn.Module):
    """`unused` never gets a grad; `rank0_only` gets one on rank 0 only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.used = torch.nn.Linear(5, 5)
        self.rank0_only = torch.nn.Linear(5, 5)
        self.unused = torch.nn.Linear(5, 5)

    def forward(self, x, rank):
        h = self.used(x)
        return self.rank0_only(h) if rank == 0 else h


def unused_params(rank, world):
    model = Partial()
    before = copy.deepcopy(model)
    ref = copy.deepcopy(model)
    # tiny buckets: the buckets of unused params must still be reduced in step(), never awaited forever
    opt = FusedZeroAdam(model.parameters(), lr=0.1, weight_decay=0.0, zero_stage=2, bucket_cap_mb=0.0001)
    x = torch.ones(4, 5)
    model(x, rank).square().mean().backward()
    opt.step()
    # Reference: averaged grads, with zeros standing in for rank 1's missing rank0_only grad.
    ref_opt = torch.optim.AdamW([p for n, p in ref.named_parameters() if not n.startswith("unused")], lr=0.1,
                                weight_decay=0.0)
    grads = {}
    for r in range(world):
        ref.zero_grad()
        ref(x, r).square().mean().backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                grads[n] = grads.get(n, 0) + p.grad / world
    for n, p in ref.named_parameters():
        p.grad = grads.get(n)
    ref_opt.step()
    return {
        "unused_unchanged": all(torch.equal(a, b) for a, b in zip(model.unused.parameters(),
                                                                   before.unused.parameters())),
        "diff": max(abs_diff(a, b) for a, b in zip(model.parameters(), ref.parameters())),
    }


def grad_scaler_skip(rank, world, device="cpu", backend=None):
    """fp16 params: an inf on rank 1 only skips the step on both ranks, and both scalers back off."""
    model = make_model(torch.float16, device=device)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=2, **({"backend": backend} if backend else {}))
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=1024.0)
    per = BATCH // world
    log = []
    for step, (x, y) in enumerate(batches(3, device=device)):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        loss = loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        if step == 1 and rank == world - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        log.append((changed, scaler.get_scale()))
    return log


def mismatched_params(rank, world):
    model = torch.nn.Linear(4, 4 + rank)
    FusedZeroAdam(model.parameters())
    return "built"


def step_after_destroy(rank, world):
    """A backward and a step after dist.destroy_process_group(): an error that says so.
    Also: whether building the optimizer installed the exit drain."""
    from zerokern.zero.comm import exit_drain

    model = make_model()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    drain = exit_drain._registered
    (x, y), = batches(1)
    loss_fn(model, x, y).backward()
    opt.step()
    dist.destroy_process_group()
    try:
        loss_fn(model, x, y).backward()
        opt.step()
    except RuntimeError as e:
        return str(e), drain
    return None, drain


def checkpoint_save(rank, world, path, steps):
    """Train `steps` steps at this world size; rank 0 saves the model and the full optimizer state."""
    model = make_model(torch.bfloat16)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=2, bucket_cap_mb=0.001)
    per = BATCH // world
    for x, y in batches(steps):
        opt.zero_grad()
        loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    full = opt.full_state_dict()
    shard = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": full}, path)
    dist.barrier()
    return {"shard_format": shard["zerokern"]["format"], "full_is_none": full is None}


def checkpoint_resume(rank, world, path, steps_before, steps_after):
    """Load the checkpoint at this world size and continue; compare with an uninterrupted run."""
    model = make_model(torch.bfloat16)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05, zero_stage=2, bucket_cap_mb=0.002)
    ck = torch.load(path, weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optim"])
    per = BATCH // world
    for x, y in batches(steps_before + steps_after)[steps_before:]:
        opt.zero_grad()
        loss_fn(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    ref = reference(torch.bfloat16, steps_before + steps_after)
    # a shard saved by this rank loads back (through torch.save, as a user would); another rank's
    # is refused, naming the param and the slices
    torch.save(opt.state_dict(), f"{path}.rank{rank}")
    opt.load_state_dict(torch.load(f"{path}.rank{rank}", weights_only=True))
    dist.barrier()
    refused = None
    try:
        opt.load_state_dict(torch.load(f"{path}.rank{(rank + 1) % world}", weights_only=True))
    except ValueError as e:
        refused = str(e)
    return {"diff": max(abs_diff(a, b) for a, b in zip(model.parameters(), ref.parameters())),
            "refused": refused}


def example_losses(rank, world, optimizer, dtype, grad_accum, stage):
    """examples/train_gpt.py's train() on this rank: its losses."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
    import train_gpt

    args = train_gpt.parser().parse_args(["--optimizer", optimizer, "--dtype", dtype, "--grad-accum", str(grad_accum),
                                          "--steps", "25", "--log-every", "1000"]
                                         + ([] if stage is None else ["--zero-stage", str(stage)]))
    return list(train_gpt.train(args, rank, world)[0].values())  # {step: loss}, in step order
