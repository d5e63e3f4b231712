"""zerokern's kernels as functions (the public name of zerokern.kernels.ops)."""

from .kernels.ops import *  # noqa: F401,F403
from .kernels.ops import __all__  # noqa: F401
