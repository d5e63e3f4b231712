"""Per-rank bodies of the DeepSpeed tests (run by dist_harness on CPU, gloo)."""

import os
import sys

import torch

from numerics import abs_diff

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup(rank, world):
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import deepspeed  # noqa: F401  (after DS_ACCELERATOR)


def _model(dtype):
    from train_gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab=32, d=32, heads=2, layers=2, ctx=16)


def config(stage, dtype, offload=False, own_optimizer=False, untested_flag=True):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0,  # DeepSpeed 0.19 defaults to 1.0: set it explicitly
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}, "steps_per_print": 10**6}
    if untested_flag:
        cfg["zero_allow_untested_optimizer"] = True
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if own_optimizer:  # DeepSpeed's Adam, as torch's AdamW (its compiled ops are not needed)
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.05, "torch_adam": True}}
    return cfg


def _data(rank, world, steps):
    from train_gpt import markov_batches

    for x, y in markov_batches(32, 16, 2 * world, steps, seed=3):
        yield x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2]


def _train(engine, rank, world, steps, skip=0):
    import torch.nn.functional as F

    losses = []
    for i, (x, y) in enumerate(_data(rank, world, skip + steps)):
        if i < skip:
            continue
        loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _engine(stage, dtype, offload, ours, register=False):
    import deepspeed

    from zerokern import FusedAdam

    model = _model(dtype)
    if ours:
        if register:
            from zerokern.integrations.deepspeed import register as reg
            reg()
        opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt,
                                          config=config(stage, dtype, offload, untested_flag=not register))
    else:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, dtype, offload, own_optimizer=True))
    return engine


def losses_vs_deepspeed_adam(rank, world, stage, dtype, offload, register):
    _setup(rank, world)
    ours = _engine(stage, dtype, offload, ours=True, register=register)
    mine = _train(ours, rank, world, 4)
    steps = sorted({int(st["step"]) for st in ours.optimizer.optimizer.state.values()}) \
        if stage > 0 or dtype == "bf16" else sorted({int(st["step"]) for st in ours.optimizer.state.values()})
    theirs = _train(_engine(stage, dtype, offload, ours=False), rank, world, 4)
    return {"ours": mine, "theirs": theirs, "steps": steps, "optimizer": type(ours.optimizer).__name__}


def checkpoint_resume(rank, world, tmp, stage, dtype):
    _setup(rank, world)
    import torch.distributed as dist

    engine = _engine(stage, dtype, False, ours=True)
    _train(engine, rank, world, 3)
    engine.save_checkpoint(tmp, tag="t3")
    trained = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    straight = _train(engine, rank, world, 3, skip=3)
    fresh = _engine(stage, dtype, False, ours=True)
    fresh.load_checkpoint(tmp, tag="t3")
    resumed = _train(fresh, rank, world, 3, skip=3)
    dist.barrier()
    fp32_diff = None
    if rank == 0 and stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        sd = get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t3")
        fp32_diff = max(abs_diff(sd[k], trained[k]) for k in sd)
    return {"straight": straight, "resumed": resumed, "fp32_diff": fp32_diff}
