"""The small GPT of train_gpt.py, trained by DeepSpeed with zerokern's FusedAdam.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_gpt_deepspeed.py \\
        --deepspeed_config examples/ds_config.json                 # CPU: 2 processes, gloo
    deepspeed --num_gpus 8 examples/train_gpt_deepspeed.py --deepspeed_config examples/ds_config.json

DeepSpeed does the ZeRO partitioning, reduction and clipping; FusedAdam is the
fused update it calls on its fp32 partitions. For CPU offload add
"offload_optimizer": {"device": "cpu"} and "zero_force_ds_cpu_optimizer": false
to the config's zero_optimization / top level: zerokern's CPU kernel then
replaces DeepSpeedCPUAdam.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed  # noqa: E402
from train_gpt import GPT, markov_batches  # noqa: E402

from zerokern import FusedAdam  # noqa: E402
from zerokern.integrations.deepspeed import register  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    register()  # FusedAdam joins ZeRO's supported optimizers: no "zero_allow_untested_optimizer" needed
    torch.manual_seed(0)
    model = GPT(vocab=96, d=128, heads=4, layers=2, ctx=64)
    optimizer = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
    rank, world = engine.global_rank, engine.world_size
    per = engine.train_micro_batch_size_per_gpu()
    for step, (x, y) in enumerate(markov_batches(96, 64, per * world, args.steps)):
        x, y = x[rank * per:(rank + 1) * per].to(engine.device), y[rank * per:(rank + 1) * per].to(engine.device)
        loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  ({type(engine.optimizer).__name__} over "
                  f"{type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, 'optimizer') else ''})",
                  flush=True)


if __name__ == "__main__":
    main()
