"""The small GPT of train_gpt.py, trained by DeepSpeed with zerokern's FusedAdam.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_gpt_deepspeed.py \\
        --deepspeed_config examples/ds_config.json                 # CPU: 2 processes, gloo
    deepspeed --num_gpus 8 examples/train_gpt_deepspeed.py --deepspeed_config examples/ds_config.json

DeepSpeed does the ZeRO partitioning, reduction and clipping; FusedAdam is the
fused update it calls on its fp32 partitions. For CPU offload add
"offload_optimizer": {"device": "cpu"} and "zero_force_ds_cpu_optimizer": false
to the config's zero_optimization / top level: zerokern's CPU kernel then
replaces DeepSpeedCPUAdam. bench/multihost.py runs it under torchrun on the namespaced hosts
with the bench's model (--d-model, --layers, ...), --zero-stage and --hpz (ZeRO++'s hpZ: stage 3
params kept sharded within groups of that many ranks), logging per-step seconds (--log-json).
"""

import json
import time

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
    ap.add_argument("--vocab", type=int, default=96)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, help="global batch (default: the config's micro batch x world)")
    ap.add_argument("--zero-stage", type=int, help="overrides the config's zero_optimization.stage")
    ap.add_argument("--hpz", type=int, default=1, help="ZeRO++ hpZ partition size (stage 3)")
    ap.add_argument("--qwz", action="store_true", help="ZeRO++ qwZ: int8 blockwise weights in the stage-3 gathers")
    ap.add_argument("--qgz", action="store_true", help="ZeRO++ qgZ: int4 gradients through an all-to-all (stage 3)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--log-json", help="per-step seconds and losses (rank 0)")
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.batch is not None:
        config["train_micro_batch_size_per_gpu"] = args.batch // world
    if args.zero_stage is not None:
        config["zero_optimization"]["stage"] = args.zero_stage
    if args.hpz > 1:
        config["zero_optimization"]["zero_hpz_partition_size"] = args.hpz
    if args.qwz:
        config["zero_optimization"]["zero_quantized_weights"] = True
    if args.qgz:
        config["zero_optimization"]["zero_quantized_gradients"] = True
    args.deepspeed_config = None

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    register()  # FusedAdam joins ZeRO's supported optimizers: no "zero_allow_untested_optimizer" needed
    torch.manual_seed(0)
    model = GPT(vocab=args.vocab, d=args.d_model, heads=args.heads, layers=args.layers, ctx=args.ctx)
    optimizer = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, config=config)
    rank, world = engine.global_rank, engine.world_size
    per = engine.train_micro_batch_size_per_gpu()
    losses, seconds = [], []
    for step, (x, y) in enumerate(markov_batches(args.vocab, args.ctx, per * world, args.steps)):
        x, y = x[rank * per:(rank + 1) * per].to(engine.device), y[rank * per:(rank + 1) * per].to(engine.device)
        began = time.perf_counter()
        loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - began)
        losses.append(loss.item())
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  ({type(engine.optimizer).__name__} over "
                  f"{type(engine.optimizer.optimizer).__name__ if hasattr(engine.optimizer, 'optimizer') else ''})",
                  flush=True)
    if rank == 0 and args.log_json:
        with open(args.log_json, "w") as f:
            json.dump({"world": world, "losses": losses, "step_seconds": seconds, "counted_inter_host_bytes": None}, f)


if __name__ == "__main__":
    main()
