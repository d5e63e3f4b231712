"""What the matrix-whole layout (zerokern/zero/core/matrix_layout.py) costs against plan_layout:
padding in elements and bytes, buckets, and the per-rank cost balance (max/mean), for a GPT's
shapes with Muon on its 2-D hidden weights (or Adafactor on every param). Pure planning: no
tensors, no collectives, so the numbers are exact and the machine does not matter (the planning
time is reported for what it is).

    PYTHONPATH=. python bench/matrix_layout.py                       # 12-layer GPT, d=768, 2 and 4 ranks
    PYTHONPATH=. python bench/matrix_layout.py --worlds 2 4 8 --cap-mb 25 --json out.json
    PYTHONPATH=. python bench/matrix_layout.py --model llama-70b --costs muon --span 1 3 --worlds 4 8

The GPT is nanoGPT's (tied embedding and head, nn.Linear weights as (out, in)); gradient order is
the reverse of registration order, as zerokern's units lay params out ([Note: bucket order] in
zerokern/zero/unit.py). tests/zero/core/test_matrix_layout.py imports gpt_shapes from here.
"""

import argparse
import json
import math
import platform
import sys
import time

from zerokern.zero.core.layout import plan_layout
from zerokern.zero.core.matrix_layout import plan_matrix_layout


def gpt_shapes(layers=12, d=768, vocab=50257, ctx=1024):
    """(names, shapes, muon): a GPT's params in gradient order, and the indices of its 2-D hidden
    weights (Muon's group; embeddings, norms and biases go to AdamW)."""
    reg = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for k in range(layers):
        h = f"h.{k}."
        reg += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                (h + "attn.c_attn.weight", (3 * d, d)), (h + "attn.c_attn.bias", (3 * d,)),
                (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                (h + "mlp.c_fc.weight", (4 * d, d)), (h + "mlp.c_fc.bias", (4 * d,)),
                (h + "mlp.c_proj.weight", (d, 4 * d)), (h + "mlp.c_proj.bias", (d,))]
    reg += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    reg.reverse()
    names, shapes = [n for n, _ in reg], [s for _, s in reg]
    muon = [i for i, (n, s) in enumerate(reg) if len(s) == 2 and n.startswith("h.")]
    return names, shapes, muon


def llama_shapes(layers=80, d=8192, ffn=28672, kv=1024, vocab=32000):
    """(names, shapes, muon) of a Llama (no biases, RMSNorm, grouped-query attention, gated MLP,
    untied embedding and head; Llama-70B by default), as gpt_shapes."""
    reg = [("embed.weight", (vocab, d))]
    for k in range(layers):
        h = f"layers.{k}."
        reg += [(h + "input_norm.weight", (d,)), (h + "q.weight", (d, d)), (h + "k.weight", (kv, d)),
                (h + "v.weight", (kv, d)), (h + "o.weight", (d, d)), (h + "post_norm.weight", (d,)),
                (h + "gate.weight", (ffn, d)), (h + "up.weight", (ffn, d)), (h + "down.weight", (d, ffn))]
    reg += [("norm.weight", (d,)), ("head.weight", (vocab, d))]
    reg.reverse()
    names, shapes = [n for n, _ in reg], [s for _, s in reg]
    muon = [i for i, (n, s) in enumerate(reg) if len(s) == 2 and n.startswith("layers.")]
    return names, shapes, muon


MODELS = {"gpt": lambda: gpt_shapes(12, 768), "llama-7b": lambda: llama_shapes(32, 4096, 11008, 1024),
          "llama-70b": lambda: llama_shapes()}


def row(shapes, whole, world, cap_mb, cost, bytes_per_element=4, align=16, span=1):
    """One result: the matrix layout against plan_layout on the same tensors."""
    cap = int(cap_mb * 2**20 // bytes_per_element)
    numels = [math.prod(s) for s in shapes]
    flat = plan_layout(numels, world, cap, align)
    t0 = time.perf_counter()
    plan = plan_matrix_layout(shapes, whole, world, cap, align, cost, span=span)
    seconds = time.perf_counter() - t0
    extra = plan.layout.padded_numel - flat.padded_numel
    shard_max = max(b.shard_numel for b in plan.layout.buckets)
    with_matrix = [b.padded_numel for b in plan.layout.buckets if any(plan.owners[i] is not None for i in b.tensors)]
    return {
        "world": world, "cost": cost, "cap_mb": cap_mb, "span": span, "params": plan.numel,
        "plan_layout_padded": flat.padded_numel, "matrix_padded": plan.layout.padded_numel,
        "extra_elements": extra, "extra_bytes": extra * bytes_per_element,
        "extra_pct": 100.0 * extra / flat.padded_numel,
        "buckets": len(plan.layout.buckets), "plan_layout_buckets": len(flat.buckets),
        "largest_bucket_mb": shard_max * world * bytes_per_element / 2**20,
        "largest_matrix_bucket_mb": max(with_matrix) * bytes_per_element / 2**20,
        "balance": plan.balance, "plan_s": seconds,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt",
                    help="gpt: 12 layers, d=768 (the issue's); llama-7b (with grouped-query attention), llama-70b")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cap-mb", type=float, nargs="+", default=[25.0])
    ap.add_argument("--span", type=int, nargs="+", default=[1])
    ap.add_argument("--costs", nargs="+", default=["muon", "adafactor"], choices=["muon", "adafactor"],
                    help="muon: on the hidden 2-D weights; adafactor: on every tensor (torch's reads each whole)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    names, shapes, muon = MODELS[args.model]()
    rows = []
    for cap_mb in args.cap_mb:
        for span in args.span:
            for world in args.worlds:
                for cost in args.costs:
                    rows.append(row(shapes, muon if cost == "muon" else range(len(shapes)), world, cap_mb, cost,
                                    span=span))
    print(f"{args.model}, fp32 (4 bytes/element), align 16; python {platform.python_version()}")
    head = ("world", "cost", "cap_mb", "span", "params", "plan_layout_padded", "matrix_padded", "extra_bytes",
            "extra_pct", "buckets", "plan_layout_buckets", "largest_bucket_mb", "largest_matrix_bucket_mb", "balance", "plan_s")
    write_rows(rows, head, args.json)


def write_rows(rows, head, path):
    """Print rows as CSV (columns `head`), and write them with this run's arguments as JSON to path."""
    print(",".join(head))
    for r in rows:
        print(",".join(f"{r[h]:.4f}" if isinstance(r[h], float) else f"{r[h]}" for h in head))
    if path:
        with open(path, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
