"""What announcing every collective costs ([Note: announced collectives] in
zerokern/zero/comm/check.py), on 2 gloo ranks of this machine.

    python bench/collective_check.py [--rounds 15] [--json out.json]

Each case with the check on and off, interleaved round by round in one run. "Off" is what
ZEROKERN_CHECK_COLLECTIVES=0 gives: the rounds swap each Comm's check for None, so collectives are
launched on the calling thread, on the user's group, unannounced.
- a small all-reduce through zerokern's Comm (4 floats), launched and waited for: the latency of
  the smallest collective a step makes, announcement and thread hand-off included;
- a training step (forward, backward, step) of a 4-block MLP at stages 2 and 3, bucket_cap_mb
  small enough that each step makes a few dozen collectives.
It also prints how many collectives a step makes and in how many announcement rounds rank 0's
check announced them ([Note: announcing in rounds]: it varies with timing).
Medians and the 25th-75th percentiles, in ms, per rank 0.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402


def _model(stage):
    import zerokern
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh()) for _ in range(4)],
                                torch.nn.Linear(256, 1))
    if stage == 3:
        for m in model:
            zerokern.shard(m, stage=3, bucket_cap_mb=0.1)
        zerokern.shard(model, stage=3, bucket_cap_mb=0.1)
        return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-3)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-3, zero_stage=stage, bucket_cap_mb=0.1)


def _rank(rank, world, tmp, rounds, out_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    import gc

    from zerokern.zero.comm import check as collective_check
    from zerokern.zero.comm.base import Comm
    from zerokern.zero.comm.factory import make_comm
    models = {s: _model(s) for s in (2, 3)}
    comm = make_comm()
    x = torch.randn(32, 256)
    small = torch.zeros(4)
    check = collective_check.for_group(dist.group.WORLD)
    comms = [o for o in gc.get_objects() if isinstance(o, Comm)]  # every Comm the models made, and ours

    def step(stage):
        model, opt = models[stage]
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def small_all_reduces():
        for _ in range(100):
            comm.wait(comm.all_reduce(small, name="bench"))

    cases = {"all_reduce of 4 floats (per call)": small_all_reduces,
             "stage 2 train step": lambda: step(2), "stage 3 train step": lambda: step(3)}
    per_call = {"all_reduce of 4 floats (per call)": 100}
    step(2), step(3)  # warm up
    seq0, rounds0 = check.seq, check.rounds
    step(2)
    n2, r2 = check.seq - seq0, check.rounds - rounds0
    step(3)
    n3, r3 = check.seq - seq0 - n2, check.rounds - rounds0 - r2
    times = {(c, on): [] for c in cases for on in (True, False)}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            for c in comms:
                c.check = check if on else None
            for c, fn in cases.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[(c, on)].append((time.perf_counter() - t0) / per_call.get(c, 1))
    for c in comms:
        c.check = check
    if rank == 0:
        rows = []
        for c in cases:
            for on in (True, False):
                s = H.summary(times[(c, on)])
                rows.append({"case": c, "check": "on" if on else "off",
                             **{k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}})
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "collectives_per_step": {"stage 2": n2, "stage 3": n3},
                       "rounds_per_step": {"stage 2": r2, "stage 3": r3}}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_rank, args=(2, tmp, args.rounds, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    H.print_table(res["rows"], [("case", "case", "{}"), ("check", "check", "{}"), ("median_ms", "median ms", "{:.3f}"),
                                ("p25_ms", "p25", "{:.3f}"), ("p75_ms", "p75", "{:.3f}"), ("n", "n", "{}")])
    print("collectives per step:", res["collectives_per_step"], "announcement rounds per step (rank 0):",
          res["rounds_per_step"])
    med = {(r["case"], r["check"]): r["median_ms"] for r in res["rows"]}
    for s in (2, 3):
        c = f"stage {s} train step"
        print(f"{c}: {med[(c, 'on')]:.2f} ms with the check, {med[(c, 'off')]:.2f} ms without "
              f"({med[(c, 'on')] / med[(c, 'off')]:.2f}x)")
    if args.json:
        H.write_json(args.json, H.machine_info("cpu"), res["rows"], extra={"collectives_per_step": res["collectives_per_step"],
                                                                          "rounds_per_step": res["rounds_per_step"]})


if __name__ == "__main__":
    main()
