"""Step time and inter-host bytes on the multi-host test bed (bench/netbed.py): 2 namespaced hosts
x 2 ranks, each host's link capped (tc tbf), examples/train_gpt.py launched with torchrun --nnodes.

    python bench/multihost.py                          # 1 Gbit/s links, a 14M-param GPT, 6 steps
    python bench/multihost.py --rate 200mbit --json out.json --plot out.png

Rows: zerokern ZeRO-2, zerokern ZeRO-3, torch DDP + AdamW, each run twice, interleaved (A B C A B
C). Step time: the median over rank 0's steps after the first. Inter-host bytes per step: what both
hosts' veth pairs sent during the run (tx counters), less what a --steps 0 run of the same variant
sent (rendezvous, process groups, the first broadcast of the params), divided by the steps.
Needs root and iproute2.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
import netbed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"zerokern ZeRO-2": ["--zero-stage", "2"], "zerokern ZeRO-3": ["--zero-stage", "3"],
            "torch DDP + AdamW": ["--optimizer", "torch"]}


def run(bed, name, model_args, steps, tmp, job):
    """One run of a variant on the bed: (rank 0's log, bytes both hosts sent)."""
    log = os.path.join(tmp, f"{job}.json")
    script = [os.path.join(ROOT, "examples", "train_gpt.py"), *model_args, *VARIANTS[name], "--steps", str(steps),
              "--log-every", "1000", "--log-json", log]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    before = sum(bed.tx_bytes(h) for h in range(bed.hosts))
    procs = [bed.popen(h, bed.torchrun(h, 2, script, job=job), env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True) for h in range(bed.hosts)]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"multihost: {name} failed:\n" + "\n".join(o[-3000:] for o in outs))
    sent = sum(bed.tx_bytes(h) for h in range(bed.hosts)) - before
    with open(log) as f:
        return json.load(f), sent


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", default="1gbit", help="each host's link (a tc rate)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    why = netbed.unavailable()
    if why:
        sys.exit(f"multihost: no test bed here: {why}")
    model_args = ["--d-model", str(args.d_model), "--layers", str(args.layers), "--vocab", str(args.vocab),
                  "--heads", "6", "--ctx", "64", "--batch", "8"]
    d, v, layers = args.d_model, args.vocab, args.layers
    params = v * d + 64 * d + layers * (12 * d * d + 13 * d) + 2 * d
    samples = {name: {"step_s": [], "bytes_per_step": []} for name in VARIANTS}
    with netbed.NetBed(hosts=2, rate=args.rate) as bed, tempfile.TemporaryDirectory() as tmp:
        job = 0
        for _ in range(args.repeats):
            for name in VARIANTS:
                job += 1
                _, setup = run(bed, name, model_args, 0, tmp, f"zk{job}s")
                log, sent = run(bed, name, model_args, args.steps, tmp, f"zk{job}")
                samples[name]["step_s"] += log["step_seconds"][1:]
                samples[name]["bytes_per_step"].append((sent - setup) / args.steps)
                print(f"{name:20s} run {job}: median step {statistics.median(log['step_seconds'][1:]):.3f} s, "
                      f"{(sent - setup) / args.steps / 1e6:.1f} MB/step across hosts", flush=True)
    results = []
    print(f"\n{params / 1e6:.1f}M params (fp32), 2 hosts x 2 ranks, links {args.rate}")
    print(f"{'row':20s} {'step s (p25-p75)':>24s} {'MB/step across hosts':>22s} {'x param bytes':>14s}")
    for name, s in samples.items():
        q = statistics.quantiles(s["step_s"], n=4) if len(s["step_s"]) > 1 else [s["step_s"][0]] * 3
        b = statistics.median(s["bytes_per_step"])
        results.append({"impl": name, "median_step_s": statistics.median(s["step_s"]), "p25_s": q[0], "p75_s": q[2],
                        "bytes_per_step": b, "bytes_per_step_runs": s["bytes_per_step"],
                        "step_s_samples": s["step_s"]})
        print(f"{name:20s} {statistics.median(s['step_s']):10.3f} ({q[0]:.3f}-{q[2]:.3f}) {b / 1e6:22.1f} "
              f"{b / (4 * params):14.2f}")
    out = {"machine": H.machine_info("cpu"), "rate": args.rate, "params": params, "steps": args.steps,
           "repeats": args.repeats, "hosts": 2, "ranks_per_host": 2, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5))
        names = [r["impl"] for r in results]
        a1.barh(names, [r["median_step_s"] for r in results],
                xerr=[[r["median_step_s"] - r["p25_s"] for r in results], [r["p75_s"] - r["median_step_s"]
                                                                           for r in results]])
        a1.set_xlabel("seconds per step")
        a2.barh(names, [r["bytes_per_step"] / 1e6 for r in results])
        a2.set_xlabel("MB per step across hosts")
        for a in (a1, a2):
            a.invert_yaxis()
        fig.suptitle(f"{params / 1e6:.1f}M params, 2 hosts x 2 ranks, {args.rate} links")
        fig.tight_layout()
        fig.savefig(args.plot)
    return out


if __name__ == "__main__":
    main()
