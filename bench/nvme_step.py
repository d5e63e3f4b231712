"""The optimizer step with its state on disk (OffloadPolicy(device="nvme")) against the disk's own
O_DIRECT bandwidth on the same path, and against the same step with the state in memory.

    python bench/nvme_step.py --path /var/tmp --params 2e8 --rounds 3
    python bench/nvme_step.py --optimizer zero-adamw   # ZeroOptimizer(torch.optim.AdamW), same bytes

One process (zero_stage=1 on one rank: every param's state on this rank). Each round, interleaved:
dd writes and reads a file of the step's size with O_DIRECT (the disk's read and write GB/s, one
stream, one after the other), fio runs a 50/50 mix of 16 MB O_DIRECT reads and writes at queue
depth 8 (the step's own pattern; where fio is installed), then one step() in memory, then one with
the state on disk (backward outside the timing). The step
moves each state array twice (read from one slot, written to the other): 8 B/param each way for
fp32 params (their own masters, in memory), 12 for bf16 (fp32 masters on disk too). `% of disk`
is the time the disk needs for those bytes over the step's time: at fio's mixed rate (read + write
GB/s at once) where fio is installed, else at dd's (read bytes / read GB/s + written bytes / write
GB/s).
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time

import torch

from zerokern import FusedZeroAdam, OffloadPolicy, ZeroOptimizer


def dd(path, nbytes, block=16 << 20):
    """(write GB/s, read GB/s) of an nbytes file at `path`, O_DIRECT, as dd reports them."""
    name = os.path.join(path, f"zerokern-dd-{os.getpid()}.bin")
    count = max(1, nbytes // block)
    try:
        rates = []
        for cmd in ([f"if=/dev/zero", f"of={name}", "oflag=direct"], [f"if={name}", "of=/dev/null", "iflag=direct"]):
            out = subprocess.run(["dd", f"bs={block}", f"count={count}", *cmd], capture_output=True, text=True,
                                 check=True).stderr
            copied = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
            rates.append(int(copied.group(1)) / float(copied.group(2)) / 1e9)
        return tuple(rates)
    finally:
        if os.path.exists(name):
            os.unlink(name)


def fio_mixed(path, nbytes, seconds=6):
    """(read GB/s, write GB/s) of fio's 50/50 mix of 16 MB O_DIRECT reads and writes at queue depth 8
    on an nbytes file at `path` (the step's own pattern: both at once), or None without fio."""
    if shutil.which("fio") is None:
        return None
    name = os.path.join(path, f"zerokern-fio-{os.getpid()}.bin")
    try:
        out = subprocess.run(["fio", "--name=mix", f"--filename={name}", f"--size={max(nbytes, 64 << 20)}",
                              "--bs=16M", "--direct=1", "--rw=rw", "--rwmixread=50", "--iodepth=8",
                              "--ioengine=libaio", f"--runtime={seconds}", "--time_based", "--output-format=json"],
                             capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{"):])["jobs"][0]
        return job["read"]["bw_bytes"] / 1e9, job["write"]["bw_bytes"] / 1e9
    finally:
        if os.path.exists(name):
            os.unlink(name)


def build(n, dtype, offload, optimizer="fused", tensors=8):
    torch.manual_seed(0)
    sizes = [n // tensors] * (tensors - 1) + [n - (n // tensors) * (tensors - 1)]
    params = [torch.nn.Parameter((torch.randn(s) * 0.02).to(dtype)) for s in sizes]
    if optimizer == "fused":
        opt = FusedZeroAdam(params, lr=1e-3, weight_decay=0.01, zero_stage=1, offload=offload)
    else:  # the inner optimizer's state streamed ([Note: inner state on disk]): AdamW's two moments
        opt = ZeroOptimizer(params, torch.optim.AdamW, lr=1e-3, weight_decay=0.01, zero_stage=1, offload=offload)
    weights = [torch.randn(s).to(dtype) for s in sizes]  # backward gives these as grads
    return params, opt, weights


def timed_step(params, opt, weights):
    opt.zero_grad()
    sum((p * w).sum() for p, w in zip(params, weights)).float().backward()
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/var/tmp", help="a directory on the disk to measure")
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk-mb", type=float, default=16.0)
    ap.add_argument("--buffers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--optimizer", choices=["fused", "zero-adamw"], default="fused",
                    help="FusedZeroAdam, or ZeroOptimizer(torch.optim.AdamW)")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = int(args.params)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    arrays = 2 if dtype == torch.float32 else 3
    moved = arrays * 4 * n  # each way
    policy = OffloadPolicy(device="nvme", path=args.path, chunk_mb=args.chunk_mb, buffer_count=args.buffers,
                           io_threads=args.threads)
    mem = build(n, dtype, None, args.optimizer)
    disk = build(n, dtype, policy, args.optimizer)
    timed_step(*mem)  # first steps: allocations, the masters' first read
    timed_step(*disk)
    rows = []
    for r in range(args.rounds):
        w, rd = dd(args.path, moved)
        mix = fio_mixed(args.path, moved)
        t_mem = timed_step(*mem)
        t_disk = timed_step(*disk)
        # the disk's time for the step's bytes: at fio's rates for reads and writes at once where fio is
        # installed (the step's pattern), else at dd's separate rates, one after the other
        need = 2 * moved / ((mix[0] + mix[1]) * 1e9) if mix else moved / (rd * 1e9) + moved / (w * 1e9)
        rows.append(dict(round=r, dd_write_gbs=w, dd_read_gbs=rd, fio_mixed_read_gbs=mix and mix[0],
                         fio_mixed_write_gbs=mix and mix[1], step_in_memory_s=t_mem, step_on_disk_s=t_disk,
                         disk_time_s=need, pct_of_disk=100 * need / t_disk))
        print(f"round {r}: dd write {w:.2f} GB/s, read {rd:.2f} GB/s"
              + ("" if not mix else f"; fio 50/50 mix read {mix[0]:.2f} + write {mix[1]:.2f} GB/s")
              + f"; step in memory {t_mem:.3f} s, on disk {t_disk:.3f} s; the disk needs {need:.3f} s for its "
              f"{2 * moved / 1e9:.2f} GB ({'fio' if mix else 'dd'}): {100 * need / t_disk:.0f}%")
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0] if k != "round" and rows[0][k] is not None}
    spread = {k: (min(row[k] for row in rows), max(row[k] for row in rows)) for k in med}
    print(f"median of {args.rounds}: step on disk {med['step_on_disk_s']:.3f} s "
          f"({spread['step_on_disk_s'][0]:.3f}-{spread['step_on_disk_s'][1]:.3f}), in memory "
          f"{med['step_in_memory_s']:.3f} s, disk time {med['disk_time_s']:.3f} s: {med['pct_of_disk']:.0f}% of the "
          f"disk's read+write bandwidth ({args.optimizer}, {args.params:.0e} {args.dtype} params, {2 * moved / 1e9:.2f} GB moved a step)")
    print("memory_report:", {k: v for k, v in disk[1].memory_report().items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                       "args": vars(args), "bytes_each_way": moved, "rows": rows, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()
