"""zerokern's optimizers."""

from .fused_adam import FusedAdam
from .fused_zero_adam import FusedZeroAdam, StepOptions
from .zero_optimizer import ZeroOptimizer
from .grad_scaler import GradScaler

__all__ = ["FusedAdam", "FusedZeroAdam", "GradScaler", "StepOptions", "ZeroOptimizer"]
