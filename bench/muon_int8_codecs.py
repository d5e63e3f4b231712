"""Which 8-bit form of Muon's momentum trains like fp32? One process, bench/muon_loss.py's GPT, data,
schedule and hyper-parameters (torch.optim.Muon + torch.optim.AdamW), the momentum_buffer put
through a codec after every step; the eval curve of each codec against fp32 momentum, and how the
codec's rounding compares with the step's own change of the momentum, (1 - beta) (g - m).

    python bench/muon_int8_codecs.py --steps 100 --schedule 300 --seeds 0 1

Codecs: NAME-ROUNDING-BLOCK, NAME "dynamic" (kernels/lowbit.py's signed map) or "linear" (255
evenly spaced values in [-1, 1]), ROUNDING "nearest" or "stochastic" (unbiased: up with
probability the distance from the code below over the gap; torch.Generator draws, a lab only),
BLOCK elements a row's block; a suffix "-cols": each column divided by its absmax before the row
blocks (a scale per column too).
"bf16": the momentum rounded to bf16 (2 bytes an element), for scale; "zerokern": ZeroOptimizer's
int8 codec itself (zerokern/optim/lowbit_momentum.py: linear, blocks of its BLOCK, with columns).
Per step, over the matrices: "err/change", ||rounded - exact|| / ||exact - previous|| (a step's
rounding against the step's own change of the momentum); "drift", ||momentum - shadow|| / ||shadow||,
shadow an fp32 momentum fed the same grads (the rounding as it piles up in the state).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lowbit_loss import CTX, EVAL_EVERY, GPT, _loss, _lr  # noqa: E402
from muon_loss import ADAMW, MUON, PEAK, _data, hidden_and_rest  # noqa: E402
from zerokern.kernels import lowbit  # noqa: E402
from zerokern.optim import lowbit_momentum  # noqa: E402

LINEAR = torch.linspace(-1, 1, 255)


def _map(name):
    return lowbit.qmap(True)[:255] if name == "dynamic" else LINEAR  # ascending, each value once


def codec(m, name, rounding, block, gen, columns=False):
    """m put through the codec: row-aligned blocks of `block`, absmax scales; columns: each column
    divided by its absmax first (a second, per-column scale)."""
    if columns:
        c = m.abs().amax(dim=0, keepdim=True)
        c = torch.where(c > 0, c, torch.ones_like(c))
        return codec(m / c, name, rounding, block, gen) * c
    rows, cols = m.shape
    nb = -(-cols // block)
    x = torch.nn.functional.pad(m, (0, nb * block - cols)).view(rows, nb, block)
    scale = x.abs().amax(dim=2, keepdim=True)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    normed = (x * inv).reshape(-1)
    q = _map(name)
    lo = (torch.bucketize(normed, q, right=True) - 1).clamp(0, q.numel() - 2)
    if rounding == "nearest":
        mid = (q[:-1] + q[1:]) * 0.5
        code = torch.bucketize(normed, mid, right=False)
    else:
        p = (normed - q[lo]) / (q[lo + 1] - q[lo])
        u = (torch.randint(0, 65536, normed.shape, generator=gen).float() + 0.5) / 65536
        code = lo + (u < p).long()
    return (q[code].view(rows, nb, block) * scale).view(rows, -1)[:, :cols]


def run(seed, steps, schedule, eval_batches, name):
    torch.set_num_threads(1)
    train, starts, evs = _data(seed, schedule, eval_batches, 2)
    torch.manual_seed(seed)
    model = GPT()
    hidden, rest = hidden_and_rest(model)
    muon, adamw = torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)
    gen = torch.Generator().manual_seed(1000 + seed)
    curve, stats, shadow = [], [], {}
    for step in range(steps):
        scale = _lr(step, schedule) / PEAK
        muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"] = MUON["lr"] * scale, ADAMW["lr"] * scale
        batch = torch.stack([train[s:s + CTX + 1] for s in starts[step]])  # both ranks' rows
        muon.zero_grad()
        adamw.zero_grad()
        _loss(model, batch).backward()
        before = {p: muon.state[p]["momentum_buffer"].clone() for p in hidden if p in muon.state}
        for p in hidden:
            shadow.setdefault(p, torch.zeros_like(p)).lerp_(p.grad, 1 - MUON["momentum"])
        muon.step()
        adamw.step()
        if name != "fp32":
            drift = norm = err = change = 0.0
            kind, rounding, block, *cols = name.split("-") if "-" in name else [None] * 3
            for p in hidden:
                buf = muon.state[p]["momentum_buffer"]
                prev = before.get(p, torch.zeros_like(buf))
                if name == "bf16":
                    r = buf.bfloat16().float()
                elif name == "zerokern":
                    r = lowbit_momentum.decode_rows(*lowbit_momentum.encode_rows(buf))
                else:
                    r = codec(buf, kind, rounding, int(block), gen, columns=cols == ["cols"])
                drift += (r - shadow[p]).square().sum().item()
                norm += shadow[p].square().sum().item()
                err += (r - buf).square().sum().item()
                change += (buf - prev).square().sum().item()
                buf.copy_(r)
            stats.append(((drift / max(norm, 1e-30)) ** 0.5, (err / max(change, 1e-30)) ** 0.5))
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            with torch.no_grad():
                curve.append((step + 1, sum(_loss(model, b).item() for b in evs) / len(evs)))
    return curve, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--schedule", type=int, default=300, help="the lr schedule's length (muon_loss.py --steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--codecs", nargs="+", default=["zerokern", "dynamic-nearest-256", "dynamic-stochastic-256",
                                                    "dynamic-nearest-64", "linear-nearest-256"])
    ap.add_argument("--baseline", help="a muon_loss.py results file whose one-process curves (same model, data and "
                    "schedule) stand for the fp32 run here")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    for seed in args.seeds:
        if args.baseline:
            with open(args.baseline) as f:
                base = json.load(f)["runs"][str(seed)]["torch_one_process"][: args.steps // EVAL_EVERY]
        else:
            base, _ = run(seed, args.steps, args.schedule, args.eval_batches, "fp32")
        out[seed] = {"fp32": base}
        print(f"seed {seed} fp32: " + " ".join(f"{s}:{v:.4f}" for s, v in base), flush=True)
        for name in args.codecs:
            curve, stats = run(seed, args.steps, args.schedule, args.eval_batches, name)
            out[seed][name] = {"curve": curve, "stats": stats}
            diffs = " ".join(f"{s}:{100 * (v - b) / b:+.2f}%" for (s, v), (_, b) in zip(curve, base))
            early, late = stats[: len(stats) // 4], stats[len(stats) // 4:]
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            print(f"seed {seed} {name}: {diffs}; err/change {mean([e for _, e in early]):.3f} (first quarter) "
                  f"{mean([e for _, e in late]):.3f} (rest); drift {mean([d for d, _ in late]):.4f} (after the first "
                  "quarter)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
