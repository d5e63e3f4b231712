"""The exit drain's switch, under the name its callers import (optim/fused_adam.py,
integrations/deepspeed.py, the bench and test scripts): the drain itself is part of the one exit
path, comm/context.py ([Note: exit drain] there)."""

from .context import PROCESS


def register():
    """Ask for the drain at exit (idempotent)."""
    PROCESS.drains = True


def __getattr__(name):
    if name == "_registered":  # (what tests/zero_workers.py reads: whether the drain was asked for)
        return PROCESS.drains
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
