"""FusedZeroAdam.step() at world size 1 against torch.optim.AdamW(fused=True),
on the same model (fp32 params), interleaved.

    python bench/zero_step.py [--sizes 1e7,1e8] [--json out.json]

Each iteration runs a cheap backward (untimed) so both optimizers see real
gradients, then times step() alone. The model is the GPT-style list of layer
tensors of bench/_harness.transformer_shapes.
"""

import argparse
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern import FusedZeroAdam  # noqa: E402


class Params(torch.nn.Module):
    def __init__(self, shapes, device):
        super().__init__()
        torch.manual_seed(0)
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes)

    def loss(self):
        # d loss / d p = 1e-3 * (p.sign() + 1): cheap, nonzero, different every step
        return sum((p * (p.detach().sign() + 1)).sum() for p in self.ps) * 1e-3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,1e8")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--jsonl", help="append each size's rows to this path as it finishes (JSON lines)")
    args = ap.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    info = H.machine_info(device)
    rows, log = [], H.CaseLog(args.jsonl, info)
    for n in tqdm([int(float(s)) for s in args.sizes.split(",")], desc="sizes"):
        shapes = H.transformer_shapes(n)
        models = {"zerokern-FusedZeroAdam": Params(shapes, device), "torch-AdamW(fused)": Params(shapes, device)}
        opts = {"zerokern-FusedZeroAdam": FusedZeroAdam(models["zerokern-FusedZeroAdam"].parameters(), lr=1e-4,
                                                        weight_decay=0.01),
                "torch-AdamW(fused)": torch.optim.AdamW(models["torch-AdamW(fused)"].parameters(), lr=1e-4,
                                                        weight_decay=0.01, fused=True)}
        times = {k: [] for k in opts}
        for r in range(args.rounds + 1):
            for name in (list(opts) if r % 2 else list(opts)[::-1]):
                opts[name].zero_grad()
                models[name].loss().backward()
                H.sync(device)
                t = H.time_one(opts[name].step, device)
                if r:
                    times[name].append(t)
        numel = sum(p.numel() for p in models["torch-AdamW(fused)"].parameters())
        base = H.summary(times["torch-AdamW(fused)"])["median_ms"]
        for name, t in times.items():
            s = H.summary(t)
            rows.append({"params": numel, "tensors": len(shapes), "impl": name, **s,
                         "speedup_vs_torch_fused": base / s["median_ms"]})
        diff = max((a - b).abs().max().item() for a, b in zip(models["zerokern-FusedZeroAdam"].parameters(),
                                                              models["torch-AdamW(fused)"].parameters()))
        rows[-1]["max_param_diff"] = rows[-2]["max_param_diff"] = diff
        log.add(rows[-2:])
        del models, opts
    print(f"optimizer step, world size 1, {info.get('gpu') or info['cpu']} ({device}, {info['torch_threads']} threads)")
    H.print_table(rows, [("params", "params", "{:.2e}"), ("tensors", "tensors", "{}"), ("impl", "impl", "{}"),
                         ("median_ms", "ms", "{:.3f}"), ("p25_ms", "p25", "{:.3f}"), ("p75_ms", "p75", "{:.3f}"),
                         ("speedup_vs_torch_fused", "vs torch fused", "{:.2f}x"),
                         ("max_param_diff", "max |diff|", "{:.1e}")])
    if args.json:
        H.write_json(args.json, info, rows)


if __name__ == "__main__":
    main()
