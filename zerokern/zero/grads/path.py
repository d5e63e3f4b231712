"""The grad paths: what .grad holds and when, and what a bucket's reduction means, for the two
grad modes of the stage definition, chosen once per dtype group (FlatParams) by grad_path().
Outside core/stage.py this is the one file that asks which grad mode it is in.

LocalGrads, stages 0 and 1, and every stage on one process. A bucket's full buffer
holds this rank's grads as autograd accumulated them, and .grad is a view of it from backward
until zero_grad() ([Note: the local grads are the truth] in bucket.py). At stage 0 (and on one
process) the bucket all-reduces in place, so .grad holds the average after backward, as DDP's;
at stage 1 it reduce-scatters into a shard of its own and .grad keeps the local grad.

ReleasedGrads, stages 2 and 3 on several ranks: [Note: stage-2 memory] (released.py) and
[Note: stage-2 .grad] (placeholder.py). Both answer:
    make_buckets(flat, comm, strategy)   the dtype group's GradBuckets
    launch / settle / abandon(flat, b)   the bucket's transitions, as ReduceSchedule (and a grad
    end_round(flat, b, release)          that arrives while its bucket is in flight) drives them:
    zero(flat, b, set_to_none)           what the mode does around each is done here, so a bucket
                                         keeps buffers and collectives only
    before_accumulate(flat, i)           autograd is about to add a grad into params[i].grad
    grad_changed(flat, i)                params[i].grad is no longer the tensor the runtime bound
    after_backward(agreement)            the mode's agreement after a synced backward (several
                                         ranks with local grads: stage 1 here)
"""

import torch

from ..comm.wire import GradWire
from ..core.stage import GradMode, Strategy
from ..core.states import BucketState
from .bucket import GradBucket
from .placeholder import CONSUMED, ShardedGrad
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


def note_stale(flat, i: int) -> None:
    """A backward adding to a grad step() had consumed and freed (stages 2/3) cannot give torch's
    numbers: the bucket notes it and step() raises on every rank ([Note: grads after step]). A
    grad the user dropped or replaced since such a backward (model.zero_grad(), p.grad = None: a
    GAN's G backward reached D's params after D's step) holds nothing from before: forgotten."""
    m = flat.members[i]
    g = m.param.grad
    if isinstance(g, ShardedGrad) and g.kind is CONSUMED:
        flat.bucket_of(i).stale.add(i)
    elif g is not m.bound:
        flat.bucket_of(i).stale.discard(i)


class LocalGrads:
    def __init__(self, local: bool):
        self.local = local  # .grad keeps this rank's local grad after backward (stage 1), not the average

    def make_buckets(self, flat, comm, strategy, reduce_precision=None):
        return [GradBucket(flat.layout, b, flat.dtype, flat.device, comm, flat.rank, strategy.reduce_scatters,
                           _bucket_name(flat, b), _wire(comm, reduce_precision, flat, b)) for b in flat.layout.buckets]

    def before_accumulate(self, flat, i: int) -> None:
        m, bucket = flat.members[i], flat.bucket_of(i)
        g = m.param.grad
        if bucket.is_view(i, g, m.shape):
            return  # the usual case: autograd adds into the bound view in place
        note_stale(flat, i)  # one process at stages 2/3 frees its buffers after step() too
        if g is None or isinstance(g, ShardedGrad):
            # torch starts from no grad: a zeroed slot, which autograd adds into in place
            flat.set_grad(i, bucket.zeroed_view(i, m.shape))

    def grad_changed(self, flat, i: int) -> None:
        """Nothing to forget: the local grads are the truth, and sync_grad moves a new one in."""

    # The bucket's own transitions are the whole story here: its buffer is kept until zero_grad().
    def launch(self, flat, bucket) -> None:
        bucket.launch()

    def settle(self, flat, bucket) -> None:
        bucket.wait()

    def abandon(self, flat, bucket) -> None:
        bucket.abandon()

    def end_round(self, flat, bucket, release: bool) -> None:
        bucket.release() if release else bucket.end_round()

    def zero(self, flat, bucket, set_to_none: bool) -> None:
        bucket.zero(set_to_none)

    def after_backward(self, agreement) -> None:
        """[Note: overflow on any rank] at stage 1: if a reduced shard holds an inf/nan on some
        rank, an inf is written into a local grad on every rank, so every rank's GradScaler
        (which reads local .grad) skips and backs off alike. At stage 0 .grad holds the average:
        every rank's scaler sees the same values, and nothing is agreed."""
        if not self.local:
            return
        flag, _ = agreement.agreed_overflow()
        for s in agreement.stores:
            for i in s.bucket.plan.tensors:
                p = s.flat.params[i]
                if p.numel() and p.grad is not None:
                    s.bucket.poke_overflow(p.grad.view(-1)[:1], flag)
                    return


def grad_path(strategy: Strategy):
    """The grad path of a dtype group, chosen once from the stage definition."""
    return ReleasedGrads() if strategy.grads is GradMode.SCATTER_RELEASE else LocalGrads(strategy.local_grads)


class ReleasedGrads:
    """Stages 2/3 on several ranks ([Note: stage-2 memory], [Note: stage-2 .grad])."""

    def make_buckets(self, flat, comm, strategy, reduce_precision=None):
        return [ReleasingGradBucket(flat.layout, b, flat.dtype, flat.device, comm, flat.rank, True,
                                    _bucket_name(flat, b), _wire(comm, reduce_precision, flat, b))
                for b in flat.layout.buckets]

    # --- the bucket's transitions ([Note: stage-2 memory] in released.py) ------------------

    def launch(self, flat, bucket) -> None:
        """A re-launch first settles the last reduction; the members' .grad changes are taken at
        the same point of the collective order on every rank (reconcile), then the pending grads go."""
        self.settle(flat, bucket)
        self.reconcile(flat, bucket)
        bucket.launch()

    def settle(self, flat, bucket) -> None:
        """IN_FLIGHT -> REDUCED: the full buffer, scratch since the launch, goes back to the pool."""
        if bucket.state is BucketState.IN_FLIGHT:
            bucket.wait()
            self._give_back(flat, bucket)

    def release_buffer(self, flat, bucket) -> None:
        """The full buffer goes back to the pool as soon as the reduction no longer reads it (the
        end of its first hop with hybrid sharding: [Note: reading the input] in comm/hybrid.py,
        else its end); the reduction may run on, and settle() ends it."""
        if bucket.state is not BucketState.IN_FLIGHT:
            return  # settled already (re-launched since, or waited for): as settle(), nothing to give
        if not bucket.input_read():
            bucket.wait()
        self._give_back(flat, bucket)

    def abandon(self, flat, bucket) -> None:
        self.settle(flat, bucket)
        bucket.abandon()

    def end_round(self, flat, bucket, release: bool) -> None:
        """After step() (release or not: the full buffer never outlives the round here)."""
        self.settle(flat, bucket)
        self._give_back(flat, bucket)
        bucket.end_round()

    def zero(self, flat, bucket, set_to_none: bool) -> None:
        self.end_round(flat, bucket, True)

    def _give_back(self, flat, bucket) -> None:
        if bucket.full is not None:
            self.released(flat, bucket)  # the .grad views become placeholders before the buffer goes
            bucket.give_back()

    def before_accumulate(self, flat, i: int) -> None:
        note_stale(flat, i)
        self.prepare_grad(flat, i)

    def grad_changed(self, flat, i: int) -> None:
        self.take_grad_change(flat, i)

    def released(self, flat, bucket) -> None:
        """A bucket's full buffer is going back to the pool: its members' .grad become
        placeholders, also where this rank had no grad: the shard may hold other ranks' part, as DDP
        gives a param unused on one rank the averaged grad."""
        for i in bucket.plan.tensors:
            m = flat.members[i]
            g = m.param.grad
            if bucket.has_grad(i) and (g is None or isinstance(g, ShardedGrad) or bucket.is_view(i, g, m.shape)):
                flat.set_grad(i, flat.placeholder(i))

    def reconcile(self, flat, bucket) -> None:
        """Just before the bucket's launch: its members' .grad changes are taken now, at the same
        point of the collective order on every rank, so a reduced grad the user dropped is zeroed
        in the shard before any rank adds a new reduction to it."""
        for i in bucket.plan.tensors:
            flat.sync_grad(i)

    @staticmethod
    def take_grad_change(flat, i: int) -> None:
        """A .grad the user replaced (None or a tensor) since the runtime bound it: the param's
        reduced grad of this round is forgotten, as torch forgets a grad it no longer holds (its
        pending part, if any, is zeroed by prepare_grad() or launch())."""
        m = flat.members[i]
        # Also where this rank had no grad (bound None): the shard holds the other ranks' part.
        if m.param.grad is not m.bound:
            flat.bucket_of(i).drop_reduced(i)
            if isinstance(m.bound, ShardedGrad):
                m.bound = None

    def prepare_grad(self, flat, i: int) -> None:
        """Before autograd adds a grad for params[i]. A .grad that views the pending buffer takes
        the add in place (accumulation). A grad assigned by hand moves into the buffer and autograd
        adds to it, as torch would. Otherwise (None, a placeholder, a dropped view) .grad becomes
        None: autograd then hands over its new grad, and the hook copies it into the buffer (taken
        from the pool), which so needs no zeroing ([Note: zeroing on demand])."""
        m, bucket = flat.members[i], flat.bucket_of(i)
        g = m.param.grad
        if bucket.is_view(i, g, m.shape):
            return
        self.take_grad_change(flat, i)
        if isinstance(g, torch.Tensor) and not isinstance(g, ShardedGrad):
            view = bucket.view_for_overwrite(i, m.shape)
            view.copy_(g)
            bucket.note_write()
            flat.set_grad(i, view)
        else:
            flat.set_grad(i, None)

    def after_backward(self, agreement) -> None:
        """The placeholders in .grad answer the scaler from the agreed overflow flag ([Note:
        stage-2 .grad]). Only a scaler asks, so once step() has run without one (fp32, bf16
        training) the pass over the shards is left out. The decision is the same on every rank
        (step() checks that the scalers agree). Asking when the flag was not computed here (the
        first steps ran without a scaler) gives this rank's flag, and step() raises if the ranks'
        scalers disagree. The same collective agrees on which params had a grad anywhere."""
        usage = [float(got) for s in agreement.stores for got in s.bucket.got]
        if agreement.scaler_in_use:
            flag, usage = agreement.agreed_overflow(usage)
            for s in agreement.stores:
                s.bucket.overflow = flag
        else:
            usage = agreement.agreed_usage(usage)
        self._hand_out_placeholders(agreement.stores, usage)

    @staticmethod
    def _hand_out_placeholders(stores, usage):
        """[Note: who had a grad] At stages 2/3 a param no backward on this rank reached keeps
        .grad None, as torch's; one another rank's backward reached gets the placeholder of the
        averaged grad, as DDP gives it. So every rank holds the same .grad kinds after a synced
        backward, and a change of one (.grad = None, zero_()) happens on every rank, the shard's
        owner too, at the same point of the collective order. One small all-reduce per synced
        backward (DDP's find_unused_parameters pays the same)."""
        k = 0
        for s in stores:
            for i, got in zip(s.bucket.plan.tensors, s.bucket.got):
                if usage[k] > 0 and not got and s.flat.members[i].param.grad is None:
                    s.flat.set_grad(i, s.flat.placeholder(i))
                k += 1
