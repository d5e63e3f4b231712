"""HF Trainer run for tests/integrations/test_hf_trainer.py (launched with torchrun, or plainly for one
process): a tiny random-init GPT-2 on synthetic tokens, trained with torch AdamW under DDP
(--optimizer torch) or with zerokern's ZeroTrainer (--optimizer zero: the FusedZeroAdam it builds;
--optimizer zero-opt: a zerokern.ZeroOptimizer over torch AdamW and a warmup schedule passed in,
with Trainer's param groups; after training every rank calls save_model and rank 0 reads it back
with from_pretrained). Rank 0 writes the logged losses and the final params to --out. --optimizer zero-plain (tests/zero/grads/test_ddp_guard.py):
a plain Trainer given a FusedZeroAdam, which must fail; each rank writes its error to
--out.rank<r>."""

import argparse
import os

import torch
from zerokern.zero.comm import exit_drain
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

STEPS, SAVE_AT, ACCUM, GLOBAL_BATCH, SEQ = 20, 10, 2, 8, 16


class CountReductions(TrainerCallback):
    """Counts FusedZeroAdam's bucket reductions (one per bucket per optimizer step is expected)."""

    def __init__(self):
        self.count, self.buckets = 0, None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        if not hasattr(inner, "comm"):
            return
        self.buckets = len(inner.schedule.buckets)
        comm = inner.comm

        def counting(collective):
            def counted(*a, **k):  # bucket reductions are labelled "<collective>[<bucket>]"
                self.count += "[" in k.get("name", "")
                return collective(*a, **k)
            return counted
        # stage 2 on gloo reduces with an all-reduce ([Note: the collective for the backend])
        comm.reduce_scatter, comm.all_reduce = counting(comm.reduce_scatter), counting(comm.all_reduce)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizer", choices=["torch", "zero", "zero-opt", "zero-plain"], required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--zero-stage", type=int, default=2)
    args = ap.parse_args()
    # The reference run (no zerokern optimizer) needs this too: without it a gloo worker thread can
    # abort the process at interpreter exit after the last collective (seen once in CI on the DDP +
    # AdamW run; [Note: exit drain] in zerokern/zero/exit_drain.py says why). It only waits at exit.
    exit_drain.register()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    # counting sequences from random starts (mod 64, with a random stride of 1 or 2): learnable
    starts = torch.randint(64, (STEPS * ACCUM * GLOBAL_BATCH, 1), generator=g)
    strides = torch.randint(1, 3, (STEPS * ACCUM * GLOBAL_BATCH, 1), generator=g)
    seqs = (starts + strides * torch.arange(SEQ)) % 64
    data = [{"input_ids": t, "labels": t} for t in seqs]
    targs = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=3e-3, warmup_steps=5,
        lr_scheduler_type="linear", max_grad_norm=1.0, weight_decay=0.01, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_AT, report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch")
    counter = CountReductions()
    if args.optimizer == "torch":
        trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[counter])
    elif args.optimizer == "zero-plain":  # what ZeroTrainer is for: the plain Trainer wraps the model in DDP
        from zerokern import FusedZeroAdam
        opt = FusedZeroAdam(model.parameters(), lr=3e-3, zero_stage=args.zero_stage, bucket_cap_mb=0.01)
        trainer = Trainer(model=model, args=targs, train_dataset=data, optimizers=(opt, None))
        try:
            trainer.train()
        except Exception as e:
            with open(f"{args.out}.rank{trainer.args.process_index}", "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            raise
        return
    else:
        from zerokern.integrations.hf import ZeroTrainer
        if args.zero_stage == 3 and world > 1:  # the units first (FSDP2's shape): each block, then the root
            import zerokern
            for block in model.transformer.h:
                zerokern.shard(block, stage=3, bucket_cap_mb=0.01)
            zerokern.shard(model, stage=3, bucket_cap_mb=0.01)
        sharded = args.zero_stage == 3 and world > 1
        if args.optimizer == "zero-opt":  # issue 39: ZeroTrainer given a ZeroOptimizer and a schedule
            import zerokern
            from transformers import get_linear_schedule_with_warmup
            decay = set(Trainer.get_decay_parameter_names(None, model))  # Trainer's groups, as the reference
            groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
                      {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
            sharding = {} if sharded else {"zero_stage": args.zero_stage, "bucket_cap_mb": 0.01}
            opt = zerokern.ZeroOptimizer(groups, torch.optim.AdamW, lr=3e-3, **sharding)
            trainer = ZeroTrainer(model=model, args=targs, train_dataset=data, callbacks=[counter],
                                  optimizers=(opt, get_linear_schedule_with_warmup(opt, 5, STEPS)))
        else:
            trainer = ZeroTrainer(model=model, args=targs, train_dataset=data, callbacks=[counter],
                                  zero_kwargs={"zero_stage": args.zero_stage, "bucket_cap_mb": 0.01})
    trainer.train(resume_from_checkpoint=args.resume)
    pretrained = None
    if args.optimizer == "zero-opt":
        trainer.save_model()  # every rank (at stage 3 a collective)
        if trainer.args.process_index == 0:
            pretrained = {n: p.detach().clone() for n, p in
                          GPT2LMHeadModel.from_pretrained(args.output_dir).named_parameters()}
    if args.zero_stage == 3 and world > 1:  # each rank holds slices: the whole weights (a collective)
        import zerokern
        params = {k: v for k, v in zerokern.full_state_dict(model).items() if k in dict(model.named_parameters())}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    norms = {h["step"]: h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h}
    if trainer.args.process_index == 0:
        torch.save({"losses": losses, "grad_norms": norms, "world": world, "reductions": counter.count,
                    "buckets": counter.buckets,
                    "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
                    "wrapped": type(trainer.model_wrapped).__name__,
                    "params": params, "pretrained": pretrained}, args.out)


if __name__ == "__main__":
    main()
