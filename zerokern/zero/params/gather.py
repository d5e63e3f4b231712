"""The param gathers of every stage: BucketParams, the one machine that moves a param bucket's
full buffer between SHARDED, GATHERING and GATHERED (ParamState), and GatherAfterStep, the policy
of stages 1/2 that runs it after each update. Stage 3's policy (around each unit's forward and
backward) is UnitParams / Stage3Runtime in params/per_unit.py, over the same machine.

What differs between the stages is one value, `frees` (stage 3: params/policy.py): at stages 1/2
the full buffer always has its storage and this rank's slice is a view of it, so SHARDED only
means "the other ranks' slices are stale" (the update wrote this rank's); at stage 3 the slice is
a tensor of its own and the buffer's storage exists only while GATHERING or GATHERED. With
gather_precision="int8" a bucket's gather travels through its ParamWire (comm/wire.py, handed
to the Comm's all_gather as `wire=`): the weights at stage 3, the update at stages 1/2, in int8,
decoded by every rank into every slice.

[Note: quantized param gathers] Each rank sends its slice of the bucket as blockwise int8 codes
with an fp32 scale per 64 elements ([Note: the wire format] in kernels/wire.py): one uint8
all-gather of one contiguous chunk per rank, nbytes(n) = n + 4 ceil(n / 64) bytes for a slice
of n elements (rounded up to a multiple of 4, so each chunk's scales can be read as fp32 in
place), against 4n for fp32 params (3.76x fewer) and 2n for bf16 (1.88x). Every rank, the owner
of a slice too, writes that slice from the decoded bytes alone, so every rank computes with
bit-identical params: the same bytes, decoded and added by the same ops.
- Stage 3 (ParamWire.adds False): what is sent is the owner's slice itself (ZeRO++'s qwZ). The
  slices (the fp32 masters, or the 16-bit params the update writes next to theirs) stay exact;
  only the gathered copy that forward and backward compute with is quantized, freed after.
- Stages 1/2 (adds True): the model's full params are the gathered copy, kept between steps,
  so the owner sends the update: delta = master - held, the exact fp32 master minus the value
  every rank holds for the slice (the owner's own slice of the full buffer: held values, never
  the master), and every rank adds decode(delta) to its copy. What one gather's rounding lost is
  in the next delta, so the held params never drift from the master by more than one gather's
  rounding: |master - held| < scale + one rounding of the add, scale = (absmax of the delta's
  block) / 127, per element (tests/zero/params/test_wire_gather.py checks it over hundreds of steps). The
  stores keep the master apart from the params for this (ShardStore's `holds_gathered`).
The rounding is stochastic, as encode_ does it: unbiased (E[decode] = the value sent), so a
param that moves by less than a step between gathers still moves on average, where rounding to
nearest would pin it. It is keyed ([Note: reproducible rounding] in kernels/lowbit.py) by the
bucket's name, the slice's place in it and `count`, the count of updates of the slices: at
stage 3 the gathers of one step (forward, backward, a checkpoint's recompute) give the same
bytes, so backward computes with the weights forward used, and a rerun gives the same bytes.
`count` is not in checkpoints: a resumed run's gathers start from 0 again, so they round with
other bits than the run that never stopped (docs/usage.md says so; the masters load exactly).
A non-finite value in a block makes its scale NaN: every element of that block decodes to NaN on
every rank (a step with an inf/nan update shows on every rank's params, as an exact gather's
would; it is never clamped to a finite value). At stages 1/2 the block's held params then stay
NaN (each delta is NaN there) until new weights are loaded: a model.load_state_dict() writes the
params in place, and the master re-reads them ([Note: in-place weights] in unit.py; so does a
load of the model's own values, which loses the master's last sub-step rounding once).
With a mesh the param gathers stay inside a host and are never quantized ([Note: hybrid
sharding] in comm/hybrid.py: only the hop between hosts is, and param gathers never take it). A
(1, N) mesh is one flat group (comm/factory.py), quantized as without a mesh.
The bytes of a gather are made when it is launched and dropped once it is decoded (world x
nbytes(n)), so memory_report() has nothing to count for them between steps; the masters that
fp32 params now keep apart are counted as master_params.

[Note: gather behind forward] After the update each rank holds new values for its own slice of
each bucket only; one all-gather per bucket brings the rest. By default step() waits for them
all (and small buckets are gathered together: [Note: coalesced param gathers]). With overlap_param_gather=True (zerokern.shard units only) step() launches them, unit by
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

import torch

from ..comm.wire import ParamWire
from ..core.states import ParamState
from . import coalesced
from .coalesced import Alone, CoalescedGather, plan_groups


def quantizes(precision, comm) -> bool:
    """Do the param gathers over `comm` travel in `precision`? Not with a mesh: its gathers stay
    inside a host, whose hop stays full precision ([Note: quantized param gathers])."""
    return precision is not None and comm.distributed and comm.shards is comm


def param_wire(precision, comm, flat, b: int, adds: bool):
    """Bucket b's ParamWire, or None where its gathers travel as they are. adds: the gathers send
    each update (stages 1/2), not the weights (stage 3)."""
    if not quantizes(precision, comm):
        return None
    return ParamWire(precision, flat.buckets[b].name, flat.layout.buckets[b].shard_numel, comm.rank, comm.world_size,
                     adds)


class BucketParams:
    """One param bucket's full buffer: the one place that says whether it holds every rank's values."""

    def __init__(self, flat, b: int, comm, frees: bool, counter=None, wire=None, master=None):
        """frees: the buffer's storage exists only while gathered (stage 3; flat.param_shards then
        holds this rank's slice). counter: what adds up the gathered bytes (Stage3Runtime), or None.
        wire: a ParamWire (comm/wire.py) where the gathers travel in int8 ([Note: quantized param
        gathers]); master: then, at stages 1/2, the store's exact fp32 master of this
        rank's slice, whose difference from the held params is what is sent."""
        self.flat, self.b, self.comm, self.frees, self.counter = flat, b, comm, frees, counter
        self.wire, self.master = wire, master
        if wire is not None and not frees and master is None:
            raise RuntimeError("zerokern internal error: a quantized gather after the step needs the master")
        self.state = ParamState.GATHERED  # built from whole params
        self._range = flat.layout.rank_range(flat.rank, b)  # this rank's [start, end) of the buffer
        self._work = None
        if frees:
            self._count(self.buffer.untyped_storage().nbytes())

    @property
    def buffer(self) -> torch.Tensor:
        return self.flat.param_bufs.buffers[self.b]

    def launch(self) -> None:
        """SHARDED -> GATHERING: every rank's slice is gathered into the full buffer."""
        if self.state is not ParamState.SHARDED:
            return
        f, buf = self.flat, self.buffer
        if self.frees:
            nbytes = buf.numel() * buf.element_size()
            buf.untyped_storage().resize_(nbytes)
            self._count(nbytes)
        name = f"all_gather[{f.buckets[self.b].name}]"
        if self.wire is not None:  # every rank's slice from its int8 bytes, this rank's too
            if self.frees:  # the weights
                sent = f.param_shards[self.b].to(torch.float32)
            else:  # the update: the exact master minus what every rank holds for the slice
                held = buf[self._range[0]:self._range[1]]
                sent = self.master.to(device=buf.device, dtype=torch.float32) - held.to(torch.float32)
            self._work = self.comm.all_gather(buf, sent, name=name, wire=self.wire)
        else:
            if self.frees:
                mine = buf[self._range[0]:self._range[1]]
                with torch.no_grad():
                    mine.copy_(f.param_shards[self.b])
            else:
                mine = f.param_shards[self.b]  # a view of the buffer: the gather is in place
            self._work = self.comm.all_gather(buf, mine, name=name)
        if f.shard_io is not None:  # the slice was read from disk and copied: [Note: stage-3 params on disk]
            f.shard_io[self.b].release_param()
        self.state = ParamState.GATHERING

    def own_slice(self) -> torch.Tensor:
        """This rank's slice of the full buffer (at stages 1/2 the update wrote it there)."""
        return self.buffer[self._range[0]:self._range[1]]

    def filled(self) -> None:
        """SHARDED -> GATHERED: a coalesced gather wrote every rank's slice into the buffer
        ([Note: coalesced param gathers] in params/coalesced.py)."""
        if self.state is not ParamState.SHARDED or self.frees or self.wire is not None:
            raise RuntimeError(f"zerokern internal error: bucket {self.b} filled in state {self.state}")
        self.state = ParamState.GATHERED

    def wait(self) -> None:
        """GATHERING -> GATHERED."""
        if self.state is ParamState.GATHERING:
            self.comm.wait(self._work)
            self._work = None
            self.state = ParamState.GATHERED

    def release(self) -> None:
        """-> SHARDED: only this rank's slice is current (the update is about to write it, or at
        stage 3 the unit is done with its params), and with `frees` the buffer's storage goes. A
        gather in flight is waited for first: it writes the buffer, and every rank launched it."""
        if self.state is ParamState.GATHERING:
            self.wait()
        if self.state is not ParamState.GATHERED:
            return
        if self.frees:
            buf = self.buffer
            self._count(-buf.untyped_storage().nbytes())
            buf.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    def _count(self, n: int) -> None:
        if self.counter is not None:
            self.counter.gathered_bytes += n
            self.counter.peak_bytes = max(self.counter.peak_bytes, self.counter.gathered_bytes)


class GatherAfterStep:
    """Stages 1/2: the buckets' gathers after each update, in the order the next forward uses
    them, and (with overlap_param_gather) the module pre-hooks that wait for them."""

    def __init__(self, comm, stores, overlap: bool = False, precision=None):
        """stores: the ShardStores in the order the next forward uses them (the reverse of backward's);
        none where nothing is gathered (one rank, or stage 0). overlap: overlap_param_gather (the
        gathers are waited for by the next forward's hooks, not at once). precision: "int8" where
        the gathers send each update quantized ([Note: quantized param gathers]; the
        stores then hold the masters apart from the params), else None."""
        self.comm = comm
        self.stores = stores
        self.overlap = overlap
        self.buckets = [BucketParams(s.flat, s.b, comm, frees=False, master=s.master,
                                     wire=param_wire(precision, comm, s.flat, s.b, adds=True)) for s in stores]
        self._pending = 0  # buckets in GATHERING: 0 makes every hook return at once
        # [Note: coalesced param gathers] in params/coalesced.py: where step() waits at once
        self.groups = [] if overlap or not comm.distributed else self._coalesced(self.buckets)

    @property
    def pending(self) -> bool:
        return self._pending > 0

    def updated(self) -> None:
        """The update wrote this rank's slice of every bucket: gather them all (the caller waited for
        the last step's gathers first: they share the buffers)."""
        for bp in self.buckets:
            bp.release()
            if bp.wire is not None:
                bp.wire.count += 1  # a new key for the rounding of each update
        if self.groups:  # each group one collective; two in flight at most (their staging buffers)
            last = None
            for group in self.groups:
                group.launch()
                if last is not None:
                    last.wait()
                last = group
            last.wait()
            return
        for bp in self.buckets:
            bp.launch()
        self._pending = len(self.buckets) if self.overlap else 0  # overlap: the next forward's hooks wait
        if not self.overlap:
            for bp in self.buckets:
                bp.wait()

    def _coalesced(self, buckets) -> list:
        """The groups of buckets gathered as one collective each (a group of one gathers as
        launch() does), or [] where no two buckets coalesce."""
        keys = [(bp.buffer.dtype, bp.buffer.device, bp.flat.rank, bp.flat.layout.world_size)
                if bp.wire is None and bp.flat.shard_io is None and bp.buffer.is_contiguous() else None
                for bp in buckets]
        nbytes = [bp.buffer.numel() * bp.buffer.element_size() for bp in buckets]
        groups = plan_groups(nbytes, keys, coalesced.LIMIT_BYTES)  # read at build: tests and bench set it
        if all(len(g) == 1 for g in groups):
            return []
        return [CoalescedGather([buckets[b] for b in g], self.comm, buckets[g[0]].flat.rank,
                                buckets[g[0]].flat.layout.world_size) if len(g) > 1 else Alone(buckets[g[0]])
                for g in groups]

    def wait(self, ks) -> None:
        """GATHERING -> GATHERED for these buckets (by index into stores)."""
        for k in ks:
            bp = self.buckets[k]
            if bp.state is ParamState.GATHERING:
                bp.wait()
                self._pending -= 1

    def wait_all(self) -> None:
        if self._pending:
            self.wait(range(len(self.buckets)))

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
