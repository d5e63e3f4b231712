"""zerokern's fused Adam against its peers, on whatever this machine has.

    python bench/adam_throughput.py                      # CPU here, GPU where present
    python bench/adam_throughput.py --json out.json --plot out.png
    python bench/adam_throughput.py --quick              # seconds: a smoke test

For each precision (fp32 AdamW; mixed = fp32 master weights, bf16 grads, bf16
model params written back), layout (one flat tensor; a GPT-style list of layer
tensors; 200 equal tensors, which shows the per-tensor cost) and size, it times every usable zerokern backend and the installed
peers, interleaved, and reports median ms/step with the 25th-75th percentile
spread, params/s, GB/s and how close that is to the roof.

Bytes per parameter, the traffic an ideal single pass moves:
  fp32:  read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B)                 = 28 B
  mixed: read+write fp32 p, m, v (24 B) + read bf16 g (2 B) + write bf16 p (2 B) = 28 B
Peers that need more passes (torch's step + casting copies) are charged the
same 28 B, so their GB/s is "effective" and comparable.

Roofs measured in the same run: on CPUs, `roof` is a kernel moving exactly
those streams with no Adam arithmetic (a plain copy underestimates what seven
streams reach there); on GPUs, a device-to-device copy of the same bytes.
"""

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.kernels.backends.registry import PREFERENCE  # noqa: E402

BYTES_PER_PARAM = 28
MANY = 200  # the "many" layout: the same params split into this many equal tensors
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class Case:
    """The tensors of one (precision, layout, size) case, shared by all implementations."""

    def __init__(self, precision, layout, n, device):
        shapes = {"flat": lambda: [(n,)], "layers": lambda: H.transformer_shapes(n),
                  "many": lambda: [(n // MANY,)] * MANY}[layout]()
        self.precision, self.layout, self.device = precision, layout, device
        self.numel = sum(torch.Size(s).numel() for s in shapes)
        self.params = [torch.randn(s, device=device) * 0.02 for s in shapes]
        gdtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.grads = [(torch.randn(s, device=device) * 1e-3).to(gdtype) for s in shapes]
        self.model = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes] if precision == "mixed" else None
        self.step = 0

    def zeros(self):
        return [torch.zeros_like(p) for p in self.params]


def zerokern_impl(case, backend):
    m, v = case.zeros(), case.zeros()
    state = {"step": 0}

    def step():
        state["step"] += 1
        ops.fused_adam_(case.params, case.grads, m, v, lr=HYPER["lr"], beta1=HYPER["betas"][0],
                        beta2=HYPER["betas"][1], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                        step=state["step"], model_params=case.model, backend=backend)
    return step


def torch_optimizer_impl(case, make_optimizer):
    """A torch.optim-style optimizer on fp32 params. In mixed precision it needs
    the bf16 grads upcast into fp32 .grad and the result cast back: both copies
    are part of its step (that is what a mixed-precision loop around it pays)."""
    params = [p.detach().requires_grad_() for p in case.params]  # shares storage with case.params
    if case.precision == "fp32":
        for p, g in zip(params, case.grads):
            p.grad = g
        return make_optimizer(params).step
    for p in params:
        p.grad = torch.empty_like(p)
    opt = make_optimizer(params)
    grads32 = [p.grad for p in params]
    masters = [p.detach() for p in params]

    def step():
        torch._foreach_copy_(grads32, case.grads)
        opt.step()
        torch._foreach_copy_(case.model, masters)
    return step


def peers(case, device, with_deepspeed=True):
    """name -> factory of a step function, for every peer installed here."""
    out = {}
    for name, kw in (("torch-forloop", dict(foreach=False)), ("torch-foreach", dict(foreach=True)),
                     ("torch-fused", dict(fused=True))):
        out[name] = lambda kw=kw: torch_optimizer_impl(case, lambda ps: torch.optim.AdamW(ps, **HYPER, **kw))
    if not with_deepspeed:
        return out
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return out
    if device == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        out["deepspeed-cpu-adam"] = lambda: torch_optimizer_impl(
            case, lambda ps: DeepSpeedCPUAdam(ps, **HYPER, adamw_mode=True))
    else:
        from deepspeed.ops.adam import FusedAdam

        out["deepspeed-fused-adam"] = lambda: torch_optimizer_impl(
            case, lambda ps: FusedAdam(ps, **HYPER, adam_w_mode=True))
    return out


def apex_peer(case, device):
    if device != "cuda":
        return {}
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return {}
    return {"apex-fused-adam": lambda: torch_optimizer_impl(case, lambda ps: FusedAdam(ps, **HYPER, adam_w_mode=True))}


def roof_impl(case):
    m, v = case.zeros(), case.zeros()
    return lambda: torch.ops.zerokern.stream_roof_(case.params, case.grads, m, v, case.model or [])


def implementations(case, device, with_reference, with_deepspeed=True):
    impls = {}
    backends = [b for b, ok in ops.available_backends().items()
                if ok and b in PREFERENCE.get(device, ()) and (with_reference or b != "torch")]
    for b in backends:
        impls[f"zerokern-{b}"] = lambda b=b: zerokern_impl(case, b)
    impls.update(peers(case, device, with_deepspeed))
    impls.update(apex_peer(case, device))
    if device == "cpu" and ops.available_backends()["cpu"]:
        impls["roof"] = lambda: roof_impl(case)
    return impls


def run_case(precision, layout, n, device, budget_s, rounds, with_reference, progress, with_deepspeed=True):
    case = Case(precision, layout, n, device)
    fns = {}
    for name, factory in implementations(case, device, with_reference, with_deepspeed).items():
        try:
            fns[name] = factory()
            fns[name]()  # also the first step, which allocates optimizer state
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            print(f"  {name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            fns.pop(name, None)
    nrounds = rounds or H.rounds_for(fns, device, budget_s)
    times = H.interleaved(fns, device, nrounds, progress=None)
    progress.update(1)
    nbytes = BYTES_PER_PARAM * case.numel
    copy_gbs = H.copy_bandwidth(nbytes, device)
    stats = {name: H.summary(t) for name, t in times.items()}
    roof_gbs = nbytes / stats["roof"]["median_ms"] / 1e6 if "roof" in stats else copy_gbs
    baseline = stats.get("torch-fused")
    rows = []
    for name, s in stats.items():
        gbs = nbytes / s["median_ms"] / 1e6
        rows.append({
            "precision": precision, "layout": layout, "params": case.numel, "tensors": len(case.params),
            "impl": name, **s, "params_per_s": case.numel / s["median_ms"] * 1e3, "gb_per_s": gbs,
            "roof_gb_per_s": roof_gbs, "pct_of_roof": 100 * gbs / roof_gbs,
            "copy_gb_per_s": copy_gbs, "pct_of_copy": 100 * gbs / copy_gbs,
            "speedup_vs_torch_fused": baseline["median_ms"] / s["median_ms"] if baseline else None,
        })
    del case, fns
    return rows


def many_vs_flat(rows):
    """Per-tensor cost: time for the params split into 200 tensors over time for one tensor."""
    key = {(r["precision"], r["layout"], r["params"] // MANY * MANY, r["impl"]): r["median_ms"] for r in rows}
    lines = []
    for (prec, layout, n, impl), ms in sorted(key.items()):
        if layout == "many" and (prec, "flat", n, impl) in key:
            lines.append(f"  {prec:5s} {n:.0e} {impl:20s} {ms / key[(prec, 'flat', n, impl)]:.2f}x")
    if lines:
        print(f"\n{MANY} tensors vs one tensor of the same total size (time ratio):")
        print("\n".join(lines))


def parse_sizes(text):
    return [int(float(x)) for x in text.split(",")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--sizes", type=parse_sizes, help="params per case, e.g. 1e6,1e7,1e8 "
                    "(default: 1e6,1e7,1e8 on CPU; 1e6,1e7,1e8,2.56e8,1e9 on GPU)")
    ap.add_argument("--precisions", default="fp32,mixed")
    ap.add_argument("--layouts", default="flat,layers,many")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per case (sets the rounds)")
    ap.add_argument("--rounds", type=int, help="fixed number of interleaved rounds instead of --budget")
    ap.add_argument("--with-reference", action="store_true", help="also time zerokern's plain-torch backend")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, 3 rounds, no DeepSpeed peers (their first use compiles C++ for minutes): "
                         "a smoke test")
    ap.add_argument("--json", help="write results (with machine facts) to this path")
    ap.add_argument("--plot", help="write a PNG of GB/s against size to this path")
    ap.add_argument("--jsonl", help="append each case's rows to this path as it finishes (JSON lines)")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or ([10_000, 100_000] if args.quick else
                           [1_000_000, 10_000_000, 100_000_000] if device == "cpu" else
                           [1_000_000, 10_000_000, 100_000_000, 256_000_000, 1_000_000_000])
    rounds = 3 if args.quick and not args.rounds else args.rounds
    info = H.machine_info(device)
    print(f"zerokern fused Adam on {info.get('gpu') or info['cpu']} ({device}, {info['torch_threads']} threads), "
          f"torch {info['torch']}; backends: {ops.available_backends()}")

    cases = [(p, l, n) for p in args.precisions.split(",") for l in args.layouts.split(",") for n in sizes]
    rows, log = [], H.CaseLog(args.jsonl, info)
    with tqdm(total=len(cases), desc="cases", unit="case") as progress:
        for precision, layout, n in cases:
            progress.set_postfix_str(f"{precision} {layout} {n:.0e}")
            case = run_case(precision, layout, n, device, args.budget, rounds, args.with_reference, progress,
                            with_deepspeed=not args.quick)
            log.add(case)
            rows += case

    H.print_table(rows, [
        ("precision", "prec", "{}"), ("layout", "layout", "{}"), ("params", "params", "{:.2e}"),
        ("impl", "impl", "{}"), ("median_ms", "ms", "{:.3f}"), ("p25_ms", "p25", "{:.3f}"), ("p75_ms", "p75", "{:.3f}"),
        ("gb_per_s", "GB/s", "{:.1f}"), ("pct_of_roof", "%roof", "{:.0f}"), ("pct_of_copy", "%copy", "{:.0f}"),
        ("speedup_vs_torch_fused", "vs torch-fused", "{:.2f}x"),
    ])
    many_vs_flat(rows)
    if args.json:
        H.write_json(args.json, info, rows)
    if args.plot:
        for r in rows:
            r["case"] = f"{r['precision']} {r['layout']}"
        H.plot(args.plot, rows, "params", "gb_per_s", "impl", "case", "params", "GB/s (28 B/param)",
               f"fused Adam, {info.get('gpu') or 'CPU'}")


if __name__ == "__main__":
    main()
