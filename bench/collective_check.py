"""What announcing every collective costs ([Note: announced collectives] in
zerokern/zero/collective_check.py), on 2 gloo ranks of this machine.

    python bench/collective_check.py [--rounds 15] [--json out.json]

Three numbers, each with the check on and off, interleaved round by round in one run (the check
is switched by replacing CollectiveCheck.announce with a no-op for the "off" rounds):
- one announcement alone (the 16-byte all-reduce on the check's own gloo group), per call;
- a small all-reduce on the training group (4 floats): the smallest collective a step makes;
- a training step (forward, backward, step) of a 4-block MLP at stages 2 and 3, bucket_cap_mb
  small enough that each step makes a few dozen collectives.
Medians and the 25th-75th percentiles, in ms, per rank 0.
"""

import argparse
import json
import os
import statistics
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
    from zerokern.zero import collective_check
    models = {s: _model(s) for s in (2, 3)}
    x = torch.randn(32, 256)
    check = collective_check.for_group(dist.group.WORLD)
    real = collective_check.CollectiveCheck.announce
    small = torch.zeros(4)
    count = {"n": 0}

    def counting(self, name, tensor=None):
        count["n"] += 1
        return real(self, name, tensor)

    def step(stage):
        model, opt = models[stage]
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    cases = {
        "announce alone (per call)": lambda: [real(check, "bench") for _ in range(100)],
        "all_reduce of 4 floats (per call)": lambda: [dist.all_reduce(small) for _ in range(100)],
        "stage 2 train step": lambda: step(2),
        "stage 3 train step": lambda: step(3),
    }
    per_call = {"announce alone (per call)": 100, "all_reduce of 4 floats (per call)": 100}
    collective_check.CollectiveCheck.announce = counting
    step(2), step(3)  # warm up; count the collectives of one step each
    count["n"] = 0
    step(2)
    n2 = count["n"]
    count["n"] = 0
    step(3)
    n3 = count["n"]
    times = {(c, on): [] for c in cases for on in (True, False)}
    for r in range(rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            collective_check.CollectiveCheck.announce = real if on else (lambda self, name, tensor=None: None)
            for c, fn in cases.items():
                if c.startswith("announce") and not on:
                    continue
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[(c, on)].append((time.perf_counter() - t0) / per_call.get(c, 1))
    collective_check.CollectiveCheck.announce = real
    if rank == 0:
        rows = []
        for c in cases:
            for on in (True, False):
                if times[(c, on)]:
                    s = H.summary(times[(c, on)])
                    rows.append({"case": c, "check": "on" if on else "off", **{k: round(v, 4) if isinstance(v, float)
                                                                              else v for k, v in s.items()}})
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "collectives_per_step": {"stage 2": n2, "stage 3": n3}}, f)
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
    print("collectives per step:", res["collectives_per_step"])
    med = {(r["case"], r["check"]): r["median_ms"] for r in res["rows"]}
    for s in (2, 3):
        c = f"stage {s} train step"
        print(f"{c}: {med[(c, 'on')]:.2f} ms with the check, {med[(c, 'off')]:.2f} ms without "
              f"({med[(c, 'on')] / med[(c, 'off')]:.2f}x)")
    if args.json:
        H.write_json(args.json, H.machine_info("cpu"), res["rows"], extra={"collectives_per_step": res["collectives_per_step"]})


if __name__ == "__main__":
    main()
