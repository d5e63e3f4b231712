"""Step time and inter-host bytes on the multi-host test bed (bench/netbed.py): 2 namespaced hosts
x 2 ranks, each host's link capped (tc tbf), examples/train_gpt.py launched with torchrun --nnodes.

    python bench/multihost.py                          # 1 Gbit/s links, a 14M-param GPT, 6 steps
    python bench/multihost.py --rate 200mbit --json out.json --plot out.png

Rows: zerokern ZeRO-2 and ZeRO-3 flat (sharded over all 4 ranks) and hybrid (--mesh 2,2: sharded
within a host, replicated across; [Note: hybrid sharding]), torch FSDP2 HSDP (fully_shard over the
same 2 x 2 mesh) and torch DDP + AdamW, each run --repeats times, interleaved (A B C .. A B C ..).
Step time: the median over rank 0's steps after the first. Inter-host bytes per step: what both
hosts' veth pairs sent during the run (tx counters), less what a --steps 0 run of the same variant
sent (rendezvous, process groups, the first broadcast of the params), divided by the steps; next
to it the planner's count (zerokern.plan, hosts=2: [Note: bytes across hosts]) and, for hybrid
rows, zerokern's own count from the collectives' sizes (HybridComm.inter_host_bytes). Both
counts are payload: the veth counters also carry TCP/IP headers (about 3-4% at a 1500-byte MTU).
--tree LABEL=PATH (repeatable) runs each zerokern row once per source tree (its examples, PATH
first on PYTHONPATH; e.g. a `git archive` of the commit before a change, zerokern/_C*.so copied
in), interleaved with the other rows: before and after a change under the same load.
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
            "zerokern hybrid ZeRO-2": ["--zero-stage", "2", "--mesh", "2,2"],
            "zerokern hybrid ZeRO-3": ["--zero-stage", "3", "--mesh", "2,2"],
            "zerokern hybrid ZeRO-3 int8": ["--zero-stage", "3", "--mesh", "2,2", "--reduce-precision", "int8"],
            "zerokern hybrid ZeRO-3 int4": ["--zero-stage", "3", "--mesh", "2,2", "--reduce-precision", "int4"],
            "zerokern ZeRO-2 int4": ["--zero-stage", "2", "--reduce-precision", "int4"],
            "zerokern ZeRO-3 int4 gather int8": ["--zero-stage", "3", "--reduce-precision", "int4",
                                                 "--gather-precision", "int8"],
            "torch FSDP2 HSDP": ["--optimizer", "fsdp2", "--mesh", "2,2"],
            "torch DDP + AdamW": ["--optimizer", "torch"],
            # examples/train_gpt_deepspeed.py (DeepSpeed's ZeRO with zerokern.FusedAdam as its optimizer)
            "DeepSpeed ZeRO-2": ["--zero-stage", "2"],
            "DeepSpeed ZeRO-3 hpZ=2": ["--zero-stage", "3", "--hpz", "2"]}
DEEPSPEED = {"DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3 hpZ=2"}
# which of the planner's counts a row is: (stage, hybrid[, reduce_precision[, gather_precision]])
PLANNED = {"zerokern ZeRO-2": (2, False), "zerokern ZeRO-3": (3, False), "zerokern hybrid ZeRO-2": (2, True),
           "zerokern hybrid ZeRO-3": (3, True), "zerokern hybrid ZeRO-3 int8": (3, True, "int8"),
           "zerokern hybrid ZeRO-3 int4": (3, True, "int4"), "zerokern ZeRO-2 int4": (2, False, "int4"),
           "zerokern ZeRO-3 int4 gather int8": (3, False, "int4", "int8"), "torch FSDP2 HSDP": (3, True), "torch DDP + AdamW": (0, False),
           # hpZ gathers the params for backward within a host, for forward over all ranks, and
           # reduce-scatters the grads over all ranks: two flat collectives, as ZeRO-2
           "DeepSpeed ZeRO-2": (2, False), "DeepSpeed ZeRO-3 hpZ=2": (2, False)}


def run(bed, name, model_args, steps, tmp, job, tree=None):
    """One run of a variant on the bed, from source tree `tree` (None: this one): (rank 0's log,
    bytes both hosts sent)."""
    root = tree or ROOT
    log = os.path.join(tmp, f"{job}.json")
    if name in DEEPSPEED:
        example = ["train_gpt_deepspeed.py", "--deepspeed_config", os.path.join(ROOT, "examples", "ds_config.json")]
    else:
        example = ["train_gpt.py"]
    script = [os.path.join(root, "examples", example[0]), *example[1:], *model_args, *VARIANTS[name], "--steps",
              str(steps), "--log-every", "1000", "--log-json", log]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p])
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
    ap.add_argument("--only", help="comma-separated row names to run (default: all)")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="run each zerokern row from this source tree too (repeatable): before/after a change")
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
    from zerokern.plan import plan
    def planned(stage, hybrid, reduce_precision=None, gather_precision=None):
        row = plan(params=params, dp=4, hosts=2, dtype="fp32", reduce_precision=reduce_precision,
                   gather_precision=gather_precision).stages[stage]
        return row.hybrid_inter_host_bytes if hybrid else row.inter_host_bytes
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    trees = [t.split("=", 1) for t in args.tree]
    if any(len(t) != 2 or not os.path.isdir(os.path.join(t[1], "zerokern")) for t in trees):
        sys.exit(f"multihost: --tree takes LABEL=PATH, PATH a source tree with zerokern/ in it: {args.tree}")
    # (row, variant, tree): a zerokern row once per --tree
    rows = [(f"{n} [{label}]" if label else n, n, path) for n in names
            for label, path in (trees if trees and n.startswith("zerokern") else [(None, None)])]
    samples = {row: {"step_s": [], "bytes_per_step": [], "counted": []} for row, _, _ in rows}
    with netbed.NetBed(hosts=2, rate=args.rate) as bed, tempfile.TemporaryDirectory() as tmp:
        job = 0
        for _ in range(args.repeats):
            for row, name, tree in rows:
                job += 1
                _, setup = run(bed, name, model_args, 0, tmp, f"zk{job}s", tree)
                log, sent = run(bed, name, model_args, args.steps, tmp, f"zk{job}", tree)
                samples[row]["step_s"] += log["step_seconds"][1:]
                samples[row]["bytes_per_step"].append((sent - setup) / args.steps)
                if log.get("counted_inter_host_bytes") is not None:
                    samples[row]["counted"].append(log["counted_inter_host_bytes"] / args.steps)
                print(f"{row:32s} run {job}: median step {statistics.median(log['step_seconds'][1:]):.3f} s, "
                      f"{(sent - setup) / args.steps / 1e6:.1f} MB/step across hosts", flush=True)
    results = []
    print(f"\n{params / 1e6:.1f}M params (fp32), 2 hosts x 2 ranks, links {args.rate}")
    print(f"{'row':32s} {'step s (p25-p75)':>22s} {'MB/step across hosts':>21s} {'x param bytes':>14s} "
          f"{'planner MB':>11s} {'counted MB':>11s}")
    for (name, s), (_, variant, _) in zip(samples.items(), rows):
        q = statistics.quantiles(s["step_s"], n=4) if len(s["step_s"]) > 1 else [s["step_s"][0]] * 3
        b = statistics.median(s["bytes_per_step"])
        plan_b = planned(*PLANNED[variant])
        counted = statistics.median(s["counted"]) if s["counted"] else None
        results.append({"impl": name, "median_step_s": statistics.median(s["step_s"]), "p25_s": q[0], "p75_s": q[2],
                        "bytes_per_step": b, "bytes_per_step_runs": s["bytes_per_step"],
                        "planner_bytes_per_step": plan_b, "counted_bytes_per_step": counted,
                        "step_s_samples": s["step_s"]})
        print(f"{name:32s} {statistics.median(s['step_s']):8.3f} ({q[0]:.3f}-{q[2]:.3f}) {b / 1e6:21.1f} "
              f"{b / (4 * params):14.2f} {plan_b / 1e6:11.1f} "
              f"{'' if counted is None else f'{counted / 1e6:.1f}':>11s}")
    out = {"machine": H.machine_info("cpu"), "rate": args.rate, "trees": dict(trees), "params": params,
           "steps": args.steps, "repeats": args.repeats, "hosts": 2, "ranks_per_host": 2, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        names = [r["impl"] for r in results]
        a1.barh(names, [r["median_step_s"] for r in results],
                xerr=[[r["median_step_s"] - r["p25_s"] for r in results], [r["p75_s"] - r["median_step_s"]
                                                                           for r in results]])
        a1.set_xlabel("seconds per step")
        a2.barh(names, [r["bytes_per_step"] / 1e6 for r in results], label="measured (veth)")
        a2.scatter([r["planner_bytes_per_step"] / 1e6 for r in results], names, color="k", marker="|", s=200,
                   zorder=3, label="planner (ring model)")
        a2.set_xlabel("MB per step across hosts")
        a2.legend(fontsize=7)
        for a in (a1, a2):
            a.invert_yaxis()
        fig.suptitle(f"{params / 1e6:.1f}M params, 2 hosts x 2 ranks, {args.rate} links")
        fig.tight_layout()
        fig.savefig(args.plot)
    return out


if __name__ == "__main__":
    main()
