"""What the CUDA kernels' first-call self-check costs ([Note: first-call self-check] in
zerokern/kernels/backends/selfcheck.py), per kernel family.

    python bench/self_check_cost.py               # the GPU's kernels against the CPU oracle
    python bench/self_check_cost.py --device cpu  # no GPU: the CPU kernels checked against themselves

Two numbers a family: `first`, the check on the family's first call in a fresh process (one
process per family and round, so it includes whatever the first launch of those kernels loads, but not the low-bit
quantizer's tables, which that kernel's first call builds with or without a check);
and `again`, the same check re-run in a warm process (selfcheck.forget()), median and spread of
--rounds. A process pays `first` once per family it uses.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

FIRST = """
import sys, time, torch, zerokern
from zerokern.kernels.backends import selfcheck
dev, backend, family = torch.device(sys.argv[1]), sys.argv[2], sys.argv[3]
if dev.type == "cuda":
    torch.zeros(1, device=dev); torch.cuda.synchronize()  # the context, which any GPU program pays
if family == "lowbit":  # the quantizer's tables, which the kernel's first call builds with or without a check
    from zerokern.kernels import lowbit
    lowbit.maps(dev); lowbit.maps(torch.device("cpu"))
t = time.perf_counter()
selfcheck.ensure(family, dev, backend=backend)
print(time.perf_counter() - t)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--fresh", type=int, default=3, help="fresh processes per family for `first`")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from zerokern.kernels.backends import selfcheck

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    backend = "cuda" if use_cuda else "cpu"
    name = torch.cuda.get_device_name(dev) if use_cuda else "CPU kernels against themselves (no GPU)"
    print(f"self-check cost on {dev} ({name}), oracle: zerokern's CPU kernel, {os.cpu_count()} cpus")
    rows = []
    for family in sorted(selfcheck.FAMILIES):
        first = []
        for _ in range(args.fresh):
            out = subprocess.run([sys.executable, "-c", FIRST, str(dev), backend, family], capture_output=True,
                                 text=True, check=True)
            first.append(float(out.stdout.strip().splitlines()[-1]))
        again = []
        for _ in range(args.rounds):
            selfcheck.forget()
            if use_cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            selfcheck.ensure(family, dev, backend=backend)
            again.append(time.perf_counter() - t)
        q = statistics.quantiles(again, n=4)
        rows.append(dict(family=family, first_ms=[round(x * 1e3, 3) for x in first],
                         again_median_ms=round(statistics.median(again) * 1e3, 3),
                         again_p25_ms=round(q[0] * 1e3, 3), again_p75_ms=round(q[2] * 1e3, 3)))
        r = rows[-1]
        print(f"{family:7s} first {', '.join(f'{x:.3f}' for x in r['first_ms'])} ms   again median "
              f"{r['again_median_ms']:.3f} ms (p25 {r['again_p25_ms']:.3f}, p75 {r['again_p75_ms']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "name": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
