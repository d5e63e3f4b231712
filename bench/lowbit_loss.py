"""Does low-bit state train as well? A small GPT on real text, 2 ranks, fp32 AdamW against each option.

    python bench/lowbit_loss.py                       # 300 steps per run, about 10 minutes on 2 CPU cores
    python bench/lowbit_loss.py --steps 40            # a quick look
    python bench/lowbit_loss.py --json out.json --plot out.png

Text: the Python standard library's own sources (every machine has them), as bytes (vocab 256);
the last 10% of the bytes are held out for the eval loss. Model: a 4-layer GPT (d 128, 4 heads,
context 64). Every run starts from the same weights and sees the same batches, 2 gloo ranks x 16
sequences, lr 1e-3 after 30 steps of warmup, cosine-decayed to 1e-4 at the end, weight decay 0.01,
stage 2 (sharded state).
Runs:
  fp32 adamw           torch.optim.AdamW under DDP, fp32 params: the reference
  fp32 int8-state      FusedZeroAdam(state_precision="int8"), fp32 params
  fp32 torchao AdamW8bit  torchao.optim.AdamW8bit under DDP, fp32 params (the peer; skipped if not installed)
  bf16 masters         FusedZeroAdam, bf16 params with fp32 masters and moments (bf16 compute's own cost)
  bf16 masters int8    ... and int8 moments
  bf16 sr              FusedZeroAdam(master_weights=False): bf16 params, stochastic rounding, fp32 moments
  bf16 sr int8         ... and int8 moments: about 6 bytes per param in all
  bf16 rn (control)    torch.optim.AdamW under DDP on bf16 params: no master, round to nearest
  fp32 zero2           FusedZeroAdam stage 2, fp32 params: the unquantized run of the wire rows
  fp32 reduce int8     ... with reduce_precision="int8" (grads reduced as int8 blocks, error feedback)
  fp32 reduce int4     ... "int4"
  fp32 reduce int8 no-EF / int4 no-EF   ... without error feedback (ZEROKERN_ERROR_FEEDBACK=0): the control
Reported: the eval loss every 25 steps and at the end, each run's final eval loss against fp32 AdamW's.
"""

import argparse
import glob
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

RUNS = ["fp32 adamw", "fp32 int8-state", "fp32 torchao AdamW8bit", "bf16 masters", "bf16 masters int8", "bf16 sr",
        "bf16 sr int8", "bf16 rn (control)"]
WIRE_RUNS = ["fp32 zero2", "fp32 reduce int8", "fp32 reduce int4", "fp32 reduce int8 no-EF", "fp32 reduce int4 no-EF"]
CTX, BATCH, EVAL_EVERY = 64, 16, 25


def corpus(limit=3_000_000):
    """The standard library's .py files, as one byte tensor (sorted, so the same on every machine
    with this Python), at most `limit` bytes."""
    root = os.path.dirname(os.__file__)
    out, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8).long()


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, d=128, layers=4, heads=4):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, d), torch.nn.Parameter(torch.randn(CTX, d) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.register_buffer("mask", torch.triu(torch.full((CTX, CTX), float("-inf")), 1), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        mask = self.mask[: idx.shape[1], : idx.shape[1]].to(x.dtype)
        for b in self.blocks:
            x = b(x, mask)
        return self.ln(x) @ self.tok.weight.t()  # tied head


def _lr(step, steps, peak=1e-3, warmup=30):
    """Linear warmup, then cosine decay to a tenth of the peak at the last step: the final loss is
    then a settled one (at a constant 2e-3 each optimizer, fp32 AdamW included, had loss spikes in
    some runs, and the last eval said more about when a spike came than about the optimizer)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - 1 - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _loss(model, batch):
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))


def _build(name, world, seed):
    import zerokern

    torch.manual_seed(seed)
    model = GPT()
    if name.startswith("bf16"):
        model = model.to(torch.bfloat16)
    if name in ("fp32 adamw", "bf16 rn (control)", "fp32 torchao AdamW8bit"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if name == "fp32 torchao AdamW8bit":
            import torchao.optim
            return ddp, torchao.optim.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.01)
        return ddp, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    options = {"fp32 int8-state": dict(state_precision="int8"), "bf16 masters": {},
               "bf16 masters int8": dict(state_precision="int8"), "bf16 sr": dict(master_weights=False),
               "bf16 sr int8": dict(master_weights=False, state_precision="int8"), "fp32 zero2": {},
               "fp32 reduce int8": dict(reduce_precision="int8"), "fp32 reduce int4": dict(reduce_precision="int4"),
               "fp32 reduce int8 no-EF": dict(reduce_precision="int8"),
               "fp32 reduce int4 no-EF": dict(reduce_precision="int4")}[name]
    os.environ["ZEROKERN_ERROR_FEEDBACK"] = "0" if name.endswith("no-EF") else "1"  # read when the buckets are made
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3, weight_decay=0.01, zero_stage=2, **options)
    return model, opt


def _rank(rank, world, tmp, args, out_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data = corpus()
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    g = torch.Generator().manual_seed(1 + args.seed)
    starts = torch.randint(0, len(train) - CTX - 1, (args.steps, world * BATCH), generator=g)
    ev = torch.randint(0, len(held) - CTX - 1, (args.eval_batches, BATCH), generator=g)
    eval_batches = [torch.stack([held[s:s + CTX + 1] for s in row]) for row in ev]
    curves = {}
    for name in args.runs:
        if name == "fp32 torchao AdamW8bit":
            try:
                import torchao.optim  # noqa: F401
            except ImportError:
                continue
        model, opt = _build(name, world, args.seed)
        curve = []

        def evaluate():
            with torch.no_grad():
                return sum(_loss(model, b).item() for b in eval_batches) / len(eval_batches)

        for step in range(args.steps):
            for group in opt.param_groups:
                lr = _lr(step, args.steps)
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)  # torchao keeps lr as a tensor and refuses a number
                else:
                    group["lr"] = lr
            rows = starts[step][rank * BATCH:(rank + 1) * BATCH]
            batch = torch.stack([train[s:s + CTX + 1] for s in rows])
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
            if (step + 1) % EVAL_EVERY == 0 or step + 1 == args.steps:
                curve.append((step + 1, evaluate()))
        curves[name] = curve
        if rank == 0:
            print(f"{name:20s} eval loss {curve[-1][1]:.4f}", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(curves, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated; 'wire' = fp32 adamw and the quantized-reduction rows: " + ", ".join(WIRE_RUNS))
    ap.add_argument("--seed", type=int, default=0, help="the initial weights and the batches")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    args.runs = ["fp32 adamw"] + WIRE_RUNS if args.runs == "wire" else args.runs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "curves.json")
        mp.start_processes(_rank, args=(2, tmp, args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            curves = json.load(f)
    ref = curves.get("fp32 adamw", [[0, math.nan]])[-1][1]
    final = {name: c[-1][1] for name, c in curves.items()}
    print(f"\nfinal eval loss after {args.steps} steps (fp32 AdamW {ref:.4f}):")
    for name, v in final.items():
        print(f"  {name:20s} {v:.4f}  {100 * (v - ref) / ref:+.2f}% vs fp32 AdamW")
    result = {"machine": H.machine_info("cpu"), "steps": args.steps, "seed": args.seed, "world": 2,
              "batch_per_rank": BATCH,
              "context": CTX, "curves": curves, "final": final,
              "vs_fp32_adamw_pct": {n: 100 * (v - ref) / ref for n, v in final.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, c in curves.items():
            ax.plot([s for s, _ in c], [v for _, v in c], label=name, ls="--" if "control" in name else "-")
        ax.set_xlabel("step")
        ax.set_ylabel("eval loss (held-out stdlib bytes)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
    return result


if __name__ == "__main__":
    main()
