"""transformers.Trainer with FusedZeroAdam or ZeroOptimizer.

    from zerokern.integrations.hf import ZeroTrainer

    trainer = ZeroTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0),
                          train_dataset=ds, zero_kwargs={"zero_stage": 2})
    trainer.train()                       # torchrun --nproc_per_node=N train.py
    trainer.train(resume_from_checkpoint=True)   # at any world size
    trainer.zero_optimizer.memory_report()       # trainer.optimizer is Accelerate's wrapper

ZeroTrainer is a Trainer that builds FusedZeroAdam from the TrainingArguments
(learning_rate, adam_beta1/2, adam_epsilon, weight_decay with Trainer's
no-decay groups; zero_kwargs are passed on: zero_stage, bucket_cap_mb,
overlap_comm, ...) after Trainer has placed the model, unless you pass one
yourself (optimizers=(opt, sched) or optimizer_cls_and_kwargs; any zerokern
optimizer, zerokern.ZeroOptimizer too, as recognised by
zerokern.optim.engine_optimizer.zero_optimizer_in). Then, in the same places where
Trainer special-cases DeepSpeed and FSDP:
- its Accelerator is attach()ed (zerokern/integrations/accelerate.py): no DDP
  wrap, gradient accumulation enters opt.no_sync(), max_grad_norm clips with
  opt.clip_grad_norm_ (the global norm);
- at stage 3 (the model sharded with zerokern.shard(..., stage=3) before the
  Trainer is built), save_model gathers the whole weights on every rank (a
  collective, as with FSDP: call trainer.save_model() on every rank) and rank 0
  writes them;
- checkpoints hold the optimizer as a torch.distributed.checkpoint directory,
  "optimizer_zerokern", written by every rank (Trainer writes optimizer.pt from
  rank 0 only, which would hold rank 0's shard), so resume_from_checkpoint
  works at any world size.
Trainer's own _save_optimizer_and_scheduler, _load_optimizer_and_scheduler
and _save (which save_model calls with the gathered weights) are private; tests/integrations/test_hf_trainer.py pins
them to the transformers version installed.
"""

import os

import torch
from transformers import Trainer

from ..optim import FusedZeroAdam
from ..optim.engine_optimizer import zero_optimizer_in
from .accelerate import attach
from .dcp import load_optimizer, save_optimizer

OPTIMIZER_DIR = "optimizer_zerokern"
SCHEDULER_NAME = "scheduler.pt"  # as transformers.trainer.SCHEDULER_NAME


class ZeroTrainer(Trainer):
    # set through TrainingArguments, where Trainer reads them too (its max_grad_norm clip would
    # silently win over one given here)
    _FROM_ARGS = {"lr": "learning_rate", "betas": "adam_beta1/adam_beta2", "eps": "adam_epsilon",
                  "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm"}

    def __init__(self, *args, zero_kwargs=None, **kwargs):
        self.zero_kwargs = dict(zero_kwargs or {})
        for key in self.zero_kwargs.keys() & self._FROM_ARGS.keys():
            raise ValueError(f"ZeroTrainer(zero_kwargs={{'{key}': ...}}): set TrainingArguments("
                             f"{self._FROM_ARGS[key]}=...) instead; zero_kwargs are FusedZeroAdam's own options "
                             "(zero_stage, bucket_cap_mb, overlap_comm, offload, ...)")
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        attach(self.accelerator)

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            a = self.args
            self.optimizer_cls_and_kwargs = (FusedZeroAdam, dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                                                 eps=a.adam_epsilon, **self.zero_kwargs))
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def _zero_optimizer(self):
        return zero_optimizer_in(self.optimizer)  # inside Accelerate's wrapper

    @property
    def zero_optimizer(self):
        """The zerokern optimizer, FusedZeroAdam or ZeroOptimizer (None before train() builds it):
        trainer.optimizer is Accelerate's wrapper, which has no memory_report()."""
        return self._zero_optimizer()

    def save_model(self, output_dir=None, _internal_call=False):
        opt = self._zero_optimizer()
        if opt is None or not opt.engine.param_policy.state_dict_is_collective:
            return super().save_model(output_dir, _internal_call)
        # Stage 3: each rank holds slices of the weights. As Trainer's FSDP and DeepSpeed branches:
        # every rank gathers (the attached accelerator's get_state_dict, a collective), rank 0 writes.
        self._save(output_dir if output_dir is not None else self.args.output_dir,
                   state_dict=self.accelerator.get_state_dict(self.model))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir):
        opt = self._zero_optimizer()
        if opt is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer(self.model, opt, os.path.join(output_dir, OPTIMIZER_DIR))  # every rank
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        opt = self._zero_optimizer()
        if opt is None or checkpoint is None or not os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_optimizer(self.model, opt, os.path.join(checkpoint, OPTIMIZER_DIR))
        if self.lr_scheduler is not None and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
