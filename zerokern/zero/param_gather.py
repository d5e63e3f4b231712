"""ParamGather: the all-gathers that bring every rank the params the others updated, and the
points that wait for them. The one place that says whether a bucket's params are current
(GatherState).

[Note: gather behind forward] After the update each rank holds new values for its own slice of
each bucket only; one all-gather per bucket brings the rest. By default step() waits for them
all. With overlap_param_gather=True (zerokern.shard units only) step() launches them, unit by
unit in the order the next forward reaches the units, and returns. A unit's gathers are waited
for in its forward pre-hook (as FSDP2 unshards a unit there), so the forward of the units
before it overlaps them, as FSDP2's prefetch and Megatron's overlap_param_gather do; a module
holding a param also waits for that param's bucket in its own pre-hook, for a submodule called
on its own. Everything that reads or writes params through an API waits first:
state_dict() and load_state_dict() of any module that owns a sharded param (so DCP, Accelerate's
and Trainer's saves), and the optimizer's step(), state_dict(), load_state_dict() and
full_state_dict(). A direct read of a param between step() and the next forward (an EMA update,
a copy, evaluation that calls no module) is invisible to all of these: it must call
opt.finish_param_gather() first. That contract is why the overlap is opt-in.
"""

import weakref
from typing import Dict, List

from .states import GatherState


class ParamGather:
    def __init__(self, comm, stores):
        """stores: the ShardStores in the order the next forward uses them (the reverse of backward's);
        none where nothing is gathered (one rank, or stage 0)."""
        self.comm = comm
        self.stores = stores
        self.state = [GatherState.CURRENT] * len(stores)
        self._works = [None] * len(stores)
        self._pending = 0  # buckets in GATHERING: 0 makes every hook return at once

    @property
    def pending(self) -> bool:
        return self._pending > 0

    def launch(self, ks) -> None:
        """Gather these buckets (by index into stores), whose shards were just updated. The caller
        waited for the last step's gathers first (they share the buffers)."""
        for k in ks:
            s = self.stores[k]
            buf = s.flat.param_bufs.buffers[s.b]
            self._works[k] = self.comm.all_gather(buf, s.param_shard(), name=f"all_gather[{s.bucket.name}]")
            self.state[k] = GatherState.GATHERING
            self._pending += 1

    def wait(self, ks) -> None:
        """GATHERING -> CURRENT for these buckets (by index into stores)."""
        for k in ks:
            if self.state[k] is GatherState.GATHERING:
                self.comm.wait(self._works[k])
                self._works[k] = None
                self.state[k] = GatherState.CURRENT
                self._pending -= 1

    def wait_all(self) -> None:
        if self._pending:
            self.wait(range(len(self.stores)))

    # --- module hooks ----------------------------------------------------------

    def hook_modules(self, units) -> None:
        """The pre-hooks that wait. A unit's module waits in its forward pre-hook for all of the
        unit's buckets, as FSDP2 unshards a unit before its forward: the unit's forward may read
        any of its params, also those of submodules it never calls (`self.wpe.weight[:t]`).
        Every module that holds one of the params waits for that param's bucket in its forward
        (a submodule called on its own), state_dict() and load_state_dict() pre-hooks."""
        index = {(id(s.flat), s.b): k for k, s in enumerate(self.stores)}
        waits: Dict[int, List] = {}  # id(module) -> [module, buckets to wait for, hook state dicts too]
        for u in units:
            module = u.module()
            for owner, p in u.param_owners:
                f, i = u.locate(p)
                k = index[(id(f), f.layout.slots[i].bucket)]
                entry = waits.setdefault(id(owner), [owner, set(), True])
                entry[1].add(k)
                entry[2] = True  # also where the unit's own module came first without the flag
                if module is not None:
                    waits.setdefault(id(module), [module, set(), False])[1].add(k)
        me = weakref.ref(self)  # the hooks outlive an optimizer that is dropped; its state must not
        for module, ks, owns in waits.values():
            ks = sorted(ks)

            def wait_for(*_, ks=ks):
                gather = me()
                if gather is not None and gather._pending:
                    gather.wait(ks)

            # a unit belongs to one optimizer for good (FusedZeroAdam checks), so these stay
            module.register_forward_pre_hook(wait_for)
            if owns:
                module.register_state_dict_pre_hook(wait_for)
                module.register_load_state_dict_pre_hook(wait_for)
