"""Bytes per parameter of the whole training state with low-bit optimizer state, measured, against the planner.

    python bench/lowbit_memory.py                     # 50M-param MLP stack; stage 0 on 1 process, stage 3 on 2 and 4
    python bench/lowbit_memory.py --params 1e7 --json out.json

For each option (fp32 AdamW; bf16 params with fp32 masters; int8 moments; bf16 without masters and
int8 moments) three numbers per param on each rank after one training step:
  rss        what the process's resident memory grew by from before the model was built (the
             allocator's view: every byte of params, grads, masters, state and buffers it keeps)
  held       FusedZeroAdam.memory_report()'s total (params, grads, masters, moments, comm buffers)
  planned    zerokern.plan's total for the same stage, world size, dtype and options
held and planned by kind are in the JSON. After the step no stage-3 unit is gathered, so held has
no working set; planned counts the working set and gradient buckets a step needs at its peak. rss
also has gloo's and the collectives' own buffers and what the allocator keeps.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

OPTIONS = {"fp32": (torch.float32, dict()), "bf16 masters": (torch.bfloat16, dict()),
           "bf16 masters int8": (torch.bfloat16, dict(state_precision="int8")),
           "bf16 nomaster int8": (torch.bfloat16, dict(state_precision="int8", master_weights=False))}
WIDTH = 1024


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(option, params, stage):
    import zerokern
    import zerokern.plan

    dtype, opts = OPTIONS[option]
    layers = max(1, int(params) // (WIDTH * WIDTH + WIDTH))
    torch.ones(4).sum()  # torch's own first-use allocations, before the baseline
    base = rss_bytes()
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(dtype)
    if stage == 3:
        for layer in model:
            zerokern.shard(layer, stage=3, state_precision=opts.get("state_precision", "fp32"))
        zerokern.shard(model, stage=3, state_precision=opts.get("state_precision", "fp32"))
        opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-4, **opts)
    else:
        opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-4, zero_stage=stage, **opts)
    x = torch.randn(8, WIDTH, dtype=dtype)
    model(x).float().square().mean().backward()
    opt.step()
    n = layers * (WIDTH * WIDTH + WIDTH)
    rss = rss_bytes() - base
    report = opt.memory_report()
    held = report["total"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = zerokern.plan.plan(n, dp=world, dtype="fp32" if dtype == torch.float32 else "bf16",
                              unit_params=WIDTH * WIDTH + WIDTH, root_params=0,
                              state_precision=opts.get("state_precision", "fp32"),
                              master_weights=opts.get("master_weights", True)).stages[stage]
    return {"option": option, "stage": stage, "world": world, "params": n, "rss_per_param": rss / n,
            "held_per_param": held / n, "planned_per_param": plan.total_bytes / n,
            "held_by_kind_per_param": {k: v / n for k, v in report.items() if k != "total"},
            "planned_by_kind_per_param": {k: getattr(plan, k + "_bytes") / n for k in (
                "params", "gathered", "grads", "buffers", "master", "adam") if getattr(plan, k + "_bytes") is not None}}


def _one(option, params, q):
    q.put(measure(option, params, 0))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    # glibc grows its mmap threshold as large blocks are freed, after which freed tensors stay in the
    # heap and in the rss; a fixed threshold keeps every tensor-sized block mmapped, so rss follows
    # what is held (the ranks are spawned with this environment)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = []
    ctx = mp.get_context("spawn")
    for option in OPTIONS:  # stage 0, a fresh process each: the rss of one option alone
        q = ctx.Queue()
        p = ctx.Process(target=_one, args=(option, args.params, q))
        p.start()
        rows.append(q.get())
        p.join()
    for world in (2, 4):
        for option in OPTIONS:
            with tempfile.TemporaryDirectory() as tmp:
                mp.start_processes(_rank_one, args=(world, tmp, option, args.params, tmp), nprocs=world,
                                   start_method="spawn")
                for r in range(world):
                    with open(os.path.join(tmp, f"rank{r}.json")) as f:
                        rows.append(dict(json.load(f), rank=r))
    print(f"{'option':22s} {'stage':>5s} {'world':>5s} {'rank':>4s} {'rss B/param':>12s} {'held':>8s} {'planned':>8s}")
    for r in rows:
        print(f"{r['option']:22s} {r['stage']:5d} {r['world']:5d} {r.get('rank', 0):4d} {r['rss_per_param']:12.2f} "
              f"{r['held_per_param']:8.2f} {r['planned_per_param']:8.2f}")
    out = {"machine": H.machine_info("cpu"), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def _rank_one(rank, world, tmp, option, params, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    row = measure(option, params, 3)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
