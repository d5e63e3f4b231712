"""The Work-likes every Comm hands back besides torch's, and the bounded wait they share. A leaf
of comm/: the quantized collectives (wire.py), the quantized param gathers (params/wire_gather.py)
and the collective check use them without importing the Comm classes."""

import functools
from datetime import timedelta

import torch.distributed as dist


class Callback:
    """A Work-like whose wait() is a call: `read` of a two-hop reduction ([Note: reading the
    input] in comm/hybrid.py)."""

    def __init__(self, wait):
        self.wait = wait


class _Done:
    """A finished collective (world size 1)."""

    def wait(self):
        return True

    def wait_for(self, seconds):
        return True

    def is_completed(self):
        return True


class Finish:
    """A launched collective whose result is written when it is waited for (decoded, summed)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        if self.then is not None:
            self.work.wait()
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self):
        return self.then is None or self.work.is_completed()

    def wait_for(self, seconds) -> bool:
        if self.then is None or finished(self.work, seconds):
            self.wait()
            return True
        return False


@functools.lru_cache(maxsize=8)
def _delta(seconds) -> timedelta:
    """(The check's poll interval is made once, not at every wait.)"""
    return timedelta(seconds=max(seconds, 1e-3))


def finished(work, seconds) -> bool:
    """Waits up to `seconds` for a launched collective: True once it completed (a planned one's
    wait checks in between whether the other ranks went elsewhere, comm/check.py)."""
    bounded = getattr(work, "wait_for", None)  # zerokern's composites (comm/gloo.py)
    if bounded is not None:
        return bounded(seconds)
    if isinstance(work, dist.Work):
        try:  # a zero timeout would mean none: wait at least a millisecond
            # gloo's send/recv say False on timeout, its collectives raise
            return work.wait(_delta(seconds)) is not False
        except RuntimeError as e:
            if "timed out" in str(e).lower():
                return False
            raise
    return True  # done when returned (an object all-gather)
