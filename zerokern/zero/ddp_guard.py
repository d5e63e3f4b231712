"""Deprecated import path (zerokern 0.1 moved the runtime into sub-packages): catch
`zerokern.WrappedInDDPError` instead. This module goes in the next release."""

import warnings

from .core import errors as _errors

_MOVED = ("WrappedInDDPError",)


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"zerokern.zero.ddp_guard.{name} moved: use zerokern.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
