"""MemberGrads: one dtype group's .grad, member by member: what each param's .grad is, the one
the runtime set there last (`bound`), and the bucket that holds it. The grad path of the group
(grads/path.py: LocalGrads, ReleasedGrads) is a MemberGrads: it owns this state, so a grad hook
or a bucket transition finds what it needs here, without reaching back into the FlatParams.

[Note: a short grad walk] One bucket's grad at stage 2 goes hook -> grad path -> bucket ->
schedule, and back only for the update (tests/zero/test_call_trace.py counts the functions it enters).
The checks that run per grad or per member test their condition inline and call out only to
raise or to act, so the usual case (a grad that autograd hands over, a .grad still the one bound)
costs no call of its own.
"""

from typing import List, Optional

import torch

from .placeholder import CONSUMED, REDUCED, ZERO, ShardedGrad


class MemberGrads:
    """The .grad of each member of a FlatParams (members, in backward order) and its bucket.
    Subclasses (the grad paths) add what the mode does: before_accumulate, grad_changed and the
    bucket transitions."""

    def __init__(self, flat, buckets):
        """flat: the FlatParams whose members these are (its Member records are shared: param,
        names, full shape); buckets: its GradBuckets, made by the grad path."""
        self.members = flat.members
        self.dtype, self.device = flat.dtype, flat.device
        self.buckets = buckets
        self.bucket = [buckets[s.bucket] for s in flat.layout.slots]  # member i's bucket
        self.bound: List[Optional[torch.Tensor]] = [None] * len(flat.members)  # the .grad the runtime set last

    # --- .grad ---------------------------------------------------------------------

    def set(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """params[i].grad = grad, remembered as bound. torch checks a grad's shape against the
        param's when it is assigned; a stage-3 param whose unit is sharded has data of shape [0]
        ([Note: stage-3 params]), so it stands in a stride-0 view of the full shape (no copy) for
        the assignment ([Note: shapes between gathers] in params/empty.py: an empty param is one
        with an empty_version, or a plain tensor whose own shape is [0])."""
        m = self.members[i]
        p = m.param
        if grad is not None:
            if p.device != self.device or p.dtype != self.dtype:  # before torch refuses it with its own message
                m.check_moved(self.dtype, self.device)
            if m.empty_version is not None or p.shape != grad.shape:
                held = p.data
                p.data = held.new_zeros(()).expand(m.shape)  # 0-d: expands to any shape, () too
                p.grad = grad
                p.data = held
                self.bound[i] = grad
                return
        p.grad = grad
        self.bound[i] = grad

    def bind(self, i: int) -> None:
        """params[i].grad becomes its bucket view, holding the grad it has now (if any)."""
        self._bind(i)
        self.bucket[i].note_write()

    def _bind(self, i: int) -> None:
        """bind() but for noting the write, which the caller does (mark_got notes it)."""
        m, bucket = self.members[i], self.bucket[i]
        g = m.param.grad
        if isinstance(g, ShardedGrad) or bucket.is_view(i, g, m.shape):
            return
        if g is not None:
            view = bucket.view_for_overwrite(i, m.shape)
            view.copy_(g)  # a fresh grad from autograd, or one assigned by hand
        else:
            view = bucket.view(i, m.shape)
        self.set(i, view)

    def took(self, i: int, synced: bool):
        """The post-accumulate hook: autograd's grad for params[i] moves into (or already is) its
        bucket view, and the bucket counts it. Returns the bucket."""
        bucket = self.bucket[i]
        self._bind(i)
        bucket.mark_got(i, synced)  # notes the write
        return bucket

    def placeholder(self, i: int, kind=REDUCED) -> ShardedGrad:
        m = self.members[i]
        return ShardedGrad(m.param, m.name, self.bucket[i], i, m.shape, kind)

    def note_stale(self, i: int) -> None:
        """A backward adding to a grad step() had consumed and freed (stages 2/3) cannot give torch's
        numbers: the bucket notes it and step() raises on every rank ([Note: grads after step]). A
        grad the user dropped or replaced since such a backward (model.zero_grad(), p.grad = None: a
        GAN's G backward reached D's params after D's step) holds nothing from before: forgotten."""
        g = self.members[i].param.grad
        if isinstance(g, ShardedGrad) and g.kind is CONSUMED:
            self.bucket[i].stale.add(i)
        elif g is not self.bound[i]:
            self.bucket[i].stale.discard(i)

    def sync(self, members=None) -> None:
        """What the user did to each member's .grad (all, or the indices given) since the runtime
        bound it: before step() and each launch. A .grad that is still the one bound last passes on
        identity (a CONSUMED placeholder still held is stale: step() raises); the others go to
        _changed()."""
        bound = self.bound
        for i in (range(len(bound)) if members is None else members):
            g = self.members[i].param.grad
            if g is not bound[i]:
                self._changed(i, g)
            elif isinstance(g, ShardedGrad) and g.kind is CONSUMED:
                self.bucket[i].stale.add(i)  # a grad the last step used, still held: step() raises

    def _changed(self, i: int, g: Optional[torch.Tensor]) -> None:
        """params[i].grad (g) is not the one bound: a grad assigned by hand (no backward, so no
        hook) moves into its bucket; one set to None (torch's way to skip a param) no longer counts."""
        bucket = self.bucket[i]
        bucket.stale.discard(i)  # dropped or replaced since (model.zero_grad(), p.grad = None): as torch
        self.grad_changed(i)
        if g is None:
            bucket.clear_got(i)
        elif not bucket.is_view(i, g, self.members[i].shape):
            self._bind(i)
            bucket.mark_got(i, False)

    def grad_changed(self, i: int) -> None:
        """params[i].grad is no longer the tensor the runtime bound (the grad path's to say what that drops)."""
        raise NotImplementedError

    # --- after step() and zero_grad() ------------------------------------------------

    def after_step(self, had) -> None:
        """The full grad buffers were freed after step() (stages 2 and 3): a param that had a grad
        holds a CONSUMED placeholder, as torch would still hold its grad; the others None.
        had[m.t]: member m had a grad on some rank this step. A placeholder still bound (the usual
        case: backward's REDUCED one) turns CONSUMED in place, as zero_() turns one ZERO."""
        for i, m in enumerate(self.members):
            g = m.param.grad
            if had[m.t]:
                if g is self.bound[i] and isinstance(g, ShardedGrad):
                    g.kind = CONSUMED
                else:
                    self.set(i, ShardedGrad(m.param, m.name, self.bucket[i], i, m.shape, CONSUMED))
            elif g is not None:
                self.set(i, None)

    def after_zero_grad(self, set_to_none: bool) -> None:
        """As torch's zero_grad: every .grad None, or (set_to_none=False) each existing grad a zero
        grad that the next step() uses (momentum and weight decay move the param) unless a backward
        adds to it: the (zeroed) bucket view, or a ZERO placeholder where the buffer is freed."""
        for i, m in enumerate(self.members):
            g = m.param.grad
            if g is None and self.bound[i] is None:
                continue
            m.check_moved(self.dtype, self.device)
            bucket = self.bucket[i]
            if set_to_none or g is None:
                self.set(i, None)
            elif bucket.full is not None:
                self.set(i, bucket.view(i, m.shape))  # zeroed by the schedule
                bucket.mark_got(i, False)
            else:
                self.set(i, self.placeholder(i, ZERO))
                bucket.mark_got(i, False)
