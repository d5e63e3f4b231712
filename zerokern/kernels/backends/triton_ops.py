"""The "triton" backend: every op, from the module that implements it."""

from .triton_adam import fused_adam_  # noqa: F401
from .triton_flat import flatten, flatten_into, unflatten, unflatten_into  # noqa: F401
from .triton_lowbit import fused_adam_lowbit_  # noqa: F401
