"""Materialise one unit of a model built on the meta device, and nothing more.

[Note: meta init] A model too large for one rank is built on the meta device (`with
torch.device("meta"): model = GPT(...)`) and sharded block by block with zerokern.shard(...,
stage=3). Each shard() call materialises only the params and buffers of its own unit (the
module's, minus those of units already sharded inside it) on the target device, initialises
them, and at stage 3 keeps this rank's slice and frees the rest before the next block is
materialised, so a rank never holds the whole model: at most about two copies of one unit (the
new tensors and the flat buffer they are copied into) next to the slices kept so far.

Initialisation: by default every module in the unit that holds one of its new params or
buffers runs its own reset_parameters() (nn.Linear, nn.Embedding, nn.LayerNorm... have one);
`init=fn` replaces that: fn(module) is called under no_grad with the unit's params and buffers
materialised. Params of units inside it are empty by then, so fn's writes to them do nothing:
where those units were initialised by the same fn (HF's pattern: one
`init = lambda m: m.apply(model._init_weights)` passed to every shard() call, the root's last),
that is what the user meant, and the writes are forgotten; where they were initialised another way
(reset_parameters(), another fn) the root's init would silently not reach them, so shard() raises
naming the param (writes through p.data are not seen: they bypass the version counter). The new
tensors start as NaN (integers: their largest value), and one still holding it after
initialisation (a param nothing covers, a buffer computed in __init__) is an error naming it,
never uninitialised memory trained on; a bool buffer has no such value, so one that init did not
write or replace (its version counter did not move) is the same error.
Every rank runs the init, and the unit's values are then broadcast from rank 0 (as DDP's
construction does), so the ranks need not share a seed.

Tied params stay tied: a meta param held by several modules becomes one new Parameter in all
of them, also across units: the unit sharded first materialises and initialises it, and later
units take it as it is (their init sees it empty).
"""

from typing import Callable, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import empty as empty_param

# meta param -> the Parameter that replaced it: a param tied across units (a head sharded on its own,
# tied to the root's embedding) is materialised by the first unit; later units take the same one.
_DONE = WeakIdKeyDictionary()


def in_scope(module: torch.nn.Module, is_unit) -> List[torch.nn.Module]:
    """The modules of `module`'s tree that are not inside another unit (is_unit(m): m is one)."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not is_unit(c))
    return out


def _unset(t: torch.Tensor, device) -> torch.Tensor:
    """A new tensor for meta `t` holding a mark no initialisation leaves: NaN, or an integer
    type's largest value (a bool has none: see materialize)."""
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, float("nan"), device=device)
    if t.dtype == torch.bool:
        return torch.zeros_like(t, device=device)
    return torch.full_like(t, torch.iinfo(t.dtype).max, device=device)


def _untouched(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).max).any())


def materialize(module: torch.nn.Module, device: torch.device, init: Optional[Callable], is_unit,
                inner=()) -> None:
    """Replace the meta params and buffers of `module`'s own unit by initialised tensors on `device`.
    inner: (name, param, the init its unit was materialised with, forget) of the stage-3 params
    of units inside `module`; forget() makes the unit forget a write to its empty param.
    On an error the module is left as it was (on meta), so shard() can be called again."""
    scope = in_scope(module, is_unit)
    names = {id(m): prefix for prefix, m in module.named_modules()}
    fresh = {}  # id(tensor) -> (its name, the tensor): what this call materialises
    owners = set()  # id() of the modules holding one of them
    undo = []  # (dict, key, the meta tensor it held)
    local = {}  # id(meta param) -> its new Parameter
    taken = {}  # id(param) -> (name, param, version) of params tied to a unit sharded earlier
    bool_buffers = []  # (name, the buffers dict, key, the new tensor) of bool buffers
    for m in scope:
        where = names.get(id(m), "")
        for name, p in m._parameters.items():
            if p is None or p.device.type != "meta":
                continue
            undo.append((m._parameters, name, p))
            q = _DONE.get(p)  # a param tied to one of a unit sharded earlier: that unit initialised it
            if q is not None:
                taken[id(q)] = (f"{where}.{name}".lstrip("."), q, q._version)
            else:
                q = local.get(id(p))  # tied within this unit: one new Parameter
                if q is None:
                    q = local[id(p)] = torch.nn.Parameter(_unset(p, device), requires_grad=p.requires_grad)
                    fresh[id(q)] = (f"{where}.{name}".lstrip("."), q, p)
                owners.add(id(m))
            m._parameters[name] = q
        for name, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                undo.append((m._buffers, name, b))
                m._buffers[name] = _unset(b, device)
                fresh[id(m._buffers[name])] = (f"{where}.{name}".lstrip("."), m._buffers[name], None)
                if b.dtype == torch.bool:  # no value marks a bool unset: its version counter must move
                    bool_buffers.append((f"{where}.{name}".lstrip("."), m._buffers, name, m._buffers[name]))
                owners.add(id(m))
    if not fresh:
        return
    try:
        bools = [name for name, t, _ in fresh.values() if t.dtype == torch.bool]
        if bools and init is None:
            raise ValueError(
                f"zerokern.shard: {bools[0]} is a bool tensor built on the meta device, whose values (a mask "
                "computed in __init__) no reset_parameters() restores; pass init=fn to zerokern.shard and set it "
                "there, or register it after shard()")
        versions = [t._version for _, _, _, t in bool_buffers]
        inner_versions = [p._version for _, p, _, _ in inner]
        with torch.no_grad():
            if init is not None:
                with empty_param.let_through():  # its writes to inner units' empty params: checked below
                    init(module)
            else:
                for m in scope:
                    if id(m) in owners and hasattr(m, "reset_parameters"):
                        m.reset_parameters()
        # An element still holding its mark is one nothing initialised (a param no reset_parameters()
        # covers, an init= that skips one, a buffer computed in __init__): an error naming it, never
        # uninitialised values trained on.
        for name, q, version in taken.values():
            if q._version != version:
                raise ValueError(
                    f"zerokern.shard: {name} is tied to a param of a unit sharded earlier, which initialised it; "
                    "this unit's init wrote to it, which does nothing (it is sharded there): initialise it in the "
                    "init of the unit sharded first")
        written = [(name, theirs, forget) for (name, p, theirs, forget), v in zip(inner, inner_versions)
                   if p._version != v]
        for name, theirs, _ in written:
            if theirs is not init:
                how = "reset_parameters()" if theirs is None else "another init"
                raise ValueError(
                    f"zerokern.shard: init(module) wrote to {name}, a param of a unit sharded earlier with {how}; "
                    "there the write does nothing (that unit keeps only its slice). Pass the same init to every "
                    "shard() call (init = lambda m: m.apply(model._init_weights); shard(block, stage=3, init=init) "
                    "for each block, then shard(model, stage=3, init=init))")
        for (name, d, key, t), version in zip(bool_buffers, versions):
            if d.get(key) is t and t._version == version:  # neither written nor replaced by init
                raise ValueError(
                    f"zerokern.shard: {name} is a bool buffer built on the meta device that init(module) did not "
                    "set (a mask computed in __init__ has no values on meta): set it in init=fn (e.g. "
                    "module.mask.copy_(torch.tril(...))), or register it after shard()")
        for name, t, _ in fresh.values():
            if _untouched(t):
                raise ValueError(
                    f"zerokern.shard: {name} was built on the meta device and is not initialised after "
                    + ("init(module)" if init is not None else "the reset_parameters() of the modules holding it")
                    + " (it still holds the NaN or max-int it was filled with): initialise it in init=fn (fn(module) "
                    "initialises the unit's params and buffers in place), or give its module a reset_parameters(). "
                    "A param tied to one of a unit sharded earlier is initialised by that unit")
    except BaseException:
        for d, key, old in undo:  # back on meta: a second shard() call starts from scratch
            d[key] = old
        raise
    for _, q, p in fresh.values():
        if p is not None:
            _DONE[p] = q  # later units holding the same meta param take this one
    for _, _, forget in written:
        forget()  # the unit was initialised by this same init: its write to an empty param meant nothing new
