"""examples/train_gpt.py at stage 3 against FSDP2, with the collective check on and off, as whole
torchrun jobs in rotation (order reversed every other rotation), on this machine's CPUs.

    python bench/train_gpt_rotations.py [--rotations 3] [--steps 60] [--json out.json]
    python bench/train_gpt_rotations.py --cases zerokern-s2,zerokern-s2-int8,zerokern-s2-int4   # loopback

Cases: zerokern stage 3 (the check on, the default), the same with ZEROKERN_CHECK_COLLECTIVES=0,
and FSDP2 (`--optimizer fsdp2`: fully_shard + torch AdamW); with --cases, stage 2 with grads reduced in
full precision, int8 or int4 (what quantizing costs where the link is fast: loopback). Per run: the median step time of steps
10 to the end (the example's --log-json); per case: the median over runs, and the range. The final
losses are printed too: the cases train the same model on the same batches.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "zerokern-s3": (["--zero-stage", "3"], {}),
    "zerokern-s3-check-off": (["--zero-stage", "3"], {"ZEROKERN_CHECK_COLLECTIVES": "0"}),
    "fsdp2": (["--optimizer", "fsdp2"], {}),
    "zerokern-s2": (["--zero-stage", "2"], {}),
    "zerokern-s2-int8": (["--zero-stage", "2", "--reduce-precision", "int8"], {}),
    "zerokern-s2-int4": (["--zero-stage", "2", "--reduce-precision", "int4"], {}),
}
DEFAULT = ("zerokern-s3", "zerokern-s3-check-off", "fsdp2")


def run(case, steps, tmp):
    flags, env = CASES[case]
    out = os.path.join(tmp, f"{case}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "train_gpt.py"), *flags, "--steps", str(steps), "--log-json", out]
    subprocess.run(cmd, check=True, cwd=tmp, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(out) as f:
        log = json.load(f)
    return statistics.median(log["step_seconds"][10:]) * 1e3, log["losses"][-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rotations", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--cases", default=",".join(DEFAULT), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--json")
    args = ap.parse_args()
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"train_gpt_rotations: unknown case(s) {unknown}; choose from {list(CASES)}")
    runs = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rotations):
            order = cases if r % 2 == 0 else cases[::-1]
            for case in order:
                ms, loss = run(case, args.steps, tmp)
                runs[case].append({"rotation": r + 1, "median_step_ms": ms, "final_loss": loss})
                print(f"rotation {r + 1} {case}: {ms:.1f} ms/step, final loss {loss:.5f}", flush=True)
    medians = {c: statistics.median(x["median_step_ms"] for x in v) for c, v in runs.items()}
    for c, v in runs.items():
        ms = [x["median_step_ms"] for x in v]
        print(f"{c:24s} {medians[c]:7.1f} ms/step ({min(ms):.1f}-{max(ms):.1f})")
    first = cases[0]
    print("; ".join(f"{c} / {first}: {medians[c] / medians[first]:.3f}x" for c in cases[1:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "runs": runs, "medians_ms": medians}, f, indent=1)


if __name__ == "__main__":
    main()
