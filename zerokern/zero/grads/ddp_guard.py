"""Refuse a FusedZeroAdam-trained model that is wrapped in torch's DistributedDataParallel.

[Note: DDP wrap] FusedZeroAdam reduces its grads itself; DDP's reducer would all-reduce them
again and write into .grad, a view of zerokern's buckets (at stage 2 a ShardedGrad placeholder).
A plain transformers.Trainer or Accelerator wraps every multi-process model in DDP. Every rank
(all run DDP alike) raises WrappedInDDPError instead, naming the fix:
- in the forward, before any backward: DDP sets the class attribute
  DistributedDataParallel._active_ddp_module while it runs the wrapped module (torch 2.0 on;
  dynamo reads it too). A zerokern.shard module's pre-hook reads it every forward; params no unit
  holds have no module of ours, so a global module pre-hook reads it from FusedZeroAdam's
  construction until its first step() returns (watch);
- a wrap that comes later meets an error path (DDP writing into a ShardedGrad, or into stage-1
  grads): refuse_if_reduced then looks for a live DDP over those params (a gc scan, there only).
A DDP that ignores the optimizer's params (_set_params_and_buffers_to_ignore_for_model) is left
alone. Not seen: delay_all_reduce_named_params over every param, and DDP's python reducer
(compiled autograd): neither sets the attribute.
"""

import gc
import weakref

import torch

from ..core.errors import WrappedInDDPError

_DDP = getattr(torch.nn.parallel, "DistributedDataParallel", None)


def message(name: str) -> str:
    return (f"zerokern: the model is wrapped in torch's DistributedDataParallel, which all-reduces the gradients "
            f"of {name} and the other params that FusedZeroAdam reduces itself (DDP's reducer would write into "
            "zerokern's gradient buckets). transformers.Trainer: use zerokern.integrations.hf.ZeroTrainer. Accelerate: "
            "call zerokern.integrations.accelerate.attach(accelerator) before accelerator.prepare(...). A "
            "plain loop: do not wrap the model in DistributedDataParallel; FusedZeroAdam does the reduction")


# DDP -> {id(param): name} of the params its reducer reduces. Weak: a dropped DDP drops its entry.
_REDUCED = weakref.WeakKeyDictionary()
# DDP -> the units and watches found not to be reduced by it (checked once each)
_CLEARED = weakref.WeakKeyDictionary()


def _reduced(ddp) -> dict:
    reduced = _REDUCED.get(ddp)
    if reduced is None:
        ignored = getattr(ddp, "parameters_to_ignore", ())
        delayed = {id(p) for p in getattr(ddp, "_delay_all_reduce_params", ())}  # ignored by name, yet reduced
        reduced = {id(p): n for n, p in ddp.module.named_parameters()
                   if p.requires_grad and (n not in ignored or id(p) in delayed)}
        _REDUCED[ddp] = reduced
    return reduced


def _refuse(ddp, owner, ids) -> None:
    """Raise if `ddp` reduces one of the params with these ids (owner: what is remembered as cleared
    otherwise)."""
    cleared = _CLEARED.get(ddp)
    if cleared is None:
        cleared = _CLEARED[ddp] = weakref.WeakSet()
    if owner in cleared:
        return
    reduced = _reduced(ddp)
    hit = next((reduced[i] for i in ids if i in reduced), None)
    if hit is not None:
        raise WrappedInDDPError(message(hit))
    cleared.add(owner)


def _active():
    return getattr(_DDP, "_active_ddp_module", None)


def check_forward(unit) -> None:
    """From a zerokern.shard module's forward pre-hook: refuse a DDP forward over the unit's params."""
    ddp = _active()
    if ddp is not None:
        _refuse(ddp, unit, [id(p) for p in unit.params])


class _Watch:
    """The params of a FusedZeroAdam outside any zerokern.shard unit, watched from every module's
    forward until the optimizer's first step() ([Note: DDP wrap])."""

    def __init__(self, opt, params):
        self.opt = weakref.ref(opt)  # the global hook holds this watch: it must not hold the optimizer
        self.ids = [id(p) for p in params]  # alive as long as the optimizer (checked before use)
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_forward)
        # torch iterates its step hooks while calling them, so this one cannot remove itself; once
        # the watch is closed it only returns
        opt.register_step_post_hook(self.close)
        weakref.finalize(opt, self.close)  # an optimizer dropped before stepping

    def _pre_forward(self, module, args):
        ddp = _active()
        if ddp is None:
            return
        if self.opt() is None:
            self.close()
            return
        _refuse(ddp, self, self.ids)

    def close(self, *step_hook_args) -> None:
        """Also the step post-hook (called with opt, args, kwargs): the watch ends at the first step()."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def watch(opt, units) -> None:
    """At the construction of a torch optimizer `opt` over zerokern `units`: watch the
    params that no zerokern.shard unit holds (the units' own forward hooks check theirs), until
    opt's first step(). Only where a process group exists (DDP needs one)."""
    if _DDP is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    loose = [p for u in units if u.module() is None for p in u.params]
    if loose:  # the params of a unit the optimizer made itself
        _Watch(opt, loose)


def refuse_if_reduced(params=(), grad=None) -> None:
    """On an error path a DDP wrap leads to (never per step: it scans the garbage collector's
    objects): raise WrappedInDDPError if a live DDP reduces one of `params`, or the param whose
    .grad is `grad`."""
    if _DDP is None:
        return
    ids = {id(p) for p in params}
    for obj in gc.get_objects():
        if issubclass(type(obj), _DDP):
            reduced = _reduced(obj)
            for p in obj.module.parameters():
                if id(p) in reduced and (id(p) in ids or (grad is not None and p.grad is grad)):
                    raise WrappedInDDPError(message(reduced[id(p)]))
