"""zerokern: fused optimizer and flat-buffer kernels for ZeRO-1/2/3 data parallelism.

The public names come from modules that import torch and the compiled extensions. They are
loaded on first use (PEP 562), so `python -m zerokern.plan` answers without paying for torch;
when torch is already imported, `import zerokern` loads them at once, registering
torch.ops.zerokern as it always has.
"""

import sys

__all__ = ["ops", "FusedAdam", "FusedZeroAdam", "ZeroOptimizer", "GradScaler", "OffloadPolicy", "shard",
           "full_state_dict", "available_backends", "unavailable_backends",
           "RankLost", "CollectiveMismatch", "WrappedInDDPError", "BackendUnavailableError", "KernelSelfCheckError"]
__version__ = "0.1.0"


def _load():
    """Import the torch-backed parts; binds the public names (and ops, optim, zero) here."""
    global ops, available_backends, unavailable_backends, FusedAdam, FusedZeroAdam, GradScaler, ZeroOptimizer
    global OffloadPolicy, full_state_dict, shard, RankLost, CollectiveMismatch, WrappedInDDPError, BackendUnavailableError
    global KernelSelfCheckError
    from .kernels.backends.registry import BackendUnavailableError
    from .kernels.backends.selfcheck import KernelSelfCheckError
    from .ops import available_backends, unavailable_backends
    from .optim import FusedAdam, FusedZeroAdam, GradScaler, ZeroOptimizer
    from .zero.api import full_state_dict, shard
    from .zero.core.errors import CollectiveMismatch, RankLost, WrappedInDDPError
    from .zero.core.stage import OffloadPolicy
    ops = sys.modules[__name__ + ".ops"]  # not `from . import ops`: that asks __getattr__ for "ops" again


def __getattr__(name):  # called only for a name not bound yet
    # Only names that _load binds: any other (`from zerokern import plan` asks for "plan" first)
    # must not load torch.
    if name in __all__ or name in ("optim", "zero", "kernels"):
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if "torch" in sys.modules:
    _load()
