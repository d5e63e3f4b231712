"""ReduceSchedule: one global order of every gradient bucket of every unit and
dtype that an optimizer owns, and the backward state (BackwardState).

[Note: one collective order] Every rank must issue the same collectives in the
same order. The schedule puts all buckets in one list, ordered by when backward
completes them (the lowest param index in the optimizer's param list last:
[Note: bucket order] in unit.py), which every rank computes alike from the
same params. A bucket is launched in backward only when it is complete and
every bucket before it has been launched; the end-of-backward callback
launches the rest, in order, complete or not. So a param with no grad on one
rank, or one dtype finishing before another, never reorders collectives.

[Note: interrupted backward] autograd drops the queued end-of-backward callback
when backward raises. The schedule then stays RUNNING with collectives in
flight. The next forward of a unit, zero_grad() or step() calls reset(): it
waits out those collectives (every rank launched the same ones), and the
version rule of grads/bucket.py ([Note: the local grads are the truth]) decides
whether their results are still valid when step() comes.
"""

import inspect
import weakref
from collections import deque
from typing import Callable, List, Optional, Tuple

import torch

from .bucket import GradBucket
from .pool import IN_FLIGHT_BUCKETS, GradBufferPool
from ..core.states import BackwardState, BucketState


class _WeakCallback:
    """A schedule's callback attribute, held weakly where it is a bound method (why: the comment
    on after_backward in ReduceSchedule.__init__). Stored as a callable returning the callback
    (or None) in `_<name>`, which the backward calls directly."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.slot)()

    def __set__(self, obj, fn: Optional[Callable[[], None]]) -> None:
        setattr(obj, self.slot, weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn))


class ReduceSchedule:
    """placed: (grad path, bucket) pairs in the collective order: each bucket with the grad path
    of its dtype group (grads/path.py), which the schedule asks to move the bucket from phase to
    phase."""

    after_backward = _WeakCallback()
    before_settle = _WeakCallback()

    def __init__(self, placed: List[Tuple[object, GradBucket]], comm, overlap: bool,
                 after_backward: Optional[Callable[[], None]] = None):
        self.buckets = [b for _, b in placed]
        self._sizes = [len(b.plan.tensors) for b in self.buckets]  # members per bucket
        self._paths = [g for g, _ in placed]
        self.comm = comm
        self.overlap = overlap
        # e.g. sharing an fp16 overflow across ranks. A bound method is held weakly: the params'
        # grad hooks hold the units, the units this schedule, and a strong reference to the
        # optimizer here would close a cycle through the hooks that the garbage collector does not
        # see (torch keeps tensor hooks in C++), keeping every dropped optimizer and its buffers.
        self.after_backward = after_backward
        # launched behind the last reductions of a backward, before any is waited for (the
        # agreement's usage flags: [Note: who had a grad] in grads/path.py); held weakly too
        self.before_settle = None
        self.owner = None  # a weak reference to the ZeroEngine driving this schedule
        self.state = BackwardState.IDLE
        self._next = 0  # buckets before this one were launched in the running backward
        # [Note: stage-2 memory]: stage-2 buckets draw their full buffers from one pool, and at most
        # IN_FLIGHT_BUCKETS of their reductions run at once in backward (the oldest is waited for).
        # A bucket of several params is at most about bucket_cap_mb: those share one buffer size.
        # [Note: what the pool keeps]: free buffers for a backward's reductions in flight, the two
        # buckets being filled and the one a tied embedding holds open (zerokern/plan counts those).
        unit = {}
        for b in self.buckets:
            if b.draws_from_pool and len(b.plan.tensors) > 1:
                unit[b.dtype] = max(unit.get(b.dtype, 0), b.plan.padded_numel)
        self.pool = GradBufferPool(keep=IN_FLIGHT_BUCKETS + 3, unit=unit)
        self._in_flight = deque()  # (grad path, bucket) of the pooled reductions running
        for b in self.buckets:
            if b.draws_from_pool:
                b.pool = self.pool

    # --- backward ------------------------------------------------------------

    def on_grad(self, bucket: GradBucket) -> None:
        """A unit's hook saw a grad in a synced backward."""
        if self.state is not BackwardState.RUNNING:
            self.state = BackwardState.RUNNING
            self._next = 0
            # [Note: hooks under torch.compile] (params/per_unit.py): run eagerly, never traced
            torch.autograd.Variable._execution_engine.queue_callback(torch.compiler.disable(self._end_of_backward))
        if self.overlap:  # the next bucket is complete once every member's hook ran in this backward
            while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == self._sizes[self._next]:
                self._launch(self._next)
                self._next += 1

    def _launch(self, k: int) -> None:
        path, bucket = self._paths[k], self.buckets[k]
        path.launch(bucket)
        if bucket.draws_from_pool:  # its buffer goes back once the reduction has read it
            self._in_flight.append((path, bucket))
            while len(self._in_flight) > IN_FLIGHT_BUCKETS:
                oldest_path, oldest = self._in_flight.popleft()
                oldest_path.release_buffer(oldest)  # its full buffer goes back to the pool

    def _end_of_backward(self) -> None:
        with torch.no_grad():
            for k in range(self._next, len(self.buckets)):
                self._launch(k)
            before = self._before_settle()
            if before is not None:
                before()
            for path, b in zip(self._paths, self.buckets):
                path.settle(b)
            self._in_flight.clear()
            self._next = 0
            self.state = BackwardState.FINISHED
            after = self._after_backward()
            if after is not None:
                after()

    def reset(self) -> None:
        """[Note: interrupted backward] A RUNNING backward whose callback never came: wait out
        what it launched; nothing else changes. No-op otherwise."""
        if self.state is BackwardState.RUNNING and torch._C._current_graph_task_id() == -1:
            for path, b in zip(self._paths, self.buckets):
                path.abandon(b)
            self._in_flight.clear()
            self._next = 0
            self.state = BackwardState.IDLE

    # --- step ------------------------------------------------------------------

    def reduce(self, needs: List[bool]) -> None:
        """Launch the buckets that some rank needs reduced (the same list on every rank), then wait for all."""
        with torch.no_grad():
            for path, b, need in zip(self._paths, self.buckets, needs):
                if need:
                    path.launch(b)
            for path, b in zip(self._paths, self.buckets):
                if b.state is BucketState.IN_FLIGHT:  # settle() of one that is not: nothing to do
                    path.settle(b)

    def end_round(self, release: bool, updated: bool = True) -> None:
        """updated: the step changed the params (its round's error feedback is kept)."""
        for path, b in zip(self._paths, self.buckets):
            path.end_round(b, release)
            if b.wire is not None:  # the round's error feedback ([Note: error feedback])
                b.settle_wire(updated)
        self._in_flight.clear()
        self._next = 0
        self.state = BackwardState.IDLE

    def zero(self, set_to_none: bool = True) -> None:
        self.reset()
        for path, b in zip(self._paths, self.buckets):
            path.zero(b, set_to_none)
            b.settle_wire(False)  # grads dropped before a step: so is what their rounding lost
        self._in_flight.clear()
        self._next = 0
        self.state = BackwardState.IDLE
