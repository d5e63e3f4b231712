"""FusedZeroAdam: a torch.optim.Optimizer giving ZeRO stage 1/2 data
parallelism with zerokern's fused kernels (see flat_group.py for the runtime)."""

import contextlib
import hashlib
import operator
from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.registry import resolve
from ..ops import fused_adam_
from . import checkpoint
from .comm import Comm
from .flat_group import FlatGroup


@dataclass(frozen=True)
class ZeroConfig:
    """The options that are not per-parameter-group hyper-parameters."""

    adam_w_mode: bool = True
    bias_correction: bool = True
    zero_stage: Optional[int] = None
    bucket_cap_mb: float = 25.0
    overlap_comm: bool = True
    max_grad_norm: Optional[float] = None
    backend: str = "auto"

    def __post_init__(self):
        if self.zero_stage == 3:
            raise ValueError("zero_stage=3 (sharded parameters) is not offered yet; use 0, 1 or 2")
        if self.zero_stage not in (None, 0, 1, 2):
            raise ValueError(f"zero_stage must be None, 0, 1 or 2, got {self.zero_stage!r}")
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


def _check_hyper(lr, betas, eps, weight_decay):
    # torch.optim.Adam's checks and wording.
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


class FusedZeroAdam(torch.optim.Optimizer):
    """Adam/AdamW with ZeRO stage 1/2 sharding and fused kernels.

    FusedZeroAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                  adam_w_mode=True, bias_correction=True, zero_stage=None, process_group=None,
                  bucket_cap_mb=25.0, overlap_comm=True, max_grad_norm=None, backend="auto")

    Semantics are torch.optim.AdamW's (adam_w_mode=True) or Adam's on the
    gradient averaged over the data-parallel group, as under DDP: per-parameter
    step counts; a parameter with no grad on any rank in a step is left
    unchanged; one with a grad on some ranks counts as a zero grad on the others.

    zero_stage: None picks 2 when a process group of size > 1 is in use, else 0.
    Stage 1 shards the fp32 master weights and Adam state; stage 2 also frees
    the full gradient buffers between steps, keeping only this rank's reduced
    shard. process_group: None uses the default group if torch.distributed is
    initialized, else runs as one process.

    The parameters are moved into flat buckets: their .data becomes a view of
    a bucket (values unchanged) and their .grad a view of a gradient bucket
    that autograd accumulates into. zero_grad() zeroes those buffers instead of
    setting .grad to None. fp32 parameters are updated in place, with no private
    copy, so weights loaded into the model later (model.load_state_dict) are the
    ones trained. fp16/bf16 parameters get fp32 master weights, created from the
    parameters at the first step; after that they follow the optimizer's own
    state (load_state_dict), and reload_master_weights() re-reads them from the
    model after a model-only load.

    With torch.amp.GradScaler (fp16): scaler.scale(loss).backward();
    scaler.step(opt); scaler.update(). An inf/nan on any rank skips the step on
    every rank and every rank's scaler backs off alike; unscaling and the skip
    happen inside the fused kernel. Do not call scaler.unscale_(opt): clip with
    max_grad_norm, which uses the global norm over all shards (one all-reduce)
    inside the fused update; the last norm is in opt.last_grad_norm.
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale and found_inf

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adam_w_mode=True,
                 bias_correction=True, zero_stage=None, process_group=None, bucket_cap_mb=25.0, overlap_comm=True,
                 max_grad_norm=None, backend="auto"):
        _check_hyper(lr, betas, eps, weight_decay)
        self.config = ZeroConfig(adam_w_mode, bias_correction, zero_stage, bucket_cap_mb, overlap_comm, max_grad_norm,
                                 backend)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(_validated_groups(params), defaults)
        for g in self.param_groups:
            _check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])

        self.comm = Comm(process_group)
        self.zero_stage = self.config.zero_stage if self.config.zero_stage is not None else (
            2 if self.comm.world_size > 1 else 0)
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(all_params)}
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._check_same_on_every_rank(all_params)
        trainable = [(i, p) for i, p in enumerate(all_params) if p.requires_grad]
        if trainable:
            resolve(backend, trainable[0][1].device)  # an unknown or unusable backend fails here
        self._steps = [0] * len(all_params)
        self._queued = False
        self.last_grad_norm = None
        self._check_overflow = any(p.dtype == torch.float16 for _, p in trainable)
        self.groups = []
        for dtype in sorted({p.dtype for _, p in trainable}, key=str):
            members = [(i, p) for i, p in trainable if p.dtype == dtype]
            fg = FlatGroup([p for _, p in members], [i for i, _ in members], self.comm, self.zero_stage,
                           self.config.bucket_cap_mb * 2**20, self._on_backward)
            fg.overlap = self.config.overlap_comm
            self.groups.append(fg)
        self._piece_cache = {}
        self._full_call_cache = {}  # id(FlatGroup) -> (its piece lists, lists per param group)
        self._pickers = {}  # id(FlatGroup) -> itemgetter of its params' global indices

    # --- construction checks -----------------------------------------------

    def _check_same_on_every_rank(self, params):
        desc = repr([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in params])
        mine = (hashlib.sha256(desc.encode()).hexdigest()[:16], len(params), sum(p.numel() for p in params),
                self.zero_stage)
        everyone = self.comm.gather_objects(mine)  # one collective, on every rank
        if any(other != everyone[0] for other in everyone):
            lines = [f"rank {r}: {n} params, {numel} elements, zero_stage {s}, shapes/dtypes/order #{h}"
                     for r, (h, n, numel, s) in enumerate(everyone)]
            raise ValueError("FusedZeroAdam: the ranks passed different parameters (shapes, dtypes or order) or "
                             "options; every rank must build the optimizer for the same model:\n  "
                             + "\n  ".join(lines))

    # --- backward ----------------------------------------------------------

    def _on_backward(self):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)

    def _finalize_backward(self):
        self._queued = False
        with torch.no_grad():
            for g in self.groups:
                g.finalize()
            if self._check_overflow:
                self._share_overflow()

    def _share_overflow(self):
        """[Note: overflow on any rank] GradScaler checks each rank's local .grad;
        an inf/nan may land in another rank's shard only. Check the reduced
        shards, agree on one flag (all-reduce MAX) and, if set, write an inf into
        a local grad, so every rank's scaler sees an overflow, skips and backs off."""
        shards = [g.shard_grad(b) for g in self.groups for b in range(len(g.layout.buckets))]
        flag = torch.zeros((), device=shards[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(shards, flag, torch.ones((), device=flag.device))
        self.comm.wait(self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, name="overflow"))
        for g in self.groups:
            for i, p in enumerate(g.params):
                if p.numel() and p.grad is not None:
                    first = p.grad.view(-1)[:1]
                    first.copy_(torch.where(flag > 0, torch.full_like(first, float("inf")), first))
                    return

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate locally, with no communication."""
        for g in self.groups:
            g.sync = False
        try:
            yield
        finally:
            for g in self.groups:
                g.sync = True

    # --- step --------------------------------------------------------------

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
        for g in self.groups:
            g.adopt_manual_grads()
        if any(not g.reduced for g in self.groups):
            for g in self.groups:  # every group, in order, so ranks issue the same collectives
                g.finalize()
        had_grad, skip = self._agree_on_grads(found_inf)
        if not skip and any(had_grad):
            scale = self._grad_scale_with_clipping(grad_scale)
            for g in self.groups:
                self._update(g, had_grad, scale)
            for g in self.groups:
                g.all_gather_params()
        for g in self.groups:
            g.reduced = False
            if self.zero_stage == 2:
                g.release_grads()
            else:
                g.got = [False] * len(g.params)
        return loss

    def _agree_on_grads(self, found_inf):
        """(global had-grad flag per param, skip). Distributed or with a GradScaler:
        one all-reduce MAX and one host read per step; one process without a
        scaler: neither (the flags are already on the host)."""
        n = len(self._steps)
        had = [False] * n
        for g in self.groups:
            for i, got in zip(g.indices, g.got):
                had[i] = had[i] or got
        if not self.comm.distributed and found_inf is None:
            return had, False
        device = self.groups[0].device if self.groups else torch.device("cpu")
        flags = torch.tensor(had + [False], dtype=torch.float32, device=device)  # the last: found_inf
        if found_inf is not None:
            flags[n] = found_inf.reshape(()).to(device)
        self.comm.wait(self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, name="grad_flags"))
        values = flags.tolist()
        return [v > 0 for v in values[:n]], values[n] > 0

    def _grad_scale_with_clipping(self, grad_scale):
        """The divisor of the reduced grads: the loss scale, times the clip factor."""
        if self.config.max_grad_norm is None:
            self.last_grad_norm = None
            return grad_scale
        shards = [g.shard_grad(b) for g in self.groups for b in range(len(g.layout.buckets))]
        sumsq = torch.stack([n.float() for n in torch._foreach_norm(shards)]).square().sum()
        self.comm.wait(self.comm.all_reduce(sumsq, name="grad_norm"))
        norm = sumsq.sqrt()
        if grad_scale is not None:
            norm = norm / grad_scale.float()
        self.last_grad_norm = norm
        clip = torch.clamp(self.config.max_grad_norm / (norm + 1e-6), max=1.0)
        base = grad_scale.float() if grad_scale is not None else torch.ones((), device=norm.device)
        return (base / clip).reshape(1)

    def _pieces(self, g, b):
        """Per piece of this rank's shard of bucket b: (global index, master, grad, m, v, model) views (cached)."""
        master, grad = g.master_shard(b), g.shard_grad(b)
        model = g.param_shard(b) if g.low_precision else None
        key = (id(g), b)
        ptrs = (master.data_ptr(), grad.data_ptr(), None if model is None else model.data_ptr())
        cached = self._piece_cache.get(key)
        if cached is None or cached[0] != ptrs:
            views = []
            for pc in g.layout.rank_pieces(g.rank, b):
                sl = slice(pc.shard_offset, pc.shard_offset + pc.numel)
                views.append((g.indices[pc.index], master[sl], grad[sl], g.exp_avg[b][sl], g.exp_avg_sq[b][sl],
                              None if model is None else model[sl]))
            cached = (ptrs, views)
            self._piece_cache[key] = cached
        return cached[1]

    def _update(self, g, had_grad, scale):
        g.ensure_master()
        pieces = [self._pieces(g, b) for b in range(len(g.layout.buckets))]
        pick = self._pickers.get(id(g))
        if pick is None:
            pick = self._pickers[id(g)] = operator.itemgetter(*g.indices, g.indices[0])  # always a tuple
        had, steps = pick(had_grad), pick(self._steps)
        if all(had) and len(set(steps)) == 1:
            # The usual step: every param had a grad and all are at the same step, so the
            # calls are the same lists as last time (built once per layout of the pieces).
            uniform_step = steps[0] + 1
            calls = {(pg, uniform_step): lists for pg, lists in self._full_calls(g, pieces).items()}
        else:
            uniform_step = None
            calls = _collect(pieces, lambda gi: (self._group_of[gi], self._steps[gi] + 1) if had_grad[gi] else None)
        for i in g.indices:
            if uniform_step is not None:
                self._steps[i] = uniform_step
            elif had_grad[i]:
                self._steps[i] += 1
        for (pg, step), (masters, grads, ms, vs, models) in calls.items():
            group = self.param_groups[pg]
            fused_adam_(masters, grads, ms, vs, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                        adam_w_mode=self.config.adam_w_mode, bias_correction=self.config.bias_correction,
                        grad_scale=scale, model_params=models if g.low_precision else None,
                        backend=self.config.backend)

    def _full_calls(self, g, pieces):
        """{param group: (masters, grads, ms, vs, models)} over all of g's pieces, cached
        while the piece lists (see _pieces) are the same objects (the entry holds them, so
        a rebuilt list is always a new object)."""
        cached = self._full_call_cache.get(id(g))
        if cached is None or len(cached[0]) != len(pieces) or any(a is not b for a, b in zip(cached[0], pieces)):
            cached = self._full_call_cache[id(g)] = (tuple(pieces), _collect(pieces, self._group_of.__getitem__))
        return cached[1]

    # --- state dicts (checkpoint.py) ---------------------------------------

    def state_dict(self):
        """This rank's shard: fp32 master weights and Adam state of the shard,
        per-param steps, and the layout it belongs to."""
        return checkpoint.shard_state_dict(self)

    def full_state_dict(self):
        """Collective (call on every rank): the whole state in torch.optim.AdamW's
        format on rank 0 (plus the fp32 master weights under "zerokern_master"),
        None on the other ranks."""
        return checkpoint.full_state_dict(self)

    def load_state_dict(self, state_dict):
        """A shard saved by this rank at this world size and layout, or a full
        state dict (from full_state_dict() at any world size, or from
        torch.optim.AdamW for the same params), re-sharded to this world size."""
        checkpoint.load_state_dict(self, state_dict)

    # --- the rest of the Optimizer API -------------------------------------

    def zero_grad(self, set_to_none: bool = True):
        """Zeroes the gradient buckets. The .grad views stay (set_to_none is
        accepted for compatibility): setting them to None would cut autograd
        off from the buckets. A parameter counts as having no grad until the
        next backward reaches it."""
        for g in self.groups:
            g.zero_grads()

    def reload_master_weights(self):
        """fp16/bf16 params: re-read the fp32 master weights from the model's
        params (after loading model weights without the optimizer's state)."""
        for g in self.groups:
            g.master = [None] * len(g.master)
        self._piece_cache.clear()

    def memory_report(self):
        """Bytes this rank holds, by kind."""
        def nbytes(ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        rep = {"params": 0, "master_params": 0, "adam_state": 0, "grads": 0, "comm_buffers": 0}
        for g in self.groups:
            rep["params"] += nbytes(g.param_bufs.buffers)
            rep["master_params"] += nbytes(g.master) if g.low_precision else 0
            rep["adam_state"] += nbytes(g.exp_avg) + nbytes(g.exp_avg_sq)
            rep["grads"] += nbytes(g.grad_full)
            rep["comm_buffers"] += nbytes(g.grad_shard)
        rep["total"] = sum(rep.values())
        return rep


def _collect(pieces, key_of):
    """{key: (masters, grads, ms, vs, models)}: the pieces (see FusedZeroAdam._pieces) grouped by
    key_of(global param index) into the lists of one fused call each; None leaves a piece out."""
    calls = {}
    for piece_list in pieces:
        for gi, *tensors in piece_list:
            key = key_of(gi)
            if key is not None:
                for lst, t in zip(calls.setdefault(key, ([], [], [], [], [])), tensors):
                    lst.append(t)
    return calls


def _validated_groups(params):
    """The param groups, checked: tensors, floating point, each tensor once, one device."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of param-group dicts, not a single tensor")
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    seen, device, k = {}, None, 0
    for gi, group in enumerate(groups):
        ps = group["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        group["params"] = ps
        for p in ps:
            where = f"params[{k}] (group {gi})"
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where} is {type(p).__name__}, expected a tensor")
            if not p.is_floating_point():
                raise TypeError(f"{where} is {p.dtype}; FusedZeroAdam trains floating-point params only")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16) and p.requires_grad:
                raise TypeError(f"{where} is {p.dtype}; expected float32, float16 or bfloat16")
            if id(p) in seen:
                raise ValueError(f"{where} is the same tensor as params[{seen[id(p)]}]; pass each parameter once")
            seen[id(p)] = k
            if device is None:
                device = p.device
            elif p.device != device:
                raise ValueError(f"{where} is on {p.device}, params[0] is on {device}; FusedZeroAdam needs one device")
            k += 1
    return groups
