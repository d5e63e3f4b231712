"""What Muon at stage 3 costs against ZeRO-3 with AdamW: each run of blocks a zerokern.shard() unit laid
out with matrices= (plan_matrix_layout per unit: [Note: whole matrices in units] in
zerokern/zero/core/whole_matrices.py), the root (embeddings, final norm) with plan_layout, against
every unit with plan_layout. Pure planning, so the numbers are exact on any machine.

    PYTHONPATH=.:bench python bench/matrix_units.py --worlds 2 4 8 --blocks-per-unit 1 2 4 --json out.json

Bytes per rank and step at stage 3 (fp32 params, reshard_after_forward=True): a gather for the
forward, one for the backward, a reduce-scatter: 3 (N-1)/N x the padded elements x 4 bytes, the
same collectives in both layouts. Balance: every rank's summed Newton-Schulz cost over the units,
max/mean (each unit's owners are balanced within the unit).
"""

import argparse
import math
import platform

from zerokern.zero.core.layout import plan_layout
from zerokern.zero.core.matrix_layout import plan_matrix_layout

from matrix_layout import gpt_shapes, write_rows


def units(layers=12, d=768, per_unit=1):
    """Per unit, (shapes, matrices) in gradient order: each run of per_unit blocks, then the
    root's own params."""
    names, shapes, _ = gpt_shapes(layers, d)
    out = []
    for k in range(0, layers, per_unit):
        mine = [i for i, n in enumerate(names)
                if n.startswith("h.") and k <= int(n.split(".")[1]) < k + per_unit]
        out.append(([shapes[i] for i in mine], [j for j, i in enumerate(mine) if len(shapes[i]) == 2]))
    root = [i for i, n in enumerate(names) if not n.startswith("h.")]
    out.append(([shapes[i] for i in root], []))
    return out


def row(world, cap_mb, per_unit=1, layers=12, d=768, bytes_per_element=4, align=16):
    cap = int(cap_mb * 2**20 // bytes_per_element)
    flat = matrix = 0
    loads = [0] * world
    largest_flat = largest_matrix = 0
    for shapes, whole in units(layers, d, per_unit):
        numels = [math.prod(s) for s in shapes]
        a = plan_layout(numels, world, cap, align)
        b = plan_matrix_layout(shapes, whole, world, cap, align, "muon").layout if whole else a
        flat += a.padded_numel
        matrix += b.padded_numel
        if whole:  # the blocks' buckets (the root's embedding bucket is the same in both)
            largest_flat = max([largest_flat] + [x.padded_numel for x in a.buckets])
            largest_matrix = max([largest_matrix] + [x.padded_numel for x in b.buckets])
            plan = plan_matrix_layout(shapes, whole, world, cap, align, "muon")
            loads = [x + y for x, y in zip(loads, plan.loads)]
    per_step = lambda n: 3 * (world - 1) / world * n * bytes_per_element  # noqa: E731
    return {"world": world, "cap_mb": cap_mb, "blocks_per_unit": per_unit, "zero3_adamw_padded": flat,
            "muon_padded": matrix,
            "extra_pct": 100.0 * (matrix - flat) / flat, "zero3_adamw_bytes_per_step": per_step(flat),
            "muon_bytes_per_step": per_step(matrix),
            "largest_block_bucket_mb_adamw": largest_flat * bytes_per_element / 2**20,
            "largest_block_bucket_mb_muon": largest_matrix * bytes_per_element / 2**20,
            "ns_balance": max(loads) / (sum(loads) / world)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--cap-mb", type=float, default=25.0)
    ap.add_argument("--blocks-per-unit", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = [row(w, args.cap_mb, k) for k in args.blocks_per_unit for w in args.worlds]
    print(f"12-layer GPT, d=768, a unit per run of blocks and the root; fp32, align 16; "
          f"python {platform.python_version()}")
    write_rows(rows, list(rows[0]), args.json)


if __name__ == "__main__":
    main()
