"""Where a training step's time goes: forward, backward and optimizer step, per variant, side by
side on N ranks (the models, data and variants of bench/train_step.py).

    python bench/step_phases.py [--world 2] [--rounds 8] [--dtype fp32]
                                [--variants zerokern-s2,zerokern-s2+gather,ddp+adamw-fused] [--json out.json]

Each round gives every variant two consecutive steps (the order reversed every other round),
each phase timed on rank 0's host clock (on a GPU, synchronised at each phase boundary, which
removes the overlap across phases a real loop has: use it for where the time goes, and
bench/train_step.py for how long a step takes). Round 0 warms up. Reported: the median of each
phase over the timed steps.

Why it exists: on 2 CPU ranks (gloo over TCP loopback) zerokern stage 2 in fp32 trails DDP; this
shows which phase holds the difference (the param all-gather after the update: ZeRO moves the
same bytes as DDP's all-reduce, but DDP hides all of them in its long backward, while the
gather has to land between step() and the next forward).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _harness as H  # noqa: E402
import train_step as TS  # noqa: E402
from train_gpt import GPT, markov_batches  # noqa: E402

PHASES = ("forward", "backward", "step")


def worker(rank, world, init, args, out):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    device = torch.device("cpu")
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d_model, args.heads, args.layers, args.ctx)
    per = args.batch
    x, y = next(iter(markov_batches(args.vocab, args.ctx, per * world, 1, seed=1)))
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    variants = [TS.build(k, base, args.dtype, device, world, args.bucket_cap_mb) for k in args.variants.split(",")]
    times = {v.name: {p: [] for p in PHASES} for v in variants}
    for r in range(args.rounds + 1):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            dist.barrier()
            for _ in range(2):
                t0 = time.perf_counter()
                logits = (v.engine or v.model)(x)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
                t1 = time.perf_counter()
                (v.engine.backward if v.engine is not None else torch.Tensor.backward)(loss)
                t2 = time.perf_counter()
                (v.engine or v.opt).step()
                t3 = time.perf_counter()
                if v.engine is None:
                    v.opt.zero_grad()
                if r:
                    for p, a, b in zip(PHASES, (t0, t1, t2), (t1, t2, t3)):
                        times[v.name][p].append(b - a)
            v.finish()
    if rank == 0:
        torch.save({name: {p: H.summary(s) for p, s in ph.items()} for name, ph in times.items()}, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--variants", default="zerokern-s2,zerokern-s2+gather,ddp+adamw-fused")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "phases.pt")
        mp.start_processes(worker, args=(args.world, f"file://{tmp}/store", args, out), nprocs=args.world,
                           start_method="spawn")
        result = torch.load(out, weights_only=False)
    rows = [{"variant": name, **{f"{p} ms": f"{ph[p]['median_ms']:.1f}" for p in PHASES},
             "total ms": f"{sum(ph[p]['median_ms'] for p in PHASES):.1f}"} for name, ph in result.items()]
    print(f"\n{args.dtype}, {args.world} ranks x {args.threads} thread(s): median per phase")
    H.print_table(rows, [(k, k, "{}") for k in rows[0]])
    if args.json:
        info = H.machine_info("cpu")
        info.update(world=args.world, threads_per_rank=args.threads, dtype=args.dtype, bucket_cap_mb=args.bucket_cap_mb,
                    model=f"GPT d={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} "
                          f"ctx={args.ctx}, batch {args.batch} per rank")
        H.write_json(args.json, info, {"phases": result})


if __name__ == "__main__":
    main()
