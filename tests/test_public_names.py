"""The exceptions users catch are exported from `zerokern`; the paths the docs named before the
runtime moved into sub-packages still work for one release, with a DeprecationWarning."""

import importlib

import pytest

import zerokern


@pytest.mark.parametrize("name, old", [("RankLost", "zerokern.zero.collective_check"),
                                       ("CollectiveMismatch", "zerokern.zero.collective_check"),
                                       ("WrappedInDDPError", "zerokern.zero.ddp_guard")])
def test_exceptions_exported_and_old_paths_warn(name, old):
    cls = getattr(zerokern, name)
    assert issubclass(cls, RuntimeError) and name in zerokern.__all__
    with pytest.warns(DeprecationWarning, match=f"use zerokern.{name}"):
        assert getattr(importlib.import_module(old), name) is cls


def test_rank_lost_is_a_collective_mismatch_and_backend_error_exported():
    assert issubclass(zerokern.RankLost, zerokern.CollectiveMismatch)
    from zerokern.kernels.backends.registry import BackendUnavailableError
    assert zerokern.BackendUnavailableError is BackendUnavailableError


def test_the_runtime_raises_the_exported_classes():
    """The classes raised are the exported ones, not copies (an `except zerokern.RankLost` catches)."""
    from zerokern.zero.comm import check
    from zerokern.zero.grads import ddp_guard
    assert check.RankLost is zerokern.RankLost and check.CollectiveMismatch is zerokern.CollectiveMismatch
    assert ddp_guard.WrappedInDDPError is zerokern.WrappedInDDPError
