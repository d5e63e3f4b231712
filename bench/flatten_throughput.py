"""zerokern's flatten / unflatten against torch's, on whatever this machine has.

    python bench/flatten_throughput.py [--json out.json] [--plot out.png] [--quick]

Cases: the parameter list of GPT-2 small (124M params, 148 tensors) and 10,000
tiny tensors (16-512 elements). Operations:
  flatten       bf16 tensors -> a new fp32 buffer   (6 B/element: read 2, write 4)
  flatten_into  bf16 tensors -> an existing fp32 buffer (6 B/element)
  unflatten     fp32 buffer -> existing bf16 tensors, in place (6 B/element)
  flatten32     fp32 tensors -> a new fp32 buffer, no cast (8 B/element)
Peers: torch._utils._flatten_dense_tensors(...).to(dtype) (concatenate, then
cast: two passes), torch.cat of per-tensor casts (or torch.cat(out=) into an
existing buffer), and torch._foreach_copy_ between the tensors and views of the
buffer, the views made per call by torch._utils._unflatten_dense_tensors (what
apex and DeepSpeed do) or made once and cached.
A new buffer's first touch (page faults, the OS zeroing it) dominates
`flatten` and `flatten32` on CPUs for both zerokern and torch. GB/s counts the bytes above; the device copy bandwidth is
measured in the same run, and every case is timed interleaved.
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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402


def gpt2_shapes(layers=12, hidden=768, vocab=50257, ctx=1024):
    h = hidden
    layer = [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return [(vocab, h), (ctx, h)] + layer * layers + [(h,), (h,)]


def tiny_shapes(count=10_000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(int(n),) for n in torch.randint(16, 513, (count,), generator=gen)]


def implementations(op, tensors, flat, device):
    """name -> step function for one operation."""
    backends = [b for b, ok in ops.available_backends().items() if ok and b in PREFERENCE.get(device, ()) and b != "torch"]
    impls = {}
    if op in ("flatten", "flatten32"):
        for b in backends:
            impls[f"zerokern-{b}"] = lambda b=b: ops.flatten(tensors, torch.float32, backend=b)
        impls["torch-flatten_dense+to"] = lambda: _flatten_dense_tensors(tensors).to(torch.float32)
        impls["torch-cat"] = lambda: torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
    elif op == "flatten_into":
        views = _unflatten_dense_tensors(flat, tensors)
        for b in backends:
            impls[f"zerokern-{b}"] = lambda b=b: ops.flatten(tensors, out=flat, backend=b)
        impls["torch-cat(out=)"] = lambda: torch.cat([t.reshape(-1) for t in tensors], out=flat)
        impls["torch-foreach_copy(cached views)"] = lambda: torch._foreach_copy_(views, tensors)
    else:
        views = _unflatten_dense_tensors(flat, tensors)
        for b in backends:
            impls[f"zerokern-{b}"] = lambda b=b: ops.unflatten_into(flat, tensors, backend=b)
        impls["torch-unflatten_dense+foreach_copy"] = lambda: torch._foreach_copy_(
            tensors, _unflatten_dense_tensors(flat, tensors))
        impls["torch-foreach_copy(cached views)"] = lambda: torch._foreach_copy_(tensors, views)
    return impls


def run_case(name, shapes, op, device, rounds, budget):
    src_dtype = torch.float32 if op == "flatten32" else torch.bfloat16
    tensors = [torch.randn(s, device=device).to(src_dtype) for s in shapes]
    numel = sum(t.numel() for t in tensors)
    flat = torch.randn(numel, device=device)
    impls = implementations(op, tensors, flat, device)
    for fn in impls.values():
        fn()
    n_rounds = rounds or H.rounds_for(impls, device, budget)
    times = H.interleaved(impls, device, n_rounds)
    nbytes = numel * (8 if op == "flatten32" else 6)
    copy_gbs = H.copy_bandwidth(nbytes, device)
    stats = {k: H.summary(v) for k, v in times.items()}
    best_torch = min(s["median_ms"] for k, s in stats.items() if k.startswith("torch"))
    return [{"case": name, "op": op, "params": numel, "tensors": len(tensors), "impl": k, **s,
             "gb_per_s": nbytes / s["median_ms"] / 1e6, "copy_gb_per_s": copy_gbs,
             "pct_of_copy": 100 * nbytes / s["median_ms"] / 1e6 / copy_gbs,
             "speedup_vs_best_torch": best_torch / s["median_ms"]} for k, s in stats.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int)
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per case")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--quick", action="store_true", help="small stand-ins for both cases: a smoke test")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--jsonl", help="append each case's rows to this path as it finishes (JSON lines)")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = ([("gpt2-tiny", gpt2_shapes(2, 64, 500, 64)), ("1k-tiny", tiny_shapes(1000))] if args.quick else
             [("gpt2-small", gpt2_shapes()), ("10k-tiny", tiny_shapes())])
    info = H.machine_info(device)
    print(f"zerokern flatten/unflatten on {info.get('gpu') or info['cpu']} ({device}, {info['torch_threads']} threads)")
    rows, log = [], H.CaseLog(args.jsonl, info)
    jobs = [(c, op) for c in cases for op in ("flatten", "flatten_into", "unflatten", "flatten32")]
    for (name, shapes), op in tqdm(jobs, desc="cases", unit="case"):
        case = run_case(name, shapes, op, device, 3 if args.quick else args.rounds, args.budget)
        log.add(case)
        rows += case
    H.print_table(rows, [("case", "case", "{}"), ("op", "op", "{}"), ("impl", "impl", "{}"),
                         ("median_ms", "ms", "{:.3f}"), ("p25_ms", "p25", "{:.3f}"), ("p75_ms", "p75", "{:.3f}"),
                         ("gb_per_s", "GB/s", "{:.1f}"), ("pct_of_copy", "%copy", "{:.0f}"),
                         ("speedup_vs_best_torch", "vs best torch", "{:.2f}x")])
    if args.json:
        H.write_json(args.json, info, rows)
    if args.plot:
        for r in rows:
            r["panel"] = r["case"]
            r["x"] = {"flatten": 1, "flatten_into": 2, "unflatten": 3, "flatten32": 4}[r["op"]]
        H.plot(args.plot, rows, "x", "gb_per_s", "impl", "panel",
               "1 flatten, 2 flatten_into, 3 unflatten, 4 flatten32", "GB/s",
               f"flat buffers, {info.get('gpu') or 'CPU'}")


if __name__ == "__main__":
    main()
