"""Materialise one unit of a model built on the meta device, and nothing more.

[Note: meta init] A model too large for one rank is built on the meta device (`with
torch.device("meta"): model = GPT(...)`) and sharded block by block with zerokern.shard(...,
stage=3). Each shard() call materialises only the params and buffers of its own unit (the
module's, minus those of units already sharded inside it) on the target device, initialises
them, and at stage 3 keeps this rank's slice and frees the rest before the next block is
materialised, so a rank never holds the whole model: at most about two copies of one unit (the
new tensors and the flat buffer they are copied into) next to the slices kept so far.

Initialisation: by default every module in the unit that holds one of its new params runs its
own reset_parameters() (nn.Linear, nn.Embedding, nn.LayerNorm... have one); a param that no
such method covers is an error naming it, and `init=fn` replaces the defaults: fn(module) is
called under no_grad with the unit's params materialised (params of units inside it are empty
by then; writing to them is a no-op). Every rank runs it, and the unit's values are then
broadcast from rank 0 (as DDP's construction does), so the ranks need not share a seed.

Tied params stay tied: a meta param held by several modules of the unit becomes one new
Parameter in all of them.
"""

from typing import Callable, List, Optional

import torch


def in_scope(module: torch.nn.Module, is_unit) -> List[torch.nn.Module]:
    """The modules of `module`'s tree that are not inside another unit (is_unit(m): m is one)."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in reversed(list(m.children())) if not is_unit(c))
    return out


def materialize(module: torch.nn.Module, device: torch.device, init: Optional[Callable], is_unit) -> None:
    """Replace the meta params and buffers of `module`'s own unit by initialised tensors on `device`."""
    scope = in_scope(module, is_unit)
    new = {}  # id(meta param) -> its Parameter on `device`
    for m in scope:
        for name, p in m._parameters.items():
            if p is not None and p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                m._parameters[name] = new[id(p)]
        for name, b in m._buffers.items():
            if b is not None and b.device.type == "meta":
                m._buffers[name] = torch.empty_like(b, device=device)
    if not new:
        return
    fresh = {id(q) for q in new.values()}
    with torch.no_grad():
        if init is not None:
            init(module)
            return
        covered = set()
        for m in scope:
            mine = [p for p in m._parameters.values() if p is not None and id(p) in fresh]
            if mine and hasattr(m, "reset_parameters"):
                m.reset_parameters()
                covered.update(id(p) for p in mine)
    scope_ids = set(map(id, scope))
    missing = [f"{prefix}{'.' if prefix else ''}{name}" for prefix, m in module.named_modules() if id(m) in scope_ids
               for name, p in m._parameters.items() if p is not None and id(p) in fresh and id(p) not in covered]
    if missing:
        raise ValueError(
            f"zerokern.shard: {missing[0]} was built on the meta device and no reset_parameters() of the module "
            "holding it initialises it; pass init=fn to zerokern.shard (fn(module) initialises the unit's params "
            "in place), or give that module a reset_parameters()")
