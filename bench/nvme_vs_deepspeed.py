"""The optimizer step with its state on disk, zerokern against DeepSpeed's NVMe offload, on the same
model and path, in one run (DeepSpeed first, in its launcher, then zerokern, alternating --rounds times).

    DS_ACCELERATOR=cpu python bench/nvme_vs_deepspeed.py --path /var/tmp --layers 8 --hidden 2048

One process each, fp32 params (8 Linear layers of hidden x hidden by default, 33.6M params), Adam.
DeepSpeed: ZeRO-3 with offload_optimizer {device: nvme} (its NVMe optimizer offload needs stage 3
and libaio; on CPU with DS_ACCELERATOR=cpu). zerokern: FusedZeroAdam with
OffloadPolicy(device="nvme"). Per step: the optimizer step's seconds (engine.step() / opt.step(),
backward outside), and the bytes the process read from and wrote to the disk during it
(/proc/self/io read_bytes / write_bytes: what reached the block layer), median of the steps after
the first.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

CHILD = r"""
import json, os, sys, time, torch, deepspeed
path, layers, hidden, steps = sys.argv[-4], int(sys.argv[-3]), int(sys.argv[-2]), int(sys.argv[-1])  # after the launcher's --local_rank
def io():
    d = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
cfg = {"train_micro_batch_size_per_gpu": 2,
       "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path,
                                                               "pin_memory": False, "buffer_count": 4}},
       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
       "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2, "single_submit": False,
               "overlap_events": True}}
try:
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
except Exception as e:  # its error, as it gives it
    print("RESULT", json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
    sys.exit(0)
x = torch.randn(2, hidden)
rows = []
for _ in range(steps):
    engine.backward(engine(x).pow(2).mean())
    r0, w0 = io(); t = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t; r1, w1 = io()
    rows.append({"s": dt, "read": r1 - r0, "written": w1 - w0})
print("RESULT", json.dumps({"params": params, "rows": rows}), flush=True)
"""


def io():
    d = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(d["read_bytes"]), int(d["write_bytes"])


def deepspeed_run(path, layers, hidden, steps):
    os.makedirs(path, exist_ok=True)
    script = os.path.join(path, "ds_child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run(["deepspeed", "--num_gpus", "1", script, path, str(layers), str(hidden), str(steps)],
                         capture_output=True, text=True, env=env, timeout=3600)
    shutil.rmtree(path, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"no result (rc {out.returncode}): {(out.stdout + out.stderr)[-1500:]}"}


def zerokern_run(path, layers, hidden, steps):
    from zerokern import FusedZeroAdam, OffloadPolicy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
    opt = FusedZeroAdam(model.parameters(), lr=1e-3, weight_decay=0.01, zero_stage=2,
                        offload=OffloadPolicy(device="nvme", path=path))
    x = torch.randn(2, hidden)
    rows = []
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        r0, w0 = io()
        t = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t
        r1, w1 = io()
        rows.append({"s": dt, "read": r1 - r0, "written": w1 - w0})
    return {"params": sum(p.numel() for p in model.parameters()), "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/var/tmp")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {"deepspeed": [], "zerokern": []}
    for r in range(args.rounds):
        results["deepspeed"].append(deepspeed_run(os.path.join(args.path, f"ds-nvme-{os.getpid()}"), args.layers,
                                                  args.hidden, args.steps))
        results["zerokern"].append(zerokern_run(args.path, args.layers, args.hidden, args.steps))
    print(f"optimizer step with its state on disk at {args.path}, {args.layers} x Linear({args.hidden}), fp32, "
          f"{os.cpu_count()} cpus; median of steps 2..{args.steps} over {args.rounds} rounds (min-max)")
    summary = {}
    for name, runs in results.items():
        errors = [run["error"] for run in runs if "error" in run]
        if errors:
            print(f"{name:10s} error: {errors[0]}")
            summary[name] = {"error": errors[0]}
            continue
        rows = [row for run in runs for row in run["rows"][1:]]
        med = {k: statistics.median(row[k] for row in rows) for k in ("s", "read", "written")}
        lo, hi = min(row["s"] for row in rows), max(row["s"] for row in rows)
        n = runs[0]["params"]
        print(f"{name:10s} {med['s']:.3f} s ({lo:.3f}-{hi:.3f}); read {med['read'] / 1e6:.1f} MB "
              f"({med['read'] / n:.1f} B/param), written {med['written'] / 1e6:.1f} MB "
              f"({med['written'] / n:.1f} B/param); {n / 1e6:.1f}M params")
        summary[name] = dict(med, min_s=lo, max_s=hi, params=n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "raw": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
