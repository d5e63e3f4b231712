"""ZeroEngine: the ZeRO runtime of one optimizer's params over one process group. It owns the
units, the reduce schedule, the shard stores, the param gathers (stages 1/2) or the stage-3
runtime, and every cross-rank agreement (which params had grads, overflow, the grad norm). An
optimizer (FusedZeroAdam, ZeroOptimizer) drives it with one protocol per step:

    had, skip = engine.begin_step(found_inf, grad_scale)   # reduce what is left, agree
    if not skip and any(had):
        scale = engine.grad_divisor(grad_scale, had, max_grad_norm)   # loss scale x clip
        ... update each store's operands (store.operands() / store.finish()) ...
        engine.gather_updated()
    engine.end_step(had, skip)

and asks it for zero_grad, no_sync, clip_grad_norm_ and memory_report. The optimizer never
touches buckets, collectives or units itself. docs/DESIGN.md draws the layers.
"""

import contextlib
import dataclasses
import hashlib
import weakref

import torch

from .grads import ddp_guard
from .unit import make_unit, unit_of
from .params.gather import GatherAfterStep
from .grads.schedule import ReduceSchedule
from .comm.factory import comm_for
from .comm.hybrid import resolve_mesh
from .core.stage import GradMode, ParamMode, ShardConfig, optimizer_stage
from .params.per_unit import runtime_for
from .state.lowbit_store import LowBitStore
from .state.store import ShardStore

NORM_CHUNK = 1 << 15  # elements per partial norm of the global grad norm (see _global_norm)


def forward_order(units, index):
    """zerokern.shard units in the order a forward runs their pre-hooks: a unit before the units
    inside its module, siblings in the order their params were registered."""
    def key(u):
        module = u.module()
        inside = [index[p] for p in module.parameters() if p in index] if module is not None else []
        inside = inside or [index[p] for p in u.params]
        return min(inside), -len(inside)
    return sorted(units, key=key)


def owner_of(params):
    """The one optimizer (FusedZeroAdam, ZeroOptimizer) whose engine trains every tensor in `params`,
    else None (none given, one not owned, or owners that differ). Integrations ask this before
    changing what they do."""
    owner = None
    for p in params:
        u = unit_of(p)
        engine = u.schedule.owner() if u is not None and u.schedule is not None and u.schedule.owner else None
        opt = engine.optimizer() if engine is not None else None
        if opt is None or (owner is not None and opt is not owner):
            return None
        owner = opt
    return owner


def sharding(units, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload, overlap_param_gather,
             align=None, mesh=None, device_type="cpu"):
    """(Comm, ShardConfig) for the params: the units' own, or one from the arguments. align: the
    element multiple the state needs its shards in (int8 state: its blocks), or None."""
    if units:
        # Bucket size and reshard_after_forward are each unit's own (a root often keeps its params
        # gathered, as FSDP2's reshard_after_forward=False); the rest is one engine's, so alike.
        configs = {dataclasses.replace(u.config, bucket_cap_mb=1.0, reshard_after_forward=True) for u in units}
        groups = {id(u.comm.group) for u in units}
        if len(configs) > 1 or len(groups) > 1:
            raise ValueError("zerokern: the params were sharded with different stages, overlap, offload or process "
                             "groups (only bucket_cap_mb and reshard_after_forward may differ per unit): "
                             + "; ".join(f"{u.name}: {u.config}" for u in units))
        config = units[0].config
        given = {"zero_stage": (zero_stage, config.stage), "bucket_cap_mb": (bucket_cap_mb, config.bucket_cap_mb),
                 "overlap_comm": (overlap_comm, config.overlap_comm), "offload": (offload, config.offload),
                 "overlap_param_gather": (overlap_param_gather, config.overlap_param_gather)}
        for name, (mine, theirs) in given.items():
            if mine is not None and mine != theirs:
                raise ValueError(f"zerokern: FusedZeroAdam({name}={mine!r}), but zerokern.shard() set {theirs!r} "
                                 f"for these params; pass it to shard() only")
        unaligned = [u for u in units if align is not None and u.config.align % align]
        if unaligned:
            raise ValueError(f"zerokern: unit '{unaligned[0].name}' was laid out for fp32 or bf16 state; int8 state "
                             f"keeps one scale per block of {align} elements, so the shards must align to them: "
                             "pass state_precision='int8' to zerokern.shard() too")
        if process_group is not None and process_group is not units[0].comm.group:
            raise ValueError("zerokern: FusedZeroAdam got another process_group than zerokern.shard(); pass it "
                             "to shard() only")
        if mesh is not None and resolve_mesh(mesh, process_group, device_type).get_group("shard") is not \
                units[0].comm.group:
            raise ValueError("zerokern: FusedZeroAdam got another mesh than zerokern.shard(); pass it to shard() "
                             "only")
        return units[0].comm, config
    comm = comm_for(process_group, mesh, device_type)
    stage = optimizer_stage(zero_stage, comm.world_size)
    return comm, ShardConfig(stage, 25.0 if bucket_cap_mb is None else bucket_cap_mb,
                             True if overlap_comm is None else overlap_comm, offload,
                             **({} if align is None else {"align": align}),
                             overlap_param_gather=False if overlap_param_gather is None else overlap_param_gather)


class ZeroEngine:
    def __init__(self, optimizer, groups, names, *, zero_stage=None, process_group=None, bucket_cap_mb=None,
                 overlap_comm=None, offload=None, overlap_param_gather=None, state_keys=("exp_avg", "exp_avg_sq"),
                 what="FusedZeroAdam", options="", state=None, mesh=None):
        """groups: the param groups' param lists (validated); names: {param: name} where known.
        state_keys: the state tensors each store keeps per shard (the optimizer's own). state: a
        StatePolicy (state/lowbit_store.py) for low-bit state or params without masters, else None."""
        self.optimizer = weakref.ref(optimizer)  # the runtime never calls up into it
        self.what = what
        all_params = [p for g in groups for p in g]
        self.trainable = [p for p in all_params if p.requires_grad]
        self._frozen = [(k, p) for k, p in enumerate(all_params) if not p.requires_grad]
        owned = list({id(u): u for u in (unit_of(p) for p in self.trainable) if u is not None}.values())
        loose = [p for p in self.trainable if unit_of(p) is None]
        self.comm, config = sharding(owned, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload,
                                     overlap_param_gather, state.align if state is not None else None, mesh,
                                     self.trainable[0].device.type if self.trainable else "cpu")
        self.zero_stage = config.stage  # as given; what it means is self.strategy
        self.strategy = strategy = config.strategy(self.comm.world_size)
        index = {p: k for k, p in enumerate(all_params)}
        if loose and (config.overlap_param_gather or strategy.needs_units):
            call, why = (("zerokern.shard(module, stage=3)", "at stage 3 params are gathered in the forward hooks of "
                          "the modules that own them") if strategy.needs_units else
                         ("zerokern.shard(module)", "with overlap_param_gather=True the gather is waited for in the "
                          "forward pre-hooks of the modules that own the params"))
            raise ValueError(f"zerokern: {names.get(loose[0], f'params[{index[loose[0]]}]')} is not sharded with "
                             f"{call}: {why}, so every trainable param must be in a unit (shard each block, then "
                             "the root)")
        self._check_same_on_every_rank(all_params, [len(g) for g in groups], config, options)
        for u in owned:
            if u.schedule is not None:
                raise ValueError(f"zerokern: unit '{u.name}' already belongs to another optimizer; "
                                 "build one optimizer over all of a model's params")
            frozen = [m.name for f in u.flat for m in f.members if not m.param.requires_grad]
            if frozen:
                raise ValueError(f"zerokern: {frozen[0]} (unit '{u.name}') was trainable when zerokern.shard() made the "
                                 "unit and is frozen now (requires_grad=False): freeze it before shard(), or keep it "
                                 "trainable and give it lr=0 in a param group of its own")
            missing = [m.name for f in u.flat for m in f.members if m.param not in index]
            if missing:
                raise ValueError(f"zerokern: {missing[0]} (unit '{u.name}') is trainable but not in this "
                                 "optimizer's params: pass all of the unit's params, or freeze it before shard()")
        self.units = owned + ([make_unit(loose, [names.get(p, f"params[{index[p]}]") for p in loose],
                                         [0] * len(loose), self.comm, config, "params")] if loose else [])
        tindex = {p: k for k, p in enumerate(self.trainable)}
        # [Note: one collective order] in grads/schedule.py: buckets by when backward completes them.
        placed = sorted(((f, b) for u in self.units for f in u.flat for b in range(len(f.buckets))),
                        key=lambda fb: -min(index[fb[0].params[i]] for i in fb[0].layout.buckets[fb[1]].tensors))
        self.schedule = ReduceSchedule([f.buckets[b] for f, b in placed], self.comm, config.overlap_comm,
                                       self._share_overflow)
        self.schedule.owner = weakref.ref(self)
        self._check_overflow = any(p.dtype == torch.float16 for p in self.trainable)
        self._scaler_in_use = True  # until a step() runs without a GradScaler ([Note: overflow on any rank])
        for u in self.units:
            u.schedule = self.schedule
        self._broadcast_params()  # before the stores read their masters
        # [Note: stage-3 params] in params/per_unit.py: shard() sharded them; the runtime gathers in forward and backward
        self.stage3 = None
        if strategy.params is ParamMode.GATHER_PER_UNIT:
            self.stage3 = runtime_for(self.comm)
            self.stage3.expect_order(forward_order(owned, index))
        self.stores = [ShardStore(f, b, config.offload, state_keys) if state is None else LowBitStore(f, b, state)
                       for f, b in placed]
        self._members = [[tindex[f.params[i]] for i in f.layout.buckets[b].tensors] for f, b in placed]
        self._flat_members = [(f, [tindex[p] for p in f.params]) for u in self.units for f in u.flat]
        # per store, [(trainable index, shard offset, numel, start in the flattened param)] in shard order
        self.pieces = [self._pieces_of(s, tindex) for s in self.stores]
        # each trainable param's first element in the global count that keys stochastic rounding
        # (over the params in order, so the same at every world size and stage: [Note: reproducible rounding])
        starts = [0]
        for f, i in (self._where(p) for p in self.trainable):
            starts.append(starts[-1] + f.members[i].shape.numel())
        self.global_starts = starts[:-1]
        # [Note: gather behind forward]: the next forward uses the buckets in the reverse of backward's order
        gathered = strategy.params is ParamMode.GATHER_AFTER_STEP
        in_order = self.stores[::-1]
        if config.overlap_param_gather:  # unit by unit, as the forward reaches them (sort is stable)
            position = {id(u): k for k, u in enumerate(forward_order(owned, index))}
            in_order = sorted(in_order, key=lambda s: position[id(unit_of(s.flat.params[0]))])
        self.param_gather = GatherAfterStep(self.comm, in_order if gathered else [])
        self._overlap_gather = config.overlap_param_gather and gathered
        if self._overlap_gather:
            self.param_gather.hook_modules(owned)
        self.last_grad_norm = None
        self._clip = None  # (max_norm, norm) from clip_grad_norm_ for the next step
        self._overflow_seen = False  # clip_grad_norm_'s reduction found an overflow (fp16) this round
        self.last_step_skipped = False  # the last step() skipped the update (an inf/nan on some rank)
        ddp_guard.watch(optimizer, self.units)  # [Note: DDP wrap] in grads/ddp_guard.py

    def _where(self, p):
        return unit_of(p).locate(p)

    @staticmethod
    def _pieces_of(store, tindex):
        f, b = store.flat, store.b
        pieces = {pc.index: pc for pc in f.layout.rank_pieces(f.rank, b)}
        out = []
        for i in f.layout.buckets[b].tensors:
            pc = pieces.get(i)
            off, n, start = (pc.shard_offset, pc.numel, pc.tensor_start) if pc else (0, 0, 0)
            out.append((tindex[f.params[i]], off, n, start))
        return out

    def param_of(self, store, k):
        """(param, name, full shape) of the k-th piece of a store."""
        f = store.flat
        i = f.layout.buckets[store.b].tensors[k]
        m = f.members[i]
        return m.param, m.name, m.shape

    # --- the step protocol ---------------------------------------------------

    @torch.no_grad()
    def begin_step(self, found_inf, grad_scale):
        """(had, skip): everything before the update ([Note: overflow on any rank])."""
        if found_inf is not None and grad_scale is None:
            raise RuntimeError(f"scaler.unscale_(optimizer) is not supported with {self.what} (the grads it "
                               "would unscale are already reduced); clip with max_grad_norm=... or "
                               "opt.clip_grad_norm_")
        had, skip = self._prepare(found_inf, grad_scale)
        self._scaler_in_use = grad_scale is not None
        return had, skip or self._overflow_seen  # an fp16 sum that overflowed when clip_grad_norm_ reduced it

    def gather_updated(self):
        """After the update: the stores send offloaded params back, the gathers bring the others' slices."""
        for store in self.stores:
            store.finish()
        self.param_gather.updated()  # _prepare waited for the last step's gathers
        if not self._overlap_gather:
            self.param_gather.wait_all()

    def end_step(self, had, skip):
        self.last_step_skipped = bool(skip and any(had))
        self._clip = None
        self._overflow_seen = False
        self.schedule.end_round(release=self.strategy.frees_grads_after_step)
        if self.strategy.frees_grads_after_step:  # [Note: grads after step] in grads/placeholder.py
            for f, members in self._flat_members:
                f.after_step([had[t] for t in members])

    def _broadcast_params(self):
        """As DDP: every rank starts from rank 0's params, frozen ones too (one broadcast per
        bucket buffer and per frozen param)."""
        self.comm.broadcast_from_first(
            [buf for u in self.units for f in u.flat if f.param_shards is None  # stage 3: shard() did it
             for buf in f.param_bufs.buffers] + [p for _, p in self._frozen])

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

    def _check_same_on_every_rank(self, params, group_sizes, config, options):
        desc = repr(([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params], group_sizes))
        mine = (hashlib.sha256(desc.encode()).hexdigest()[:16], len(params), sum(p.numel() for p in params),
                repr(config), options)
        everyone = self.comm.differing(mine, f"{self.what}(...)")
        if everyone is not None:
            lines = [f"rank {r}: {n} params, {numel} elements, shapes/dtypes/order/groups #{h}, {cfg}, {opts}"
                     for r, (h, n, numel, cfg, opts) in enumerate(everyone)]
            raise ValueError(f"{self.what}: the ranks passed different parameters (shapes, dtypes or order) or "
                             "options; every rank must build the optimizer for the same model:\n  "
                             + "\n  ".join(lines))

    def _share_overflow(self):
        """[Note: overflow on any rank] GradScaler checks each rank's local .grad, but where
        those are local (stages 1/2 on several ranks) an inf/nan may be in another rank's
        grads only, or appear in a reduced shard only (an fp16 sum overflowing). Check the
        reduced shards, agree on one flag (all-reduce MAX) and, if set, write an inf into a
        local grad, so every rank's scaler sees an overflow, skips and backs off alike. Any
        dtype: fp32/bf16 params under autocast(fp16) use a scaler too. No host sync. At stage 2
        only while a scaler is in use (see below)."""
        if not self.strategy.local_grads or not self.stores:
            return
        if self.strategy.grads is GradMode.SCATTER_RELEASE:
            # The placeholders in .grad answer the scaler from this flag ([Note: stage-2 .grad]).
            # Only a scaler asks, so once step() has run without one (fp32, bf16 training) the
            # pass over the shards is left out. The decision is the same on every rank (step()
            # checks that the scalers agree). Asking when the flag was not computed here (the first
            # steps ran without a scaler) gives this rank's flag, and step() raises if the ranks'
            # scalers disagree. The same collective agrees on which params had a grad anywhere
            # ([Note: who had a grad]).
            usage = [float(got) for s in self.stores for got in s.bucket.got]
            if self._scaler_in_use:
                flag, usage = self._agreed_overflow(usage)
                for s in self.stores:
                    s.bucket.overflow = flag
            else:
                usage = self._agreed_usage(usage)
            self._hand_out_placeholders(usage)
            return
        flag, _ = self._agreed_overflow()
        for s in self.stores:
            for i in s.bucket.plan.tensors:
                p = s.flat.params[i]
                if p.numel() and p.grad is not None:
                    s.bucket.poke_overflow(p.grad.view(-1)[:1], flag)
                    return

    def _agreed_overflow(self, usage=None):
        """(flag, usage): flag 1.0 if a reduced shard holds an inf/nan on any rank, else 0, and the
        usage flags MAX-ed over the ranks, in one all-reduce."""
        shards = [s.bucket.reduced_grad() for s in self.stores]
        device = shards[0].device
        flags = torch.zeros(1 + len(usage or ()), device=device)
        if usage:
            flags[1:] = torch.tensor(usage, device=device)
        flag = flags[0]
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=device))
        self.comm.wait(self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, name="overflow"))
        return flags[0], (flags[1:].tolist() if usage else usage)

    def _agreed_usage(self, usage):
        flags = torch.tensor(usage, device=self.stores[0].bucket.device)
        self.comm.wait(self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, name="grad_usage"))
        return flags.tolist()

    def _hand_out_placeholders(self, usage):
        """[Note: who had a grad] At stages 2/3 a param no backward on this rank reached keeps
        .grad None, as torch's; one another rank's backward reached gets the placeholder of the
        averaged grad, as DDP gives it. So every rank holds the same .grad kinds after a synced
        backward, and a change of one (.grad = None, zero_()) happens on every rank, the shard's
        owner too, at the same point of the collective order. One small all-reduce per synced
        backward (DDP's find_unused_parameters pays the same)."""
        k = 0
        for s in self.stores:
            for i, got in zip(s.bucket.plan.tensors, s.bucket.got):
                if usage[k] > 0 and not got:
                    s.flat.give_reduced_placeholder(i)
                k += 1

    def share_found_inf(self, found_inf_per_device):
        """Called by zerokern.GradScaler after its inf check of the local grads: every rank
        gets the same found_inf (all-reduce MAX), also when the reduction happens in step()
        (every backward under no_sync()), which the check after backward cannot cover."""
        if not self.comm.distributed:
            return
        # exactly one all-reduce on every rank, whatever devices (or none) this rank's grads were on
        device = self.stores[0].bucket.device if self.stores else torch.device("cpu")
        flag = torch.zeros((), dtype=torch.float32, device=device)
        for t in found_inf_per_device.values():
            flag = torch.maximum(flag, t.to(device, torch.float32).reshape(()))
        self.comm.wait(self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, name="found_inf"))
        for t in found_inf_per_device.values():
            t.copy_(flag.to(t.device, t.dtype).reshape(t.shape))

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

    # [Note: compile] step() is opaque to torch.compile: a compiled training step graph-breaks
    # here once per call instead of recompiling for every new step count and bucket state.

    def _prepare(self, found_inf, grad_scale=None):
        """Everything step() needs before the update: a backward that never finished is
        reset, what the model did to params and grads is adopted, the ranks agree on which
        params had grads and which buckets need reducing, and those are reduced."""
        self.param_gather.wait_all()  # adopt() below and the update write the params
        self.schedule.reset()
        if self.stage3 is not None:
            self.stage3.reshard_all(self.units)  # the update writes the slices; a gathered unit would go stale
        self._check_frozen()
        for u in self.units:
            u.sync_from_model()
        self._refresh_changed_masters()
        had, needs, skip = self._agree(found_inf, grad_scale)  # raises on every rank if any rank edited local grads
        self.schedule.reduce(needs)
        if self._check_overflow and any(needs):
            # [Note: overflow on any rank] for what was reduced here rather than in backward
            # (no_sync accumulation, edited or re-reduced buckets): an fp16 sum can overflow where
            # no local grad did. Every rank agrees to skip the step then.
            skip = self._overflowed([s for s, need in zip(self.stores, needs) if need]) or skip
        return had, skip

    def _overflowed(self, stores):
        shards = [s.bucket.reduced_grad() for s in stores]
        flag = torch.zeros((), device=shards[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=flag.device))
        self.comm.wait(self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, name="overflow"))
        return bool(flag.item())

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
        self._clip = None
        had, overflow = self._prepare(None)
        self._overflow_seen = self._overflow_seen or overflow  # step() must skip too: it reduces nothing more
        norm = self._global_norm(float(norm_type), had)
        if max_norm != float("inf"):  # inf: the norm only (as HF Trainer asks for logging); max_grad_norm stays
            self._clip = (max_norm, norm)
        self.last_grad_norm = norm
        return norm

    def _global_norm(self, norm_type, had):
        """The norm of the averaged (still loss-scaled) gradient, computed in fp32 over the
        reduced shards, each element once at every stage; params without a grad this step
        (had[t] False, e.g. .grad set to None) count for nothing, as in torch."""
        if all(had):
            shards = [s.bucket.reduced_grad() for s in self.stores]
        else:
            shards = []
            for s, pieces in zip(self.stores, self.pieces):
                grad = s.bucket.reduced_grad()
                shards += [grad[off:off + n] for t, off, n, _ in pieces if had[t] and n]
        device = shards[0].device if shards else torch.device("cpu")
        if not shards:
            return torch.zeros((), device=device)
        sharded = self.strategy.shards_state  # each rank holds a different part
        if norm_type == float("inf"):
            total = torch.stack(torch._foreach_norm(shards, norm_type, dtype=torch.float32)).max()
            if sharded:
                # the shards of one shard group cover every element once (replicas hold the same)
                self.comm.wait(self.comm.shards.all_reduce(total, op=torch.distributed.ReduceOp.MAX, name="grad_norm"))
            return total
        # One fp32 norm over a bucket of millions of elements loses about 1e-4 (relative) on a CPU,
        # which clipping then carries into every step; norms of NORM_CHUNK-element pieces, summed
        # in fp64, agree with DDP's per-param norms to about 1e-7 at any bucket size, at the same cost.
        pieces = [c for g in shards for c in g.split(NORM_CHUNK)]
        norms = torch.stack(torch._foreach_norm(pieces, norm_type, dtype=torch.float32))  # one call
        total = norms.double().pow(norm_type).sum()
        if sharded:
            self.comm.wait(self.comm.shards.all_reduce(total, name="grad_norm"))
        return total.pow(1.0 / norm_type).float()

    def _agree(self, found_inf, grad_scale=None):
        """(global had-grad flag per trainable param, which buckets to reduce, skip).
        Distributed or with a GradScaler: one all-reduce MAX and one host read per step;
        one process without a scaler: neither (the flags are already on the host)."""
        buckets = self.schedule.buckets
        if all(all(b.got) for b in buckets):
            had = [True] * len(self.trainable)
        else:
            had = [False] * len(self.trainable)
            for members, b in zip(self._members, buckets):
                for t, got in zip(members, b.got):
                    had[t] = had[t] or got
        needs = self.schedule.local_needs()
        stale = [b.stale_accumulation for b in buckets]  # [Note: grads after step]
        if not self.comm.distributed and found_inf is None:
            if any(stale):
                self._raise_stale([b for b, st in zip(buckets, stale) if st])
            return had, needs, False
        edited = [b.edited() or 2.0 * st for b, st in zip(buckets, stale)]  # 1: edited, 2: stale
        n, m = len(had), len(needs)
        device = self.stores[0].bucket.device if self.stores else torch.device("cpu")
        # the last four: found_inf and grad_scale, each as x and -x, so one MAX gives max and min
        flags = torch.tensor(had + needs + edited + [0.0] * 4, dtype=torch.float32, device=device)
        if found_inf is not None:
            f = found_inf.reshape(()).to(device, torch.float32)
            flags[n + 2 * m:n + 2 * m + 2] = torch.stack([f, -f])
        if grad_scale is not None:
            g = grad_scale.reshape(()).to(device, torch.float32)
            flags[n + 2 * m + 2:] = torch.stack([g, -g])
        self.comm.wait(self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, name="grad_flags"))
        values = flags.tolist()
        if any(v > 1 for v in values[n + m:n + 2 * m]):
            self._raise_stale([b for b, e in zip(buckets, values[n + m:n + 2 * m]) if e > 1])
        if any(v > 0 for v in values[n + m:n + 2 * m]):
            self._raise_edited([b for b, e in zip(buckets, values[n + m:n + 2 * m]) if e > 0])
        inf_max, inf_min, scale_max, scale_min = values[n + 2 * m], -values[n + 2 * m + 1], values[-2], -values[-1]
        if grad_scale is not None and scale_max != scale_min:
            raise RuntimeError(
                f"zerokern: the GradScalers of the ranks hold different scales ({scale_min} to {scale_max}), so "
                "each rank's gradients were scaled differently and their average is wrong. Give every rank the "
                "same GradScaler settings and state (init_scale, a loaded state_dict), and use "
                "zerokern.GradScaler so their inf checks agree")
        if found_inf is not None and (inf_max > 0) != (inf_min > 0):
            raise RuntimeError(
                "zerokern: GradScaler found an inf/nan in the local gradients of some ranks only, so their scales "
                "would drift apart (the last backward ran under no_sync(), or a scaler first stepped after steps "
                "without one). Use zerokern.GradScaler, whose inf check agrees across ranks, or run the last "
                "backward before each step synced")
        return [v > 0 for v in values[:n]], [v > 0 for v in values[n:n + m]], inf_max > 0

    def _names_in(self, buckets):
        """The params of `buckets`, for an error: the first four and how many more."""
        names = [s.flat.members[i].name for s in self.stores if s.bucket in buckets for i in s.bucket.plan.tensors]
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    def _raise_stale(self, buckets):
        shown = self._names_in(buckets)
        raise RuntimeError(
            f"zerokern: the gradients of {shown} (on some rank) are from before the last step(), with no "
            f"zero_grad() since. At zero_stage={self.zero_stage} step() frees the gradients (the stage's memory "
            "saving), so they cannot carry over to this step as torch's would. Call opt.zero_grad() (or "
            "model.zero_grad()) after each step(), or use zero_stage=1, which keeps them")

    def _raise_edited(self, buckets):
        ddp_guard.refuse_if_reduced(self.trainable)  # DDP's reducer wrote them ([Note: DDP wrap])
        shown = self._names_in(buckets)
        raise RuntimeError(
            f"zerokern: the gradients of {shown} were changed in place between backward and step() (on some "
            f"rank). At zero_stage={self.zero_stage} on {self.comm.world_size} ranks .grad holds the local, "
            "unreduced gradient, so such an edit (e.g. torch's clip_grad_norm_) would not give DDP's numbers. "
            "Clip with opt.clip_grad_norm_ or max_grad_norm=, edit grads in a hook (p.register_hook), or use "
            "zero_stage=0, where .grad is the averaged gradient")

    def grad_divisor(self, grad_scale, had, max_grad_norm):
        """The divisor of the reduced grads: the loss scale, times the clip factor."""
        if self._clip is not None:  # opt.clip_grad_norm_ ran this step
            max_norm, norm = self._clip
        elif max_grad_norm is None:
            self.last_grad_norm = None
            return grad_scale
        else:
            max_norm, norm = max_grad_norm, self._global_norm(2.0, had)
        if grad_scale is not None:
            norm = norm / grad_scale.float()
        self.last_grad_norm = norm
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
        self._clip = None  # a new round: a clip or an overflow of the dropped one does not carry over
        self._overflow_seen = False
        for f, _ in self._flat_members:
            f.after_zero_grad(set_to_none)

    def reload_master_weights(self):
        """fp16/bf16 params: re-read the fp32 master weights from the model's
        params (after loading model weights without the optimizer's state)."""
        for s in self.stores:
            s.master_valid = not s.separate_master

    def memory_report(self):
        """Bytes this rank holds, by kind."""
        rep = {"params": 0, "master_params": 0, "adam_state": 0, "grads": 0, "comm_buffers": 0}
        for s in self.stores:
            buf = s.flat.param_bufs.buffers[s.b]
            if s.flat.param_shards is not None:  # stage 3: the slice, and the full buffer while gathered
                rep["params"] += s.param_shard().numel() * buf.element_size() + buf.untyped_storage().nbytes()
            else:
                rep["params"] += buf.numel() * buf.element_size()
            for d in (s.nbytes(), s.bucket.nbytes()):
                for k, v in d.items():
                    rep[k] += v
        rep["comm_buffers"] += self.schedule.pool.free_bytes()  # stage-2 full buffers kept for reuse
        rep["total"] = sum(rep.values())
        return rep
