"""Does Muon over shards train as one process does? bench/lowbit_loss.py's byte-level GPT on real
text, Muon on the 2-D hidden weights and AdamW on the rest: zerokern.ZeroOptimizer at stage 2 on
2 gloo ranks against torch.optim.Muon + torch.optim.AdamW on one process (issue 51, "Real text").

    python bench/muon_loss.py --steps 300 --seeds 0 1 --json bench/results/muon_loss_int8_cpu_<date>.json

Both runs start from the same weights and see the same 32 sequences a step (2 ranks x 16, or 32 on
one process), lowbit_loss's schedule (30 steps of warmup, cosine to a tenth), its text and its
eval batches. Muon: lr 0.02 at the peak, momentum 0.95, nesterov, weight decay 0.01 (torch's
adjust_lr_fn default); AdamW: lr 1e-3 at the peak, weight decay 0.01. Muon groups: every 2-D
weight inside a block (attention in/out projections, MLP matrices); AdamW: the tied embedding,
the position table, norms and biases. Reported: eval loss every 25 steps, the final one, and the
2-rank run's against the one-process run's in %. The same zerokern run with the Muon momentum in
int8 blocks ("state_precision": "int8" in the Muon group: [Note: int8 momentum of whole matrices]
in zerokern/optim/lowbit_momentum.py) is a row beside it, with the Muon momentum's bytes on the
ranks (summed) in both.
"""

import argparse
import json
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
from lowbit_loss import BATCH, CTX, EVAL_EVERY, GPT, _loss, _lr, corpus  # noqa: E402

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAMW = dict(lr=1e-3, weight_decay=0.01)
PEAK = 1e-3  # _lr's peak: each group's lr is its own peak x _lr(step) / PEAK


def hidden_and_rest(model):
    """(Muon's params, AdamW's): the 2-D weights inside the blocks, and everything else."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
    return hidden, rest


def _data(seed, steps, eval_batches, world):
    data = corpus()
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    g = torch.Generator().manual_seed(1 + seed)
    starts = torch.randint(0, len(train) - CTX - 1, (steps, world * BATCH), generator=g)
    ev = torch.randint(0, len(held) - CTX - 1, (eval_batches, BATCH), generator=g)
    return train, starts, [torch.stack([held[s:s + CTX + 1] for s in row]) for row in ev]


def _train(model, opts, groups, train, starts, rows, eval_batches, steps, bases):
    """steps optimizer steps on the rows `rows` of each step's batch; the eval curve."""
    curve = []
    for step in range(steps):
        scale = _lr(step, steps) / PEAK
        for g, base in zip(groups, bases):
            g["lr"] = base * scale
        batch = torch.stack([train[s:s + CTX + 1] for s in starts[step][rows]])
        for o in opts:
            o.zero_grad()
        _loss(model, batch).backward()
        for o in opts:
            o.step()
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            with torch.no_grad():
                curve.append((step + 1, sum(_loss(model, b).item() for b in eval_batches) / len(eval_batches)))
    return curve


def one_process(seed, steps, eval_batches):
    torch.set_num_threads(1)
    train, starts, evs = _data(seed, steps, eval_batches, 2)
    torch.manual_seed(seed)
    model = GPT()
    hidden, rest = hidden_and_rest(model)
    muon, adamw = torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)
    groups = [muon.param_groups[0], adamw.param_groups[0]]
    return _train(model, [muon, adamw], groups, train, starts, slice(0, 2 * BATCH), evs, steps,
                  [MUON["lr"], ADAMW["lr"]])


def _rank(rank, world, tmp, seed, steps, eval_batches, out, precision):
    import zerokern

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    train, starts, evs = _data(seed, steps, eval_batches, world)
    torch.manual_seed(seed)
    model = GPT()
    hidden, rest = hidden_and_rest(model)
    opt = zerokern.ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, "state_precision": precision,
                                   **MUON}, {"params": rest}], torch.optim.AdamW, zero_stage=2, **ADAMW)
    curve = _train(model, [opt], opt.param_groups, train, starts, slice(rank * BATCH, (rank + 1) * BATCH), evs,
                   steps, [MUON["lr"], ADAMW["lr"]])
    momentum = sum(v.numel() * v.element_size() for p in hidden for v in opt.state[p].values())
    counts = torch.tensor([float(opt.matrices_stepped), float(momentum)], dtype=torch.float64)
    dist.all_reduce(counts)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"curve": curve, "matrices_stepped": int(counts[0]), "matrices": len(hidden),
                       "momentum_bytes": int(counts[1]), "momentum_elements": sum(p.numel() for p in hidden)}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"],
                    help="the Muon momentum's state_precision in the zerokern runs")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    load = [os.getloadavg()]
    runs = {}
    for seed in args.seeds:
        zks = {}
        for precision in args.precisions:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "zk.json")
                mp.start_processes(_rank, args=(2, tmp, seed, args.steps, args.eval_batches, out, precision),
                                   nprocs=2, start_method="spawn")
                with open(out) as f:
                    zks[precision] = json.load(f)
        one = one_process(seed, args.steps, args.eval_batches)
        b = one[-1][1]
        runs[seed] = {"torch_one_process": one, "final": {"one_process": b}}
        for precision, zk in zks.items():
            a = zk["curve"][-1][1]
            tag = "" if precision == "fp32" else f"_{precision}"  # the fp32 keys as the first version wrote them
            runs[seed].update({f"zerokern{tag}_stage2_2ranks": zk["curve"], f"diff_pct{tag}": 100 * (a - b) / b,
                               f"matrices_stepped{tag}": zk["matrices_stepped"],
                               f"momentum_bytes{tag}": zk["momentum_bytes"]})
            runs[seed]["final"][f"zerokern{tag}"] = a
            runs[seed]["expected_stepped"] = zk["matrices"] * args.steps
            runs[seed]["momentum_elements"] = zk["momentum_elements"]
            print(f"seed {seed}: eval loss after {args.steps} steps: zerokern stage 2, 2 ranks, {precision} momentum "
                  f"{a:.4f}; one process {b:.4f}; {100 * (a - b) / b:+.3f}%; NS runs {zk['matrices_stepped']} "
                  f"(= {zk['matrices']} matrices x {args.steps} steps: "
                  f"{zk['matrices_stepped'] == zk['matrices'] * args.steps}); Muon momentum {zk['momentum_bytes']:,} "
                  f"bytes for {zk['momentum_elements']:,} elements; load {os.getloadavg()[0]:.2f}", flush=True)
        load.append(os.getloadavg())
    result = {"machine": H.machine_info("cpu"), "loadavg": load, "steps": args.steps, "world": 2,
              "batch_per_rank": BATCH, "context": CTX, "muon": MUON, "adamw": ADAMW, "model": "lowbit_loss.GPT "
              "(d 128, 4 layers, 4 heads, vocab 256)", "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
