"""FusedZeroAdam: Adam/AdamW over ZeRO shards, in fused kernels.

The engine (zerokern/zero/engine.py) owns the runtime: units, buckets, reductions, gathers, the
shard stores and every cross-rank agreement. This class owns what torch.optim.Optimizer owns:
param groups, hyper-parameters, per-param state (views into the stores, so torch's state-dict
tools see it), the step counts, and a step() that asks the engine to prepare, runs the fused
kernel on the stores' operands and tells the engine it is done. docs/DESIGN.md has the layers.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import lowbit
from ..kernels.backends.registry import resolve
from ..kernels.lowbit_ops import fused_adam_lowbit_
from ..kernels.ops import fused_adam_
from . import state_dict as checkpoint
from ..zero.core.stage import StatePolicy
from ..zero.engine import ZeroEngine
from ..zero.state.swap import NvmeOffloadError
from .engine_optimizer import EngineOptimizer
from .hyper import check_hyper
from .lowbit_options import block_slice, check_lowbit_options
from .update_lists import UniformCalls, extend_calls
from .zero_setup import validated_groups


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


class FusedZeroAdam(EngineOptimizer):
    """Adam/AdamW with ZeRO stage 0/1/2/3 sharding and fused kernels (stage 3: params sharded
    with zerokern.shard(module, stage=3) on each block and the root; [Note: stage-3 params] in
    zero/params/per_unit.py).

    FusedZeroAdam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *,
                  adam_w_mode=True, bias_correction=True, zero_stage=None, process_group=None,
                  bucket_cap_mb=None, overlap_comm=None, max_grad_norm=None, backend="auto", offload=None,
                  overlap_param_gather=None, state_precision="fp32", master_weights=True, rounding_seed=0,
                  mesh=None, reduce_precision=None, gather_precision=None)

    state_precision ("fp32", "bf16", "int8") and master_weights (False: bf16 params without fp32
    masters, stochastically rounded) cut the optimizer state to 2.03 bytes per param at the least
    (docs/usage.md, "Fewer bytes"); with zerokern.shard, int8 needs shard(..., state_precision="int8").
    With offload=OffloadPolicy(device="nvme", ...) that state is kept on disk as it is in memory
    ([Note: low-bit chunks on disk]).

    Semantics are torch.optim.AdamW's (adam_w_mode=True) or Adam's on the
    gradient averaged over the data-parallel group, as under DDP: per-parameter
    step counts; a parameter with no grad on any rank in a step is left
    unchanged; one with a grad on some ranks counts as a zero grad on the others.
    weight_decay defaults to 0, as in torch.optim.Adam and apex's and DeepSpeed's FusedAdam
    (torch.optim.AdamW's default is 0.01: pass weight_decay=0.01 for its numbers).

    Sharding: params sharded with zerokern.shard(module, ...) keep the options
    given there. Other params form one unit built here with zero_stage (None:
    2 when a process group of size > 1 is in use, else 0), process_group (None:
    the default group if torch.distributed is initialized, else one process),
    bucket_cap_mb (25), overlap_comm (True), mesh (None, or hybrid sharding over a
    (replicate, shard) DeviceMesh or pair of sizes: [Note: hybrid sharding]), offload (None, or
    zerokern.OffloadPolicy()), overlap_param_gather (False), reduce_precision and gather_precision
    (None; zerokern.shard() says what they do). Stage 1 shards
    the fp32 master weights and Adam state; stage 2 also the gradients: on
    several ranks each bucket's full gradient buffer is freed as soon as its
    reduction completes, so a rank holds its reduced shards plus a few buckets
    in backward (the planner allows 5) ([Note: stage-2 memory] in
    zero/grads/released.py). At stages 1/2 step() all-gathers the updated params;
    with overlap_param_gather=True (zerokern.shard() units only) it returns
    before they arrive, and each unit waits for its params in its next forward
    (a module holding a param in its state_dict() and load_state_dict() too);
    code that reads params directly in between (an EMA, a copy) calls
    opt.finish_param_gather() first
    ([Note: gather behind forward] in zero/params/gather.py).

    The params are moved into flat buckets: their .data becomes a view of a
    bucket (values unchanged) and their .grad a view of a gradient bucket that
    autograd accumulates into. After backward: at stage 0 .grad holds the
    averaged gradient, as DDP; at stage 1 on several ranks this rank's local
    (unreduced) gradient, and editing it between backward and step() raises
    ([Note: the local grads are the truth] in zero/grads/bucket.py); at stage 2 on
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

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, adam_w_mode=True,
                 bias_correction=True, zero_stage=None, process_group=None, bucket_cap_mb=None, overlap_comm=None,
                 max_grad_norm=None, backend="auto", offload=None, overlap_param_gather=None,
                 state_precision="fp32", master_weights=True, rounding_seed=0, mesh=None, reduce_precision=None,
                 gather_precision=None):
        check_hyper(lr, betas, eps, weight_decay)
        self.options = StepOptions(adam_w_mode, bias_correction, max_grad_norm, backend)
        self.state_policy = StatePolicy(state_precision, master_weights, rounding_seed)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self._constructing = True
        super().__init__(validated_groups(params), defaults)
        self._constructing = False
        for g in self.param_groups:
            check_hyper(g["lr"], g["betas"], g["eps"], g["weight_decay"])
        # FusedZeroAdam(model.named_parameters()): errors name params as the model does
        names = {p: n for g in self.param_groups for p, n in zip(g["params"], g.get("param_names", ()))}
        self.engine = ZeroEngine(self, [g["params"] for g in self.param_groups], names, zero_stage=zero_stage,
                                 process_group=process_group, bucket_cap_mb=bucket_cap_mb, overlap_comm=overlap_comm,
                                 offload=offload, overlap_param_gather=overlap_param_gather, mesh=mesh,
                                 reduce_precision=reduce_precision, gather_precision=gather_precision,
                                 what="FusedZeroAdam", options=repr((self.options, self.state_policy)),
                                 state=None if self.state_policy.plain else self.state_policy)
        trainable = self.engine.trainable
        if not self.state_policy.plain:
            check_lowbit_options(self.state_policy, self.engine, names, backend)
        if trainable:
            resolve(backend, trainable[0].device)  # an unknown or unusable backend fails here
        group_of = {p: gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self._group_of = [group_of[p] for p in trainable]
        # Every param's "step" is a 0-dim view of this one tensor: the usual step counts up with one
        # op (torch._foreach_add_ over 0-dim CPU tensors costs ~7 us each), and it is the truth that
        # step() reads (a dcp.load into opt.state_dict() moves it too).
        self._step_buffer = torch.zeros(len(trainable), dtype=torch.float32)
        self._pieces = self.engine.pieces
        for store, pieces in zip(self.engine.stores, self._pieces):
            self._init_state(store, pieces)
        self._calls = [UniformCalls(store, pieces, self._group_of) for store, pieces in zip(self.stores, self._pieces)]

    def _init_state(self, store, pieces):
        """self.state[p] for the params of one store: views of this rank's slice of each."""
        for k, (t, off, n, start) in enumerate(pieces):
            p, _, shape = self.engine.param_of(store, k)
            st = {"step": self._step_buffer[t], "exp_avg": store.exp_avg[off:off + n],
                  "exp_avg_sq": store.exp_avg_sq[off:off + n]}
            if store.separate_master:
                st["master_param"] = store.master[off:off + n]
            scales = getattr(store, "scales", lambda: None)()
            if self.strategy.shards_state:  # [Note: sharded state in checkpoints]
                for key in checkpoint.SLICED:
                    if key in st:
                        checkpoint.mark_slice(st[key], start, n, shape.numel())  # stage 3: p is empty
            for key, sc in (scales or {}).items():  # int8: the blocks of this piece ([Note: int8 shards in blocks])
                st[key + checkpoint.SCALE] = sc[block_slice(off, n)]
                if self.strategy.shards_state:
                    blocks = lowbit.num_blocks
                    checkpoint.mark_slice(st[key + checkpoint.SCALE], start // lowbit.BLOCK, blocks(n),
                                          blocks(shape.numel()))
            self.state[p] = st

    @property
    def _steps(self):
        return list(map(int, self._step_buffer.tolist()))

    def _update(self, had, scale):  # noqa: D102 (EngineOptimizer's)
        """The fused update of every shard (one kernel call per param group and step count)."""
        stores = self.engine.stores
        if isinstance(scale, torch.Tensor) and stores and scale.device != stores[0].device:
            scale = scale.to(stores[0].device)  # offloaded stores update on the CPU
        if stores and getattr(stores[0], "streams", False):
            self._update_streamed(had, scale)
            return
        if not self.state_policy.plain:
            self._update_lowbit(had, scale)
            self._step_buffer += torch.tensor(had, dtype=torch.float32)
            return
        steps = self._steps
        uniform = len(set(steps)) <= 1 and all(had)
        calls = {}  # (param group, step, with model params) -> (masters, grads, ms, vs, models)
        for store, pieces, uc in zip(stores, self._pieces, self._calls):
            if not store.master_valid:
                store.refresh_master()
            operands = store.operands()
            if uniform:
                for pg, lists in uc.lists(operands).items():
                    extend_calls(calls, (pg, steps[0] + 1, operands[4] is not None), lists)
            else:
                for t, off, n, _ in pieces:
                    if had[t]:
                        views = [None if x is None else x[off:off + n] for x in operands]
                        extend_calls(calls, (self._group_of[t], steps[t] + 1, operands[4] is not None),
                                     [None if v is None else [v] for v in views])
        for (pg, step, low), (masters, grads, ms, vs, models) in calls.items():
            group = self.param_groups[pg]
            fused_adam_(masters, grads, ms, vs, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                        eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                        adam_w_mode=self.options.adam_w_mode, bias_correction=self.options.bias_correction,
                        grad_scale=scale, model_params=models if low else None, backend=self.options.backend)
        if uniform:
            self._step_buffer += 1
        else:
            self._step_buffer += torch.tensor(had, dtype=torch.float32)

    def _update_streamed(self, had, scale):
        """The update over NvmeStores or LowBitNvmeStores ([Note: NVMe swap]): each shard streamed from
        disk chunk by chunk, one fused_adam_ (or fused_adam_lowbit_) call per (param group, step count)
        and chunk, over the pieces in it. Every rank then says whether its reads and writes all
        succeeded: only if all did are the new params and state committed; else every rank raises,
        with nothing changed."""
        steps = self._steps
        self.stores[0].swap.flush()  # what went through the mapping (a loaded state dict) reaches the file
        problem = None
        for store, pieces in zip(self.stores, self._pieces):
            if not store.master_valid:
                try:
                    store.refresh_master()
                except NvmeOffloadError as e:
                    problem = f"rank {self.engine.comm.rank}: {e}"
                    break
            if not self.state_policy.plain:
                problem = store.stream(self._lowbit_chunk_run(pieces, had, steps, scale))
                if problem is not None:
                    break
                continue

            def run(lo, hi, master, grad, m, v, model, pieces=pieces):
                calls = {}
                for t, off, n, _ in pieces:
                    a, z = max(off, lo), min(off + n, hi)
                    if had[t] and a < z:
                        c = calls.setdefault((self._group_of[t], steps[t] + 1), ([], [], [], [], []))
                        for lst, x in zip(c, (master, grad, m, v, model)):
                            if x is not None:
                                lst.append(x[a - lo:z - lo])
                for (pg, step), (ps, gs, ms, vs, models) in calls.items():
                    group = self.param_groups[pg]
                    fused_adam_(ps, gs, ms, vs, lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                                eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                                adam_w_mode=self.options.adam_w_mode, bias_correction=self.options.bias_correction,
                                grad_scale=scale, model_params=models or None, backend=self.options.backend)
            problem = store.stream(run)
            if problem is not None:
                break
        self.stores[0].swap.progress_done()  # the first step's masters were written
        failed = [p for p in self.engine.comm.gather_objects(problem, name="nvme_step") if p]
        if failed:
            raise NvmeOffloadError("zerokern: the optimizer step could not read or write its state on disk, so it was "
                                   "not applied on any rank (the params and the optimizer state are those of the "
                                   "last step): " + "; ".join(failed))
        for store, pieces in zip(self.stores, self._pieces):
            store.commit()
            self._repoint_state(store, pieces)
        self._step_buffer += torch.tensor(had, dtype=torch.float32)

    def _repoint_state(self, store, pieces):
        """self.state[p]'s tensors, the same objects, now over the slot just written (set_ moves a tensor
        to other memory in place): a reference a user keeps across step() stays live, as with torch.optim."""
        bases = {"exp_avg": store.exp_avg, "exp_avg_sq": store.exp_avg_sq}
        if store.separate_master:
            bases["master_param"] = store.master
        scales = {k + checkpoint.SCALE: sc for k, sc in (getattr(store, "scales", lambda: None)() or {}).items()}
        for k, (t, off, n, _) in enumerate(pieces):
            st = self.state[self.engine.param_of(store, k)[0]]
            for key, base in bases.items():
                st[key].set_(base.untyped_storage(), base.storage_offset() + off, (n,), (1,))
            for key, base in scales.items():  # int8: the piece's blocks ([Note: int8 shards in blocks])
                st[key].set_(base.untyped_storage(), base.storage_offset() + off // lowbit.BLOCK,
                             (lowbit.num_blocks(n),), (1,))

    def _update_lowbit(self, had, scale):
        """The update over LowBitStores: one fused_adam_lowbit_ call per (param group, step count),
        over each param's piece of each shard, with the piece's block scales and the global index
        of its first element ([Note: reproducible rounding])."""
        steps = self._steps
        calls = {}  # (param group, step) -> the call's lists
        starts = self.engine.global_starts
        for store, pieces in zip(self.stores, self._pieces):
            if not store.master_valid:
                store.refresh_master()
            master, grad, m, v, model = store.operands()
            scales = store.scales() or {}
            operands = (master, grad, m, v, scales.get("exp_avg"), scales.get("exp_avg_sq"), model)
            for t, off, n, start in pieces:
                if had[t] and n:
                    self._add_lowbit_piece(calls, steps, t, off, n, starts[t] + start, operands)
        self._run_lowbit(calls, scale)

    def _lowbit_chunk_run(self, pieces, had, steps, scale):
        """The run(lo, hi, ...) a LowBitNvmeStore's stream() calls per chunk: the pieces' parts in
        elements [lo, hi) of the shard, each with the global index of its first element (a piece cut
        at a chunk's edge starts on a block there: [Note: low-bit chunks on disk])."""
        starts = self.engine.global_starts

        def run(lo, hi, params, grad, m, v, ms, vs, model):
            calls = {}
            for t, off, n, start in pieces:
                a, z = max(off, lo), min(off + n, hi)
                if had[t] and a < z:
                    self._add_lowbit_piece(calls, steps, t, a - lo, z - a, starts[t] + start + a - off,
                                           (params, grad, m, v, ms, vs, model))
            self._run_lowbit(calls, scale)
        return run

    def _add_lowbit_piece(self, calls, steps, t, off, n, base, operands):
        """Elements [off, off + n) of the operands (params, grad, m, v, m's and v's block scales or None,
        model or None), param t's, into the call of its (param group, step count)."""
        params, grad, m, v, ms, vs, model = operands
        sl = slice(off, off + n)
        c = calls.setdefault((self._group_of[t], steps[t] + 1), {k: [] for k in (
            "params", "grads", "m", "v", "model", "ms", "vs", "bases")})
        c["params"].append(params[sl])
        c["grads"].append(grad[sl])
        c["m"].append(m[sl])
        c["v"].append(v[sl])
        if model is not None:
            c["model"].append(model[sl])
        if ms is not None:
            c["ms"].append(ms[block_slice(off, n)])
            c["vs"].append(vs[block_slice(off, n)])
        c["bases"].append(base)

    def _run_lowbit(self, calls, scale):
        """One fused_adam_lowbit_ call per (param group, step count) of `calls`."""
        int8 = self.state_policy.precision == "int8"
        for (pg, step), c in calls.items():
            group = self.param_groups[pg]
            fused_adam_lowbit_(c["params"], c["grads"], c["m"], c["v"], lr=group["lr"], beta1=group["betas"][0],
                               beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
                               step=step, adam_w_mode=self.options.adam_w_mode,
                               bias_correction=self.options.bias_correction, grad_scale=scale,
                               model_params=c["model"] or None, exp_avg_scales=c["ms"] if int8 else None,
                               exp_avg_sq_scales=c["vs"] if int8 else None, index_bases=c["bases"],
                               seed=self.state_policy.seed, backend=self.options.backend)

    # --- state dicts (optim/state_dict.py) ------------------------------------

    def state_dict(self):
        """This rank's shard in torch.optim.AdamW's format: per param, views of this rank's
        slice (flattened) of "exp_avg", "exp_avg_sq" (and "master_param" for fp16/bf16
        params), "step"; every param-group key; and under "zerokern" where the slices lie.
        With reduce_precision="int8"/"int4" on several ranks also "error_feedback", which
        makes it a collective: call it on every rank ([Note: error feedback in checkpoints])."""
        self.engine.finish_param_gather()
        return checkpoint.shard_state_dict(self)

    def full_state_dict(self):
        """Collective (call on every rank): the whole state in torch.optim.AdamW's
        format on rank 0 (plus the fp32 master weights under "zerokern_master"),
        None on the other ranks."""
        self.engine.finish_param_gather()
        return checkpoint.full_state_dict(self)

    def load_state_dict(self, state_dict):
        """A shard saved by this rank at this world size and layout, or a full
        state dict (from full_state_dict() at any world size, or from
        torch.optim.AdamW for the same params), re-sharded to this world size."""
        self.engine.finish_param_gather()
        checkpoint.load_state_dict(self, state_dict)
