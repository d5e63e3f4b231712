"""GradBucket: one bucket's gradient buffers and its reduction, and the one
place that says what phase the bucket is in (BucketState).

[Note: the local grads are the truth] A bucket's full buffer holds this rank's
local gradients, exactly as autograd accumulated them. A reduction is only a
cached result of them. Every write the runtime knows of (autograd's
accumulation, seen by the post-accumulate hook; a grad assigned by hand; its
own zeroing) records the buffer's version counter (Tensor._version, bumped by
every in-place write) in `known_version`, and a grad that arrives after its
bucket was launched (a backward after an interrupted one, a reentrant
checkpoint segment or shared weights reaching a param twice) marks the bucket
`rewritten`: step() reduces it again (ReduceSchedule agrees on it across ranks
first), so no stale reduction is ever used. At stage 0 the all-reduce works in
place, so after it the buffer holds the average: an edit after backward (a
mask, torch's clip_grad_norm_) edits the average, as under DDP, and is kept; a
second all-reduce of a rewritten bucket is exact because the average is the
same on every rank (avg + local -> avg + avg(local)). At stages 1/2 with more
than one rank, .grad holds the local grad while the reduced one is a shard: an
in-place edit there (the version moved past `known_version`) cannot give
DDP's numbers when it differs per rank (clipping by each rank's own norm), so
`edited()` reports it and step() raises on every rank, naming the params and
opt.clip_grad_norm_. A grad that arrives while its bucket's
collective runs waits for it before autograd adds it in (ShardUnit's pre-hook),
so no write ever races a collective.
"""

import functools
from typing import List, Optional

import torch

from ..core.layout import Bucket, FlatLayout
from ..core.states import BucketState


class GradBucket:
    """Bucket `plan.index` of `layout`: its full grad buffer (allocated on first
    use; released at stage 2 on one process after the step) and, when sharded over
    ranks, this rank's reduced shard (kept). Stage 2 on several ranks is
    ReleasingGradBucket (grads/released.py)."""

    draws_from_pool = False  # the full buffer is its own, kept until step()/zero_grad()

    def __init__(self, layout: FlatLayout, plan: Bucket, dtype, device, comm, rank: int, scatters: bool, name: str,
                 wire=None):
        self.layout, self.plan = layout, plan
        self.dtype, self.device = dtype, device
        self.comm, self.rank = comm, rank
        self.dp_size = comm.dp_size  # how many ranks' grads a reduction averages (fixed with the group)
        self.scatters = scatters  # reduce-scatter into self.shard (stages 1/2, world > 1); else all-reduce in place
        self.name = name  # for errors and profiler labels
        self.wire = wire  # a GradWire (comm/wire.py) when the grads travel in another precision, else None
        self.full: Optional[torch.Tensor] = None
        self._reduced_view: Optional[torch.Tensor] = None
        self._shard: Optional[torch.Tensor] = None  # the reduced shard (scatters only): see shard
        self.state = BucketState.IDLE
        self.work = None
        self.rewritten = False  # a hook fired after the launch (reentrant checkpointing, shared weights)
        self.known_version = None  # full._version after the last write the runtime knows of
        self.reduced_in_round = False  # launched at least once since the round began
        self.ready = set()  # members whose hook ran in the current synced backward
        # By position in plan.tensors: the member has a grad, as torch's p.grad is not None: set by
        # backward, kept across step() where the buffer is kept (stages 0/1), cleared by None.
        self.got: List[bool] = [False] * len(plan.tensors)
        # Members whose grad is one step() had consumed (freed), then added to or stepped again, and
        # not dropped or zeroed since: step() raises ([Note: grads after step] in placeholder.py).
        self.stale: set = set()
        self._pos = {t: k for k, t in enumerate(plan.tensors)}
        self._range = layout.rank_range(rank, plan.index)  # this rank's [start, end) of the bucket
        self._gaps = layout.gaps(plan.index)  # what no member holds (zero(): a quantized all-reduce)
        self._gap_index = None  # their elements' indices, made at the first zero() that needs them

    # --- buffers -------------------------------------------------------------

    @property
    def shard(self) -> Optional[torch.Tensor]:
        """This rank's reduced grad shard (None where the bucket does not scatter), zeros until a
        reduction writes it. Made at its first use, not with the bucket: at stage 3 the units are
        built (and with OffloadPolicy(params=True) their param slices held) before the optimizer
        moves the slices to disk, and a model's slices and grad shards together at construction
        were twice the memory of either."""
        if self._shard is None and self.scatters:
            self._shard = torch.zeros(self.plan.shard_numel, dtype=self.dtype, device=self.device)
        return self._shard

    def full_buffer(self) -> torch.Tensor:
        if self.full is None:
            self.full = torch.zeros(self.plan.padded_numel, dtype=self.dtype, device=self.device)
            start, end = self._range
            self._reduced_view = None if self.scatters else self.full[start:end]
        return self.full

    def view(self, index: int, shape) -> torch.Tensor:
        """Tensor `index`'s grad as a view of the full buffer."""
        return slot_view(self.full_buffer(), self.layout.slots[index].offset, shape)

    def view_for_overwrite(self, index: int, shape) -> torch.Tensor:
        """As view(), for a caller that writes the whole slot before anything reads it."""
        return self.view(index, shape)

    def zeroed_view(self, index: int, shape) -> torch.Tensor:
        """view(), zeroed: for a member that starts from no grad (autograd adds into it)."""
        view = self.view(index, shape)
        view.zero_()
        self.note_write()
        return view

    def is_view(self, index: int, grad: Optional[torch.Tensor], shape) -> bool:
        full = self.full
        # a placeholder (grads/placeholder.py) has no storage: its data_ptr() is 0, never a slot's
        if grad is None or full is None or grad.shape != shape:
            return False
        s = self.layout.slots[index]
        return grad.data_ptr() == full.data_ptr() + s.offset * full.element_size()

    def reduced_grad(self) -> torch.Tensor:
        """This rank's reduced (averaged) grad shard; valid in state REDUCED."""
        if self.scatters:
            return self.shard
        self.full_buffer()
        return self._reduced_view  # this rank's range of the full buffer; goes with it in release()

    # --- transitions -----------------------------------------------------------

    def mark_got(self, index: int, synced: bool) -> None:
        k = self._pos[index]
        self.got[k] = True
        if self.state is not BucketState.IDLE:
            self.rewritten = True
        if self.full is not None:  # note_write(), inline: it runs per grad
            self.known_version = self.full._version
        if synced:
            self.ready.add(index)

    def note_write(self) -> None:
        """The runtime (or autograd, through a hook) just wrote the buffer: not a user edit."""
        if self.full is not None:
            self.known_version = self.full._version

    def edited(self) -> bool:
        """The local grads were changed in place after the reduction by something other than
        the runtime, at a stage where .grad holds local grads ([Note: the local grads are the truth])."""
        return (self.scatters and self.state is not BucketState.IDLE and self.full is not None
                and self.full._version != self.known_version)

    def clear_got(self, index: int) -> None:
        """The member's .grad was set to None: it has no grad this round."""
        self.got[self._pos[index]] = False
        self.ready.discard(index)

    def launch(self) -> None:
        """IDLE/REDUCED -> IN_FLIGHT: members with no grad this round contribute zeros."""
        self.wait()  # a re-launch waits out the previous collective on this buffer
        # In place (stage 0) the buffer holds averages after the first reduction, also for a
        # member this rank had no grad for: zeroing it again would drop the other ranks' part.
        full = self._begin_launch(zero_missing=self.scatters or not self.reduced_in_round)
        if self.wire is not None:  # stage 1's second reduction replaces the first ([Note: error feedback])
            self.wire.replaces = self.scatters
        if self.scatters:
            self.work = self.comm.reduce_scatter(self.shard, full, name=f"reduce_scatter[{self.name}]", wire=self.wire)
        else:
            self.work = self.comm.all_reduce(full, name=f"all_reduce[{self.name}]", across=full, wire=self.wire)
        self.state = BucketState.IN_FLIGHT

    def _begin_launch(self, zero_missing: bool) -> torch.Tensor:
        """The bookkeeping every launch shares; returns the full buffer to reduce. zero_missing:
        members without a grad this round contribute zeros."""
        full = self.full if self.full is not None else self.full_buffer()
        if zero_missing:
            for k, i in enumerate(self.plan.tensors):
                if not self.got[k]:
                    s = self.layout.slots[i]
                    full[s.offset:s.offset + s.numel].zero_()
        self.reduced_in_round = True
        self.ready.clear()
        self.rewritten = False
        self.known_version = full._version  # note_write(), inline: it runs per launch
        return full

    def wait(self) -> None:
        """IN_FLIGHT -> REDUCED: sums become averages."""
        if self.state is not BucketState.IN_FLIGHT:
            return
        self.comm.wait(self.work)
        self.work = None
        if self.comm.distributed:
            (self.shard if self.scatters else self.full).div_(self.dp_size)
        if not self.scatters:
            self.note_write()  # in place: the average is now what the buffer holds
        self.state = BucketState.REDUCED

    def needs_reduction(self) -> bool:
        """Not reduced this round though it has grads, or a grad came after the launch."""
        return (self.state is BucketState.IDLE and any(self.got)) or self.rewritten

    def end_round(self) -> None:
        """After step(): -> IDLE; the local grads (and who has one) stay until zero_grad(), as torch's."""
        self.wait()
        self.state = BucketState.IDLE
        self.ready.clear()
        self.rewritten = False
        self.reduced_in_round = False
        self.stale.clear()

    def zero(self, set_to_none: bool = True) -> None:
        """zero_grad(): -> IDLE, no grads counted (FlatParams.after_zero_grad counts the zero grads
        that torch would step). set_to_none: the buffer is left as it is; a member's slot is zeroed
        when a backward next binds it (zeroed_view), so nothing is zeroed twice."""
        self.end_round()
        self.got = [False] * len(self.got)
        if self.full is not None and not set_to_none:
            self.full.zero_()
            self.note_write()
        elif self.full is not None and self.wire is not None and not self.scatters:
            # [Note: quantized reductions] decode whole blocks, so a quantized all-reduce in place
            # also writes the gaps no member holds: 0 while every input is finite, but a block
            # with an inf/nan (a skipped step) leaves it there, and no backward rewrites the gaps,
            # so each later round's block would decode to nan again: they are zeroed here.
            if self._gap_index is None:  # one op per zero_grad, not one per gap (about one per member)
                self._gap_index = torch.cat([torch.arange(a, b) for a, b in self._gaps] or
                                            [torch.empty(0, dtype=torch.long)]).to(self.full.device)
            self.full.index_fill_(0, self._gap_index, 0)
            self.note_write()

    def release(self) -> None:
        """Stages 2/3 on one process after step(): -> IDLE and the full buffer dropped (the .grad
        views go with it)."""
        self.end_round()
        self.full = None
        self._reduced_view = None
        self.got = [False] * len(self.got)

    def abandon(self) -> None:
        """A backward that never finished: wait out its collective (every rank launched the same
        ones) and keep the result only as long as the local grads do not move
        ([Note: the local grads are the truth])."""
        self.wait()
        self.ready.clear()

    def poke_overflow(self, first: torch.Tensor, flag: torch.Tensor) -> None:
        """Write an inf into `first` (a member's first grad element) where flag > 0, so every
        rank's GradScaler sees the overflow. Not a grad edit: the reduction stays valid."""
        was_known = self.full is not None and self.full._version == self.known_version
        first.copy_(torch.where(flag > 0, torch.full_like(first, float("inf")), first))
        if was_known:
            self.note_write()

    def settle_wire(self, updated: bool) -> None:
        """The round's error feedback is kept if its step updated, else dropped ([Note: error feedback])."""
        if self.wire is not None:
            self.wire.settle(updated)

    def nbytes(self) -> dict:
        full = 0 if self.full is None else self.full.numel() * self.full.element_size()
        shard = 0 if self._shard is None else self._shard.numel() * self._shard.element_size()
        # the reduced shard is a gradient too
        return {"grads": full + shard, "comm_buffers": 0, "error_feedback": self._wire_nbytes()}

    def _wire_nbytes(self) -> int:
        return 0 if self.wire is None else self.wire.nbytes()


def slot_view(full: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """full[offset:offset + numel].view(shape) of a contiguous 1-D buffer, as one view op: a
    grad hook makes one per param and backward, and slicing then viewing dispatches twice
    (9 against 3 us on CPU-2)."""
    return full.as_strided(shape, _contiguous_strides(tuple(shape)), full.storage_offset() + offset)


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple) -> tuple:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))
