"""Every Comm the runtime can be handed satisfies the written-down interface
(zerokern/zero/comm/protocol.py): the three in the runtime and bench/overlap.py's simulated-link
stand-in (which once broke CI when the interface grew and it did not)."""

import importlib.util
import inspect
import pathlib
import tempfile

import pytest
import torch.distributed as dist

from zerokern.zero.comm.base import Comm
from zerokern.zero.comm.gloo import GlooComm
from zerokern.zero.comm.hybrid import HybridComm
from zerokern.zero.comm.protocol import CommProtocol

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _bench_sim_comm():
    spec = importlib.util.spec_from_file_location("bench_overlap", ROOT / "bench" / "overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SimComm, module.SimulatedLink


def _members():
    return [n for n in dir(CommProtocol) if not n.startswith("_")] + list(CommProtocol.__annotations__)


def _check(comm):
    missing = [n for n in _members() if not hasattr(comm, n)]
    assert not missing, f"{type(comm).__name__} lacks {missing}"
    assert isinstance(comm, CommProtocol)
    for name in _members():
        want = getattr(CommProtocol, name, None)
        if not inspect.isfunction(want):
            continue
        have = getattr(type(comm), name)
        # the same parameters by name, so a caller's keyword reaches every implementation
        want_params = [p for p in inspect.signature(want).parameters][1:]
        have_params = [p for p in inspect.signature(have).parameters][1:]
        assert have_params == want_params, f"{type(comm).__name__}.{name}{have_params}: protocol has {want_params}"


@pytest.fixture
def gloo_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_every_comm_satisfies_the_protocol(gloo_group):
    plain = Comm(gloo_group)
    sim_comm, link = _bench_sim_comm()
    for comm in (plain, GlooComm(gloo_group), HybridComm(plain, plain, plain, ("mesh",)),
                 sim_comm(plain, link(bandwidth=1e9, latency=0.0))):
        _check(comm)


def test_the_check_finds_a_missing_member():
    # a stand-in written before broadcast() was added to the interface
    partial = type("Partial", (), {n: v for n, v in vars(Comm).items() if n not in ("broadcast", "__dict__")})
    with pytest.raises(AssertionError, match="broadcast"):
        _check(partial(None))

    class Renamed(Comm):
        def differing(self, value, what):  # a parameter renamed: callers' keywords would break
            return None

    with pytest.raises(AssertionError, match="differing"):
        _check(Renamed(None))
