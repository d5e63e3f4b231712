"""ShardedGrad: what .grad holds at zero_stage=2 once backward has reduced it.

[Note: stage-2 .grad] At stage 2 on several ranks a bucket's full gradient
buffer is released as soon as its reduction completes (grads/released.py), so
the averaged gradient exists only as this rank's shard inside the optimizer.
Each param of a reduced bucket then gets this placeholder as its .grad (also
one this rank had no grad for: the shard holds the other ranks' part, as DDP
gives such a param the averaged grad): a tensor of the param's shape, dtype
and device with no storage. It keeps what
torch users rely on honest:
- `p.grad is not None` stays true, as after any backward;
- torch.amp.GradScaler's inf check (the one op it runs on grads with a fused
  optimizer) is answered from the reduced shards' overflow flag, which every
  rank agreed on after backward, so every rank's scaler skips alike;
- zero_() (model.zero_grad(set_to_none=False)) zeroes the param's reduced grad;
  setting .grad to None or assigning a tensor drops it (the grad path sees that);
- anything else (torch.nn.utils.clip_grad_norm_, reading or editing values)
  raises an error that names the param and the fix, never a silent no-op.

[Note: grads after step] .grad follows torch's rules at every stage: None until a backward
reaches the param, None again after zero_grad() (set_to_none=True), a zero grad that the next
step() uses after zero_grad(set_to_none=False). At stages 0/1 the grads stay in their buckets
across step() and accumulate as torch's do. At stages 2/3 step() frees them (the stage's memory
saving); a param that had a grad then holds a CONSUMED placeholder, as torch would still hold
its grad. A backward that adds to it, or a step() that would use it again (no zero_grad() in
between), cannot give torch's numbers: the bucket notes the member (bucket.stale) and step()
raises on every rank after one agreement, before any update. Unless the grad is dropped first, as
torch would drop it: model.zero_grad(), p.grad = None or zero_() after such a backward (a GAN's
G backward through D after D's step(), actor-critic, distillation from a trained teacher) forget
the member, and the next backward starts from nothing. zero_() of a CONSUMED placeholder
(model.zero_grad(set_to_none=False)) makes it a ZERO one, stepped as torch steps a zero grad.
"""

import weakref

import torch

from . import ddp_guard

_AMP_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_ZERO = torch.ops.aten.zero_.default
_FOREACH_ZERO = torch.ops.aten._foreach_zero_.default


# What a placeholder stands for (kind):
REDUCED = "reduced"  # this step's averaged grad, sharded in the bucket (after backward)
CONSUMED = "consumed"  # a grad step() used, then freed with the full buffer ([Note: grads after step])
ZERO = "zero"  # a zero grad (zero_grad(set_to_none=False)): the next step() uses it, as torch would


class ShardedGrad(torch.Tensor):
    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, bucket, index: int, shape=None, kind=REDUCED):
        # shape: the param's full shape (at stage 3 its data is empty while its unit is sharded)
        self = torch.Tensor._make_wrapper_subclass(cls, shape if shape is not None else param.shape,
                                                   dtype=param.dtype, device=param.device)
        # The bucket weakly: a param's .grad is not seen by the garbage collector, and a strong
        # reference would keep the bucket, its FlatParams and the param itself alive for good.
        self.param_name, self._bucket, self.index, self.kind = name, weakref.ref(bucket), index, kind
        return self

    def zero_in_place(self) -> None:
        """zero_() of the grad: a reduced one is dropped from the shard, a consumed one becomes a
        zero grad for the next step (as torch zeroes a grad it keeps). Either way nothing from before
        the last step() is left in it ([Note: grads after step])."""
        self.bucket.stale.discard(self.index)
        if self.kind is REDUCED:
            self.bucket.drop_reduced(self.index)
        elif self.kind is CONSUMED:
            self.kind = ZERO
            self.bucket.mark_got(self.index, False)

    @property
    def bucket(self):
        bucket = self._bucket()
        if bucket is None:
            raise RuntimeError(f"zerokern: the gradient of {self.param_name} was reduced by a FusedZeroAdam that is "
                               "gone (the model or optimizer was dropped); set .grad to None")
        return bucket

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return (f"ShardedGrad({self.param_name}, shape={list(self.shape)}, dtype={self.dtype}, device={self.device}"
                + ("" if self.kind is REDUCED else f", {self.kind}") + ")")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _AMP_CHECK:
            grads, found_inf, inv_scale = args
            real = [g for g in grads if not isinstance(g, ShardedGrad)]
            if real:
                func(real, found_inf, inv_scale)
            reduced = [g for g in grads if isinstance(g, ShardedGrad) and g.kind is REDUCED]
            for bucket in {id(g.bucket): g.bucket for g in reduced}.values():
                flag = bucket.overflow_flag().to(found_inf.device, found_inf.dtype).reshape(found_inf.shape)
                torch.maximum(found_inf, flag, out=found_inf)
            return None
        if func is _ZERO:
            args[0].zero_in_place()
            return args[0]
        if func is _FOREACH_ZERO:
            for g in args[0]:
                g.zero_in_place() if isinstance(g, ShardedGrad) else g.zero_()
            return None
        culprit = next(a for a in _flat(args, kwargs) if isinstance(a, ShardedGrad))
        ddp_guard.refuse_if_reduced(grad=culprit)  # DDP's reducer writing into it ([Note: DDP wrap])
        if culprit.kind is not REDUCED:
            raise RuntimeError(
                f"zerokern: {func.__name__} on the gradient of {culprit.param_name}: at zero_stage 2 and 3 the "
                f"full gradients are freed after step(), so .grad is a placeholder without values "
                f"({culprit.kind}). Read gradients between backward and step() through opt.clip_grad_norm_ "
                "or a hook (p.register_hook), or use zero_stage=1, which keeps them")
        raise RuntimeError(
            f"zerokern: {func.__name__} on the gradient of {culprit.param_name}: at zero_stage=2 and 3 .grad is a "
            "placeholder without values once backward has reduced it (the averaged gradient is sharded inside "
            "the optimizer). Clip with opt.clip_grad_norm_(max_norm) or max_grad_norm= (opt.last_grad_norm "
            "gives the norm), edit grads in a hook (p.register_hook), or use zero_stage=1, where .grad keeps "
            "this rank's local gradient")


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
