"""Agreement: every decision the ranks of one engine must take alike, each in one collective, so
that every rank raises, skips or updates together (rules 2, 5 and 9 of docs/DESIGN.md).

- before the update: who had a grad, which buckets to reduce, edited or stale grads, and the
  GradScalers' found_inf and scale, in one all-reduce MAX of a `StepFlags` record;
- after a synced backward: overflow in the reduced shards, and (released grads) which params a
  backward reached on some rank ([Note: overflow on any rank], [Note: who had a grad]);
- zerokern.GradScaler's found_inf (share_found_inf).
"""

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .core.errors import fields_of, which_differ
from .grads import ddp_guard

_MAX = torch.distributed.ReduceOp.MAX


@dataclass
class StepFlags:
    """The flags one all-reduce MAX agrees on before the update. Packed as one float tensor:
    `had` and `needs` as 0/1 (MAX: some rank), `edited` as 0/1/2 (1: local grads edited in
    place, 2: a grad step() had consumed was accumulated into), then found_inf and the loss
    scale each as (x, -x), so that one MAX gives the maximum and (negated) the minimum."""

    had: List[bool]  # per trainable param: it had a grad (on this rank; agreed: on some rank)
    needs: List[bool]  # per bucket: it must be reduced before the update
    edited: List[float]  # per bucket: 0, 1 (edited) or 2 (stale)
    found_inf: Tuple[float, float] = (0.0, 0.0)  # (max, min) over the ranks
    scale: Tuple[float, float] = (0.0, 0.0)  # (max, min) over the ranks

    def pack(self, device, found_inf=None, grad_scale=None) -> torch.Tensor:
        """The tensor to all-reduce; found_inf and grad_scale (tensors) are written on the device,
        without a host read."""
        # one list, as torch takes it (no per-element conversion in Python: a step's per-param cost)
        flags = torch.tensor(self.had + self.needs + list(self.edited) + [0.0] * 4,
                             dtype=torch.float32, device=device)
        for k, t in ((4, found_inf), (2, grad_scale)):
            if t is not None:
                t = t.reshape(()).to(device, torch.float32)
                flags[len(flags) - k:len(flags) - k + 2] = torch.stack([t, -t])
        return flags

    @classmethod
    def unpack(cls, values: List[float], n: int, m: int) -> "StepFlags":
        """The agreed record from the all-reduced values (n params, m buckets; had and needs are 0 or 1)."""
        return cls(list(map(bool, values[:n])), list(map(bool, values[n:n + m])), values[n + m:n + 2 * m],
                   (values[-4], -values[-3]), (values[-2], -values[-1]))


class Agreement:
    """The cross-rank agreements of one engine over its stores (in the schedule's order)."""

    def __init__(self, comm, strategy, path, schedule, stores, members, trainable, what: str):
        """path: the grad path of every unit (grads/path.py); members[k]: the
        trainable indices of store k's bucket's params (in bucket order)."""
        self.comm, self.strategy, self.path, self.schedule, self.stores = comm, strategy, path, schedule, stores
        self.members, self.trainable, self.what = members, trainable, what
        self.distributed = comm.distributed  # collectives run (fixed with the group)
        self.check_fp16 = any(p.dtype == torch.float16 for p in trainable)
        self.scaler_in_use = True  # until a step() runs without a GradScaler ([Note: overflow on any rank])
        self.device = stores[0].bucket.device if stores else torch.device("cpu")  # where the flags are
        self._usage = None  # (flags, work): the usage flags' all-reduce launched in before_settle

    # --- before the update -----------------------------------------------------

    def before_update(self, found_inf, grad_scale) -> Tuple[List[bool], List[bool], bool]:
        """(global had-grad flag per trainable param, which buckets to reduce, skip).
        Distributed or with a GradScaler: one all-reduce MAX and one host read per step;
        one process without a scaler: neither (the flags are already on the host)."""
        if found_inf is not None and grad_scale is None:
            raise RuntimeError(f"scaler.unscale_(optimizer) is not supported with {self.what} (the grads it "
                               "would unscale are already reduced); clip with max_grad_norm=... or "
                               "opt.clip_grad_norm_")
        self.scaler_in_use = grad_scale is not None
        buckets = self.schedule.buckets
        had = [False] * len(self.trainable)
        # per bucket: to be reduced; holds a grad from before the last step(); 1 edited, 2 stale
        needs, stale, edited = [], [], []
        for members, b in zip(self.members, buckets):
            for t, got in zip(members, b.got):
                if got:
                    had[t] = True
            needs.append(b.needs_reduction())
            stale.append(bool(b.stale))  # [Note: grads after step]
            edited.append(1.0 if b.edited() else 2.0 if b.stale else 0.0)
        if not self.distributed and found_inf is None:
            if True in stale:
                self._raise_stale([b for b, st in zip(buckets, stale) if st])
            return had, needs, False
        mine = StepFlags(had, needs, edited)
        flags = mine.pack(self.device, found_inf, grad_scale)
        self.comm.wait(self.comm.all_reduce(flags, op=_MAX, name="grad_flags"))
        agreed = StepFlags.unpack(flags.tolist(), len(had), len(needs))
        worst = max(agreed.edited, default=0.0)  # 2: stale somewhere, 1: edited somewhere
        if worst > 1:
            self._raise_stale([b for b, e in zip(buckets, agreed.edited) if e > 1])
        if worst > 0:
            self._raise_edited([b for b, e in zip(buckets, agreed.edited) if e > 0])
        (inf_max, inf_min), (scale_max, scale_min) = agreed.found_inf, agreed.scale
        if grad_scale is not None and scale_max != scale_min:
            raise RuntimeError(
                f"zerokern: the GradScalers of the ranks hold different scales ({scale_min} to {scale_max}), so "
                "each rank's gradients were scaled differently and their average is wrong. Give every rank the "
                "same GradScaler settings and state (init_scale, a loaded state_dict), and use "
                "zerokern.GradScaler so their inf checks agree")
        if found_inf is not None and (inf_max > 0) != (inf_min > 0):
            raise RuntimeError(
                "zerokern: GradScaler found an inf/nan in the local gradients of some ranks only, so their scales "
                "would drift apart (the last backward ran under no_sync(), or a scaler first stepped after steps "
                "without one). Use zerokern.GradScaler, whose inf check agrees across ranks, or run the last "
                "backward before each step synced")
        return agreed.had, agreed.needs, inf_max > 0

    def overflowed(self, needs) -> bool:
        """[Note: overflow on any rank] for what was reduced in step() rather than in backward
        (no_sync accumulation, edited or re-reduced buckets): an fp16 sum can overflow where
        no local grad did. Every rank agrees to skip the step then."""
        if not (self.check_fp16 and any(needs)):
            return False
        shards = [s.bucket.reduced_grad() for s, need in zip(self.stores, needs) if need]
        flag = torch.zeros((), device=shards[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=flag.device))
        self.comm.wait(self.comm.all_reduce(flag, op=_MAX, name="overflow"))
        return bool(flag.item())

    def _names_in(self, buckets):
        """The params of `buckets`, for an error: the first four and how many more."""
        names = [s.flat.members[i].name for s in self.stores if s.bucket in buckets for i in s.bucket.plan.tensors]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    def _raise_stale(self, buckets):
        shown = self._names_in(buckets)
        raise RuntimeError(
            f"zerokern: the gradients of {shown} (on some rank) are from before the last step(), with no "
            f"zero_grad() since. At zero_stage={self.strategy.stage} step() frees the gradients (the stage's memory "
            "saving), so they cannot carry over to this step as torch's would. Call opt.zero_grad() (or "
            "model.zero_grad()) after each step(), or use zero_stage=1, which keeps them")

    def _raise_edited(self, buckets):
        ddp_guard.refuse_if_reduced(self.trainable)  # DDP's reducer wrote them ([Note: DDP wrap])
        shown = self._names_in(buckets)
        raise RuntimeError(
            f"zerokern: the gradients of {shown} were changed in place between backward and step() (on some "
            f"rank). At zero_stage={self.strategy.stage} on {self.comm.world_size} ranks .grad holds the local, "
            "unreduced gradient, so such an edit (e.g. torch's clip_grad_norm_) would not give DDP's numbers. "
            "Clip with opt.clip_grad_norm_ or max_grad_norm=, edit grads in a hook (p.register_hook), or use "
            "zero_stage=0, where .grad is the averaged gradient")

    # --- after a synced backward -------------------------------------------------

    def before_settle(self):
        """At the end of a synced backward, once its last reductions are launched and before any
        is waited for: the usage flags' all-reduce MAX ([Note: who had a grad] in grads/path.py),
        launched, so the ranks meet once there, not once for the grads and again for the flags.
        agreed_usage waits for it. Only without a scaler: with one, the flags travel with the
        overflow flag, which is known only once the grads are in."""
        self._usage = None
        if self.stores and self.path.usage is not None and not self.scaler_in_use:
            flags = torch.tensor(self.path.usage(self), device=self.device)
            self._usage = (flags, self.comm.all_reduce(flags, op=_MAX, name="grad_usage"))

    def after_backward(self):
        """[Note: overflow on any rank] GradScaler checks each rank's local .grad, but where
        those are local (stages 1/2/3 on several ranks) an inf/nan may be in another rank's
        grads only, or appear in a reduced shard only (an fp16 sum overflowing). The grad path
        checks the reduced shards and has the ranks agree on one flag (all-reduce MAX), so every
        rank's scaler sees an overflow, skips and backs off alike. Any dtype: fp32/bf16 params
        under autocast(fp16) use a scaler too. No host sync."""
        if self.stores and self.path.after_backward is not None:
            self.path.after_backward(self)  # the grad path knows whether .grad is local

    def agreed_overflow(self, usage: Optional[List[float]] = None):
        """(flag, usage): flag 1.0 if a reduced shard holds an inf/nan on any rank, else 0, and the
        usage flags MAX-ed over the ranks, in one all-reduce."""
        shards = [s.bucket.reduced_grad() for s in self.stores]
        device = shards[0].device
        flags = torch.zeros(1 + len(usage or ()), device=device)
        if usage:
            flags[1:] = torch.tensor(usage, device=device)
        flag = flags[0]
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=device))
        self.comm.wait(self.comm.all_reduce(flags, op=_MAX, name="overflow"))
        return flags[0], (flags[1:].tolist() if usage else usage)

    def agreed_usage(self):
        """The usage flags MAX-ed over the ranks: the all-reduce before_settle launched (or
        launches now)."""
        if self._usage is None:
            self.before_settle()
        (flags, work), self._usage = self._usage, None
        self.comm.wait(work)
        return flags.tolist()

    # --- the optimizer's construction ----------------------------------------------------

    @staticmethod
    def same_model_on_every_rank(comm, what, params, group_sizes, config, options) -> None:
        """Every rank built the optimizer over the same params (shapes, dtypes, order, groups) and
        options, or every rank raises, listing each rank's."""
        desc = repr(([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params], group_sizes))
        mine = {"params": len(params), "elements": sum(p.numel() for p in params),
                "the params' shapes/dtypes/order/groups": "#" + hashlib.sha256(desc.encode()).hexdigest()[:16],
                **fields_of(config.agreed()), "options": options}
        everyone = comm.differing(mine, f"{what}(...)")
        if everyone is not None:
            raise ValueError(f"{what}: the ranks passed different parameters (shapes, dtypes or order) or "
                             "options; every rank must build the optimizer for the same model. The ranks differ in "
                             + which_differ(everyone))

    # --- zerokern.GradScaler ---------------------------------------------------------

    def share_found_inf(self, found_inf_per_device):
        """Called by zerokern.GradScaler after its inf check of the local grads: every rank
        gets the same found_inf (all-reduce MAX), also when the reduction happens in step()
        (every backward under no_sync()), which the check after backward cannot cover."""
        if not self.distributed:
            return
        # exactly one all-reduce on every rank, whatever devices (or none) this rank's grads were on
        device = self.device
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for t in found_inf_per_device.values():
            flag = torch.maximum(flag, t.to(device, torch.float32).reshape(()))
        self.comm.wait(self.comm.all_reduce(flag, op=_MAX, name="found_inf"))
        for t in found_inf_per_device.values():
            t.copy_(flag.to(t.device, t.dtype).reshape(t.shape))
