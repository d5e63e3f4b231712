"""Where one rank's training step spends its CPU time: bench/muon_step.py's model and variants, each
rank's thread time per part (forward, backward, optimizer step; inside the step: ZeroOptimizer's
update, torch's Muon.step and its Newton-Schulz, torch's AdamW.step), median over the steps.

    python bench/muon_step_parts.py --world 4 --steps 16 --variants zerokern-muon,zerokern-muon-pieces,zerokern-adamw

Thread time (time.thread_time) leaves out waiting (collectives, other processes on the same cores),
so parts compare across variants on a loaded machine better than wall time does; wall time of the
whole step (to a barrier) is printed beside it. The variants take turns, the order rotated per step.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
import muon_step as M  # noqa: E402
from lowbit_loss import CTX, GPT, _loss  # noqa: E402

PARTS = {}  # part -> thread seconds in this step


def _timed(owner, name, part):
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[part] = PARTS.get(part, 0.0) + time.thread_time() - t0
    setattr(owner, name, timed)


def worker(rank, world, init, args, out):
    import zerokern.optim.fused_zero_adam as fused
    import zerokern.optim.zero_optimizer as zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _timed(zero.ZeroOptimizer, "_update", "update")
    _timed(fused.FusedZeroAdam, "_update", "update")
    _timed(torch.optim.Muon, "step", "Muon.step")
    _timed(torch.optim._muon, "_zeropower_via_newtonschulz", "Muon.step: Newton-Schulz")
    _timed(torch.optim.AdamW, "step", "AdamW.step")
    torch.manual_seed(0)
    base = GPT(d=args.d, layers=12, heads=4)
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 256, (world * args.batch, CTX + 1), generator=g)[rank * args.batch:(rank + 1) * args.batch]
    variants = [M.build(k, base, args.bucket_cap_mb) for k in args.variants.split(",")]
    for v in variants:
        for _ in range(2):  # warm-up
            v.step(batch)
    res = {v.name: {} for v in variants}
    for r in range(args.steps):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            PARTS.clear()
            dist.barrier()
            w0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            loss = _loss(v.model, batch)
            c1 = time.thread_time()
            loss.backward()
            c2 = time.thread_time()
            for opt in v.opts:  # DDP's variant holds two: torch's Muon and its AdamW
                opt.step()
            c3 = time.thread_time()
            for opt in v.opts:
                opt.zero_grad()
            p1 = time.process_time()  # every thread of the process: the comm worker's and gloo's too
            dist.barrier()
            for part, s in (("forward", c1 - c0), ("backward", c2 - c1), ("step", c3 - c2),
                            ("whole step, all threads", p1 - p0),
                            ("whole step, wall", time.perf_counter() - w0), *PARTS.items()):
                res[v.name].setdefault(part, []).append(s)
    every = [None] * world
    dist.all_gather_object(every, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.5)
    ap.add_argument("--variants", default="zerokern-muon,zerokern-muon-pieces,zerokern-adamw")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    every = H.run_ranks(worker, args.world, args)
    print(f"{args.world} ranks, d {args.d}; ms per step, median over {args.steps} steps, per rank "
          f"(thread time but the wall line); load before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    rows = {}
    for name in every[0]:
        print(name)
        for part in every[0][name]:
            ms = [statistics.median(r[name][part]) * 1e3 for r in every]
            rows.setdefault(name, {})[part] = ms
            print(f"  {part:26s} " + "  ".join(f"{m:7.2f}" for m in ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "loadavg": [load0, os.getloadavg()], "ms_per_rank": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
