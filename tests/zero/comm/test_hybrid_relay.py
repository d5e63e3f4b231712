"""The relay that launches hybrid sharding's replica hops ([Note: the replica hop's thread] and
[Note: reading the input] in zerokern/zero/comm/hybrid.py): hops launch in the order they were
handed over, each only once its first hop is done, without blocking the caller; `read` is done
once the hop launched; a failed launch raises to the waiter. No process group needed."""

import threading

import pytest

from zerokern.zero.comm.hybrid import _Hop, _Relay, _Then


class _First:
    """A first hop that completes when the test says so."""

    def __init__(self):
        self.done = threading.Event()

    def wait(self):
        assert self.done.wait(10), "the first hop was never completed"

    def is_completed(self):
        return self.done.is_set()


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


def test_hops_launch_in_order_each_after_its_first_hop():
    relay, launched = _Relay(), []
    firsts = [_First() for _ in range(3)]
    hops = [relay.hand(_Hop(f, lambda k=k: (launched.append(k), _Done())[1], True)) for k, f in enumerate(firsts)]
    # handing over never waited: nothing has launched, the caller went on
    firsts[2].done.set()  # a later first hop done early: its hop still waits its turn
    assert not hops[0].launched.wait(0.2) and launched == []
    firsts[0].done.set()
    hops[0].read.wait()
    assert launched == [0] and not hops[2].launched.wait(0.2)  # behind hop 1, whose first hop runs
    firsts[1].done.set()
    for h in hops:
        h.wait()
    assert launched == [0, 1, 2]
    assert all(h.is_completed() for h in hops)


def test_a_failed_launch_raises_to_the_waiter_and_later_hops_go_on():
    relay, first = _Relay(), _First()
    first.done.set()

    def fails():
        raise RuntimeError("launch failed")
    bad = relay.hand(_Hop(first, fails, True))
    good = relay.hand(_Hop(first, _Done, True))
    with pytest.raises(RuntimeError, match="launch failed"):
        bad.read.wait()
    with pytest.raises(RuntimeError, match="launch failed"):
        bad.wait()
    assert good.wait() is True


def test_no_read_where_the_second_hop_reads_the_input():
    first = _First()
    first.done.set()
    assert _Hop(first, _Done, frees_input=False).read is None
    assert _Then(first, _Done, frees_input=False).read is None
    then = _Then(first, _Done, frees_input=True)
    then.read.wait()  # (check off) the second hop is launched on the caller's thread at read
    assert then.work is not None and then.is_completed()
