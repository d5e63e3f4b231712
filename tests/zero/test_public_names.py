"""The exceptions users catch are exported from `zerokern`. The paths before the runtime moved into
sub-packages (zerokern.zero.collective_check, zerokern.zero.ddp_guard) are gone: there has never
been a release that had them (issue 48)."""

import importlib

import pytest

import zerokern


@pytest.mark.parametrize("name", ["RankLost", "CollectiveMismatch", "WrappedInDDPError"])
def test_exceptions_exported(name):
    cls = getattr(zerokern, name)
    assert issubclass(cls, RuntimeError) and name in zerokern.__all__


@pytest.mark.parametrize("old", ["zerokern.zero.collective_check", "zerokern.zero.ddp_guard"])
def test_the_old_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


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
