"""Deprecated import path (zerokern 0.1 moved the runtime into sub-packages): catch
`zerokern.RankLost` and `zerokern.CollectiveMismatch` instead. This module goes in the next release."""

import warnings

from .core import errors as _errors

_MOVED = ("CollectiveMismatch", "RankLost")


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"zerokern.zero.collective_check.{name} moved: use zerokern.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
