"""Muon over shards (issue 51): bytes, Newton-Schulz balance, checkpoint cost and step time of
zerokern.ZeroOptimizer(Muon + AdamW) at stage 2 against its peers, side by side in one run.

    python bench/muon_step.py --world 4 --json bench/results/muon_step_cpu_4r_<date>.json
    python bench/muon_step.py --world 2 --json bench/results/muon_step_cpu_2r_<date>.json

Model: bench/lowbit_loss.py's GPT with 12 layers (d --d, 4 heads, context 64, vocab 256, tied
head), fp32, --batch sequences per rank. Muon (lr 0.02, momentum 0.95, weight decay 0.01) on the
48 2-D weights inside the blocks, AdamW (lr 1e-3, weight decay 0.01) on the rest.

Variants (each rank builds every one from the same weights, feeds them the same batches):
  zerokern-muon        ZeroOptimizer([Muon group, AdamW group], AdamW, zero_stage=2)
  zerokern-muon-pieces the same, stepping each AdamW piece alone (as before optim/flat_runs.py; not by default)
  zerokern-muon-alone  the same, with one param gather a bucket (as before params/coalesced.py)
  zerokern-adamw       FusedZeroAdam(zero_stage=2) on every param: ZeRO-2 with AdamW, the bytes to match
  ddp-muon             DistributedDataParallel + torch.optim.Muon + torch.optim.AdamW: every rank runs every NS
  fsdp2-muon           fully_shard on each block and the root + torch.optim.Muon + AdamW (its error if any)
  deepspeed-zero2-muon deepspeed.initialize, ZeRO stage 2, optimizer "Muon" (params tagged use_muon)
A variant that cannot be built or fails its first step is recorded with its error and left out.

Measured:
- bytes per step (zerokern variants): every collective the optimizer's Comm launches in one step,
  counted at the Comm (zerokern's Comm keeps no byte counter of its own, so the bench wraps its
  reduce_scatter / all_gather / all_reduce / broadcast): the full buffer's bytes per collective,
  and the bytes a ring sends per rank ((N-1)/N of it for reduce-scatter and all-gather, 2(N-1)/N
  for all-reduce). Beside them, the layout's padded elements (padded_elements_seen): a bucket's
  reduction and gather each move its padded size, so the two variants' bytes differ by padding.
- Newton-Schulz: each rank's matrices (those whose momentum it holds whole) and their cost
  max(m,n) min(m,n)^2, max/mean over the ranks; opt.matrices_stepped summed over the ranks against
  48 per step.
- checkpoint: opt.state_dict() (zerokern-muon: the momentum gathered whole on every rank, one
  all-reduce) and dcp.save of it, timed, with the all-reduce's bytes; zerokern-adamw beside it.
- step time: rounds of one turn per variant, the order rotated per round; a turn is a barrier, one
  untimed step, --steps-per-turn timed steps, a barrier (the time is the slowest rank's); median and
  25th-75th percentiles over the rounds, and the machine's load average before and after.
- agreement (validate before timing): every variant's params after one step on the same batch,
  max difference from ddp-muon's (Muon's NS runs in bf16, so reduction order shows at ~1e-3 of lr).
"""

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402
from lowbit_loss import CTX, GPT, _loss  # noqa: E402

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAMW = dict(lr=1e-3, weight_decay=0.01)
KINDS = ["zerokern-muon", "zerokern-adamw", "ddp-muon", "fsdp2-muon", "deepspeed-zero2-muon"]


def hidden_and_rest(model):
    """(Muon's params, AdamW's): the 2-D weights inside the blocks, and the rest."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    return hidden, [p for p in model.parameters() if not any(p is q for q in hidden)]


class Bytes:
    """Counts what zerokern's Comm launches: {name: [calls, full-buffer bytes, ring bytes per rank]}.
    Wraps the Comm classes' public collectives once; a collective that calls another (a subclass's
    reduce_scatter handing over to the base's) is counted once, by the outermost call."""

    KINDS = {"reduce_scatter": ("input", 1), "all_gather": ("output", 1), "all_reduce": ("tensor", 2),
             "broadcast": ("tensor", 1)}

    def __init__(self):
        from zerokern.zero.comm import base, gloo

        self.counts, self._depth = {}, threading.local()
        for cls in (base.Comm, gloo.GlooComm):
            for method in self.KINDS:
                if method in vars(cls):
                    setattr(cls, method, self._wrap(method, vars(cls)[method]))

    def _wrap(self, method, fn):
        arg, ring = self.KINDS[method]

        def counted(comm, *args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and comm.world_size > 1:
                names = fn.__code__.co_varnames[1:fn.__code__.co_argcount]
                t = dict(zip(names, args), **kwargs)[arg]
                name = kwargs.get("name") or (args[names.index("name")] if "name" in names[:len(args)] else method)
                n = t.numel() * t.element_size()
                c = self.counts.setdefault(f"{method}:{name}", [0, 0, 0.0])
                c[0] += 1
                c[1] += n
                c[2] += n * ring * (comm.world_size - 1) / comm.world_size
            self._depth.n = depth + 1
            try:
                return fn(comm, *args, **kwargs)
            finally:
                self._depth.n = depth
        return counted

    def take(self):
        out, self.counts = self.counts, {}
        return out


class Variant:
    def __init__(self, name, model, opts, engine=None):
        self.name, self.model, self.opts, self.engine = name, model, opts, engine

    def step(self, batch):
        loss = _loss(self.engine or self.model, batch)
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss.backward()
            for o in self.opts:
                o.step()
            for o in self.opts:
                o.zero_grad()
        return loss.detach()


def build(kind, base, cap_mb):
    model = copy.deepcopy(base)
    hidden, rest = hidden_and_rest(model)
    if kind == "zerokern-muon":
        import zerokern

        opt = zerokern.ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, **MUON}, {"params": rest}],
                                     torch.optim.AdamW, zero_stage=2, bucket_cap_mb=cap_mb, **ADAMW)
        return Variant(kind, model, [opt])
    if kind == "zerokern-muon-pieces":  # the A/B of [Note: element-wise pieces as runs] in one run
        v = build("zerokern-muon", base, cap_mb)
        opt = v.opts[0]
        opt._runs = []  # private: every AdamW piece stepped alone, as before FlatRuns
        opt._one_by_one = [t for t in opt._piece if not (t in opt._whole and opt._where[t][2] == 0)]
        return Variant(kind, v.model, [opt])
    if kind == "zerokern-muon-alone":  # the A/B of [Note: coalesced param gathers] in one run
        from zerokern.zero.params import coalesced

        saved, coalesced.LIMIT_BYTES = coalesced.LIMIT_BYTES, 0  # read when the optimizer is built
        try:
            v = build("zerokern-muon", base, cap_mb)
            return Variant(kind, v.model, v.opts)
        finally:
            coalesced.LIMIT_BYTES = saved
    if kind == "zerokern-adamw":
        import zerokern

        return Variant(kind, model, [zerokern.FusedZeroAdam(model.parameters(), zero_stage=2, bucket_cap_mb=cap_mb,
                                                             **ADAMW)])
    if kind == "ddp-muon":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        return Variant(kind, ddp, [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)])
    if kind == "fsdp2-muon":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        hidden, rest = hidden_and_rest(model)  # fully_shard replaced the params by DTensors
        return Variant(kind, model, [torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)])
    if kind == "deepspeed-zero2-muon":
        import deepspeed

        for p in model.parameters():
            p.use_muon = any(p is q for q in hidden)
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 2, "reduce_bucket_size": int(cap_mb * 2**20 / 4),
                                     "overlap_comm": False, "contiguous_gradients": True},
               "optimizer": {"type": "Muon", "params": {"lr": ADAMW["lr"], "muon_lr": MUON["lr"],
                                                        "adam_lr": ADAMW["lr"], "momentum": MUON["momentum"],
                                                        "weight_decay": ADAMW["weight_decay"]}},
               "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
        with contextlib.redirect_stdout(sys.stderr):
            engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return Variant(kind, model, [opt], engine=engine)
    raise ValueError(kind)


def _owned(opt, hidden):
    """The matrices this rank steps: the ones whose momentum it holds whole (the others' is empty)."""
    return [p for p in hidden if opt.state[p].get("momentum_buffer", torch.empty(0)).numel()]


def _gathered(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _measure_bytes(v, counter, batch, world):
    """One step's collectives (after a warm-up step), and the layout's padded elements to check them by."""
    v.step(batch)
    counter.take()
    v.step(batch)
    counts = counter.take()
    opt = v.opts[0]
    padded = sum(s.bucket.plan.padded_numel for s in opt.stores)  # the layout's buckets, padding included
    return {"collectives": counts, "ring_bytes_per_rank": sum(c[2] for c in counts.values()),
            "buffer_bytes": sum(c[1] for c in counts.values()), "padded_elements_seen": padded}


def _checkpoint_cost(v, counter, tmp, rounds=3):
    """Seconds of opt.state_dict() and of dcp.save of it (median over rounds), and the bytes it sent."""
    import torch.distributed.checkpoint as dcp

    opt, sd_t, save_t = v.opts[0], [], []
    counter.take()
    for r in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        sd = opt.state_dict()
        dist.barrier()
        t1 = time.perf_counter()
        dcp.save({"optim": sd}, checkpoint_id=os.path.join(tmp, f"{v.name}-{r}"))
        dist.barrier()
        sd_t.append(t1 - t0)
        save_t.append(time.perf_counter() - t1)
    counts = counter.take()
    return {"state_dict": H.summary(sd_t), "dcp_save": H.summary(save_t),
            "state_dict_collectives": {k: c for k, c in counts.items() if "whole_state" in k or "state_dict" in k}}


def worker(rank, world, init, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    counter = Bytes()
    torch.manual_seed(0)
    base = GPT(d=args.d, layers=args.layers, heads=4)
    hidden_base, _ = hidden_and_rest(base)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (world * args.batch, CTX + 1), generator=g)[rank * args.batch:
                                                                                    (rank + 1) * args.batch]
               for _ in range(args.rounds + 1)]
    result = {"numel": sum(p.numel() for p in base.parameters()), "matrices": len(hidden_base), "errors": {},
              "rows": []}
    variants = []
    for kind in args.variants.split(","):
        try:
            v = build(kind, base, args.bucket_cap_mb)
            v.step(batches[0])  # its first step: validates it runs, and the agreement below
        except Exception as e:  # noqa: BLE001  recorded: the issue asks for the peers' errors
            result["errors"][kind] = f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
            if rank == 0:
                print(f"{kind}: {result['errors'][kind]}", flush=True)
            continue
        variants.append(v)
    # agreement: every variant took one step on batches[0] from the same weights
    ref = next((v for v in variants if v.name == "ddp-muon"), None)
    agree = {}
    if ref is not None:
        def full(v):
            return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in v.model.parameters()]
        want = full(ref)
        for v in variants:
            agree[v.name] = max((a - b).abs().max().item() for a, b in zip(full(v), want))
    by_name = {v.name: v for v in variants}
    zk = [by_name[k] for k in ("zerokern-muon", "zerokern-adamw") if k in by_name]
    for v in zk:
        result[v.name] = {"bytes": _measure_bytes(v, counter, batches[0], world)}
    if "zerokern-muon" in by_name:
        opt = by_name["zerokern-muon"].opts[0]
        hidden, _ = hidden_and_rest(by_name["zerokern-muon"].model)
        mine = _owned(opt, hidden)
        cost = sum(max(p.shape) * min(p.shape) ** 2 for p in mine)
        before = opt.matrices_stepped
        by_name["zerokern-muon"].step(batches[0])
        per_step = _gathered(opt.matrices_stepped - before)
        costs, counts = _gathered(cost), _gathered(len(mine))
        result["zerokern-muon"]["ns"] = {"cost_per_rank": costs, "matrices_per_rank": counts,
                                         "max_over_mean": max(costs) / (sum(costs) / world),
                                         "stepped_in_one_step_per_rank": per_step,
                                         "stepped_in_one_step": sum(per_step), "matrices": len(hidden)}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = _gathered(tmp)[0] if args.shared_tmp is None else args.shared_tmp
        for v in zk:
            result[v.name]["checkpoint"] = _checkpoint_cost(v, counter, tmp)
    times = {v.name: [] for v in variants}
    loads = [os.getloadavg()]
    for r, batch in enumerate(batches):
        shift = r % max(1, len(variants))
        for v in variants[shift:] + variants[:shift]:
            dist.barrier()
            v.step(batch)
            t0 = time.perf_counter()
            for _ in range(args.steps_per_turn):
                loss = v.step(batch)
            dist.barrier()
            if r:
                times[v.name].append((time.perf_counter() - t0) / args.steps_per_turn)
        loads.append(os.getloadavg())
    for v in variants:
        result["rows"].append({"variant": v.name, **H.summary(times[v.name]), "agreement_max_diff": agree.get(v.name)})
    result["loadavg"] = loads
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-per-turn", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.5)
    ap.add_argument("--variants", default=",".join(KINDS))
    ap.add_argument("--shared-tmp", help="where the checkpoints go (default: rank 0's temporary directory)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    args.port = H.free_port()
    load0 = os.getloadavg()
    res = H.run_ranks(worker, args.world, args)
    info = H.machine_info("cpu")
    print(f"\n{args.world} ranks, 12-layer GPT d {args.d} ({res['numel']:,} params, {res['matrices']} Muon matrices), "
          f"batch {args.batch} x {CTX} per rank, {args.threads} thread(s) per rank; load before {load0[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f}")
    for k in ("zerokern-muon", "zerokern-adamw"):
        if k in res:
            b, ck = res[k]["bytes"], res[k]["checkpoint"]
            print(f"  {k:22s} ring bytes per rank and step {b['ring_bytes_per_rank']:,.0f}  "
                  f"({', '.join(f'{n} x{c[0]}' for n, c in b['collectives'].items())})")
            print(f"  {k:22s} state_dict() {ck['state_dict']['median_ms']:.1f} ms, dcp.save "
                  f"{ck['dcp_save']['median_ms']:.1f} ms, collectives {ck['state_dict_collectives']}")
    if "zerokern-muon" in res and "zerokern-adamw" in res:
        a, b = res["zerokern-muon"]["bytes"]["ring_bytes_per_rank"], res["zerokern-adamw"]["bytes"]["ring_bytes_per_rank"]
        print(f"  Muon+AdamW / ZeRO-2 AdamW bytes: {a / b:.4f}")
    if "zerokern-muon" in res:
        ns = res["zerokern-muon"]["ns"]
        print(f"  NS cost per rank {ns['cost_per_rank']} max/mean {ns['max_over_mean']:.3f}; matrices per rank "
              f"{ns['matrices_per_rank']}; NS runs in one step {ns['stepped_in_one_step']} (matrices {ns['matrices']})")
    for k, e in res["errors"].items():
        print(f"  {k:22s} not run: {e}")
    for r in res["rows"]:
        print(f"  {r['variant']:22s} step {r['median_ms']:8.1f} ms  [{r['p25_ms']:.1f}, {r['p75_ms']:.1f}] n={r['n']}"
              f"  agreement vs ddp-muon after 1 step: {r['agreement_max_diff']}")
    res.update(machine=info, settings={k: v for k, v in vars(args).items() if k != "port"}, loadavg_before=load0,
               loadavg_after=os.getloadavg())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return res


if __name__ == "__main__":
    main()
