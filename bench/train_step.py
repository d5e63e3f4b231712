"""Whole training steps (forward, backward, optimizer step) of a GPT-shaped model
on N ranks, zerokern against its peers side by side in one run, interleaved.

    python bench/train_step.py [--world 2] [--rounds 12] [--dtypes fp32,bf16]
                               [--json out.json] [--plot out.png]

Variants (each rank builds all of them from the same initial weights and feeds
them the same batches):
  zerokern-s1, zerokern-s2   FusedZeroAdam(zero_stage=1 / 2); bf16: bf16 params, fp32 masters
  zerokern-s2+gather         zerokern.shard on each block and the root, stage 2, overlap_param_gather=True:
                             step() leaves the param all-gathers to the next forward
  zerokern-s3                zerokern.shard(stage=3) on each block and the root: params sharded too,
                             gathered unit by unit with prefetch (FSDP2's shape)
  zerokern-s3-nocheck        the same with the collective check off (ZEROKERN_CHECK_COLLECTIVES=0)
  ddp+adamw-fused            DistributedDataParallel(gradient_as_bucket_view=True) + AdamW(fused=True);
                             bf16: fp32 params under autocast(bf16)
  zero-redundancy            DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW(fused=True))
  fsdp2                      fully_shard on each block and the root + AdamW;
                             bf16: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
  deepspeed-zero2, -zero3    deepspeed.initialize with ZeRO stage 2 / 3 (when deepspeed is installed)
Every variant uses lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01.

Timing: each round gives every variant a turn, the order rotated per round. A
turn starts at a barrier, runs one untimed step, then --steps-per-turn steps on
the round's batch, timed on rank 0 from the end of the untimed step to the end
of the last timed one, divided by their number. No barrier closes the timed
steps: gloo's barrier waits for every collective still queued, so a trailing
barrier would add the last step's param gathers to zerokern-s2+gather's time,
which a training loop hides behind its next forward; each timed forward meets
what the step before it left running, as in a loop, and every variant's
collectives keep the ranks in step. What the last step leaves running is
finished, untimed, before the next turn. Reported: median and 25th/75th percentiles. The
loss after the last round is averaged over ranks; the variants must agree (same
data, same initial weights, same hyper-parameters).

Memory (per rank): for zerokern, the optimizer's own counters (memory_report()
after backward, and the peak of the stage-2 buffer pool during backward: every
full gradient buffer of a stage-2 bucket comes from that pool, so its peak is
exact), next to zerokern.plan's prediction for the same model, world size,
dtype and bucket size; at stage 3 also the peak of the gathered full params
(the runtime counts every full buffer it allocates and frees) against the
planner's working set (root unit + 2 blocks). For the peers, the bytes of the tensors Python can see
after backward: unique storages of params (local shards for FSDP2), of .grad
(DDP's grads are views of its buckets), and of the optimizer state. Buffers a
peer keeps in C++ only (FSDP2's reduce-scatter buffers, DeepSpeed's partitions)
are not visible this way and are left out (reported as None where nothing can
be seen). On a GPU, torch.cuda.max_memory_allocated() per variant is reported too.

--collectives times gloo's all_reduce, reduce_scatter and all_gather of the
model's gradient size, which is what [Note: the collective for the backend]
in zerokern/zero/comm/base.py rests on.
"""

import argparse
import contextlib
import copy
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _harness as H  # noqa: E402
from train_gpt import GPT, markov_batches  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _storages_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)  # DTensor: this rank's shard
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a placeholder without storage
            continue
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _state_tensors(opt):
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer wraps the local AdamW
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


class Variant:
    """One way to train: a model, its optimizer, and a step()."""

    def __init__(self, name, model, opt, autocast=False, engine=None):
        self.name, self.model, self.opt, self.autocast, self.engine = name, model, opt, autocast, engine
        self.loss = None
        self.mem = {}

    def step(self, x, y, measure=False):
        ctx = torch.autocast("cpu" if x.device.type == "cpu" else "cuda", dtype=torch.bfloat16) \
            if self.autocast else contextlib.nullcontext()
        with ctx:
            logits = (self.engine or self.model)(x)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        if self.engine is not None:
            self.engine.backward(loss)
            if measure:
                self._measure()
            self.engine.step()
        else:
            loss.backward()
            if measure:
                self._measure()
            self.opt.step()
            self.opt.zero_grad()
        self.loss = loss.detach()

    def finish(self):
        if hasattr(self.opt, "finish_param_gather"):
            self.opt.finish_param_gather()

    def _measure(self):
        from zerokern import FusedZeroAdam

        if isinstance(self.opt, FusedZeroAdam):
            rep = self.opt.memory_report()
            self.mem = {"params": rep["params"], "grads": rep["grads"], "grad_buffers_peak": self.opt.schedule.pool.peak_bytes,
                        "optimizer_state": rep["master_params"] + rep["adam_state"], "method": "optimizer counters",
                        "gathered_peak": self.opt.stage3.peak_bytes if self.opt.stage3 is not None else 0}
            return
        if self.engine is not None:
            self.mem = {"params": _storages_bytes(list(self.model.parameters())), "grads": None,
                        "optimizer_state": None, "method": "params only (DeepSpeed keeps the rest in C++ buffers)"}
            return
        params = list(self.model.parameters())
        self.mem = {"params": _storages_bytes(params), "grads": _storages_bytes([p.grad for p in params]),
                    "optimizer_state": _storages_bytes(_state_tensors(self.opt)), "method": "visible tensors"}


@contextlib.contextmanager
def _env(values):
    kept = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build(kind, base, dtype, device, world, cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = copy.deepcopy(base).to(device)
    bf16 = dtype == "bf16"
    if kind.startswith("zerokern"):
        import zerokern

        if bf16:
            model = model.to(torch.bfloat16)
        if kind == "zerokern-s2+gather":
            for blk in model.blocks:
                zerokern.shard(blk, stage=2, bucket_cap_mb=cap_mb, overlap_param_gather=True)
            zerokern.shard(model, stage=2, bucket_cap_mb=cap_mb, overlap_param_gather=True)
            return Variant(kind, model, zerokern.FusedZeroAdam(model.parameters(), **HYPER))
        if kind in ("zerokern-s3", "zerokern-s3-nocheck"):
            # -nocheck: its Comms are made without the collective check (ZEROKERN_CHECK_COLLECTIVES=0
            # while it is built), so the check's cost shows side by side with zerokern-s3
            off = {"ZEROKERN_CHECK_COLLECTIVES": "0"} if kind.endswith("nocheck") else {}
            with _env(off):
                for blk in model.blocks:
                    zerokern.shard(blk, stage=3, bucket_cap_mb=cap_mb)
                zerokern.shard(model, stage=3, bucket_cap_mb=cap_mb)
                return Variant(kind, model, zerokern.FusedZeroAdam(model.parameters(), **HYPER))
        opt = zerokern.FusedZeroAdam(model.parameters(), zero_stage=int(kind[-1]), bucket_cap_mb=cap_mb, **HYPER)
        return Variant(kind, model, opt)
    if kind == "ddp+adamw-fused":
        ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)
        return Variant(kind, ddp, torch.optim.AdamW(ddp.parameters(), fused=True, **HYPER), autocast=bf16)
    if kind == "zero-redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=cap_mb)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **HYPER)
        return Variant(kind, ddp, opt, autocast=bf16)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return Variant(kind, model, torch.optim.AdamW(model.parameters(), **HYPER))
    if kind in ("deepspeed-zero2", "deepspeed-zero3"):
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": int(kind[-1]), "reduce_bucket_size": int(cap_mb * 2**20 / 4),
                                     "overlap_comm": True, "contiguous_gradients": True},
               "optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"], "betas": list(HYPER["betas"]),
                                                         "eps": HYPER["eps"], "weight_decay": HYPER["weight_decay"]}},
               "gradient_clipping": 0.0, "bf16": {"enabled": bf16}, "steps_per_print": 10**9,
               "wall_clock_breakdown": False}
        engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return Variant(kind, model, opt, engine=engine)
    raise ValueError(kind)


def available(kinds):
    out = []
    for k in kinds:
        if k.startswith("deepspeed"):
            try:
                import deepspeed  # noqa: F401
            except Exception as e:  # noqa: BLE001  any import failure means: not in this run
                print(f"skipping {k}: {type(e).__name__}: {e}")
                continue
        out.append(k)
    return out


def collectives(rank, world, numel, rounds):
    """Seconds of gloo's collectives on a buffer of `numel` fp32 elements."""
    from zerokern.zero.comm.factory import make_comm

    comm = make_comm()
    full = torch.randn(numel)
    shard = torch.empty(numel // world)
    gathered = torch.randn(shard.numel() * world)
    own = slice(rank * shard.numel(), (rank + 1) * shard.numel())
    fns = {"all_reduce": lambda: dist.all_reduce(full),
           "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full[:shard.numel() * world]),
           "all_gather": lambda: dist.all_gather_into_tensor(full[:shard.numel() * world], shard),
           # what zerokern does on gloo ([Note: the collective for the backend] in zerokern/zero/comm/gloo.py)
           "all_gather_as_broadcasts": lambda: comm.wait(comm.all_gather(gathered, gathered[own])),
           "reduce_scatter_as_exchange" if world == 2 else "reduce_scatter_zerokern":
               lambda: comm.wait(comm.reduce_scatter(shard, full[:shard.numel() * world]))}
    times = {k: [] for k in fns}
    for r in range(rounds + 1):
        for k in fns:
            dist.barrier()
            t0 = time.perf_counter()
            fns[k]()
            dist.barrier()
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: H.summary(v) for k, v in times.items()}


def worker(rank, world, init, args, out):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.d_model, args.heads, args.layers, args.ctx)
    numel = sum(p.numel() for p in base.parameters())
    per = args.batch
    batches = [(x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device))
               for x, y in markov_batches(args.vocab, args.ctx, per * world, args.rounds + 1, seed=1)]
    result = {"numel": numel, "rows": []}
    if args.collectives:
        result["collectives"] = collectives(rank, world, numel, args.rounds)
    kinds = available(args.variants.split(","))
    for dtype in args.dtypes.split(","):
        variants = [build(k, base, dtype, device, world, args.bucket_cap_mb) for k in kinds]
        times = {v.name: [] for v in variants}
        peak = {}
        for r, (x, y) in enumerate(batches):
            shift = r % len(variants)
            for v in variants[shift:] + variants[:shift]:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                dist.barrier()
                v.step(x, y)  # leaves running what a training loop's next step meets
                H.sync(device)
                t0 = time.perf_counter()
                for k in range(args.steps_per_turn):
                    v.step(x, y, measure=r == 1 and k == 0)
                H.sync(device)
                if r:  # round 0 warms up
                    times[v.name].append((time.perf_counter() - t0) / args.steps_per_turn)
                v.finish()  # untimed: nothing runs on into the next variant's turn
                dist.barrier()
                if device.type == "cuda" and r == 1:
                    peak[v.name] = torch.cuda.max_memory_allocated()
            if r == 0:
                for v in variants:
                    if v.name.startswith("zerokern"):
                        v.opt.schedule.pool.reset_peak()
                        if v.opt.stage3 is not None:
                            v.opt.stage3.reset_peak()
        for v in variants:
            loss = v.loss.float().clone()
            dist.all_reduce(loss)
            row = {"variant": v.name, "dtype": dtype, **H.summary(times[v.name]), "loss": loss.item() / world,
                   "memory": v.mem}
            if v.name in peak:
                row["cuda_max_memory_allocated"] = peak[v.name]
            if v.name.startswith("zerokern"):
                from zerokern.plan import plan

                largest = max(p.numel() for p in base.parameters())
                block = sum(p.numel() for p in base.blocks[0].parameters())
                st = plan(numel, dp=world, dtype=dtype, bucket_cap_mb=args.bucket_cap_mb, largest_param=largest,
                          unit_params=block, root_params=numel - len(base.blocks) * block).stages[v.opt.zero_stage]
                row["planner"] = {"grads": st.grads_bytes, "buffers": st.buffers_bytes,
                                  "optimizer_state": st.master_bytes + st.adam_bytes,
                                  "params": st.params_bytes, "gathered": st.gathered_bytes}
            result["rows"].append(row)
        del variants
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps-per-turn", type=int, default=2, help="timed steps per variant and round")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--variants", default="zerokern-s1,zerokern-s2,zerokern-s2+gather,ddp+adamw-fused,"
                                          "zero-redundancy,fsdp2,deepspeed-zero2,zerokern-s3,deepspeed-zero3")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--bucket-cap-mb", type=float, default=4.0)
    ap.add_argument("--collectives", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    args.port = H.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.start_processes(worker, args=(args.world, f"file://{tmp}/store", args, out), nprocs=args.world,
                           start_method="spawn")
        result = torch.load(out, weights_only=False)
    info = H.machine_info(args.device)
    info.update(world=args.world, threads_per_rank=args.threads, params=result["numel"],
                model=f"GPT d={args.d_model} layers={args.layers} heads={args.heads} vocab={args.vocab} "
                      f"ctx={args.ctx}, batch {args.batch} per rank", bucket_cap_mb=args.bucket_cap_mb,
                steps_per_turn=args.steps_per_turn)
    rows = result["rows"]
    mib = lambda b: None if b is None else round(b / 2**20, 2)  # noqa: E731
    for dtype in args.dtypes.split(","):
        sub = [r for r in rows if r["dtype"] == dtype]
        ddp = next((r["median_ms"] for r in sub if r["variant"] == "ddp+adamw-fused"), None)
        print(f"\n{dtype}: {result['numel']:,} params, {args.world} ranks x {args.threads} thread(s)")
        table = []
        for r in sub:
            m, p = r["memory"], r.get("planner")
            table.append({"variant": r["variant"], "median ms": f"{r['median_ms']:.1f}",
                          "p25-p75": f"{r['p25_ms']:.1f}-{r['p75_ms']:.1f}",
                          "x DDP": f"{ddp / r['median_ms']:.2f}" if ddp else "-", "loss": f"{r['loss']:.4f}",
                          "grads MiB": mib(m.get("grads")), "buffers peak MiB": mib(m.get("grad_buffers_peak")),
                          "opt state MiB": mib(m.get("optimizer_state")),
                          "params+gathered peak MiB": mib(m["params"] + m["gathered_peak"]) if "gathered_peak" in m
                          else mib(m.get("params")),
                          "planner params+gathered MiB": mib(p["params"] + p["gathered"]) if p else "-",
                          "planner grads+buffers MiB": mib(p["grads"] + p["buffers"]) if p else "-",
                          "planner opt MiB": mib(p["optimizer_state"]) if p else "-"})
        H.print_table(table, [(k, k, "{}") for k in table[0]])
    if "collectives" in result:
        print("\ncollectives on the gradient size:", {k: round(v["median_ms"], 1) for k, v in result["collectives"].items()})
    if args.json:
        H.write_json(args.json, info, {"steps": rows, "collectives": result.get("collectives")})
    if args.plot:
        _plot(args.plot, rows, info)


def _plot(path, rows, info):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        sub = [r for r in rows if r["dtype"] == dt]
        names = [r["variant"] for r in sub]
        med = [r["median_ms"] for r in sub]
        err = [[m - r["p25_ms"] for m, r in zip(med, sub)], [r["p75_ms"] - m for m, r in zip(med, sub)]]
        ax.barh(names, med, xerr=err, color=["tab:green" if n.startswith("zerokern") else "tab:gray" for n in names])
        ax.set_xlabel("step time, ms (median, 25-75%)")
        ax.set_title(f"{dt}: {info['params']:,} params, {info['world']} ranks")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
