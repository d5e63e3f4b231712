"""The param policies: where a param's values live between steps, and what that changes for
zerokern.shard(), a unit's dtype group and the engine. param_policy() picks one from the stage
definition; outside core/stage.py this is the one file that asks which param mode it is in
(grads/path.py asks the grad mode).

WholeParams: every rank holds every param between steps (stages 0-2, and any stage on one
process); at stages 1/2 on several ranks step() all-gathers the updated shards (GatherAfterStep).
UnitShards: stage 3 on several ranks; a rank keeps its slices and each unit's params are
gathered for its forward and backward only ([Note: stage-3 params] in per_unit.py).
"""

import hashlib

import torch

from ..core.errors import fields_of, which_differ
from ..core.stage import ParamMode, Strategy
from .gather import GatherAfterStep, quantizes
from .generate import sync_generate
from .materialize import in_scope
from .per_unit import add_foreign_use, joined


def param_policy(strategy: Strategy):
    if strategy.params is ParamMode.GATHER_PER_UNIT:
        return UnitShards()
    return WholeParams(gathers_after_step=strategy.params is ParamMode.GATHER_AFTER_STEP)


class WholeParams:
    # the model's whole state dict is a collective (every rank gathers; Trainer's and Accelerate's
    # save paths ask this, as they ask about FSDP and DeepSpeed ZeRO-3)
    state_dict_is_collective = False

    def __init__(self, gathers_after_step: bool):
        self.gathers_after_step = gathers_after_step

    # --- zerokern.shard() -------------------------------------------------------------------

    def before_unit(self, comm, module, config, params, names) -> None:
        """Before the unit is made (nothing to agree on: shard() runs no collective here)."""

    def after_unit(self, comm, module, unit, is_unit, unit_of) -> None:
        """The unit was made (the params stay whole; the optimizer broadcasts them). is_unit(m):
        m is a sharded module; unit_of(p): the unit that owns p (unit.py's registry)."""

    # --- a unit's dtype group (FlatParams) -------------------------------------------------------

    def check_replaceable(self, flat, i: int, how: str) -> None:
        """params[i]'s data (how="data") or the Parameter itself (how="assign") was replaced:
        adopted ([Note: ownership] in unit.py)."""

    def broadcast_buffers(self, flat):
        """The buffers the optimizer broadcasts from rank 0 at its construction, as DDP does."""
        return list(flat.param_bufs.buffers)

    def param_bytes(self, flat, b: int) -> int:
        buf = flat.param_bufs.buffers[b]
        return buf.numel() * buf.element_size()

    def gather_whole(self, flat, comm, keep: bool, device, whole: dict) -> None:
        """full_state_dict: the params are whole already (read from the state dict)."""

    def empty_between_gathers(self, flat):
        """The indices of params that hold no values between their unit's gathers."""
        return []

    # --- the engine ---------------------------------------------------------------------------

    def start(self, comm, order):
        """The stage-3 runtime of the group, if any (None)."""
        return None

    def check_offload(self, offload, comm) -> None:
        """OffloadPolicy(params=True) keeps param shards on disk: whole params have none."""
        if offload is not None and offload.params:
            raise ValueError(f"zerokern: OffloadPolicy(params=True) puts stage 3's param shards on disk, but "
                             f"with {comm.world_size} rank(s) every rank holds whole params: it needs stage 3 "
                             "on 2 or more ranks (or params=False)")

    def holds_gathered(self, comm, precision) -> bool:
        """Do the model's params hold what quantized gathers gave rather than the masters? Then
        the stores keep an fp32 master apart from the param shard, the fp32 params' too
        ([Note: quantized param gathers] in params/gather.py). Stages 1/2 on several ranks."""
        return self.gathers_after_step and quantizes(precision, comm)

    def after_step_gather(self, comm, stores, overlap: bool, precision=None) -> GatherAfterStep:
        """The gathers of the updated shards after each step (stages 1/2 on several ranks);
        precision: gather_precision."""
        if not self.gathers_after_step:
            return GatherAfterStep(comm, [])
        return GatherAfterStep(comm, stores, overlap=overlap, precision=precision)

    def before_update(self, units) -> None:
        """Before the update writes the masters and params."""

    def after_update(self, units) -> None:
        """The update wrote the masters and params (the gathers after it are after_step_gather's)."""


class UnitShards(WholeParams):
    state_dict_is_collective = True

    def __init__(self):
        super().__init__(gathers_after_step=False)
        self.runtime = None

    def before_unit(self, comm, module, config, params, names) -> None:
        """shard() runs collectives from here on: every rank must shard the same params with the
        same options, or every rank raises, listing what each has (a mismatch would otherwise pair
        broadcasts of other sizes)."""
        desc = repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad) for p, n in zip(params, names)])
        mine = {"params": len(params), "elements": sum(p.numel() for p in params),
                "the params' names/shapes/dtypes/requires_grad": "#" + hashlib.sha256(desc.encode()).hexdigest()[:16],
                **fields_of(config.agreed())}  # not the process-local ids of config.matrices
        everyone = comm.differing(mine, f"zerokern.shard({type(module).__name__}, stage=3)")
        if everyone is not None:
            raise ValueError(f"zerokern.shard({type(module).__name__}, stage=3): the ranks shard different params "
                             "or options; every rank must shard the same model the same way. The ranks differ in "
                             + which_differ(everyone))

    def after_unit(self, comm, module, unit, is_unit, unit_of) -> None:
        """The unit's params go to its model's stage-3 runtime, which keeps this rank's slices
        from now on ([Note: stage-3 params]). Frozen params and buffers stay whole on every rank;
        they take rank 0's values too (a meta init may have drawn them from each rank's own
        generator)."""
        whole = {id(t): t for m in in_scope(module, is_unit)
                 for t in list(m._parameters.values()) + list(m._buffers.values())
                 if t is not None and not (isinstance(t, torch.nn.Parameter) and t.requires_grad)}
        comm.broadcast_from_first(list(whole.values()))
        inner = {id(u): u for u in map(unit_of, module.parameters()) if u is not None and u is not unit}
        runtime = joined(inner.values(), comm)  # [Note: one runtime per model] (params/per_unit.py)
        runtime.add(unit)
        if comm.distributed:
            sync_generate(module)  # each forward gathers: every rank must run as many
        for n, p in module.named_parameters(remove_duplicate=False):
            # a param of another unit held here too (a tied head): gathered for its use here
            other = unit_of(p)
            holder = module.get_submodule(n.rpartition(".")[0])
            if other is not None and other is not unit and not _inside(holder, other):
                add_foreign_use(holder, other.gathers)

    def check_replaceable(self, flat, i: int, how: str) -> None:
        name = flat.members[i].name
        if how == "data":
            raise RuntimeError(
                f"zerokern: {name} (unit '{flat.unit_name}'): its data was replaced (p.data = ..., model.to() that "
                "copies, to_empty()), but at stage 3 a param holds data only inside its unit's forward and backward "
                "and the optimizer keeps this rank's slice; replacing it is not offered at stage 3. Load new "
                "weights with model.load_state_dict(sd) instead (whole tensors go into the shards)")
        raise RuntimeError(f"zerokern: {name} was replaced by another tensor (load_state_dict(assign=True)?), "
                           "but at stage 3 the optimizer keeps this rank's slice of it; load new values with "
                           "model.load_state_dict(sd) without assign=True")

    def broadcast_buffers(self, flat):
        return []  # shard() did it, before keeping this rank's slices

    def param_bytes(self, flat, b: int) -> int:
        """The slice (unless on disk: OffloadPolicy(params=True)), and the full buffer while gathered."""
        buf = flat.param_bufs.buffers[b]
        mine = 0 if flat.shard_io is not None else flat.param_shard(b).numel() * buf.element_size()
        return mine + buf.untyped_storage().nbytes()

    def gather_whole(self, flat, comm, keep: bool, device, whole: dict) -> None:
        """full_state_dict: the whole dtype group at once, bucket by bucket (the same order on every
        rank); whole[id(param)] = its full values on `device` (None where not kept)."""
        for b, bucket in enumerate(flat.layout.buckets):
            full = flat.param_shards[b].new_empty(bucket.padded_numel)
            comm.wait(comm.all_gather(full, flat.param_shards[b], name=f"full_state_dict[{flat.buckets[b].name}]"))
            for i in bucket.tensors:
                slot = flat.layout.slots[i]
                value = full[slot.offset:slot.offset + slot.numel].view(flat.members[i].shape)
                whole[id(flat.params[i])] = value.to(device, copy=True) if keep else None

    def empty_between_gathers(self, flat):
        return list(range(len(flat.members)))

    def start(self, comm, order):
        """[Note: stage-3 params] shard() sharded the params; the runtime gathers them in forward
        and backward, in the units' forward order."""
        self.runtime = joined(order, comm)  # the optimizer's units' runtime ([Note: one runtime per model])
        self.runtime.expect_order(order)
        return self.runtime

    def check_offload(self, offload, comm) -> None:
        """Stage 3's param shards may live on disk (OffloadPolicy(params=True))."""

    def holds_gathered(self, comm, precision) -> bool:
        return False  # the slices are exact; only the gathered copies, freed after use, are quantized

    def before_update(self, units) -> None:
        self.runtime.reshard_all(units)  # the update writes the slices; a gathered unit would go stale

    def after_update(self, units) -> None:
        for u in units:
            if u.gathers is not None:  # its UnitParams (per_unit.py)
                u.gathers.updated()


def _inside(module, unit) -> bool:
    """Is `module` the unit's module or inside it?"""
    root = unit.module()
    return root is not None and any(m is module for m in root.modules())
