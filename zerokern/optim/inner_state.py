"""ZeroOptimizer's inner torch optimizer: its state made before the first step, so that a state
dict has every entry a checkpoint must fill.

[Note: inner state before the first step] torch optimizers make a param's state at its first
step. An optimizer whose state_dict() has no entries gives torch.distributed.checkpoint nothing
to load into (dcp.load fills in place only the entries it is given), and torch's
get_optimizer_state_dict steps an optimizer with no state (zero grads, lr 0) to make some. So:
- at construction, make_initial_state runs the inner optimizer's own _init_group for every piece
  (a step that stops after the state is made and before anything is updated): the state is then
  exactly the state the first step would have made first (Adam's zero moments and step 0,
  Adagrad's accumulator, ...);
- state an optimizer makes during its first update, not before it ("late" keys: momentum SGD's
  momentum_buffer, a copy of the first grad), has no value that means "not yet" (a zero buffer
  gives (1 - dampening) x grad at the first step where none gives grad). Until a param's first
  step its state dict entry holds zero placeholders of the late keys and FRESH: True; after it,
  the real values and FRESH: False. Loading an entry with FRESH True leaves the late keys unmade.
  FRESH is a 0-dim bool tensor, which DCP loads in place (a Python value inside an entry keyed by
  a param index would be loaded under the key's string); DCP keeps one rank's copy, and every
  rank agrees, since which params have had a step is agreed across ranks. A state dict without
  FRESH (torch's own optimizer's) is taken as stepped.
late_keys finds the late keys of a param group by running a throwaway instance of the class one
step on a 2-element tensor. A class without _init_group (not from torch.optim) has every key late.
A late key that is not a tensor (a custom optimizer's Python float) has no placeholder DCP could
fill: state_dict() raises, naming it, until every param has had a step.
"""

import torch

FRESH = "zerokern_fresh"


class _Made(Exception):
    """Raised by the wrapped _init_group once the state is made: ends the step before the update."""


def _param_keys(group):
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


@torch.no_grad()
def make_initial_state(inner, params):
    """Make, for each of `params` (params of `inner` that have no state yet), the state the inner
    optimizer's first step would make before its update. Changes no param."""
    init = getattr(type(inner), "_init_group", None)
    todo = {id(p) for p in params if not inner.state.get(p)}
    if init is None or not todo:
        return

    def make_then_stop(group, *args, **kwargs):
        init(inner, group, *args, **kwargs)
        raise _Made

    groups = inner.param_groups
    inner._init_group = make_then_stop
    try:
        for group in groups:
            mine = [p for p in group["params"] if id(p) in todo]
            if not mine:
                continue
            inner.param_groups = [group]  # one group a step: the step stops after its first _init_group
            for p in mine:
                p.grad = torch.zeros_like(p)
            try:
                inner.step()
            except _Made:
                pass
            finally:
                for p in mine:
                    p.grad = None
    finally:
        inner.param_groups = groups
        del inner._init_group


def late_keys(optimizer_class, kwargs, group, device, shape=(2,)):
    """{key: 0-dim template, None (a per-element tensor) or the value's type (not a tensor)} of the
    state that optimizer_class, with this param group's keys, makes in a param's first update and
    not before it. shape: the throwaway param's (2-D for an optimizer that takes matrices only)."""
    x = torch.zeros(shape, device=device)
    probe = optimizer_class([{**_param_keys(group), "params": [x]}], **kwargs)
    make_initial_state(probe, [x])
    before = set(probe.state.get(x, {}))
    x.grad = torch.full_like(x, 0.5)
    probe.step()
    late = {}
    for key, v in probe.state.get(x, {}).items():
        if key in before:
            continue
        if not isinstance(v, torch.Tensor):
            late[key] = type(v)  # no placeholder: with_placeholders refuses (training is unaffected)
        else:
            late[key] = None if v.shape == x.shape else torch.zeros_like(v)
    return late


def element_keys(optimizer_class, kwargs, groups, shape=(2,)):
    """{key: dtype} of the per-element state (tensors of the param's shape: Adam's moments, SGD's
    momentum_buffer) that optimizer_class makes for a param of any of these param groups, in the
    order it makes them: found, as late_keys, by a throwaway instance stepped once on 2 elements.
    OffloadPolicy(device="nvme") keeps the fp32 ones on disk (optim/inner_stream.py). shape: as
    late_keys'."""
    keys = {}
    for group in groups:
        x = torch.zeros(shape)
        probe = optimizer_class([{**_param_keys(group), "params": [x]}], **kwargs)
        make_initial_state(probe, [x])
        x.grad = torch.full_like(x, 0.5)
        probe.step()
        for key, v in probe.state.get(x, {}).items():
            if isinstance(v, torch.Tensor) and v.shape == x.shape:
                keys.setdefault(key, v.dtype)
    return keys


def with_placeholders(st, late, like, optimizer_class, name):
    """A state dict entry: the inner state `st` (the same tensors) and, where the group has late
    keys, FRESH and zero placeholders of the late keys not made yet (per-element ones like `like`).
    Raises for a late key that is not a tensor (no placeholder can stand for it)."""
    out = dict(st)
    if late:
        fresh = not all(key in st for key in late)
        out[FRESH] = torch.tensor(fresh)
        if fresh:
            for key, template in late.items():
                if isinstance(template, type):
                    raise ValueError(
                        f"ZeroOptimizer: {optimizer_class.__name__} makes its state {key!r} (a {template.__name__}, "
                        f"not a tensor) at a param's first step, and {name} has had none: a state dict now would "
                        "have no entry for it to load into. Take state dicts after every param has had a step")
                out[key] = torch.zeros_like(like) if template is None else template.clone()
    return out


def without_placeholders(st, late):
    """The entry as the inner optimizer takes it: FRESH dropped, and the late keys too if it is set."""
    fresh = bool(st.get(FRESH, False))
    return {k: v for k, v in st.items() if k != FRESH and not (fresh and k in late)}
