"""Train a small GPT with FusedZeroAdam (or torch DDP + AdamW) on synthetic data.

    torchrun --nproc_per_node=2 examples/train_gpt.py                       # zerokern, ZeRO-2, CPU (gloo)
    torchrun --nproc_per_node=2 examples/train_gpt.py --optimizer torch     # DDP + torch.optim.AdamW
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero-stage 1 --dtype bf16 --grad-accum 4
    python examples/train_gpt.py                                            # one process
    torchrun --nproc_per_node=2 --max-restarts=1 examples/train_gpt.py --ckpt-dir build/ckpt --kill-at-step 25

--ckpt-dir: a DCP checkpoint of the model and optimizer every --ckpt-every steps, and a run
that finds one there resumes from the latest (at any world size: DCP re-shards). With
torchrun --max-restarts, a rank that dies (--kill-at-step kills one, on the first attempt
only, to try it) makes the others raise within seconds, and torchrun restarts every rank,
which resume from the last checkpoint on the same loss curve.

The data is a fixed random Markov chain over the vocabulary (nothing is
downloaded), so the loss falls towards the chain's entropy. Every rank takes its
own slice of each global batch; the logged loss is the average over ranks.
"""

import argparse
import contextlib
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerokern
from zerokern import FusedZeroAdam
from zerokern.zero.comm import exit_drain


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, ctx):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()  # tied output layer


def _init_root(model):
    """--meta-init: the root unit's own params (the blocks are initialised as they are sharded), as
    GPT.__init__ initialises them."""
    for emb in (model.tok, model.pos):
        nn.init.normal_(emb.weight, std=0.02)
    model.ln.reset_parameters()


def markov_batches(vocab, ctx, batch, steps, seed=0):
    """Global batches (inputs, targets) drawn from one fixed random Markov chain."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 3
    probs = logits.softmax(-1)
    for _ in range(steps):
        seq = torch.empty(batch, ctx + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(ctx):
            seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
        yield seq[:, :-1], seq[:, 1:]


def train(args, rank=0, world=1, device="cpu"):
    torch.manual_seed(args.seed)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.meta_init:  # [Note: meta init]: no rank ever holds the whole model (stage 3 only)
        if not (args.optimizer == "zerokern" and args.zero_stage == 3):
            raise SystemExit("--meta-init needs --zero-stage 3 (zerokern): each block is materialised as it is sharded")
        with torch.device("meta"):
            model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.ctx).to(dtype)
    else:
        model = GPT(args.vocab, args.d_model, args.heads, args.layers, args.ctx).to(device, dtype)
    # --mesh R,S: hybrid sharding, sharded over S ranks (a host) and replicated over R hosts
    mesh = tuple(int(n) for n in args.mesh.split(",")) if args.mesh else None
    # what grads and gathered params travel in ([Note: quantized reductions] in zerokern/zero/comm/wire.py)
    wire = dict(reduce_precision=args.reduce_precision, gather_precision=args.gather_precision)
    if args.offload != "none":  # the optimizer state in CPU memory, or on disk under --offload-path
        wire["offload"] = zerokern.OffloadPolicy(device=args.offload, path=args.offload_path,
                                                 chunk_mb=args.offload_chunk_mb, params=args.offload_params)
    if args.optimizer == "zerokern" and args.zero_stage == 3:  # params sharded too: each block a unit
        for blk in model.blocks:
            zerokern.shard(blk, stage=3, bucket_cap_mb=args.bucket_cap_mb, mesh=mesh, **wire)
        zerokern.shard(model, stage=3, bucket_cap_mb=args.bucket_cap_mb, mesh=mesh,  # embedding, final norm
                       init=_init_root if args.meta_init else None, **wire)
        opt = FusedZeroAdam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        net = model
    elif args.optimizer == "zerokern":
        opt = FusedZeroAdam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            zero_stage=args.zero_stage, bucket_cap_mb=args.bucket_cap_mb, mesh=mesh, **wire)
        net = model
    elif args.optimizer == "fsdp2":  # torch's FSDP2 (fully_shard), HSDP with --mesh, for comparison
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        shape = mesh or (world,)
        dm = init_device_mesh(device if isinstance(device, str) else device.type, shape,
                              mesh_dim_names=("replicate", "shard")[-len(shape):])
        for blk in model.blocks:
            fully_shard(blk, mesh=dm)
        fully_shard(model, mesh=dm)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        net = model
    else:
        net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def accumulating():
        """Micro-batches before the last one: no gradient communication."""
        if args.optimizer == "zerokern":
            return opt.no_sync()
        if args.optimizer == "fsdp2":
            return _fsdp_no_sync(model)
        return net.no_sync() if world > 1 else contextlib.nullcontext()

    per_rank = args.batch // world
    micro = per_rank // args.grad_accum
    start = load_checkpoint(args.ckpt_dir, model, opt, rank) if args.ckpt_dir else 0
    losses, seconds, t0, tokens = {}, {}, time.perf_counter(), 0
    for step, (x, y) in enumerate(markov_batches(args.vocab, args.ctx, args.batch, args.steps, args.seed)):
        if step < start:  # drawn and dropped: the data stream continues where the checkpoint left it
            continue
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        began = time.perf_counter()
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for k in range(args.grad_accum):
            xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
            with accumulating() if k < args.grad_accum - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(net(xs).float().flatten(0, 1), ys.flatten()) / args.grad_accum
                loss.backward()
            total += loss.detach()
        if step == args.kill_at_step and rank == args.kill_rank % world and first_attempt():
            print(f"rank {rank}: killed at step {step}, between backward and step (--kill-at-step)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses[step] = total.item()
        seconds[step] = time.perf_counter() - began
        tokens += args.batch * args.ctx
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            rate = tokens / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {losses[step]:.4f}  {rate:,.0f} tokens/s  {memory(opt, model)}", flush=True)
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step, model, opt, rank, world)
    # {step: mean loss over ranks}, {step: this rank's seconds}, and with --mesh the bytes this rank
    # sent to other hosts by zerokern's count from the collectives' sizes ([Note: hybrid sharding])
    return losses, seconds, getattr(getattr(opt, "comm", None), "inter_host_bytes", None)


@contextlib.contextmanager
def _fsdp_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def first_attempt():
    """True unless torchrun has restarted the workers (TORCHELASTIC_RESTART_COUNT)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def save_checkpoint(ckpt_dir, step, model, opt, rank, world):
    """DCP checkpoint of model and optimizer after `step`; then `latest` names it (written last,
    atomically, so a rank dying mid-save leaves the previous checkpoint the latest)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    name = f"step{step:06d}"
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=os.path.join(ckpt_dir, name))
    if world > 1:
        dist.barrier()  # every rank's shards are written
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(ckpt_dir, "latest.tmp"), os.path.join(ckpt_dir, "latest"))


def load_checkpoint(ckpt_dir, model, opt, rank):
    """Load the latest checkpoint in ckpt_dir, if any: the step to continue from (0 if none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    os.makedirs(ckpt_dir, exist_ok=True)
    latest = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(latest):
        return 0
    with open(latest) as f:
        name = f.read().strip()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, name))
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    step = int(name.removeprefix("step"))
    if rank == 0:
        print(f"resumed from {os.path.join(ckpt_dir, name)}: continuing at step {step + 1}", flush=True)
    return step + 1


def memory(opt, model):
    """This rank's optimizer-related memory, in MB."""
    if isinstance(opt, FusedZeroAdam):
        rep = opt.memory_report()
    else:
        nb = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        rep = {"params": nb(model.parameters()), "adam_state": nb(v for s in opt.state.values() for k, v in s.items()
                                                                   if k != "step"),
               "grads": nb(p.grad for p in model.parameters() if p.grad is not None)}
    return "mem MB " + " ".join(f"{k}={v / 2**20:.1f}" for k, v in rep.items() if k != "total")


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", choices=["zerokern", "torch", "fsdp2"], default="zerokern",
                    help="torch: DDP + AdamW; fsdp2: torch's fully_shard + AdamW (HSDP with --mesh)")
    ap.add_argument("--mesh", help="R,S: hybrid sharding over R hosts x S ranks each (sharded within a host)")
    ap.add_argument("--reduce-precision", choices=["fp32", "bf16", "int8", "int4"], default=None,
                    help="zerokern: what the grads are reduced in (int8/int4: blocks with error feedback; with --mesh "
                         "only between hosts)")
    ap.add_argument("--gather-precision", choices=["int8"], default=None,
                    help="zerokern: what gathered params travel in")
    ap.add_argument("--offload", choices=["none", "cpu", "nvme"], default="none",
                    help="zerokern: the optimizer state in CPU memory or on disk (--offload-path), streamed")
    ap.add_argument("--offload-path", help="--offload nvme: a directory on a local disk")
    ap.add_argument("--offload-params", action="store_true",
                    help="--offload nvme at --zero-stage 3: the param shards on disk too")
    ap.add_argument("--meta-init", action="store_true",
                    help="--zero-stage 3: build the model on the meta device, materialise it block by block")
    ap.add_argument("--offload-chunk-mb", type=float, default=16.0, help="--offload nvme: MB per state array streamed")
    ap.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                    help="3: zerokern.shard(stage=3) on each block and the root")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: one GPU per local rank if there is a GPU, else CPU ranks (gloo)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--log-json", help="write the loss curve here (rank 0)")
    ap.add_argument("--ckpt-dir", help="DCP checkpoints here; resume from the latest one found")
    ap.add_argument("--ckpt-every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--kill-at-step", type=int, default=-1,
                    help="to try recovery: SIGKILL one rank at this step, on torchrun's first attempt only")
    ap.add_argument("--kill-rank", type=int, default=-1, help="the rank --kill-at-step kills (default: the last)")
    return ap


def pick_device(choice, local_rank):
    """One GPU per local rank (cuda:LOCAL_RANK) where this machine has that many, else a clear
    error; CPU ranks (gloo) with --device cpu, or by default where there is no GPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise SystemExit(f"train_gpt.py: local rank {local_rank} needs cuda:{local_rank}, but this machine has "
                         f"{count} GPU(s): start at most {count} process(es) per node (torchrun "
                         f"--nproc_per_node={max(count, 1)}), or pass --device cpu to train on CPU ranks (gloo)")
    return torch.device("cuda", local_rank)


def main():
    args = parser().parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        exit_drain.register()  # for the DDP run as well (FusedZeroAdam registers it itself)
    if args.batch % (world * args.grad_accum):
        raise SystemExit(f"--batch {args.batch} must be divisible by world size {world} x --grad-accum {args.grad_accum}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    losses, seconds, counted = train(args, rank, world, device)
    if counted is not None:  # every rank's count, summed: what all links carried by that count
        total = torch.tensor([float(counted)])
        dist.all_reduce(total)
        counted = total.item()
    if rank == 0:
        if losses:
            print(f"final loss {losses[max(losses)]:.4f} (uniform guess: {math.log(args.vocab):.4f})")
        if args.log_json:  # steps this run trained (a resumed run starts after its checkpoint)
            with open(args.log_json, "w") as f:
                json.dump({"args": vars(args), "world": world, "first_step": min(losses, default=None),
                           "losses": [losses[k] for k in sorted(losses)],
                           "step_seconds": [seconds[k] for k in sorted(seconds)],
                           "counted_inter_host_bytes": counted}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
