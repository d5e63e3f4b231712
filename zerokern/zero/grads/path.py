"""The grad paths: what .grad holds and when, and what a bucket's reduction means, for the two
grad modes of the stage definition. grad_path() chooses the mode once (a GradPath); it makes each
dtype group's (FlatParams') grad path, which owns the group's buckets and each member's .grad
state (grads/members.py). Outside core/stage.py this is the one file that asks which grad mode it
is in.

LocalGrads, stages 0 and 1, and every stage on one process. A bucket's full buffer
holds this rank's grads as autograd accumulated them, and .grad is a view of it from backward
until zero_grad() ([Note: the local grads are the truth] in bucket.py). At stage 0 (and on one
process) the bucket all-reduces in place, so .grad holds the average after backward, as DDP's;
at stage 1 it reduce-scatters into a shard of its own and .grad keeps the local grad.

ReleasedGrads, stages 2 and 3 on several ranks: [Note: stage-2 memory] (released.py) and
[Note: stage-2 .grad] (placeholder.py). Both answer (beside MemberGrads' own):
    launch / settle / abandon(b)         the bucket's transitions, as ReduceSchedule (and a grad
    end_round(b, release)                that arrives while its bucket is in flight) drives them:
    zero(b, set_to_none)                 what the mode does around each is done here, so a bucket
                                         keeps buffers and collectives only
    before_accumulate(i)                 autograd is about to add a grad into params[i].grad
    grad_changed(i)                      params[i].grad is no longer the tensor the runtime bound
GradPath.after_backward(agreement) is the mode's agreement after a synced backward (several ranks
with local grads: stage 1 here; none at stage 0).
"""

import torch

from ..comm.wire import GradWire
from ..comm.works import read_of
from ..core.stage import GradMode, Strategy
from ..core.states import BucketState
from .bucket import GradBucket
from .members import MemberGrads
from .placeholder import ShardedGrad
from .released import ReleasingGradBucket


def _bucket_name(flat, b) -> str:
    """For errors, profiler labels and the collective check: unit, dtype, bucket index."""
    return f"{flat.unit_name}:{str(flat.dtype).replace('torch.', '')}:{b.index}"


def _wire(comm, precision, flat, b):
    """The bucket's GradWire ([Note: quantized reductions] in comm/wire.py), None where its grads
    travel as they are (or do not travel: one process). Its rounding is keyed by comm.wire_rank."""
    if precision is None or not comm.distributed:
        return None
    return GradWire(precision, _bucket_name(flat, b), comm.wire_rank)


class GradPath:
    """The grad mode of a stage, chosen once by grad_path(): the same for every unit of an
    optimizer (their configs agree)."""

    def __init__(self, releases: bool, local: bool):
        self.releases = releases  # ReleasedGrads, else LocalGrads
        self.local = local  # .grad keeps this rank's local grad after backward (stage 1), not the average
        # the mode's agreement after a synced backward (Agreement.after_backward); None: nothing to
        # agree (.grad holds the average: stage 0, and every stage on one process)
        self.after_backward = (ReleasedGrads.after_backward if releases else
                               LocalGrads.after_backward if local else None)
        # the flags of which members a backward reached, agreed behind the reductions
        # (Agreement.before_settle); None: the stage keeps no such flags
        self.usage = ReleasedGrads.usage if releases else None

    def group(self, flat, comm, strategy: Strategy, reduce_precision=None) -> MemberGrads:
        """The grad path of one dtype group: its buckets and its members' .grad."""
        if self.releases:
            return ReleasedGrads(flat, comm, reduce_precision)
        return LocalGrads(flat, comm, strategy.reduce_scatters, reduce_precision, self.local)


def grad_path(strategy: Strategy) -> GradPath:
    """The grad path of a stage's dtype groups, chosen once from the stage definition."""
    return GradPath(strategy.grads is GradMode.SCATTER_RELEASE, strategy.local_grads)


class LocalGrads(MemberGrads):
    def __init__(self, flat, comm, scatters: bool, reduce_precision, local: bool):
        super().__init__(flat, [GradBucket(flat.layout, b, flat.dtype, flat.device, comm, flat.rank, scatters,
                                           _bucket_name(flat, b), _wire(comm, reduce_precision, flat, b))
                                for b in flat.layout.buckets])
        self.local = local  # .grad keeps this rank's local grad after backward (stage 1), not the average

    def before_accumulate(self, i: int) -> None:
        """Before autograd adds a grad into params[i].grad. A bucket still in flight here was
        launched before this grad came: it is waited for first, so the add never races the
        collective ([Note: the local grads are the truth])."""
        m, bucket = self.members[i], self.bucket[i]
        if bucket.state is BucketState.IN_FLIGHT:
            bucket.wait()
        g = m.param.grad
        if bucket.is_view(i, g, m.shape):
            return  # the usual case: autograd adds into the bound view in place
        self.note_stale(i)  # one process at stages 2/3 frees its buffers after step() too
        if g is None or isinstance(g, ShardedGrad):
            # torch starts from no grad: a zeroed slot, which autograd adds into in place
            self.set(i, bucket.zeroed_view(i, m.shape))

    def grad_changed(self, i: int) -> None:
        """Nothing to forget: the local grads are the truth, and sync() moves a new one in."""

    # The bucket's own transitions are the whole story here: its buffer is kept until zero_grad().
    def launch(self, bucket) -> None:
        bucket.launch()

    def settle(self, bucket) -> None:
        bucket.wait()

    def abandon(self, bucket) -> None:
        bucket.abandon()

    def end_round(self, bucket, release: bool) -> None:
        bucket.release() if release else bucket.end_round()

    def zero(self, bucket, set_to_none: bool) -> None:
        bucket.zero(set_to_none)

    @staticmethod
    def after_backward(agreement) -> None:
        """[Note: overflow on any rank] at stage 1: if a reduced shard holds an inf/nan on some
        rank, an inf is written into a local grad on every rank, so every rank's GradScaler
        (which reads local .grad) skips and backs off alike. At stage 0 .grad holds the average:
        every rank's scaler sees the same values, and nothing is agreed (GradPath asks only at
        stage 1)."""
        flag, _ = agreement.agreed_overflow()
        for s in agreement.stores:
            for i in s.bucket.plan.tensors:
                p = s.flat.params[i]
                if p.numel() and p.grad is not None:
                    s.bucket.poke_overflow(p.grad.view(-1)[:1], flag)
                    return


class ReleasedGrads(MemberGrads):
    """Stages 2/3 on several ranks ([Note: stage-2 memory], [Note: stage-2 .grad])."""

    def __init__(self, flat, comm, reduce_precision):
        super().__init__(flat, [ReleasingGradBucket(flat.layout, b, flat.dtype, flat.device, comm, flat.rank, True,
                                                    _bucket_name(flat, b), _wire(comm, reduce_precision, flat, b))
                                for b in flat.layout.buckets])

    # --- the bucket's transitions ([Note: stage-2 memory] in released.py) ------------------

    def launch(self, bucket) -> None:
        """A re-launch first settles the last reduction; the members' .grad changes are taken at
        the same point of the collective order on every rank (sync(): a reduced grad the user
        dropped is zeroed in the shard before any rank adds a new reduction to it), then the
        pending grads go."""
        if bucket.state is BucketState.IN_FLIGHT:
            self.settle(bucket)
        self.sync(bucket.plan.tensors)
        bucket.launch()

    def settle(self, bucket) -> None:
        """IN_FLIGHT -> REDUCED: the full buffer, scratch since the launch, goes back to the pool."""
        if bucket.state is BucketState.IN_FLIGHT:
            bucket.wait()
            if bucket.full is not None:
                self._give_back(bucket)

    def release_buffer(self, bucket) -> None:
        """The full buffer goes back to the pool as soon as the reduction no longer reads it (the
        end of its first hop with hybrid sharding: [Note: reading the input] in comm/hybrid.py,
        else its end); the reduction may run on, and settle() ends it."""
        if bucket.state is not BucketState.IN_FLIGHT:
            return  # settled already (re-launched since, or waited for): as settle(), nothing to give
        read = read_of(bucket.work)  # None: only the reduction's end can say
        if read is None:
            bucket.wait()
        else:
            bucket.comm.wait(read)
        if bucket.full is not None:
            self._give_back(bucket)

    def abandon(self, bucket) -> None:
        self.settle(bucket)
        bucket.abandon()

    def end_round(self, bucket, release: bool) -> None:
        """After step() (release or not: the full buffer never outlives the round here)."""
        if bucket.state is BucketState.IN_FLIGHT:
            self.settle(bucket)
        if bucket.full is not None:
            self._give_back(bucket)
        bucket.end_round()

    def zero(self, bucket, set_to_none: bool) -> None:
        self.end_round(bucket, True)

    def _give_back(self, bucket) -> None:
        """A bucket's full buffer is going back to the pool: its members' .grad become
        placeholders first, also where this rank had no grad: the shard may hold other ranks' part,
        as DDP gives a param unused on one rank the averaged grad."""
        for k, i in enumerate(bucket.plan.tensors):
            m = self.members[i]
            g = m.param.grad
            # a .grad still the one bound (the usual case) passes on identity: a view of this buffer
            if bucket.got[k] and (g is None or g is self.bound[i] or isinstance(g, ShardedGrad)
                                  or bucket.is_view(i, g, m.shape)):
                self.set(i, ShardedGrad(m.param, m.name, bucket, i, m.shape))
        bucket.give_back()

    # --- a member's .grad ---------------------------------------------------------------

    def before_accumulate(self, i: int) -> None:
        """Before autograd adds a grad for params[i]. A bucket still in flight (launched before
        this grad came: a reentrant checkpoint segment, shared weights reaching the param twice, a
        backward after an interrupted one) is settled first, so the add never races the
        collective. A .grad that views the pending buffer takes the add in place (accumulation).
        A grad assigned by hand moves into the buffer and autograd adds to it, as torch would.
        Otherwise (None, a placeholder, a dropped view) .grad becomes None: autograd then hands
        over its new grad, and the hook copies it into the buffer (taken from the pool), which so
        needs no zeroing ([Note: zeroing on demand])."""
        m, bucket = self.members[i], self.bucket[i]
        if bucket.state is BucketState.IN_FLIGHT:
            self.settle(bucket)
        g = m.param.grad
        if g is None and self.bound[i] is None:
            return  # the usual case (after zero_grad()): nothing bound, nothing stale, nothing to take
        self.note_stale(i)
        if bucket.is_view(i, g, m.shape):
            return
        self.grad_changed(i)
        if isinstance(g, torch.Tensor) and not isinstance(g, ShardedGrad):
            view = bucket.view_for_overwrite(i, m.shape)
            view.copy_(g)
            bucket.note_write()
            self.set(i, view)
        else:
            self.set(i, None)

    def grad_changed(self, i: int) -> None:
        """A .grad the user replaced (None or a tensor) since the runtime bound it: the param's
        reduced grad of this round is forgotten, as torch forgets a grad it no longer holds (its
        pending part, if any, is zeroed by before_accumulate() or launch())."""
        # Also where this rank had no grad (bound None): the shard holds the other ranks' part.
        if self.members[i].param.grad is not self.bound[i]:
            self.bucket[i].drop_reduced(i)
            if isinstance(self.bound[i], ShardedGrad):
                self.bound[i] = None

    @staticmethod
    def usage(agreement) -> list:
        """1.0 for each member of the stores' buckets that a backward on this rank reached, else 0."""
        usage = []
        for s in agreement.stores:
            usage += map(float, s.bucket.got)
        return usage

    @staticmethod
    def after_backward(agreement) -> None:
        """The placeholders in .grad answer the scaler from the agreed overflow flag ([Note:
        stage-2 .grad]). Only a scaler asks, so once step() has run without one (fp32, bf16
        training) the pass over the shards is left out. The decision is the same on every rank
        (step() checks that the scalers agree). Asking when the flag was not computed here (the
        first steps ran without a scaler) gives this rank's flag, and step() raises if the ranks'
        scalers disagree. The same collective agrees on which params had a grad anywhere.

        [Note: who had a grad] At stages 2/3 a param no backward on this rank reached keeps
        .grad None, as torch's; one another rank's backward reached gets the placeholder of the
        averaged grad, as DDP gives it. So every rank holds the same .grad kinds after a synced
        backward, and a change of one (.grad = None, zero_()) happens on every rank, the shard's
        owner too, at the same point of the collective order. One small all-reduce per synced
        backward (DDP's find_unused_parameters pays the same); without a scaler the flags are
        known once the last reduction is launched, so theirs is launched behind it (before any
        is waited for: Agreement.before_settle) and the ranks meet once at the end of backward."""
        if agreement.scaler_in_use:
            flag, usage = agreement.agreed_overflow(ReleasedGrads.usage(agreement))
            for s in agreement.stores:
                s.bucket.overflow = flag
        else:
            usage = agreement.agreed_usage()
        k = 0
        for s in agreement.stores:
            grads = s.flat.grads
            for i, got in zip(s.bucket.plan.tensors, s.bucket.got):
                if usage[k] > 0 and not got and grads.members[i].param.grad is None:
                    grads.set(i, grads.placeholder(i))
                k += 1
