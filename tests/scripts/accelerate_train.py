"""Accelerate loop for tests/integrations/test_accelerate.py (torchrun, or plainly for one process): an MLP
trained with accumulate(), clip_grad_norm_ and a warmup schedule, with torch AdamW under
Accelerate's DDP (--optimizer torch) or with FusedZeroAdam on an attach()ed Accelerator
(--optimizer zero), or with zerokern.ZeroOptimizer over torch AdamW (--optimizer zero-opt). Checkpoints go through torch.distributed.checkpoint. Rank 0 writes the
losses, the final params and the number of gradient reductions to --out. --optimizer zero-plain
(tests/zero/grads/test_ddp_guard.py): FusedZeroAdam on a plain Accelerator (no attach), which must fail; each
rank writes its error to --out.rank<r>."""

import argparse
import functools
import os

import torch
from zerokern.zero.comm import exit_drain
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

STEPS, ACCUM, GLOBAL_BATCH = 10, 2, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["torch", "zero", "zero-opt", "zero-plain"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save", default=None, help="DCP checkpoint directory, written after step 5")
    ap.add_argument("--resume", default=None, help="DCP checkpoint directory to start from (step 5)")
    ap.add_argument("--ckpt", choices=["dcp", "accelerate"], default="dcp",
                    help="torch.distributed.checkpoint, or accelerator.save_state/load_state")
    ap.add_argument("--save-acc", default=None,
                    help="with --save: also accelerator.save_state here after step 5 (saving reads only)")
    ap.add_argument("--zero-stage", type=int, default=2, help="3: each Linear, then the root, sharded first")
    args = ap.parse_args()
    # The reference run (no zerokern optimizer) needs this too: without it a gloo worker thread can
    # abort the process at interpreter exit after the last collective (seen once in CI on the DDP +
    # AdamW run; [Note: exit drain] in zerokern/zero/exit_drain.py says why). It only waits at exit.
    exit_drain.register()
    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    world = accelerator.num_processes
    zero = args.optimizer in ("zero", "zero-opt")  # attached, with a zerokern optimizer
    if zero:
        from zerokern.integrations.accelerate import attach
        attach(accelerator)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5))
    # a buffer that differs per rank: after prepare every rank must hold rank 0's, as under DDP
    model.register_buffer("probe", torch.full((1,), float(accelerator.process_index)))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * ACCUM * GLOBAL_BATCH, 12, generator=g)
    y = x @ torch.randn(12, 5, generator=g)  # learnable: the loss must fall
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=GLOBAL_BATCH // world)
    if args.optimizer in ("zero", "zero-opt", "zero-plain"):
        import zerokern
        if args.optimizer == "zero-opt":
            build = functools.partial(zerokern.ZeroOptimizer, optimizer_class=torch.optim.AdamW)
        else:
            build = zerokern.FusedZeroAdam
        if args.zero_stage == 3 and world > 1:
            for m in (model[0], model[2], model):
                zerokern.shard(m, stage=3, bucket_cap_mb=0.002)
            opt = build(model.parameters(), lr=5e-2, weight_decay=0.01)
        else:
            opt = build(model.parameters(), lr=5e-2, weight_decay=0.01, zero_stage=2, bucket_cap_mb=0.002)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=5e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if args.optimizer == "zero-plain":  # what attach() is for: the plain Accelerator wrapped the model in DDP
        try:
            for xb, yb in loader:
                accelerator.backward((model(xb) - yb).square().mean())
                opt.step()
                opt.zero_grad()
        except Exception as e:
            with open(f"{args.out}.rank{accelerator.process_index}", "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            raise
        return

    probes = accelerator.gather(accelerator.unwrap_model(model).probe).tolist()
    reductions = [0]
    inner = getattr(opt, "optimizer", opt)
    if zero:
        comm = inner.comm

        def counting(collective):
            def counted(*a, **k):  # bucket reductions are labelled "<collective>[<bucket>]"
                reductions[0] += "[" in k.get("name", "")
                return collective(*a, **k)
            return counted
        # stage 2 on gloo reduces with an all-reduce ([Note: the collective for the backend])
        comm.reduce_scatter, comm.all_reduce = counting(comm.reduce_scatter), counting(comm.all_reduce)

    step, losses = 0, {}
    if args.resume:
        if args.ckpt == "accelerate":
            accelerator.load_state(args.resume)
        else:
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, inner)}
            dcp.load(sd, checkpoint_id=args.resume)
            set_model_state_dict(model, sd["model"])
            set_optimizer_state_dict(model, inner, sd["optim"])
            sched.load_state_dict(torch.load(os.path.join(args.resume, "sched.pt"), weights_only=True))
        step = 5
        loader = accelerator.skip_first_batches(loader, step * ACCUM)
    micro = 0
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = (model(xb) - yb).square().mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        micro += 1
        total = accelerator.reduce(loss.detach(), reduction="mean").item()
        losses[step] = losses.get(step, 0.0) + total / ACCUM
        if accelerator.sync_gradients:
            step += 1
            if args.save and step == 5 and args.ckpt == "accelerate":
                accelerator.save_state(args.save)
            elif args.save and step == 5:
                if args.save_acc:
                    accelerator.save_state(args.save_acc)
                dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, inner)},
                         checkpoint_id=args.save)
                if accelerator.is_main_process:
                    torch.save(sched.state_dict(), os.path.join(args.save, "sched.pt"))
                accelerator.wait_for_everyone()
    saved = None
    if zero and not args.resume:
        # accelerator.save_model (safetensors): every weight must be in the file
        accelerator.save_model(model, args.out + ".model")
        if accelerator.is_main_process:
            from safetensors.torch import load_file
            saved = load_file(os.path.join(args.out + ".model", "model.safetensors"))
    if args.zero_stage == 3 and world > 1:  # each rank holds slices: the whole weights (a collective)
        import zerokern
        whole = zerokern.full_state_dict(accelerator.unwrap_model(model))
        params = {n: whole[n] for n, _ in accelerator.unwrap_model(model).named_parameters()} if whole else {}
    else:
        params = {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}
    if accelerator.is_main_process:
        torch.save({"saved_model": saved, "probes": probes, "losses": losses, "world": world, "reductions": reductions[0],
                    "buckets": len(inner.schedule.buckets) if zero else None,
                    "optimizer": type(inner).__name__,
                    "wrapped": type(model).__name__,
                    "params": params},
                   args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
