"""ZeroEngine: the ZeRO runtime of one optimizer's params over one process group. It owns the
units, the reduce schedule, the shard stores, the param gathers (stages 1/2) or the stage-3
runtime, and its Agreement (agreement.py: every cross-rank decision) and RoundFlags (step.py). An
optimizer (FusedZeroAdam, ZeroOptimizer) drives it with one protocol per step:

    step = engine.begin_step(found_inf, grad_scale, max_grad_norm)   # reduce what is left, agree
    if step.updates:
        ... update each store's operands by step.had and step.divisor (store.operands()) ...
    engine.finish_step(step)                                         # send back, gather, free

and asks it for zero_grad, no_sync, clip_grad_norm_ and memory_report. The optimizer never
touches buckets, collectives or units itself. docs/DESIGN.md draws the layers.
"""

import contextlib
import dataclasses
import weakref

import torch

from .agreement import Agreement
from .grad_norm import global_norm
from .grads import ddp_guard
from .grads.path import grad_path
from .grads.schedule import ReduceSchedule
from .options import sharding
from .params.policy import param_policy
from .state import lowbit_nvme_store, nvme_store
from .state.lowbit_store import LowBitStore
from .state.store import ShardStore
from .step import Piece, RoundFlags, Step
from .unit import check_free, forward_order, make_unit, unit_of


class ZeroEngine:
    def __init__(self, optimizer, groups, names, *, zero_stage=None, process_group=None, bucket_cap_mb=None,
                 overlap_comm=None, offload=None, overlap_param_gather=None, state_keys=("exp_avg", "exp_avg_sq"),
                 what="FusedZeroAdam", options="", state=None, mesh=None, reduce_precision=None,
                 gather_precision=None, disk_state_keys=None, matrices=None, master_weights=True):
        """groups: the param groups' param lists (validated); names: {param: name} where known.
        state_keys: the state tensors each store keeps per shard (the optimizer's own). state: a
        StatePolicy (core/stage.py) for low-bit state or params without masters, else None.
        disk_state_keys: an optimizer that keeps its own state (ZeroOptimizer: state_keys=()) names
        here the per-element fp32 state that OffloadPolicy(device="nvme") streams from disk for it.
        matrices: a WholeMatrices (core/whole_matrices.py), the params an optimizer steps whole, laid
        out whole in one rank's shard each: by this engine for the params it buckets itself, by
        zerokern.shard(matrices=...) for its units' ([Note: whole matrices in units]).
        master_weights False (ZeroOptimizer's; FusedZeroAdam's is in `state`): the stores keep no
        fp32 copy of bf16 params, whose shards the optimizer updates itself."""
        self.optimizer = weakref.ref(optimizer)  # the runtime never calls up into it
        all_params = [p for g in groups for p in g]
        self.trainable = [p for p in all_params if p.requires_grad]
        self._frozen = [(k, p) for k, p in enumerate(all_params) if not p.requires_grad]
        owned = list({id(u): u for u in (unit_of(p) for p in self.trainable) if u is not None}.values())
        loose = [p for p in self.trainable if unit_of(p) is None]
        self.comm, config = sharding(owned, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload,
                                     overlap_param_gather, state.align if state is not None else None, mesh,
                                     self.trainable[0].device.type if self.trainable else "cpu", reduce_precision,
                                     gather_precision)
        if matrices is not None:  # [Note: whole matrices in units]: shard() laid its units out
            _check_units_hold(owned, matrices, what)
            config = dataclasses.replace(config, matrices=matrices)  # for the params bucketed here
        self.strategy = strategy = config.strategy(self.comm.world_size)  # strategy.stage: the stage as given
        index = {p: k for k, p in enumerate(all_params)}
        if loose and (config.overlap_param_gather or strategy.needs_units):
            call, why = (("zerokern.shard(module, stage=3)", "at stage 3 params are gathered in the forward hooks of "
                          "the modules that own them") if strategy.needs_units else
                         ("zerokern.shard(module)", "with overlap_param_gather=True the gather is waited for in the "
                          "forward pre-hooks of the modules that own the params"))
            raise ValueError(f"zerokern: {names.get(loose[0], f'params[{index[loose[0]]}]')} is not sharded with "
                             f"{call}: {why}, so every trainable param must be in a unit (shard each block, then "
                             "the root)")
        Agreement.same_model_on_every_rank(self.comm, what, all_params, [len(g) for g in groups], config, options)
        check_free(owned, index)
        path = grad_path(strategy)  # the same for every unit: their configs agree (sharding())
        self.param_policy = param_policy(strategy)
        self.units = owned + ([make_unit(loose, [names.get(p, f"params[{index[p]}]") for p in loose],
                                         [0] * len(loose), self.comm, config, "params", path,
                                         param_policy(strategy))] if loose else [])
        tindex = {p: k for k, p in enumerate(self.trainable)}
        # [Note: one collective order] in grads/schedule.py: buckets by when backward completes them.
        placed = sorted(((f, b) for u in self.units for f in u.flat for b in range(len(f.buckets))),
                        key=lambda fb: -min(index[fb[0].params[i]] for i in fb[0].layout.buckets[fb[1]].tensors))
        self.schedule = ReduceSchedule([(f.grads, f.buckets[b]) for f, b in placed], self.comm, config.overlap_comm)
        self.schedule.owner = weakref.ref(self)
        for u in self.units:
            u.schedule = self.schedule
            for f in u.flat:
                for m in f.members:
                    m.t = tindex[m.param]  # its index among this optimizer's trainable params
        self._broadcast_params()  # before the stores read their masters
        self.stage3 = self.param_policy.start(self.comm, forward_order(owned, index))  # stage 3's runtime, or None
        # [Note: quantized param gathers]: at stages 1/2 the params then hold what the gathers gave
        holds = self.param_policy.holds_gathered(self.comm, config.gather_precision)
        if holds and not (master_weights and (state is None or state.master_weights)):
            raise ValueError(f"zerokern: {what}(gather_precision={config.gather_precision!r}) at stage "
                             f"{strategy.stage} needs fp32 master weights: the params hold the gathered values, "
                             "within one int8 step of the masters, and the masters what was trained exactly. Pass "
                             "master_weights=True, or gather_precision=None")
        if config.offload is not None and not master_weights:
            raise ValueError(f"zerokern: {what}(master_weights=False) with OffloadPolicy(device="
                             f"{config.offload.device!r}) is not offered yet: offload steps an fp32 copy of each shard "
                             "kept off the device (a master), which master_weights=False drops. Pass "
                             "master_weights=True, or offload=None")
        if config.offload is not None and config.offload.on_disk:
            why = (f"gather_precision={config.gather_precision!r}" if holds else
                   f"{what} (it keeps its inner optimizer's own state)" if tuple(state_keys) != nvme_store.STATE_KEYS
                   and disk_state_keys is None else None)
            if why:
                raise ValueError(f"zerokern: OffloadPolicy(device='nvme') with {why} is not offered yet; use "
                                 "FusedZeroAdam with fp32 state, or OffloadPolicy(device='cpu')")
            self.param_policy.check_offload(config.offload, self.comm)
            on_gpu = [p for p in self.trainable if p.device.type != "cpu"]
            if config.offload.params and on_gpu:
                raise ValueError(f"zerokern: OffloadPolicy(params=True) with params on {on_gpu[0].device} "
                                 f"({names.get(on_gpu[0], 'params')}) is not offered yet: the param shards on disk "
                                 "are read into CPU memory for the gathers. Keep params=False (the state and masters "
                                 "still go to disk), or train on the CPU")
            if config.offload.params and state is not None:
                raise ValueError(f"zerokern: OffloadPolicy(params=True) with state_precision="
                                 f"{state.precision!r} is not offered yet: the low-bit stores keep the param shards "
                                 "in memory. Use params=False (the low-bit state still goes to disk), or fp32 state")
            self.stores = (nvme_store.create(placed, config.offload, self.comm, what,
                                             state_keys if disk_state_keys is None else disk_state_keys)
                           if state is None
                           else lowbit_nvme_store.create(placed, config.offload, state, self.comm, what))
        else:
            self.stores = [ShardStore(f, b, config.offload, state_keys, holds, master_weights) if state is None
                           else LowBitStore(f, b, state, holds_gathered=holds) for f, b in placed]
        self.agreement = Agreement(self.comm, strategy, path, self.schedule, self.stores,
                                   [[tindex[f.params[i]] for i in f.layout.buckets[b].tensors] for f, b in placed],
                                   self.trainable, what)
        self.schedule.after_backward = self.agreement.after_backward  # held weakly (grads/schedule.py)
        self.schedule.before_settle = self.agreement.before_settle
        # per store, this rank's Piece of each of its params, in shard order
        self.pieces = [_pieces_of(s, tindex) for s in self.stores]
        # each trainable param's first element in the global count that keys stochastic rounding
        # (over the params in order, so the same at every world size and stage: [Note: reproducible rounding])
        starts = [0]
        for f, i in (self.locate(p) for p in self.trainable):
            starts.append(starts[-1] + f.members[i].shape.numel())
        self.global_starts = starts[:-1]
        # [Note: gather behind forward]: the next forward uses the buckets in the reverse of backward's order
        in_order = self.stores[::-1]
        if config.overlap_param_gather:  # unit by unit, as the forward reaches them (sort is stable)
            position = {id(u): k for k, u in enumerate(forward_order(owned, index))}
            in_order = sorted(in_order, key=lambda s: position[id(unit_of(s.flat.params[0]))])
        self.param_gather = self.param_policy.after_step_gather(self.comm, in_order, config.overlap_param_gather,
                                                                config.gather_precision if holds else None)
        if self.param_gather.overlap:
            self.param_gather.hook_modules(owned)
        self.flags = RoundFlags()
        ddp_guard.watch(optimizer, self.units)  # [Note: DDP wrap] in grads/ddp_guard.py

    @property
    def zero_stage(self) -> int:
        return self.strategy.stage  # as given; what it means is self.strategy

    last_grad_norm = property(lambda self: self.flags.last_grad_norm)
    last_step_skipped = property(lambda self: self.flags.last_step_skipped)

    def locate(self, p):
        """(FlatParams, local index) of trainable param p."""
        return unit_of(p).locate(p)

    def param_of(self, store, k):
        """(param, name, full shape) of the k-th piece of a store."""
        f = store.flat
        i = f.layout.buckets[store.b].tensors[k]
        m = f.members[i]
        return m.param, m.name, m.shape

    # --- the step protocol ---------------------------------------------------

    @torch.no_grad()
    def begin_step(self, found_inf, grad_scale, max_grad_norm=None) -> Step:
        """Everything before the update ([Note: overflow on any rank]): what had a grad, whether
        to skip, and (when it updates) the divisor of the reduced grads: loss scale x clip."""
        had, skip = self._prepare(found_inf, grad_scale)
        skip = skip or self.flags.overflow_seen  # an fp16 sum that overflowed in clip_grad_norm_
        step = Step(had, not skip and any(had))
        if step.updates:
            step.divisor = self._grad_divisor(grad_scale, had, max_grad_norm)
        return step

    def finish_step(self, step: Step) -> None:
        """After the update: the stores send offloaded params back, the gathers bring the others'
        slices; the round ends (the grads freed at stages 2/3, [Note: grads after step])."""
        updates = step.updates
        if updates:
            for store in self.stores:
                store.finish()
            self.param_gather.updated()  # _prepare waited for the last step's gathers
            self.param_policy.after_update(self.units)
        self.flags.last_step_skipped = not updates and any(step.had)  # had a grad, yet no update
        self.flags.new_round()
        self.schedule.end_round(release=self.strategy.frees_grads_after_step, updated=updates)
        if self.strategy.frees_grads_after_step:  # [Note: grads after step] in grads/placeholder.py
            for u in self.units:
                for f in u.flat:
                    f.grads.after_step(step.had)

    def _broadcast_params(self):
        """As DDP: every rank starts from rank 0's params, frozen ones too (one broadcast per
        bucket buffer and per frozen param)."""
        self.comm.broadcast_from_first(
            [buf for u in self.units for f in u.flat for buf in f.params_policy.broadcast_buffers(f)]
            + [p for _, p in self._frozen])

    def _check_frozen(self):
        for k, p in self._frozen:
            if p.requires_grad or p.grad is not None:
                raise NotImplementedError(
                    f"zerokern: params[{k}] was frozen (requires_grad=False) when the optimizer was built and now "
                    "has requires_grad=True or a grad; it has no place in the buckets and would not be trained. "
                    "Build the optimizer after unfreezing (or build it with the param trainable and lr=0 in its "
                    "own param group)")

    def _refresh_changed_masters(self):
        """Params adopted with new values ([Note: ownership]): their fp32 masters follow."""
        for s in self.stores:
            if s.flat.changed:
                s.refresh_params(s.flat.changed)
        for u in self.units:
            for f in u.flat:
                f.changed.clear()

    def share_found_inf(self, found_inf_per_device):
        """zerokern.GradScaler's inf check, agreed across ranks (Agreement.share_found_inf)."""
        self.agreement.share_found_inf(found_inf_per_device)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally, with no communication."""
        before = [u.sync for u in self.units]
        for u in self.units:
            u.sync = False
        try:
            yield
        finally:
            for u, s in zip(self.units, before):
                u.sync = s

    # --- step --------------------------------------------------------------

    def _prepare(self, found_inf, grad_scale=None):
        """Everything step() needs before the update: a backward that never finished is
        reset, what the model did to params and grads is adopted, the ranks agree on which
        params had grads and which buckets need reducing, and those are reduced."""
        self.param_gather.wait_all()  # adopt() below and the update write the params
        self.schedule.reset()
        self.param_policy.before_update(self.units)  # stage 3: every unit resharded
        if self._frozen:
            self._check_frozen()
        for u in self.units:
            u.sync_from_model()
        self._refresh_changed_masters()
        # raises on every rank if any rank edited local grads
        had, needs, skip = self.agreement.before_update(found_inf, grad_scale)
        self.schedule.reduce(needs)
        return had, self.agreement.overflowed(needs) or skip

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ for the sharded grads: the norm of the averaged
        gradient over all params and ranks (collective: call it on every rank, between
        backward and step()), returned as a tensor; the clip factor is applied in the fused
        update of the next step() (in place of max_grad_norm for that step). Works at every
        stage, where torch's clip_grad_norm_ on .grad would see each rank's local grads.
        With torch.amp.GradScaler the returned norm is of the still-scaled grads (the scale
        is known only in scaler.step()); the clip itself uses the unscaled norm."""
        max_norm = float(max_norm)
        self.flags.clip = None
        had, overflow = self._prepare(None)
        self.flags.overflow_seen = self.flags.overflow_seen or overflow  # step() reduces nothing more: skip there
        norm = self._global_norm(float(norm_type), had)
        if max_norm != float("inf"):  # inf: the norm only (as HF Trainer asks for logging); max_grad_norm stays
            self.flags.clip = (max_norm, norm)
        self.flags.last_grad_norm = norm
        return norm

    def _global_norm(self, norm_type, had):
        return global_norm(self.comm, self.stores, self.pieces, had, norm_type, self.strategy.shards_state)

    def _grad_divisor(self, grad_scale, had, max_grad_norm):
        """The divisor of the reduced grads: the loss scale, times the clip factor."""
        if self.flags.clip is not None:  # opt.clip_grad_norm_ ran this step
            max_norm, norm = self.flags.clip
        elif max_grad_norm is None:
            self.flags.last_grad_norm = None
            return grad_scale
        else:
            max_norm, norm = max_grad_norm, self._global_norm(2.0, had)
        if grad_scale is not None:
            norm = norm / grad_scale.float()
        self.flags.last_grad_norm = norm
        clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        base = grad_scale.float() if grad_scale is not None else torch.ones((), device=clip.device)
        return (base / clip).reshape(1)

    def finish_param_gather(self):
        """Wait until every param holds the last step's values on this rank. Needed only with
        overlap_param_gather=True, before code that reads params directly after step() and
        before the next forward (an EMA, a copy of the weights); module forwards, state_dict()
        and load_state_dict() wait by themselves ([Note: gather behind forward])."""
        self.param_gather.wait_all()

    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim: every .grad None (a param no backward reaches then is not stepped), or
        with set_to_none=False a zero grad that the next step() uses. The buckets are zeroed;
        autograd accumulates into them again ([Note: grads after step] in zero/grads/placeholder.py)."""
        self.schedule.zero(set_to_none)
        self.flags.new_round()
        for u in self.units:
            for f in u.flat:
                f.grads.after_zero_grad(set_to_none)

    def reload_master_weights(self):
        """fp16/bf16 params: re-read the fp32 master weights from the model's
        params (after loading model weights without the optimizer's state)."""
        for s in self.stores:
            s.master_valid = not s.separate_master

    def memory_report(self):
        """Bytes this rank holds, by kind."""
        rep = {"params": 0, "master_params": 0, "adam_state": 0, "grads": 0, "comm_buffers": 0, "error_feedback": 0}
        for s in self.stores:
            rep["params"] += s.flat.params_policy.param_bytes(s.flat, s.b)
            for d in (s.nbytes(), s.bucket.nbytes()):
                for k, v in d.items():
                    rep[k] += v
        rep["comm_buffers"] += self.schedule.pool.free_bytes()  # stage-2 full buffers kept for reuse
        rep["total"] = sum(rep.values())
        disk = [s for s in self.stores if getattr(s, "streams", False)]
        if disk:  # OffloadPolicy(device="nvme"): beside the memory, not in its total
            rep["nvme_buffers"] = disk[0].swap.buffer_bytes() + sum(s.staging.numel() * s.staging.element_size()
                                                                   for s in disk if s.staging is not None)
            rep["total"] += rep["nvme_buffers"]
            rep["on_disk"] = sum(s.disk_bytes() for s in disk)
        return rep


def _check_units_hold(units, matrices, what):
    """[Note: whole matrices in units]: every param of `matrices` in a unit whose layout splits it
    over several shards was laid out whole by it (zerokern.shard(matrices=...)), with its own
    optimizer's cost ([Note: a cost per param] in core/whole_matrices.py), or raise naming it."""
    fix = ("Pass matrices= to every zerokern.shard() call (the Muon groups' params, {param: \"muon\" | \"adafactor\"} "
           "for each group's class, or fn(name, param) -> \"muon\" | \"adafactor\" | None)")
    for u in units:
        laid = u.config.matrices
        for f in u.flat:
            shards = f.layout.world_size  # 1: every param is whole in any layout
            for m in f.members:
                want = matrices.cost_of(m.param)
                if shards == 1 or want is None:
                    continue
                if laid is None or not laid.holds(m.param):
                    raise ValueError(
                        f"zerokern: {what} steps {m.name} as a whole matrix, so on {shards} ranks it must lie whole "
                        f"in one rank's shard, but unit '{u.name}' was laid out by zerokern.shard() without it. "
                        f"{fix}, or at stages 1 and 2 the params without shard()")
                if laid.cost_of(m.param) != want:
                    # the numbers would be right (it is whole), but its owner was chosen by another
                    # optimizer's cost, so the balance the plan promises does not hold: a mistake in
                    # the shard() calls, refused rather than run lopsided
                    raise ValueError(
                        f"zerokern: {what} steps {m.name} with {want.capitalize()}, but unit '{u.name}' laid it "
                        f"out by {laid.cost_of(m.param).capitalize()}'s cost, so its owners are balanced by the "
                        f"wrong work. {fix}, naming it \"{want}\"")


def _pieces_of(store, tindex):
    f, b = store.flat, store.b
    pieces = {pc.index: pc for pc in f.layout.rank_pieces(f.rank, b)}
    out = []
    for i in f.layout.buckets[b].tensors:
        pc = pieces.get(i)
        out.append(Piece(tindex[f.params[i]], *((pc.shard_offset, pc.numel, pc.tensor_start) if pc else (0, 0, 0))))
    return out
