"""Bytes per rank of ZeroOptimizer(Muon + AdamW) on a bf16 GPT, with fp32 masters (the default)
and with master_weights=False ([Note: bf16 params without masters] in zerokern/optim/no_master.py).

    python bench/no_master_memory.py --worlds 1 2 --json bench/results/no_master_memory_<date>.json

Model: bench/lowbit_loss.py's GPT (--layers, d --d, 4 heads, context 64, vocab 256, tied head) in
bf16; Muon (lr 0.02, momentum 0.95) on the 2-D weights inside the blocks, AdamW (lr 1e-3) on the
rest, zero_stage=2, 0.5 MB buckets. Each rank takes --steps steps on its own batch, then counts
what it holds, read off the stores and the inner optimizers' state (not estimated):
- master: bytes of the stores' separate masters (fp32 copies of the bf16 param shards);
- muon_state / adamw_state: bytes of the inner torch optimizers' state tensors (momentum_buffer;
  exp_avg, exp_avg_sq, and the 4-byte 0-dim step per AdamW piece), on the params this rank steps;
- per element: each over the elements of those params this rank holds (Muon: the matrices it
  owns; AdamW: its shard of the rest).
Validated first: the loss after the steps is finite on every rank, and the two runs' params after
their first step differ (a master keeps updates the bf16 params round away).
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
from lowbit_loss import CTX, GPT, _loss  # noqa: E402

MUON = dict(lr=0.02, momentum=0.95)
ADAMW = dict(lr=1e-3)


def _count(opt, hidden):
    """(bytes and elements by kind) this rank holds."""
    is_hidden = {id(p) for p in hidden}
    out = {"master": sum(s.master.numel() * s.master.element_size() for s in opt.engine.stores if s.separate_master),
           "params_held": sum(s.param_shard().numel() for s in opt.engine.stores)}
    for kind in ("muon", "adamw"):
        out[f"{kind}_state"] = out[f"{kind}_elements"] = 0
    for t, p in enumerate(opt.engine.trainable):
        kind = "muon" if id(p) in is_hidden else "adamw"
        piece = opt._piece[t]
        out[f"{kind}_elements"] += piece.numel()
        out[f"{kind}_state"] += sum(v.numel() * v.element_size() for v in opt.inner.state[piece].values()
                                    if isinstance(v, torch.Tensor))
    return out


def worker(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import zerokern

    rows = []
    for master_weights in (True, False):
        torch.manual_seed(0)
        model = GPT(d=args.d, layers=args.layers).to(torch.bfloat16)
        hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
        rest = [p for p in model.parameters() if not any(p is q for q in hidden)]
        opt = zerokern.ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, **MUON},
                                      {"params": rest, **ADAMW}], torch.optim.AdamW, zero_stage=2,
                                     bucket_cap_mb=0.5, master_weights=master_weights)
        g = torch.Generator().manual_seed(100 + rank)
        first = None
        for step in range(args.steps):
            batch = torch.randint(0, 256, (2, CTX + 1), generator=g)
            opt.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            opt.step()
            if step == 0:
                first = [p.detach().float().clone() for p in model.parameters()]
        assert torch.isfinite(loss), f"rank {rank}: loss {loss.item()}"
        rows.append({"rank": rank, "world": world, "master_weights": master_weights, "loss": loss.item(),
                     "params_total": sum(p.numel() for p in model.parameters()), "matrices": len(hidden),
                     **_count(opt, hidden), "report": opt.memory_report(), "first": first})
        del opt
    a, b = rows[0].pop("first"), rows[1].pop("first")
    assert any(not torch.equal(x, y) for x, y in zip(a, b)), "with and without masters: the same params"
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([r for rs in gathered for r in rs], f)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(worker, args=(world, f"file://{tmp}/store", args, out), nprocs=world,
                               start_method="spawn")
            with open(out) as f:
                rows += json.load(f)
    table = []
    for r in rows:
        per = lambda k, n: r[k] / r[n] if r[n] else 0.0  # noqa: E731
        table.append({"ranks": r["world"], "rank": r["rank"], "masters": r["master_weights"],
                      "elements held": r["params_held"], "master B": r["master"],
                      "Muon state B": r["muon_state"], "AdamW state B": r["adamw_state"],
                      "master B/el": round(per("master", "params_held"), 3),
                      "Muon B/el": round(per("muon_state", "muon_elements"), 3),
                      "AdamW B/el": round(per("adamw_state", "adamw_elements"), 3),
                      "master+state B/el": round((r["master"] + r["muon_state"] + r["adamw_state"])
                                                 / r["params_held"], 3)})
    print(f"GPT d {args.d}, {args.layers} layers, {rows[0]['params_total']:,} params, "
          f"{rows[0]['matrices']} Muon matrices, bf16, stage 2")
    H.print_table(table, [(k, k, "{}") for k in table[0]])
    if args.json:
        H.write_json(args.json, H.machine_info("cpu"), rows, {"settings": vars(args)})


if __name__ == "__main__":
    main()
