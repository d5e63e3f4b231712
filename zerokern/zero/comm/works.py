"""What a collective hands back, written down (Work), the four handles zerokern makes besides
torch's own Works, and the bounded wait they share. A leaf of comm/: the quantized collectives
of grads and params (wire.py), the collective check and the ordered workers use them without
importing the Comm classes.

[Note: one handle protocol] Every handle is one of four, combined rather than written anew per
collective (issue 48: nine hand-made ones had drifted apart in how they waited and raised):
- Done: finished already (world size 1, an object gather);
- Then: `first`, then a step once it is done: a result written when waited for (decoded,
  summed), or a second collective launched then (hybrid sharding with the check off);
- AllOf: several collectives that together make one (a gather's broadcasts);
- Pending: one another thread launches or runs, in order (the check's, a gloo relay's, a replica
  hop's: comm/worker.py); it fails to every waiter with a copy of the thread's error.
Each declares what torch's Works lack: `wait_for(seconds)` (a bounded wait, [Note: planned
collectives] in comm/check.py) and `read` ([Note: reading the input] in comm/hybrid.py)."""

import functools
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch.distributed as dist


@runtime_checkable
class Work(Protocol):
    """What every collective returns (torch's dist.Work satisfies it): only Comm.wait waits on it."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Handle(Work, Protocol):
    """A Work zerokern made: one of the four below ([Note: one handle protocol])."""

    read: Optional[Work]  # done once the collective no longer reads its input, or None: only its end can say

    def wait_for(self, seconds: float) -> bool:
        """Waits up to `seconds`: True once the collective completed (its result written)."""


class Done:
    """A finished collective (world size 1, an object gather)."""

    read = None

    def wait(self):
        return True

    def wait_for(self, seconds) -> bool:
        return True

    def is_completed(self):
        return True


DONE = Done()  # (stateless: one serves every finished collective)


class Then:
    """`first`, then `step()` once first is done, run once, by the first waiter. launches: step
    returns a second Work (waited too; `work` holds it); else step writes a result (a decode, a
    sum) and its return is ignored. reads: `read` is done once step ran ([Note: reading the input])."""

    def __init__(self, first, step: Callable, launches: bool = False, reads: bool = False):
        self.first, self.step, self.launches = first, step, launches
        self.work = None  # the second Work (launches), or DONE once step ran
        self.read = Then(DONE, self._start) if reads else None

    def _start(self) -> None:
        if self.work is None:
            self.first.wait()
            step, self.step = self.step, None
            result = step()
            self.work = result if self.launches else DONE

    def wait(self):
        if self.work is None:
            self._start()
        return True if self.work is DONE else self.work.wait()

    def is_completed(self):
        if self.work is None:  # a result step is run by the waiter: done when first is
            return not self.launches and self.first.is_completed()
        return self.work.is_completed()

    def wait_for(self, seconds) -> bool:
        if self.work is None and not finished(self.first, seconds):
            return False
        if self.work is None:
            self._start()
        return self.work is DONE or finished(self.work, seconds)


class AllOf:
    """Several collectives that together make one (the broadcasts of a gather)."""

    read = None

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)

    def wait_for(self, seconds) -> bool:
        deadline = time.monotonic() + seconds
        for w in self.works:
            if not finished(w, deadline - time.monotonic()):
                return False
        return True


class Pending:
    """A collective that an ordered worker (comm/worker.py) launches or runs: `job()` returns its
    Work, or the thread calls launched()/failed() itself (the check). wait() waits for the launch,
    then for the Work (`waits(self)`: how, where the wait is bounded: the check's); an error is
    raised to every waiter, each its own copy. work: launched already (the check's plan)."""

    def __init__(self, job: Optional[Callable] = None, waits: Optional[Callable] = None, work=None,
                 reads: bool = False):
        self.job, self.waits = job, waits
        self.launched = threading.Event()
        self.work = self.error = self.launched_at = None
        self.read = Then(DONE, self.wait_launched) if reads else None
        if work is not None:
            self.resolve(work)

    def run(self) -> None:
        """(On the worker.) job() launches the collective (or runs it, returning DONE)."""
        job, self.job = self.job, None  # [Note: the relay thread]: nothing held once done
        try:
            self.resolve(job())
        except BaseException as e:  # noqa: BLE001  raised to the waiters
            self.fail(e)

    def resolve(self, work) -> "Pending":
        self.work, self.launched_at = work, time.monotonic()
        self.launched.set()
        return self

    def fail(self, error) -> None:
        self.error = error
        self.launched.set()

    def wait_launched(self) -> None:
        self.launched.wait()
        if self.error is not None:
            raise type(self.error)(*self.error.args) from self.error

    def wait(self):
        self.launched.wait()
        if self.error is not None:  # (wait_launched() inline: every collective with the check on waits here)
            raise type(self.error)(*self.error.args) from self.error
        return self.work.wait() if self.waits is None else self.waits(self)

    def is_completed(self):
        return self.launched.is_set() and (self.error is not None or self.work.is_completed())

    def wait_for(self, seconds) -> bool:
        deadline = time.monotonic() + seconds
        if not self.launched.wait(seconds):
            return False
        self.wait_launched()
        return finished(self.work, deadline - time.monotonic())


HANDLES = (Done, Then, AllOf, Pending)


def read_of(work) -> Optional[Work]:
    """Done once `work` no longer reads its input: a handle's `read` ([Note: reading the input] in
    comm/hybrid.py), None where only its end can say (torch's Works, most handles)."""
    return work.read if isinstance(work, HANDLES) else None


@functools.lru_cache(maxsize=8)
def _delta(seconds) -> timedelta:
    """(The check's poll interval is made once, not at every wait.)"""
    return timedelta(seconds=max(seconds, 1e-3))


def finished(work, seconds) -> bool:
    """Waits up to `seconds` for a launched collective: True once it completed (a planned one's
    wait checks in between whether the other ranks went elsewhere, comm/check.py)."""
    if isinstance(work, HANDLES):
        return work.wait_for(seconds)
    if isinstance(work, dist.Work):
        try:  # a zero timeout would mean none: wait at least a millisecond
            # gloo's send/recv say False on timeout, its collectives raise
            return work.wait(_delta(seconds)) is not False
        except RuntimeError as e:
            if "timed out" in str(e).lower():
                return False
            raise
    return True  # done when returned (an object all-gather)
