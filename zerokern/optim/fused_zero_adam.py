"""FusedZeroAdam: the optimizer over ZeRO shards.

The units (zerokern/zero/unit.py) own params, buckets and hooks; the schedule
(zero/schedule.py) owns the order and state of reductions; the shard stores
(zero/store.py) own the fp32 master weights and Adam state. This class owns
what torch.optim.Optimizer owns: param groups, per-param state (views into the
stores, so torch's state-dict tools see it), the step counts, and step().
docs/DESIGN.md has the whole picture.
"""

import contextlib
import hashlib
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.backends.registry import resolve
from ..kernels.ops import fused_adam_
from ..zero import checkpoint
from ..zero import ddp_guard
from ..zero.api import make_unit, unit_of
from ..zero.param_gather import ParamGather
from ..zero.schedule import ReduceSchedule
from ..zero.stage3 import runtime_for
from ..zero.stage import GradMode, ParamMode
from ..zero.store import ShardStore
from .hyper import check_hyper
from .update_lists import UniformCalls, extend_calls
from .zero_setup import sharding, validated_groups

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


def owner_of(params) -> Optional["FusedZeroAdam"]:
    """The one FusedZeroAdam that trains every tensor in `params`, else None (none given, one
    not owned, or owners that differ). Integrations ask this before changing what they do."""
    owner = None
    for p in params:
        u = unit_of(p)
        opt = u.schedule.owner() if u is not None and u.schedule is not None and u.schedule.owner else None
        if opt is None or (owner is not None and opt is not owner):
            return None
        owner = opt
    return owner


@dataclass(frozen=True)
class StepOptions:
    """The options of the update itself (the sharding options are the units' ShardConfig)."""

    adam_w_mode: bool = True
    bias_correction: bool = True
    max_grad_norm: Optional[float] = None
    backend: str = "auto"

    def __post_init__(self):
        if self.max_grad_norm is not None:
            if isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, (int, float)):
                raise TypeError(f"max_grad_norm must be a number or None, got {type(self.max_grad_norm).__name__}")
            if not 0 < self.max_grad_norm < float("inf"):
                raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


class FusedZeroAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO stage 0/1/2/3 sharding and fused kernels (stage 3: params sharded
    with zerokern.shard(module, stage=3) on each block and the root; [Note: stage-3 params] in
    zero/stage3.py).

    FusedZeroAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, *,
                  adam_w_mode=True, bias_correction=True, zero_stage=None, process_group=None,
                  bucket_cap_mb=None, overlap_comm=None, max_grad_norm=None, backend="auto", offload=None,
                  overlap_param_gather=None)

    Semantics are torch.optim.AdamW's (adam_w_mode=True) or Adam's on the
    gradient averaged over the data-parallel group, as under DDP: per-parameter
    step counts; a parameter with no grad on any rank in a step is left
    unchanged; one with a grad on some ranks counts as a zero grad on the others.
    weight_decay defaults to torch.optim.AdamW's 0.01 (adam_w_mode=True) or
    torch.optim.Adam's 0 (adam_w_mode=False).

    Sharding: params sharded with zerokern.shard(module, ...) keep the options
    given there. Other params form one unit built here with zero_stage (None:
    2 when a process group of size > 1 is in use, else 0), process_group (None:
    the default group if torch.distributed is initialized, else one process),
    bucket_cap_mb (25), overlap_comm (True), offload (None, or
    zerokern.OffloadPolicy()) and overlap_param_gather (False). Stage 1 shards
    the fp32 master weights and Adam state; stage 2 also the gradients: on
    several ranks each bucket's full gradient buffer is freed as soon as its
    reduction completes, so a rank holds its reduced shards plus a few buckets
    in backward (the planner allows 5) ([Note: stage-2 memory] in
    zero/stage2_bucket.py). At stages 1/2 step() all-gathers the updated params;
    with overlap_param_gather=True (zerokern.shard() units only) it returns
    before they arrive, and each unit waits for its params in its next forward
    (a module holding a param in its state_dict() and load_state_dict() too);
    code that reads params directly in between (an EMA, a copy) calls
    opt.finish_param_gather() first
    ([Note: gather behind forward] in zero/param_gather.py).

    The params are moved into flat buckets: their .data becomes a view of a
    bucket (values unchanged) and their .grad a view of a gradient bucket that
    autograd accumulates into. After backward: at stage 0 .grad holds the
    averaged gradient, as DDP; at stage 1 on several ranks this rank's local
    (unreduced) gradient, and editing it between backward and step() raises
    ([Note: the local grads are the truth] in zero/bucket.py); at stage 2 on
    several ranks a zerokern ShardedGrad placeholder, which answers GradScaler,
    zeroes with zero_() and refuses reads and edits (torch's clip_grad_norm_)
    with an error naming the param ([Note: stage-2 .grad]); under no_sync() the
    local gradient. Setting .grad to None or assigning one works at every stage; zero_grad() and
    unused params follow torch (.grad None; set_to_none=False keeps zero grads that are stepped),
    and at stages 2/3, where step() frees the grads, a backward or step() that would reuse the
    last step's grads without zero_grad() in between raises ([Note: grads after step]).
    opt.state[p] holds views of this rank's slice of p (flattened) of
    "exp_avg", "exp_avg_sq" and, for fp16/bf16 params, "master_param", with
    "step" as in torch.optim.AdamW. fp32 params are their own master weights;
    fp16/bf16 masters are read from the params at the first step, and
    reload_master_weights() re-reads them after a model-only load.

    With torch.amp.GradScaler (fp16 params, or fp32/bf16 under autocast):
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(). An inf/nan
    on any rank skips the step on every rank and every rank's scaler backs off
    alike; unscaling and the skip happen inside the fused kernel. If every
    backward of a step runs under no_sync(), use zerokern.GradScaler (same
    arguments), whose inf check agrees across ranks; a plain scaler then raises
    rather than letting the ranks' scales drift apart. Do not call scaler.unscale_(opt): clip with
    max_grad_norm, which uses the global norm over all shards inside the fused
    update; the last norm is in opt.last_grad_norm.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale and found_inf

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=None, *, adam_w_mode=True,
                 bias_correction=True, zero_stage=None, process_group=None, bucket_cap_mb=None, overlap_comm=None,
                 max_grad_norm=None, backend="auto", offload=None, overlap_param_gather=None):
        if weight_decay is None:  # the defaults of the classes users swap out: AdamW 0.01, Adam 0
            weight_decay = 0.01 if adam_w_mode else 0.0
        check_hyper(lr, betas, eps, weight_decay)
        self.options = StepOptions(adam_w_mode, bias_correction, max_grad_norm, backend)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self._constructing = True
        super().__init__(validated_groups(params), defaults)
        self._constructing = False
        for g in self.param_groups:
            check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])

        all_params = [p for g in self.param_groups for p in g["params"]]
        # FusedZeroAdam(model.named_parameters()): errors name params as the model does
        names = {p: n for g in self.param_groups for p, n in zip(g["params"], g.get("param_names", ()))}
        self._trainable = [p for p in all_params if p.requires_grad]
        self._frozen = [(k, p) for k, p in enumerate(all_params) if not p.requires_grad]
        owned = list({id(u): u for u in (unit_of(p) for p in self._trainable) if u is not None}.values())
        loose = [p for p in self._trainable if unit_of(p) is None]
        self.comm, config = sharding(owned, zero_stage, process_group, bucket_cap_mb, overlap_comm, offload,
                                     overlap_param_gather)
        self.zero_stage = config.stage  # as given; what it means is self.strategy
        self.strategy = strategy = config.strategy(self.comm.world_size)
        if config.overlap_param_gather and loose:
            raise ValueError(
                f"zerokern: overlap_param_gather=True, but params[{next(k for k, p in enumerate(all_params) if p is loose[0])}] is not sharded with "
                "zerokern.shard(module): the gather is waited for in the forward pre-hooks of the modules that "
                "own the params, so every trainable param must be in a zerokern.shard() unit (shard each block, "
                "then the root), or leave overlap_param_gather off")
        if strategy.needs_units and loose:
            raise ValueError(
                f"zerokern: zero_stage=3, but params[{next(k for k, p in enumerate(all_params) if p is loose[0])}] "
                "is not sharded with zerokern.shard(module, stage=3): at stage 3 params are gathered in the "
                "forward hooks of the modules that own them, so every trainable param must be in a unit (shard "
                "each block, then the root)")
        self._check_same_on_every_rank(all_params, config)
        if self._trainable:
            resolve(backend, self._trainable[0].device)  # an unknown or unusable backend fails here
        index = {p: k for k, p in enumerate(all_params)}
        for u in owned:
            if u.schedule is not None:
                raise ValueError(f"zerokern: unit '{u.name}' already belongs to another FusedZeroAdam; "
                                 "build one optimizer over all of a model's params")
            frozen = [n for f in u.flat for p, n in zip(f.params, f.names) if not p.requires_grad]
            if frozen:
                raise ValueError(f"zerokern: {frozen[0]} (unit '{u.name}') was trainable when zerokern.shard() made the "
                                 "unit and is frozen now (requires_grad=False): freeze it before shard(), or keep it "
                                 "trainable and give it lr=0 in a param group of its own")
            missing = [n for f in u.flat for p, n in zip(f.params, f.names) if p not in index]
            if missing:
                raise ValueError(f"zerokern: {missing[0]} (unit '{u.name}') is trainable but not in this "
                                 "optimizer's params: pass all of the unit's params, or freeze it before shard()")
        self.units = owned + ([make_unit(loose, [names.get(p, f"params[{index[p]}]") for p in loose], [0] * len(loose), self.comm,
                                         config, "params")] if loose else [])

        tindex = {p: k for k, p in enumerate(self._trainable)}
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = [group_of[p] for p in self._trainable]
        # [Note: one collective order] in zero/schedule.py: buckets by when backward completes them.
        placed = sorted(((f, b) for u in self.units for f in u.flat for b in range(len(f.buckets))),
                        key=lambda fb: -min(index[fb[0].params[i]] for i in fb[0].layout.buckets[fb[1]].tensors))
        self.schedule = ReduceSchedule([f.buckets[b] for f, b in placed], self.comm, config.overlap_comm,
                                       self._share_overflow)
        self._check_overflow = any(p.dtype == torch.float16 for p in self._trainable)
        # [Note: overflow on any rank]: where .grad is local (sharded, several ranks)
        self._share_overflow_after_backward = strategy.local_grads
        self.schedule.owner = weakref.ref(self)
        self._scaler_in_use = True  # until a step() runs without a GradScaler ([Note: overflow on any rank])
        for u in self.units:
            u.schedule = self.schedule
        self._broadcast_params()  # before the stores read their masters
        # [Note: stage-3 params] in zero/stage3.py: each rank keeps its slices, the units gather in forward
        # (zerokern.shard sharded them already; the runtime gathers them in forward and backward)
        self.stage3 = None
        if strategy.params is ParamMode.GATHER_PER_UNIT:
            self.stage3 = runtime_for(self.comm)
            self.stage3.expect_order(forward_order(owned, index))
        self.stores = [ShardStore(f, b, config.offload) for f, b in placed]
        self._members = [[tindex[f.params[i]] for i in f.layout.buckets[b].tensors] for f, b in placed]
        self._flat_members = [(f, [tindex[p] for p in f.params]) for u in self.units for f in u.flat]
        self._steps = [0] * len(self._trainable)
        self._uniform_steps = True
        # Every param's "step" is a 0-dim view of this one tensor, so the usual step counts
        # up with one op (torch._foreach_add_ over 0-dim CPU tensors costs ~7 us each).
        self._step_buffer = torch.zeros(len(self._trainable), dtype=torch.float32)
        self._pieces = [self._init_state(store, tindex) for store in self.stores]
        # [Note: gather behind forward]: the next forward uses the buckets in the reverse of backward's order
        gathered = strategy.params is ParamMode.GATHER_AFTER_STEP  # stage 3 gathers in the forward
        in_order = self.stores[::-1]
        if config.overlap_param_gather:  # unit by unit, as the forward reaches them (sort is stable)
            position = {id(u): k for k, u in enumerate(forward_order(owned, index))}
            in_order = sorted(in_order, key=lambda s: position[id(unit_of(s.flat.params[0]))])
        self.param_gather = ParamGather(self.comm, in_order if gathered else [])
        self._overlap_gather = config.overlap_param_gather and gathered
        if self._overlap_gather:
            self.param_gather.hook_modules(owned)
        self._calls = [UniformCalls(store, pieces, self._group_of) for store, pieces in zip(self.stores, self._pieces)]
        self.last_grad_norm = None
        self._clip = None  # (max_norm, norm) from opt.clip_grad_norm_ for the next step
        self._overflow_seen = False  # clip_grad_norm_'s reduction found an overflow (fp16) this round
        self.last_step_skipped = False  # the last step() skipped the update (an inf/nan on some rank)
        self._warned_no_grads = False
        ddp_guard.watch(self)  # [Note: DDP wrap] in zero/ddp_guard.py

    def _init_state(self, store, tindex):
        """self.state[p] for the params of one store: views of this rank's slice of each.
        Returns [(trainable index, shard offset, numel)] of the slices, in shard order."""
        f, b = store.flat, store.b
        pieces = {pc.index: pc for pc in f.layout.rank_pieces(f.rank, b)}
        out = []
        for i in f.layout.buckets[b].tensors:
            p = f.params[i]
            pc = pieces.get(i)
            off, n, start = (pc.shard_offset, pc.numel, pc.tensor_start) if pc else (0, 0, 0)
            st = {"step": self._step_buffer[tindex[p]], "exp_avg": store.exp_avg[off:off + n],
                  "exp_avg_sq": store.exp_avg_sq[off:off + n]}
            if store.separate_master:
                st["master_param"] = store.master[off:off + n]
            if self.strategy.shards_state:  # [Note: sharded state in checkpoints]
                for key in checkpoint.SLICED:
                    if key in st:
                        checkpoint.mark_slice(st[key], start, n, f.shapes[i].numel())  # stage 3: p is empty
            self.state[p] = st
            out.append((tindex[p], off, n, start))
        return out

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
                    f"zerokern: params[{k}] was frozen (requires_grad=False) when FusedZeroAdam was built and now "
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

    def add_param_group(self, param_group):
        if not self._constructing:
            raise NotImplementedError(
                "FusedZeroAdam.add_param_group after construction is not supported: its params would need new "
                "buckets on every rank. Build the optimizer with all param groups (a group may start with lr=0)")
        super().add_param_group(param_group)

    # --- construction checks -----------------------------------------------

    def _check_same_on_every_rank(self, params, config):
        desc = repr(([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params],
                     [len(g["params"]) for g in self.param_groups]))
        mine = (hashlib.sha256(desc.encode()).hexdigest()[:16], len(params), sum(p.numel() for p in params),
                repr(config), repr(self.options))
        everyone = self.comm.differing(mine, "FusedZeroAdam(...)")
        if everyone is not None:
            lines = [f"rank {r}: {n} params, {numel} elements, shapes/dtypes/order/groups #{h}, {cfg}, {opts}"
                     for r, (h, n, numel, cfg, opts) in enumerate(everyone)]
            raise ValueError("FusedZeroAdam: the ranks passed different parameters (shapes, dtypes or order) or "
                             "options; every rank must build the optimizer for the same model:\n  "
                             + "\n  ".join(lines))

    # --- backward ----------------------------------------------------------

    def _share_overflow(self):
        """[Note: overflow on any rank] GradScaler checks each rank's local .grad, but where
        those are local (stages 1/2 on several ranks) an inf/nan may be in another rank's
        grads only, or appear in a reduced shard only (an fp16 sum overflowing). Check the
        reduced shards, agree on one flag (all-reduce MAX) and, if set, write an inf into a
        local grad, so every rank's scaler sees an overflow, skips and backs off alike. Any
        dtype: fp32/bf16 params under autocast(fp16) use a scaler too. No host sync. At stage 2
        only while a scaler is in use (see below)."""
        if not self._share_overflow_after_backward or not self.stores:
            return
        if self.strategy.grads is GradMode.SCATTER_RELEASE:
            # The placeholders in .grad answer the scaler from this flag ([Note: stage-2 .grad]).
            # Only a scaler asks, so once step() has run without one (fp32, bf16 training) the
            # check is left out: no pass over the shards and no collective per backward. The
            # decision is the same on every rank (step() checks that the scalers agree), so the
            # collective runs on all ranks or none. Asking when the flag was not computed here
            # (the first steps ran without a scaler) gives this rank's flag, and step() raises if
            # the ranks' scalers disagree. (Agreeing only when asked hung: after a no_sync
            # backward one rank may hold no placeholder and never ask.)
            if self._scaler_in_use:
                flag = self._agreed_overflow()
                for s in self.stores:
                    s.bucket.overflow = flag
            return
        flag = self._agreed_overflow()
        for s in self.stores:
            for i in s.bucket.plan.tensors:
                p = s.flat.params[i]
                if p.numel() and p.grad is not None:
                    s.bucket.poke_overflow(p.grad.view(-1)[:1], flag)
                    return

    def _agreed_overflow(self):
        """1.0 if a reduced shard holds an inf/nan on any rank, else 0 (one all-reduce MAX)."""
        shards = [s.bucket.reduced_grad() for s in self.stores]
        flag = torch.zeros((), device=shards[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=flag.device))
        self.comm.wait(self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, name="overflow"))
        return flag

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
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and grad_scale is None:
            raise RuntimeError("scaler.unscale_(optimizer) is not supported with FusedZeroAdam (the grads it "
                               "would unscale are already reduced); clip with FusedZeroAdam(max_grad_norm=...)")
        had, skip = self._prepare(found_inf, grad_scale)
        self._scaler_in_use = grad_scale is not None
        skip = skip or self._overflow_seen  # an fp16 sum that overflowed when clip_grad_norm_ reduced it
        if had and not any(had) and not self._warned_no_grads:
            self._warned_no_grads = True
            warnings.warn("FusedZeroAdam.step(): no parameter had a gradient on any rank, so nothing was updated. "
                          "If the model's Parameters were replaced after the optimizer was built "
                          "(load_state_dict(..., assign=True) without zerokern.shard), build the optimizer after "
                          "that, as with any torch optimizer", stacklevel=3)
        if not skip and any(had):
            scale = self._grad_scale_with_clipping(grad_scale, had)
            self._update(had, scale)
            if not self._overlap_gather:
                self.param_gather.wait_all()
        self.last_step_skipped = bool(skip and any(had))
        self._clip = None
        self._overflow_seen = False
        self.schedule.end_round(release=self.strategy.frees_grads_after_step)
        if self.strategy.frees_grads_after_step:  # [Note: grads after step]
            for f, members in self._flat_members:
                f.after_step([had[t] for t in members])
        return loss

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
            for s, pieces in zip(self.stores, self._pieces):
                grad = s.bucket.reduced_grad()
                shards += [grad[off:off + n] for t, off, n, _ in pieces if had[t] and n]
        device = shards[0].device if shards else torch.device("cpu")
        if not shards:
            return torch.zeros((), device=device)
        sharded = self.strategy.shards_state  # each rank holds a different part
        if norm_type == float("inf"):
            total = torch.stack(torch._foreach_norm(shards, norm_type, dtype=torch.float32)).max()
            if sharded:
                self.comm.wait(self.comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX, name="grad_norm"))
            return total
        # One fp32 norm over a bucket of millions of elements loses about 1e-4 (relative) on a CPU,
        # which clipping then carries into every step; norms of NORM_CHUNK-element pieces, summed
        # in fp64, agree with DDP's per-param norms to about 1e-7 at any bucket size, at the same cost.
        pieces = [c for g in shards for c in g.split(NORM_CHUNK)]
        norms = torch.stack(torch._foreach_norm(pieces, norm_type, dtype=torch.float32))  # one call
        total = norms.double().pow(norm_type).sum()
        if sharded:
            self.comm.wait(self.comm.all_reduce(total, name="grad_norm"))
        return total.pow(1.0 / norm_type).float()

    def _agree(self, found_inf, grad_scale=None):
        """(global had-grad flag per trainable param, which buckets to reduce, skip).
        Distributed or with a GradScaler: one all-reduce MAX and one host read per step;
        one process without a scaler: neither (the flags are already on the host)."""
        buckets = self.schedule.buckets
        if all(all(b.got) for b in buckets):
            had = [True] * len(self._trainable)
        else:
            had = [False] * len(self._trainable)
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
                "zerokern: GradScaler found an inf/nan in the local gradients of some ranks only, so the ranks' "
                "scalers would back off differently and scale the next gradients differently. This happens when "
                "the backward before scaler.step() ran under no_sync() (the reduction then happens in step(), "
                "after the scalers looked), or when a GradScaler first steps after steps without one. Use "
                "zerokern.GradScaler (a torch.amp.GradScaler whose inf check "
                "agrees across ranks), or run the last backward before each step synced")
        return [v > 0 for v in values[:n]], [v > 0 for v in values[n:n + m]], inf_max > 0

    def _raise_stale(self, buckets):
        names = [s.flat.names[i] for s in self.stores if s.bucket in buckets for i in s.bucket.plan.tensors]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise RuntimeError(
            f"zerokern: the gradients of {shown} (on some rank) are from before the last step(), with no "
            f"zero_grad() since. At zero_stage={self.zero_stage} step() frees the gradients (the stage's memory "
            "saving), so they cannot carry over to this step as torch's would. Call opt.zero_grad() (or "
            "model.zero_grad()) after each step(), or use zero_stage=1, which keeps them")

    def _raise_edited(self, buckets):
        ddp_guard.refuse_if_reduced(self._trainable)  # DDP's reducer wrote them ([Note: DDP wrap])
        names = [s.flat.names[i] for s in self.stores if s.bucket in buckets for i in s.bucket.plan.tensors]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise RuntimeError(
            f"zerokern: the gradients of {shown} were changed in place between backward and step() (on some "
            f"rank). At zero_stage={self.zero_stage} with {self.comm.world_size} ranks .grad holds each rank's "
            "local gradient (the averaged one is sharded), so an edit there, such as "
            "torch.nn.utils.clip_grad_norm_ clipping each rank by its own norm, would not give DDP's numbers. "
            "Clip with opt.clip_grad_norm_(max_norm) or FusedZeroAdam(max_grad_norm=...); mask or scale grads "
            "in a hook (p.register_hook) or through the loss; or use zero_stage=0, where .grad holds the "
            "averaged gradient as under DDP. If the model is wrapped in DistributedDataParallel, DDP wrote "
            "its all-reduce into the grads: do not wrap it (HF Trainer: zerokern.integrations.hf.ZeroTrainer; "
            "Accelerate: zerokern.integrations.accelerate.attach)")

    def _grad_scale_with_clipping(self, grad_scale, had):
        """The divisor of the reduced grads: the loss scale, times the clip factor."""
        if self._clip is not None:  # opt.clip_grad_norm_ ran this step
            max_norm, norm = self._clip
        elif self.options.max_grad_norm is None:
            self.last_grad_norm = None
            return grad_scale
        else:
            max_norm, norm = self.options.max_grad_norm, self._global_norm(2.0, had)
        if grad_scale is not None:
            norm = norm / grad_scale.float()
        self.last_grad_norm = norm
        clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        base = grad_scale.float() if grad_scale is not None else torch.ones((), device=clip.device)
        return (base / clip).reshape(1)

    def _update(self, had, scale):
        """The fused update of every shard, then the gathers of the updated params (in forward order)."""
        if isinstance(scale, torch.Tensor) and self.stores and scale.device != self.stores[0].device:
            scale = scale.to(self.stores[0].device)  # offloaded stores update on the CPU
        uniform = self._uniform_steps and all(had)
        calls = {}  # (param group, step, with model params) -> (masters, grads, ms, vs, models)
        for store, pieces, uc in zip(self.stores, self._pieces, self._calls):
            if not store.master_valid:
                store.refresh_master()
            operands = store.operands()
            if uniform:
                for pg, lists in uc.lists(operands).items():
                    extend_calls(calls, (pg, self._steps[0] + 1, operands[4] is not None), lists)
            else:
                for t, off, n, _ in pieces:
                    if had[t]:
                        views = [None if x is None else x[off:off + n] for x in operands]
                        extend_calls(calls, (self._group_of[t], self._steps[t] + 1, operands[4] is not None),
                                     [None if v is None else [v] for v in views])
        for (pg, step, low), (masters, grads, ms, vs, models) in calls.items():
            group = self.param_groups[pg]
            fused_adam_(masters, grads, ms, vs, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                        adam_w_mode=self.options.adam_w_mode, bias_correction=self.options.bias_correction,
                        grad_scale=scale, model_params=models if low else None, backend=self.options.backend)
        for store in self.stores:
            store.finish()
        # _prepare() waited for the last step's gathers, which share these buffers
        self.param_gather.launch(range(len(self.param_gather.stores)))
        if uniform:
            self._steps = [s + 1 for s in self._steps]
            self._step_buffer += 1
        else:
            self._steps = [s + h for s, h in zip(self._steps, had)]
            self._step_buffer += torch.tensor(had, dtype=torch.float32)
            self._uniform_steps = len(set(self._steps)) <= 1

    def finish_param_gather(self):
        """Wait until every param holds the last step's values on this rank. Needed only with
        overlap_param_gather=True, before code that reads params directly after step() and
        before the next forward (an EMA, a copy of the weights); module forwards, state_dict()
        and load_state_dict() wait by themselves ([Note: gather behind forward])."""
        self.param_gather.wait_all()

    # --- state dicts (zero/checkpoint.py) ------------------------------------

    def state_dict(self):
        """This rank's shard in torch.optim.AdamW's format: per param, views of this rank's
        slice (flattened) of "exp_avg", "exp_avg_sq" (and "master_param" for fp16/bf16
        params), "step"; every param-group key; and under "zerokern" where the slices lie."""
        self.param_gather.wait_all()
        return checkpoint.shard_state_dict(self)

    def full_state_dict(self):
        """Collective (call on every rank): the whole state in torch.optim.AdamW's
        format on rank 0 (plus the fp32 master weights under "zerokern_master"),
        None on the other ranks."""
        self.param_gather.wait_all()
        return checkpoint.full_state_dict(self)

    def load_state_dict(self, state_dict):
        """A shard saved by this rank at this world size and layout, or a full
        state dict (from full_state_dict() at any world size, or from
        torch.optim.AdamW for the same params), re-sharded to this world size."""
        self.param_gather.wait_all()
        checkpoint.load_state_dict(self, state_dict)

    # --- the rest of the Optimizer API -------------------------------------

    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim: every .grad None (a param no backward reaches then is not stepped), or
        with set_to_none=False a zero grad that the next step() uses. The buckets are zeroed;
        autograd accumulates into them again ([Note: grads after step] in zero/sharded_grad.py)."""
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
