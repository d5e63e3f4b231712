"""Memory and communication planner for ZeRO data parallelism.

    python -m zerokern.plan --params 7.5e9 --dp 64
    python -m zerokern.plan --layers 80 --hidden 8192 --heads 64 --vocab 32000 --tp 8 --pp 8 --dp 4
    python -m zerokern.plan --arch llama --layers 32 --hidden 4096 --heads 32 --vocab 32000 --ffn-hidden 11008

    from zerokern.plan import plan, from_model
    p = plan(7.5e9, dp=64)            # a Plan: one StagePlan per ZeRO stage 0-3
    p = from_model(model, dp=8)       # counts a real module's trainable parameters
    p = plan(7.5e9, dp=64, gpu_memory="24GB", dp_bandwidth="400Gb/s")  # or bytes: 24e9, 50e9
    p = plan(7.5e9, dp=64, hosts=8, reduce_precision="int8")  # quantized grads: traffic.py
    p = plan(arch="llama", layers=32, hidden=4096, heads=32, vocab=32000, ffn_hidden=11008, dp=8,
             seq=4096, micro_batch_size=1, checkpointing="full")  # activations counted in the fit

Sizes: a string needs a unit (units.py); a number is bytes. Nothing here imports torch.
"""

from .activations import ActivationPlan, activation_memory
from .model import (DTYPE_BYTES, Plan, StagePlan, llama_params, llama_params_per_gpu, plan, transformer_params,
                    transformer_params_per_gpu)

__all__ = ["plan", "from_model", "Plan", "StagePlan", "transformer_params", "transformer_params_per_gpu",
           "llama_params", "llama_params_per_gpu", "DTYPE_BYTES", "activation_memory", "ActivationPlan"]


def from_model(model, **kwargs) -> Plan:
    """plan() for a real torch.nn.Module: its trainable parameters (shared ones once). Stage 3's
    gathered working set needs unit_params= (a unit's size, e.g. one block's); else it is None."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    kwargs.setdefault("largest_param", max((p.numel() for p in trainable), default=None))
    return plan(sum(p.numel() for p in trainable), **kwargs)
