"""HF generate() on a model sharded at stage 3: synced_gpus on by default.

At stage 3 every forward gathers its units, a collective, so the ranks must run the same number
of forwards. generate() stops each rank when its own sequences end, unless synced_gpus=True keeps
the finished ranks stepping (with dummy forwards) until all are done; transformers turns it on by
itself only for DeepSpeed ZeRO-3 and FSDP (generation/utils.py: is_deepspeed_zero3_enabled() or
is_fsdp_managed_module()). Setting FSDP's marker attribute on our modules would also tell
torch.compile they are FSDP's, so instead the sharded model's generate takes synced_gpus=True
where the caller left it unset. An explicit synced_gpus=False is kept: if the ranks then differ,
the next collective raises on every rank ([Note: announced collectives]).
"""

import sys
import types


def _synced_generate(self, *args, **kwargs):
    if kwargs.get("synced_gpus") is None:
        kwargs["synced_gpus"] = True
    return type(self).generate(self, *args, **kwargs)


def sync_generate(module) -> None:
    """Give `module`'s generate() synced_gpus=True by default, if it is a transformers model."""
    if "transformers" not in sys.modules or "generate" in vars(module):
        return
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # a transformers without it: nothing to do
        return
    if isinstance(module, GenerationMixin):
        module.generate = types.MethodType(_synced_generate, module)
