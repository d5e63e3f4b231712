"""zerokern: fused optimizer and flat-buffer kernels for ZeRO-1/2/3 data parallelism."""

from . import ops
from .ops import available_backends, unavailable_backends
from .optim import FusedAdam, FusedZeroAdam, GradScaler
from .zero import OffloadPolicy, full_state_dict, shard

__all__ = ["ops", "FusedAdam", "FusedZeroAdam", "GradScaler", "OffloadPolicy", "shard", "full_state_dict",
           "available_backends", "unavailable_backends"]
__version__ = "0.1.0"
