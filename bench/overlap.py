"""How much of FusedZeroAdam's communication hides behind compute: the gradient
reductions behind backward, and the all-gather of updated params behind the next forward.

    python bench/overlap.py                      # 2 CPU ranks (gloo), simulated 1 GB/s link
    python bench/overlap.py --world 4 --bandwidth 2GB/s --json out.json
    python bench/overlap.py --stage 3 --bandwidth 0.1GB/s   # stage 3: gathers in forward and backward

N ranks (gloo on CPUs) train a synthetic MLP (each Linear a zerokern.shard unit)
with FusedZeroAdam in three configurations, taking turns (A B C A B C) so
machine noise hits all: reductions overlapped with backward and the gather
waited for in step() ("overlap"), the same with the gather left to the next
forward (overlap_param_gather=True, "overlap+gather"), and nothing overlapped
("no_overlap"). Each turn runs two training iterations and measures the
second, whose forward follows the first's step() as in a training loop. Each
rank reports per iteration: forward and backward time, the time its
reductions and its gathers take on the link, and the exposed part of each:
the time the host waits for them (at the end of backward, in step(), and for
the gathers also in the forward pre-hooks).

With --stage 3 the params are sharded too: every Linear's params are gathered for
its forward and again for its backward. Two configurations take turns: with the
next unit's gather prefetched ("s3-prefetch") and without ("s3-no-prefetch");
the exposed gather time is the host's wait for gathers in the forward and
backward hooks, against the link time of all of them.

The network is simulated, so overlap shows deterministically on one machine:
each collective really runs (gloo), and its completion is then delayed to when
a link of the given bandwidth and latency would have delivered it, one
collective at a time per rank (a ring moves (world-1)/world of the buffer).
Each configuration has its own link, and its gathers are finished before the
next configuration's turn, so no turn carries traffic into another.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zerokern  # noqa: E402
from zerokern import FusedZeroAdam  # noqa: E402
from zerokern.plan.cli import parse_bytes  # noqa: E402


class SimulatedLink:
    """One link per rank: collectives are serialised on it."""

    def __init__(self, bandwidth, latency):
        self.bandwidth, self.latency, self.free_at = bandwidth, latency, 0.0

    def schedule(self, nbytes):
        start = max(time.perf_counter(), self.free_at)
        self.free_at = start + self.latency + nbytes / self.bandwidth
        return self.free_at, self.free_at - start


class _DelayedWork:
    def __init__(self, work, done_at):
        self.work, self.done_at = work, done_at

    def wait(self):
        self.work.wait()
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return True


class SimComm:
    """Wraps zerokern's Comm: the same collectives, delivered at simulated link speed."""

    def __init__(self, comm, link):
        self.inner, self.link = comm, link
        self.world_size, self.rank, self.group, self.check = comm.world_size, comm.rank, comm.group, comm.check
        self.exchange_reduce, self.broadcast_gather = comm.exchange_reduce, comm.broadcast_gather
        self.wait_by_kind = {"grads": 0.0, "params": 0.0, "other": 0.0}
        self.link_time_by_kind = {"grads": 0.0, "params": 0.0, "other": 0.0}

    @property
    def distributed(self):
        return self.inner.distributed

    @property
    def prefers_all_reduce(self):
        return self.inner.prefers_all_reduce

    @property
    def dp_size(self):
        return self.inner.dp_size

    @property
    def leads(self):
        return self.inner.leads

    @property
    def shards(self):
        return self

    @property
    def wait_seconds(self):
        return sum(self.wait_by_kind.values())

    @staticmethod
    def _kind(name):
        return "grads" if name.startswith(("reduce_scatter", "all_reduce[")) else (
            "params" if name.startswith("all_gather") else "other")

    def _delay(self, work, tensor, name):
        nbytes = tensor.numel() * tensor.element_size() * (self.world_size - 1) / self.world_size
        done_at, duration = self.link.schedule(nbytes)
        self.link_time_by_kind[self._kind(name)] += duration
        w = _DelayedWork(work, done_at)
        w.kind = self._kind(name)
        return w

    def reduce_scatter(self, output, input, name="reduce_scatter", wire=None):
        return self._delay(self.inner.reduce_scatter(output, input, name, wire), input, name)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, name="all_reduce", across=None, wire=None):
        return self._delay(self.inner.all_reduce(tensor, op, name, across, wire), tensor, name)

    def all_gather(self, output, input, name="all_gather", wire=None):
        if wire is not None:  # the wire gathers its bytes through this Comm: the link carries those
            return wire.all_gather(self, output, input, name)
        return self._delay(self.inner.all_gather(output, input, name), output, name)

    def wait(self, work):
        t0 = time.perf_counter()
        work.wait()
        self.wait_by_kind[getattr(work, "kind", "other")] += time.perf_counter() - t0

    # set-up and agreement collectives: not what the simulated link is about, so at full speed
    def broadcast(self, tensor, src_rank=0, name="broadcast"):
        return self.inner.broadcast(tensor, src_rank, name)

    def broadcast_from_first(self, tensors, name="broadcast_params"):
        self.inner.broadcast_from_first(tensors, name)

    def differing(self, mine, what):
        return self.inner.differing(mine, what)

    def gather_objects(self, obj, name="gather_objects"):
        return self.inner.gather_objects(obj, name)


CONFIGS = {"overlap": (True, False), "overlap+gather": (True, True), "no_overlap": (False, False)}
CONFIGS_S3 = {"s3-prefetch": (True, True), "s3-no-prefetch": (True, False)}  # (overlap_comm, prefetch)


def build(args, overlap, gather, link):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    if args.stage == 3:  # its own group: each configuration gets its own stage-3 runtime (and prefetch switch)
        group = dist.new_group(list(range(dist.get_world_size())))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                zerokern.shard(m, stage=3, bucket_cap_mb=args.bucket_cap_mb, process_group=group)
        zerokern.shard(model, stage=3, process_group=group)  # the root (no params of its own)
    else:
        for m in model:
            if isinstance(m, torch.nn.Linear):
                zerokern.shard(m, stage=args.stage, overlap_comm=overlap, bucket_cap_mb=args.bucket_cap_mb,
                               overlap_param_gather=gather)
    opt = FusedZeroAdam(model.parameters(), lr=1e-4)
    sim = SimComm(opt.comm, link)
    # everything that holds the Comm
    for obj in [opt.engine, opt.schedule, opt.param_gather] + opt.schedule.buckets + opt.units:
        obj.comm = sim
    if opt.stage3 is not None:
        opt.stage3.prefetch = gather
        for up in opt.stage3.units:
            up.comm = sim
    return model, opt, sim


def iteration(model, opt, x):
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(x).square().mean()
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def worker(rank, world, args, store, out_path):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    configs = CONFIGS_S3 if args.stage == 3 else CONFIGS
    runs = {name: build(args, overlap, gather, SimulatedLink(args.bandwidth, args.latency))
            for name, (overlap, gather) in configs.items()}
    x = torch.randn(args.batch, args.hidden)
    stats = {name: [] for name in runs}
    for step in range(args.steps + 1):
        for name, (model, opt, sim) in runs.items():
            dist.barrier()
            iteration(model, opt, x)  # its step() launches the gathers the measured forward meets
            before = dict(sim.wait_by_kind), dict(sim.link_time_by_kind)
            fwd, bwd, stp = iteration(model, opt, x)
            after = dict(sim.wait_by_kind)  # the forward's waits are for the gathers of the turn's first step
            opt.finish_param_gather()  # nothing carries into the next turn
            if step == 0:
                continue  # warm-up
            wait = {k: after[k] - before[0][k] for k in before[0]}
            link_t = {k: sim.link_time_by_kind[k] - before[1][k] for k in before[1]}
            stats[name].append({"forward_s": fwd, "backward_s": bwd, "step_s": stp, "grad_comm_s": link_t["grads"],
                                "grad_exposed_s": wait["grads"], "param_comm_s": link_t["params"],
                                "param_exposed_s": wait["params"]})
    # backward compute alone (no reductions): the budget the communication can hide behind
    compute = []
    model, opt, _ = next(iter(runs.values()))
    for _ in range(args.steps):
        with opt.no_sync():
            loss = model(x).square().mean()
            t0 = time.perf_counter()
            loss.backward()
            compute.append(time.perf_counter() - t0)
    result = {"rank": rank, "compute_backward_s": statistics.median(compute),
              "buckets": len(next(iter(runs.values()))[1].schedule.buckets), "configs": list(configs)}
    for name, rows in stats.items():
        result[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        result[name]["param_exposed_max_s"] = max(r["param_exposed_s"] for r in rows)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--bandwidth", type=lambda t: parse_bytes(t, per_second=True), default=1e9,
                    help="simulated per-rank link bandwidth, e.g. 1GB/s")
    ap.add_argument("--latency", type=float, default=50e-6, help="seconds per collective")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.start_processes(worker, args=(args.world, args, os.path.join(tmp, "store"), out), nprocs=args.world,
                           start_method="spawn")
        ranks = [json.load(open(f"{out}.{r}")) for r in range(args.world)]
    ms = lambda s: f"{s * 1e3:8.2f}"  # noqa: E731
    print(f"{args.world} ranks, {args.layers} x Linear({args.hidden}), batch {args.batch}, ZeRO-{args.stage}, "
          f"{ranks[0]['buckets']} buckets of <= {args.bucket_cap_mb} MB, simulated link "
          f"{args.bandwidth / 1e9:g} GB/s + {args.latency * 1e6:g} us; medians over {args.steps} steps, rank 0")
    r0 = ranks[0]
    print(f"backward compute alone: {ms(r0['compute_backward_s'])} ms")
    print(f"{'':15s} {'forward':>8s} {'backward':>9s} {'grad comm':>10s} {'exposed':>8s} {'%':>6s} "
          f"{'param gather':>13s} {'exposed':>8s} {'%':>6s} {'step':>8s}  (ms)")
    for name in r0["configs"]:
        s = r0[name]
        pct = 100 * s["grad_exposed_s"] / s["grad_comm_s"] if s["grad_comm_s"] else 0.0
        ppct = 100 * s["param_exposed_s"] / s["param_comm_s"] if s["param_comm_s"] else 0.0
        print(f"{name:15s} {ms(s['forward_s'])} {ms(s['backward_s'])}  {ms(s['grad_comm_s'])}  "
              f"{ms(s['grad_exposed_s'])} {pct:5.1f}%  {ms(s['param_comm_s'])}     {ms(s['param_exposed_s'])} "
              f"{ppct:5.1f}% {ms(s['step_s'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"}, "ranks": ranks}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
