"""Low-bit optimizer state: the update step's time and bytes, against its memory roof and peers.

    python bench/lowbit_step.py                          # 100M params (GPT-like tensors), CPU
    python bench/lowbit_step.py --params 1e7 --rounds 5  # quicker
    python bench/lowbit_step.py --json out.json --plot out.png

Rows (one optimizer step over the same params, bf16 grads, interleaved, medians with p25-p75):
  zerokern fp32        fused_adam_: fp32 masters and moments, bf16 params written back (28 B/param)
  zerokern int8        fused_adam_lowbit_: fp32 masters, int8 moments, bf16 params written  (16 B)
  zerokern int8 nomaster  int8 moments, bf16 params updated in place, stochastically rounded (10 B)
  zerokern bf16 nomaster  bf16 moments and params, stochastically rounded                     (14 B)
  torchao AdamW8bit / torchao AdamW bf16_stochastic_round / bitsandbytes AdamW8bit: where installed
  (pip install "zerokern[peers]"), over bf16 params (torchao's 8-bit state with fp32 params).
Bytes: what an ideal single pass reads and writes per param (block scales: +0.03 B). Roof: those
bytes at the bandwidth zerokern's stream roof reaches on this machine for the fp32 path's seven
streams (the same traffic with no arithmetic), so % of roof says how close each row is to memory.
Every zerokern row is checked against the plain-torch reference on a sample before it is timed.
Arithmetic ms: the same row on 2M cache-resident params (8 tensors of 256K, timed many times),
scaled to the full count: what the step costs with memory taken away. Where it exceeds the roof,
the row is compute-bound on this machine and no kernel with the same arithmetic reaches the roof.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern.kernels import lowbit as L  # noqa: E402
from zerokern.kernels.lowbit_ops import fused_adam_lowbit_  # noqa: E402
from zerokern.kernels.ops import fused_adam_  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
BYTES = {"zerokern fp32": 28, "zerokern int8": 16 + 8 / 256, "zerokern int8 nomaster": 10 + 8 / 256,
         "zerokern bf16 nomaster": 14}


def _state(sizes, gen):
    return ([torch.randn(n, generator=gen) * 1e-3 for n in sizes], [torch.rand(n, generator=gen) * 1e-6 for n in sizes])


def zerokern_rows(sizes, gen):
    """{name: step function}, each on its own copy of the params and state."""
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    p32 = [torch.randn(n, generator=gen) for n in sizes]
    m, v = _state(sizes, gen)
    rows, steps = {}, {}

    def counter(name):
        steps[name] = steps.get(name, 1) + 1
        return steps[name]

    fp = ([t.clone() for t in p32], [t.clone() for t in m], [t.clone() for t in v], [t.bfloat16() for t in p32])
    rows["zerokern fp32"] = lambda: fused_adam_(fp[0], grads, fp[1], fp[2], step=counter("fp32"), model_params=fp[3],
                                                **HYPER)
    q8 = [L.quantize(t, True) for t in m], [L.encode_moment(t, True) for t in v]
    i8 = ([t.clone() for t in p32], [c.clone() for c, _ in q8[0]], [c.clone() for c, _ in q8[1]],
          [s.clone() for _, s in q8[0]], [s.clone() for _, s in q8[1]], [t.bfloat16() for t in p32])
    bases = [sum(sizes[:k]) for k in range(len(sizes))]
    rows["zerokern int8"] = lambda: fused_adam_lowbit_(i8[0], grads, i8[1], i8[2], exp_avg_scales=i8[3],
                                                       exp_avg_sq_scales=i8[4], model_params=i8[5], index_bases=bases,
                                                       step=counter("int8"), **HYPER)
    n8 = ([t.bfloat16() for t in p32], [c.clone() for c, _ in q8[0]], [c.clone() for c, _ in q8[1]],
          [s.clone() for _, s in q8[0]], [s.clone() for _, s in q8[1]])
    rows["zerokern int8 nomaster"] = lambda: fused_adam_lowbit_(n8[0], grads, n8[1], n8[2], exp_avg_scales=n8[3],
                                                                exp_avg_sq_scales=n8[4], index_bases=bases,
                                                                step=counter("n8"), **HYPER)
    b16 = ([t.bfloat16() for t in p32], [t.bfloat16() for t in m], [t.bfloat16() for t in v])
    rows["zerokern bf16 nomaster"] = lambda: fused_adam_lowbit_(b16[0], grads, b16[1], b16[2], index_bases=bases,
                                                                step=counter("b16"), **HYPER)
    return rows, grads


def validate(sizes):
    """Each zerokern row's kernel (auto backend) against the reference on the first 70001 elements."""
    n = min(70001, sizes[0])
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    (m,), (v,) = _state([n], gen)
    worst = 0.0
    for pdt, fmt in ((torch.float32, "int8"), (torch.bfloat16, "int8"), (torch.bfloat16, "bf16")):
        outs = []
        for backend in ("torch", "auto"):
            q = p.to(pdt)
            if fmt == "int8":
                (mc, ms), (vc, vs) = L.quantize(m, True), L.encode_moment(v, True)
                fused_adam_lowbit_([q], [g], [mc], [vc], exp_avg_scales=[ms], exp_avg_sq_scales=[vs], index_bases=[0],
                                   step=2, backend=backend, **HYPER)
            else:
                fused_adam_lowbit_([q], [g], [m.bfloat16()], [v.bfloat16()], index_bases=[0], step=2,
                                   backend=backend, **HYPER)
            outs.append(q.float())
        step = (p.to(pdt).float() - outs[0]).abs().max().item()
        worst = max(worst, (outs[0] - outs[1]).abs().max().item() / max(step, 1e-12))
    if worst > 0.05:
        sys.exit(f"lowbit_step: the compiled kernel differs from the reference by {worst:.3f} of an update")
    return worst


def arithmetic_ms(total, rounds, n=1 << 18, count=8, repeat=50):
    """Each zerokern row's step on count * n cache-resident params, repeat calls per sample, scaled
    to `total` params: {name: median ms}."""
    rows, _ = zerokern_rows([n] * count, torch.Generator().manual_seed(2))
    batched = {name: (lambda f=f: [f() for _ in range(repeat)]) for name, f in rows.items()}
    times = H.interleaved(batched, "cpu", rounds, warmup=1)
    scale = total / (n * count * repeat)
    return {name: statistics.median(t) * 1e3 * scale for name, t in times.items()}


def peer_rows(sizes, grads):
    """Peers over bf16 (torchao's 8-bit over fp32) params, where importable: {name: step} and notes."""
    rows, notes = {}, []

    def params(dtype):
        ps = [torch.nn.Parameter(torch.randn(n, dtype=torch.float32).to(dtype)) for n in sizes]
        for p, g in zip(ps, grads):
            p.grad = g.to(dtype)
        return ps

    try:
        import torchao.optim as ao
        o1 = ao.AdamW8bit(params(torch.float32), lr=1e-3)
        rows["torchao AdamW8bit"] = o1.step
        o2 = ao._AdamW(params(torch.bfloat16), lr=1e-3, bf16_stochastic_round=True)
        rows["torchao AdamW bf16_stochastic_round"] = o2.step
    except Exception as e:  # noqa: BLE001  a peer that does not run here is reported, not fatal
        notes.append(f"torchao: {type(e).__name__}: {str(e)[:120]}")
    try:
        import bitsandbytes as bnb
        o3 = bnb.optim.AdamW8bit(params(torch.bfloat16), lr=1e-3)
        o3.step()
        rows["bitsandbytes AdamW8bit"] = o3.step
    except Exception as e:  # noqa: BLE001
        notes.append(f"bitsandbytes: {type(e).__name__}: {str(e)[:120]}")
    return rows, notes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    sizes = [torch.Size(s).numel() for s in H.transformer_shapes(int(args.params))]
    total = sum(sizes)
    gen = torch.Generator().manual_seed(0)
    err = validate(sizes)
    rows, grads = zerokern_rows(sizes, gen)
    notes = []
    if not args.no_peers:
        peers, notes = peer_rows(sizes, grads)
        rows.update(peers)
    # the roof: the fp32 path's seven streams with no arithmetic, on the same tensors' sizes
    rp = [torch.randn(n) for n in sizes]
    rm, rv, ro = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes], [torch.empty(n, dtype=torch.bfloat16)
                                                                                 for n in sizes]
    rows["roof (fp32 streams)"] = lambda: torch.ops.zerokern.stream_roof_(rp, grads, rm, rv, ro)
    load = H.OtherLoad()
    times = H.interleaved(rows, "cpu", args.rounds, warmup=1)
    arith = arithmetic_ms(total, args.rounds)
    others, steal = load.cpus()
    roof_s = statistics.median(times["roof (fp32 streams)"])
    bandwidth = 28 * total / roof_s
    results = []
    print(f"{total / 1e6:.1f}M params in {len(sizes)} tensors, {torch.get_num_threads()} threads; roof bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s; kernels within {err:.2g} of an update of the reference")
    print(f"{'row':40s} {'median ms':>10s} {'p25-p75':>17s} {'B/param':>8s} {'roof ms':>8s} {'% roof':>7s} "
          f"{'arith ms':>9s}")
    for name, t in times.items():
        s = H.summary(t)
        nbytes = BYTES.get(name)
        roof_ms = nbytes * total / bandwidth * 1e3 if nbytes else None
        pct = 100 * roof_ms / s["median_ms"] if roof_ms else None
        a = arith.get(name)
        results.append(dict(s, impl=name, bytes_per_param=nbytes, roof_ms=roof_ms, pct_of_roof=pct,
                            arithmetic_ms=a))
        print(f"{name:40s} {s['median_ms']:10.1f} {s['p25_ms']:8.1f}-{s['p75_ms']:<8.1f} "
              f"{'' if nbytes is None else f'{nbytes:.2f}':>8s} {'' if roof_ms is None else f'{roof_ms:.1f}':>8s} "
              f"{'' if pct is None else f'{pct:.0f}%':>7s} {'' if a is None else f'{a:.1f}':>9s}")
    for n in notes:
        print("not run:", n)
    print(f"other processes used {others if others is not None else float('nan'):.2f} CPUs meanwhile")
    out = {"machine": H.machine_info("cpu"), "params": total, "tensors": len(sizes), "rounds": args.rounds,
           "roof_gb_per_s": bandwidth / 1e9, "validation_err": err, "results": results, "not_run": notes,
           "others_cpus": others, "steal_cpus": steal}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = [r["impl"] for r in results]
        med = [r["median_ms"] for r in results]
        err_lo = [r["median_ms"] - r["p25_ms"] for r in results]
        err_hi = [r["p75_ms"] - r["median_ms"] for r in results]
        fig, ax = plt.subplots(figsize=(9, 4))
        ax.barh(names, med, xerr=[err_lo, err_hi])
        for k, r in enumerate(results):
            if r["roof_ms"]:
                ax.plot([r["roof_ms"]] * 2, [k - 0.4, k + 0.4], "k--")
        ax.set_xlabel(f"ms per step, {total / 1e6:.0f}M params (dashed: memory roof)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(args.plot)
    return out


if __name__ == "__main__":
    main()
