"""zerokern's optimizers."""

from .fused_adam import FusedAdam
from .fused_zero_adam import FusedZeroAdam, ZeroConfig

__all__ = ["FusedAdam", "FusedZeroAdam", "ZeroConfig"]
