"""ReleasingGradBucket: a bucket of the released-grads path (stages 2 and 3 on several ranks,
ReleasedGrads in path.py), whose full gradient buffer lives only while it is accumulated or
reduced.

[Note: stage-2 memory] At stage 2 the reduced shard is the truth, not the
local grads (contrast [Note: the local grads are the truth] in grads/bucket.py, which
stages 0 and 1 keep). The full buffer holds only the local grads not yet
reduced ("pending"); each reduction adds its average into the shard, which
accumulates over the synced backwards of a round (a round ends at step() or
zero_grad()), and the full buffer goes back to the pool the moment the
reduction is waited for (the pool keeps it for the next backward: [Note: what
the pool keeps] in grads/pool.py). So after a synced backward a rank holds its reduced
shards plus nothing else; during backward, the buckets autograd is filling
(usually one or two, and one a tied embedding holds open all backward) plus at
most IN_FLIGHT_BUCKETS reductions reading their buffers (ReduceSchedule waits until the
oldest beyond that has read its buffer: the reduction's end, or with hybrid sharding the end of
its first hop, [Note: reading the input] in comm/hybrid.py); zerokern/plan counts 5 buckets for it. Under no_sync() the pending buffers stay, as FSDP2's
unsharded grads do, and the next synced backward or step() reduces them.

What .grad holds is in [Note: stage-2 .grad] (grads/placeholder.py). A grad that
arrives after its bucket was reduced (a second synced backward, reentrant
checkpointing, shared weights) goes into a fresh pending buffer and is
reduced again, adding to the shard; a reduced grad that the user drops
(.grad = None, or a tensor assigned by hand) has its part of this rank's shard
zeroed (drop_reduced), as torch would forget it. The shard holds every rank's
part, so every rank must drop at the same point of the collective order: the
members' .grad are looked at just before each launch (and at step()), never
only when a rank's own backward reaches the param.

[Note: the collective for the backend] The pending buffer is scratch once it
is launched, so the bucket may reduce it with whichever collective the
backend does best (Comm.prefers_all_reduce): an in-place all-reduce followed
by reading this rank's range (gloo on more than 2 ranks, whose reduce-scatter
is slower than its all-reduce), or a reduce-scatter (NCCL, half the bytes;
on 2 gloo ranks an exchange of halves, [Note: reduce-scatter as an exchange]
in comm/base.py).
"""

import torch

from ..core.states import BucketState
from .bucket import GradBucket, slot_view

class ReleasingGradBucket(GradBucket):
    draws_from_pool = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool = None  # set by the ReduceSchedule that owns the bucket; plain allocation until then
        self._base = None  # the pool buffer self.full is a prefix of
        self._scratch = None  # where the running reduction leaves its result, if not in self.shard
        self.has_reduced = False  # the shard holds reductions of this round (see drop_reduced)
        self.overflow = None  # the agreed inf/nan flag of the shard (FusedZeroAdam, after backward)
        self._unwritten = set()  # members whose slot of a pooled buffer still holds old bytes
        ends = sorted((s.offset, s.offset + s.numel) for s in (self.layout.slots[i] for i in self.plan.tensors))
        starts = [0] + [e for _, e in ends]
        gaps = [(a, b) for a, b in zip(starts, [s for s, _ in ends] + [self.plan.padded_numel]) if b > a]
        # the padding's positions, zeroed with one op per acquire (a gap per member otherwise)
        self._padding = torch.tensor([k for a, b in gaps for k in range(a, b)], dtype=torch.long, device=self.device)

    # --- buffers -------------------------------------------------------------

    def full_buffer(self) -> torch.Tensor:
        if self.full is None:
            n = self.plan.padded_numel
            if self.pool is not None:
                # [Note: zeroing on demand] Most slots are overwritten by a whole grad (autograd's,
                # copied in by the post-accumulate hook), so a pooled buffer is not zeroed as a
                # whole: the padding is zeroed now, a member's slot when a view of it is handed
                # out to be added to (view()), and at launch for members without a grad.
                self._base = self.pool.acquire(n, self.dtype, self.device, zero=False)
                self.full = self._base[:n]
                if self._padding.numel():
                    self.full.index_fill_(0, self._padding, 0)
                self._unwritten = set(self.plan.tensors)
                self.known_version = self.full._version  # the runtime's own writes, not an edit
            else:
                self.full = torch.zeros(n, dtype=self.dtype, device=self.device)
        return self.full

    def view(self, index: int, shape) -> torch.Tensor:
        view = super().view(index, shape)
        if index in self._unwritten:
            self._unwritten.discard(index)
            view.zero_()
            self.note_write()
        return view

    def view_for_overwrite(self, index: int, shape) -> torch.Tensor:
        s = self.layout.slots[index]
        full = self.full if self.full is not None else self.full_buffer()
        self._unwritten.discard(index)
        return slot_view(full, s.offset, shape)

    def give_back(self) -> None:
        """The full buffer goes back to the pool. The grad path (ReleasedGrads) calls this once the
        members' .grad no longer view it (they became placeholders): the bucket never reaches back
        into its owner, so whoever drives it hands out the placeholders first."""
        if self.full is None:
            return
        self.full = None
        self._unwritten = set()
        if self._base is not None:
            self.pool.release(self._base)
            self._base = None

    def reduced_grad(self) -> torch.Tensor:
        return self.shard

    def drop_reduced(self, index: int) -> None:
        """Member `index`'s reduced grad is forgotten (.grad set to None, replaced, or zeroed):
        its part of this rank's shard becomes zero."""
        self.stale.discard(index)  # torch forgets it too: nothing from before the last step() is left
        if not self.has_reduced:
            return
        pc = self.layout.rank_piece(self.rank, index)
        if pc is not None:
            self.shard[pc.shard_offset:pc.shard_offset + pc.numel].zero_()

    def overflow_flag(self) -> torch.Tensor:
        """1.0 if the reduced shard holds an inf/nan on some rank (agreed after backward), else 0."""
        if self.overflow is not None:
            return self.overflow
        # No agreed flag (an interrupted backward, or no scaler seen yet): this rank's.
        flag = torch.zeros((), device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_([self.shard], flag, torch.ones((), device=self.device))
        return flag

    # --- transitions -----------------------------------------------------------

    def edited(self) -> bool:
        """Pending grads changed in place while the shard holds reductions of this round (a
        no_sync backward after a synced one, then an edit): the edit cannot reach the reduced
        part, so step() raises as at stage 1. A placeholder refuses edits itself."""
        return self.has_reduced and self.full is not None and self.full._version != self.known_version

    def launch(self) -> None:
        """IDLE/REDUCED -> IN_FLIGHT: the pending grads (zeros for members without one) are reduced.
        ReleasedGrads.launch settles a reduction still in flight and takes the members' .grad changes
        first."""
        if self.state is BucketState.IN_FLIGHT:
            raise RuntimeError(f"zerokern internal error: bucket {self.name} launched while its reduction runs")
        full = self.full if self.full is not None else self.full_buffer()
        for i in self._unwritten:  # no grad in this buffer (one may be in the shard already): zeros
            s = self.layout.slots[i]
            full[s.offset:s.offset + s.numel].zero_()
        self._unwritten = set()
        full = self._begin_launch(zero_missing=True)  # a dropped member may have left values in its slot
        name, shard = self.name, self.shard  # made here at the latest: wait() writes it
        if self.comm.prefers_all_reduce:
            self._scratch = full[self._range[0]:self._range[1]]
            self.work = self.comm.all_reduce(full, name=f"all_reduce[{name}]", across=self._scratch, wire=self.wire)
        else:
            self._scratch = torch.empty_like(shard) if self.has_reduced else shard
            self.work = self.comm.reduce_scatter(self._scratch, full, name=f"reduce_scatter[{name}]", wire=self.wire)
        self.state = BucketState.IN_FLIGHT
        self.overflow = None  # the shard changes: a flag agreed before no longer holds

    def wait(self) -> None:
        """IN_FLIGHT -> REDUCED: the average is added into the shard. The full buffer is scratch from
        now on; ReleasedGrads.settle gives it back."""
        if self.state is not BucketState.IN_FLIGHT:
            return
        self.comm.wait(self.work)
        self.work = None
        result, self._scratch = self._scratch, None
        shard, dp = self._shard, self.dp_size  # launch() made the shard
        if self.has_reduced:
            shard.add_(result.div_(dp))
        elif result is shard:
            shard.div_(dp)
        else:
            torch.div(result, dp, out=shard)
        self.has_reduced = True
        self.state = BucketState.REDUCED

    def end_round(self) -> None:
        """After step(): -> IDLE, the shard stale. ReleasedGrads.end_round settled the reduction and
        gave the full buffer back first."""
        if self.state is BucketState.IN_FLIGHT or self.full is not None:
            raise RuntimeError(f"zerokern internal error: bucket {self.name} ended its round holding a buffer")
        self.state = BucketState.IDLE
        self.ready.clear()
        self.rewritten = False
        self.reduced_in_round = False
        self.has_reduced = False
        self.overflow = None
        self.stale.clear()
        self.got = [False] * len(self.got)

    def abandon(self) -> None:
        """After ReleasedGrads.settle: the reduction of an interrupted backward is kept (torch keeps
        its partial grads too)."""
        self.ready.clear()

    def nbytes(self) -> dict:
        full = 0 if self.full is None else self.full.numel() * self.full.element_size()
        shard = 0 if self._shard is None else self._shard.numel() * self._shard.element_size()
        return {"grads": full + shard, "comm_buffers": 0,
                "error_feedback": self._wire_nbytes()}
