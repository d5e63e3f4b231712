"""The quantized collectives of zerokern/zero/comm/wire.py, whole (encode with error feedback, the
gloo collective, decode and sum), on 2 ranks over loopback, against gloo's full-precision ones.

    python bench/wire_collectives.py                               # 3.45M fp32 values: a 14M GPT's hybrid shard
    python bench/wire_collectives.py --tree before=/tmp/old --json out.json

Rows, per source tree: all_reduce and reduce_scatter in fp32 (dist's own), int8 and int4 (every
call after the first carries a residual: [Note: error feedback]). Each round launches a fresh pair
of rank processes per tree, in rotation (before, after, before, ...), so the trees share the
machine's load alike; each process times --iters calls of each row after a warm-up call and
reports their median. Reported: the median over rounds of rank 0's medians, with the 25th-75th
percentile. --tree LABEL=PATH (repeatable): that tree first on PYTHONPATH (e.g. a git worktree of
an earlier commit, zerokern/_C*.so copied in); without it, this checkout.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one rank: times each row and prints {row: median seconds} (rank 0)
RANK = r"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
rank, world, n, iters = int(sys.argv[1]), 2, int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
from zerokern.zero.comm import exit_drain, wire
exit_drain.register()  # as zerokern's comm does for its users: without it ~1 rank in 10 aborted at exit
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
rows = {}
for prec in (None, "int8", "int4"):
    for op in ("all_reduce", "reduce_scatter"):
        w = wire.GradWire(prec, op, rank) if prec else None
        out = torch.empty(n // world)
        def call():
            t = x.clone()
            if op == "all_reduce":
                work = wire.all_reduce(t, None, rank, world, w) if w else dist.all_reduce(t, async_op=True)
            else:
                work = (wire.reduce_scatter(out, t, None, rank, world, w) if w
                        else _reduce_scatter(out, t, async_op=True))
            work.wait()
            if w:
                w.settle(True)
        ts = []
        for i in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t0)
        rows[f"{op} {prec or 'fp32'}"] = statistics.median(ts[1:])
if rank == 0:
    print("RESULT " + json.dumps(rows))
dist.destroy_process_group()
"""


def one_round(tree, n, iters):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(n), str(iters)], env=env, cwd=tree or ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    lines = [x for x in outs[0].splitlines() if x.startswith("RESULT ")]
    if not lines or any(p.returncode for p in procs):
        sys.exit("wire_collectives: a rank failed:\n" + "\n".join(o[-3000:] for o in outs))
    return json.loads(lines[0][len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=3_450_000)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["this", None]]
    samples = {}
    for r in range(args.rounds):
        for label, path in trees[r % len(trees):] + trees[:r % len(trees)]:
            times = one_round(path, args.numel, args.iters)
            for row, s in times.items():
                samples.setdefault((label, row), []).append(s)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = [{"tree": label, "row": row, **H.summary(s)} for (label, row), s in samples.items()]
    rows.sort(key=lambda x: (x["row"], x["tree"]))
    H.print_table(rows, [("row", "row", "{}"), ("tree", "tree", "{}"), ("median_ms", "median ms", "{:.1f}"),
                         ("p25_ms", "p25", "{:.1f}"), ("p75_ms", "p75", "{:.1f}"), ("n", "rounds", "{}")])
    if args.json:
        H.write_json(args.json, H.machine_info("cpu"), rows, {"settings": vars(args)})


if __name__ == "__main__":
    main()
