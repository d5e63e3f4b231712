"""zerokern inside DeepSpeed.

    import deepspeed
    from zerokern import FusedAdam
    from zerokern.integrations.deepspeed import register

    register()   # optional: lets ZeRO accept FusedAdam without "zero_allow_untested_optimizer"
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=FusedAdam(model.parameters(), lr=3e-4, weight_decay=0.1), config=ds_config)

Under ZeRO 1/2 DeepSpeed flattens and partitions the params, reduces the grads,
unscales and clips them, and calls step() on its fp32 partitions: FusedAdam
then acts as a plain fused Adam on whatever param_groups hold (no hooks, no
collectives of its own). With "offload_optimizer": {"device": "cpu"} (and
"zero_force_ds_cpu_optimizer": false) it runs zerokern's CPU kernel in place of
DeepSpeedCPUAdam. Use FusedAdam, not FusedZeroAdam, here: FusedZeroAdam does
its own sharding and communication, which DeepSpeed already does.
"""

from ..optim import FusedAdam
from ..zero.comm import exit_drain


def register():
    """Adds FusedAdam to the optimizers DeepSpeed ZeRO accepts without
    "zero_allow_untested_optimizer" (DeepSpeed checks the exact type against
    deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS). Idempotent.
    Also installs the exit drain for DeepSpeed's collectives ([Note: exit drain]
    in zerokern/zero/comm/exit_drain.py)."""
    from deepspeed.runtime.zero import utils

    exit_drain.register()
    if FusedAdam not in utils.ZERO_SUPPORTED_OPTIMIZERS:
        utils.ZERO_SUPPORTED_OPTIMIZERS.append(FusedAdam)
    return FusedAdam
