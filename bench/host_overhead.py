"""Host time of one zerokern.ops.fused_adam_ call on a cache hit, with the kernel launch stubbed
out: what a GPU step costs the CPU before the GPU does anything. Runs on a CPU.

    python bench/host_overhead.py [--counts 1,200,3000] [--rounds 300] [--json out.json]

Each call goes through ops.fused_adam_ as a user's does (argument handling, backend choice, the
cached validation of [Note: host cost], hyper-parameter checks, Adam's coefficients); only the
kernel is left out: the backend's fused_adam_ runs with dry_run=True, so the native path returns
just before its runner and the Triton path just before its launches. The native path's C++
(csrc/torch/adam_cache.cpp) is the one compiled into zerokern._C and zerokern._C_cuda alike; on
the CUDA path the device guard, the grouping into launch batches and cudaLaunchKernel are left out
with the kernel. Each call has N parameters, each with 5 tensors (fp32 master, bf16 grad, fp32 m
and v, bf16 model param). Target (issue 16): at most 20 us + 0.2 us per parameter, with numbers
for lr and step.

For scale, "op, uncached": the same calls through the dispatcher op, which validates every tensor
on every call (what each call cost before the cache; the CPU kernel's own time is in it too, on
tensors of 1 element).
"""

import argparse
import functools
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets the Triton backend resolve on a CPU; nothing is launched

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern.kernels import ops  # noqa: E402
from zerokern.kernels.backends import registry  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def make_lists(n):
    master = [torch.zeros(1) for _ in range(n)]
    grads = [torch.zeros(1, dtype=torch.bfloat16) for _ in range(n)]
    m, v = [torch.zeros(1) for _ in range(n)], [torch.zeros(1) for _ in range(n)]
    model = [torch.zeros(1, dtype=torch.bfloat16) for _ in range(n)]
    return master, grads, m, v, model


def stubbed(backend):
    """ops.fused_adam_ with the backend's launch left out (dry_run)."""
    real = registry.resolve(backend, torch.device("cpu"))
    stub = types.SimpleNamespace(fused_adam_=functools.partial(real.fused_adam_, dry_run=True))
    return lambda name, device: stub


def target_us(n):
    return 20.0 + 0.2 * n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,200,3000", help="parameters per call")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    info = H.machine_info("cpu")
    rows = []
    for n in tqdm([int(c) for c in args.counts.split(",")], desc="counts"):
        p, g, m, v, out = make_lists(n)
        lr_t, step_t = torch.tensor([1e-3]), torch.tensor([3.0])
        fns = {}
        for backend in ("cpu", "triton"):
            if registry.unavailable_backends().get(backend):
                continue
            ops.fused_adam_(p, g, m, v, step=1, model_params=out, backend=backend, **HYPER)  # validated once

            def call(backend=backend, tensors=False):
                kw = dict(HYPER, lr=lr_t) if tensors else HYPER
                saved = ops.resolve
                ops.resolve = stubbed(backend)
                try:
                    ops.fused_adam_(p, g, m, v, step=step_t if tensors else 3, model_params=out, **kw)
                finally:
                    ops.resolve = saved

            label = "native (cpu/cuda)" if backend == "cpu" else "triton"
            fns[f"{label}, cached"] = call
            fns[f"{label}, cached, tensor lr/step"] = functools.partial(call, tensors=True)
        fns["op, uncached"] = lambda: torch.ops.zerokern.fused_adam_(
            p, g, m, v, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3.0,
            adam_w_mode=True, bias_correction=True, grad_scale=1.0)
        times = H.interleaved(fns, "cpu", args.rounds, warmup=3)
        for name, t in times.items():
            s = H.summary(t)
            us = s["median_ms"] * 1e3
            row = {"params": n, "tensors": 5 * n, "path": name, "median_us": us, "p25_us": s["p25_ms"] * 1e3,
                   "p75_us": s["p75_ms"] * 1e3, "target_us": target_us(n)}
            if name.endswith(", cached"):
                row["meets_target"] = us <= target_us(n)
            rows.append(row)
    print(f"fused_adam_ host time per call, launch stubbed out; {info['cpu']}, torch {info['torch']}, "
          f"triton {info['triton']}")
    H.print_table(rows, [("params", "params", "{}"), ("path", "path", "{}"), ("median_us", "us", "{:.1f}"),
                         ("p25_us", "p25", "{:.1f}"), ("p75_us", "p75", "{:.1f}"), ("target_us", "target", "{:.0f}"),
                         ("meets_target", "meets", "{}")])
    if args.json:
        H.write_json(args.json, info, rows)
    return rows


if __name__ == "__main__":
    main()
