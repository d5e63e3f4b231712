"""zerokern's optimizers."""

from .fused_zero_adam import FusedZeroAdam, ZeroConfig

__all__ = ["FusedZeroAdam", "ZeroConfig"]
