"""Markdown table of a bench JSON file, for the README and issue notes.

    python bench/results_table.py bench/results/adam_throughput_cpu_2core_2026-11-30.json
"""

import json
import sys

SHOW = ("zerokern-cpu", "zerokern-cuda", "zerokern-triton", "torch-fused", "deepspeed-cpu-adam",
        "deepspeed-fused-adam", "apex-fused-adam", "roof")


def main(path, min_params=1_000_000):
    with open(path) as f:
        data = json.load(f)
    m = data["machine"]
    print(f"{m.get('gpu') or m['cpu']}, {m['torch_threads']} threads, torch {m['torch']}, {m['date'][:10]}\n")
    print("| precision | layout | params | impl | ms (p25-p75) | GB/s | % of roof | vs torch fused |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["results"]:
        if r["impl"] in SHOW and r["params"] >= min_params:
            speed = f"{r['speedup_vs_torch_fused']:.2f}x" if r.get("speedup_vs_torch_fused") else ""
            print(f"| {r['precision']} | {r['layout']} | {r['params']:.0e} | {r['impl']} | "
                  f"{r['median_ms']:.2f} ({r['p25_ms']:.2f}-{r['p75_ms']:.2f}) | {r['gb_per_s']:.1f} | "
                  f"{r['pct_of_roof']:.0f} | {speed} |")


if __name__ == "__main__":
    main(sys.argv[1])
