"""ShardedGrad: what .grad holds at zero_stage=2 once backward has reduced it.

[Note: stage-2 .grad] At stage 2 on several ranks a bucket's full gradient
buffer is released as soon as its reduction completes (stage2_bucket.py), so
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
  setting .grad to None or assigning a tensor drops it (FlatParams sees that);
- anything else (torch.nn.utils.clip_grad_norm_, reading or editing values)
  raises an error that names the param and the fix, never a silent no-op.
"""

import weakref

import torch

_AMP_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_ZERO = torch.ops.aten.zero_.default
_FOREACH_ZERO = torch.ops.aten._foreach_zero_.default


class ShardedGrad(torch.Tensor):
    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str, bucket, index: int, shape=None):
        # shape: the param's full shape (at stage 3 its data is empty while its unit is sharded)
        return torch.Tensor._make_wrapper_subclass(cls, shape if shape is not None else param.shape,
                                                   dtype=param.dtype, device=param.device)

    def __init__(self, param, name, bucket, index, shape=None):
        # The bucket weakly: a param's .grad is not seen by the garbage collector, and a strong
        # reference would keep the bucket, its FlatParams and the param itself alive for good.
        self.param_name, self._bucket, self.index = name, weakref.ref(bucket), index

    @property
    def bucket(self):
        bucket = self._bucket()
        if bucket is None:
            raise RuntimeError(f"zerokern: the gradient of {self.param_name} was reduced by a FusedZeroAdam that is "
                               "gone (the model or optimizer was dropped); set .grad to None")
        return bucket

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"ShardedGrad({self.param_name}, shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _AMP_CHECK:
            grads, found_inf, inv_scale = args
            real = [g for g in grads if not isinstance(g, ShardedGrad)]
            if real:
                func(real, found_inf, inv_scale)
            for bucket in {id(g.bucket): g.bucket for g in grads if isinstance(g, ShardedGrad)}.values():
                flag = bucket.overflow_flag().to(found_inf.device, found_inf.dtype).reshape(found_inf.shape)
                torch.maximum(found_inf, flag, out=found_inf)
            return None
        if func is _ZERO:
            args[0].bucket.drop_reduced(args[0].index)
            return args[0]
        if func is _FOREACH_ZERO:
            for g in args[0]:
                g.bucket.drop_reduced(g.index) if isinstance(g, ShardedGrad) else g.zero_()
            return None
        culprit = next(a for a in _flat(args, kwargs) if isinstance(a, ShardedGrad))
        raise RuntimeError(
            f"zerokern: {func.__name__} on the gradient of {culprit.param_name}: at zero_stage=2 and 3 the averaged gradient "
            "is sharded inside the optimizer once backward has reduced it, and .grad is a placeholder without "
            "values (the full buffer was freed: that is stage 2's memory saving). Clip with "
            "opt.clip_grad_norm_(max_norm) or FusedZeroAdam(max_grad_norm=...) (its return value and "
            "opt.last_grad_norm give the norm; ZeroTrainer and integrations.accelerate.attach use it), scale or "
            "mask gradients in a hook (p.register_hook) or through the loss, or use zero_stage=1, where .grad "
            "keeps this rank's local gradient")


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
