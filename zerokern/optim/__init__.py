"""zerokern's optimizers."""

from .fused_adam import FusedAdam
from .fused_zero_adam import FusedZeroAdam, StepOptions

__all__ = ["FusedAdam", "FusedZeroAdam", "StepOptions"]
