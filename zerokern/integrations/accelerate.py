"""Accelerate and zerokern's optimizers (FusedZeroAdam, ZeroOptimizer).

    from accelerate import Accelerator
    from zerokern import FusedZeroAdam
    from zerokern.integrations.accelerate import attach

    accelerator = attach(Accelerator(gradient_accumulation_steps=2))
    model = Model().to(accelerator.device)            # on its device first, then the optimizer
    opt = FusedZeroAdam(model.parameters(), lr=3e-4)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ... the usual loop: accelerator.accumulate(model), accelerator.backward(loss),
        accelerator.clip_grad_norm_(model.parameters(), 1.0), opt.step(), opt.zero_grad()

[Note: accelerate] Accelerate special-cases DeepSpeed and FSDP by distributed
type; for a plain multi-process run it wraps every trainable model in DDP,
maps no_sync to the model's no_sync and clips with torch's clip_grad_norm_ on
.grad. With FusedZeroAdam all three are wrong: DDP would all-reduce on top of
zerokern's reduce-scatter (and write into the grad buckets), a model without
no_sync would reduce every micro-batch, and at stages 1/2 .grad is each rank's
local gradient, which torch's clip would scale by each rank's own norm.
attach() wraps public methods of this one Accelerator instance (nothing
global; the one Accelerate internal it writes is AcceleratedOptimizer._is_overflow,
what optimizer_step_was_skipped reads): for a model whose trainable params a
FusedZeroAdam owns, prepare_model skips the DDP wrap (Accelerate's own
evaluation_mode path, the one transformers takes for models that reduce their
own grads; device placement, autocast and compile still apply; rank 0's buffers
are broadcast, as DDP does), no_sync enters opt.no_sync(), clip_grad_norm_ is
opt.clip_grad_norm_ (the global norm over all shards, applied in the fused
update; returned unscaled, as Accelerate's), prepare_optimizer skips the state
dict round trip of device placement and reports a step the GradScaler skipped.
Checkpoints: get_state_dict returns copies of such a model's weights (at stage 3
the whole weights, gathered: call it on every rank, as with FSDP; they are
views of flat buckets, and Accelerate's safetensors save keeps one tensor per
shared storage, dropping the rest); save_state writes the weights in torch's
format (safetensors' load_model refuses to load into views of a larger buffer);
and save_state/load_state keep each FusedZeroAdam in a
torch.distributed.checkpoint directory of its own,
"optimizer_zerokern_<i>", written by every rank and re-sharded on load (Accelerate
writes optimizer.bin from rank 0 only, which would hold rank 0's shard: it gets a
note saying where the state is instead).
What is said of FusedZeroAdam here holds for every zerokern optimizer (ZeroOptimizer too),
recognised by zerokern.optim.engine_optimizer.zero_optimizer_in.
Everything else, and every other model, goes to Accelerate unchanged.
tests/integrations/test_accelerate.py pins this to the Accelerate version installed.
"""

import collections
import contextlib
import os
import re

import torch
import torch.distributed.checkpoint as dcp

from ..zero.unit import owner_of
from ..zero.api import full_state_dict
from ..optim.engine_optimizer import zero_optimizer_in
from ..optim.state_dict import FORMAT
from .dcp import drop_missing_error_feedback


OPTIMIZER_DIR = "optimizer_zerokern"


def _trainable(params):
    return [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad]


def attach(accelerator):
    """Teach this Accelerator about zerokern's optimizers (before accelerator.prepare). Returns it."""
    if getattr(accelerator, "_zerokern_attached", False):
        return accelerator
    prepare_model, prepare_optimizer = accelerator.prepare_model, accelerator.prepare_optimizer
    no_sync, clip_grad_norm_ = accelerator.no_sync, accelerator.clip_grad_norm_
    get_state_dict, save_state, load_state = accelerator.get_state_dict, accelerator.save_state, accelerator.load_state
    free_memory = accelerator.free_memory
    wrapped_in_ddp = []  # models this Accelerator wrapped in DDP: a zerokern optimizer must not own them
    zero_opts = []  # the zerokern optimizers it prepared, in order (their checkpoint directories are numbered so)

    def zero_prepare_model(model, device_placement=None, evaluation_mode=False):
        opt = owner_of(_trainable(model.parameters()))
        if opt is not None:
            evaluation_mode = True  # no DDP: the optimizer reduces the grads itself
            _broadcast_buffers(model, opt)  # what DDP would have done at construction
        out = prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if isinstance(out, torch.nn.parallel.DistributedDataParallel):
            wrapped_in_ddp.append(out)
        return out

    def zero_prepare_optimizer(optimizer, device_placement=None):
        inner = zero_optimizer_in(optimizer)
        if inner is not None:
            mine = {id(p) for g in inner.param_groups for p in g["params"]}
            for ddp in wrapped_in_ddp:
                if any(id(p) in mine for p in ddp.module.parameters()):
                    raise RuntimeError(
                        f"zerokern: accelerator.prepare wrapped the model in DDP before it saw the {type(inner).__name__} "
                        "that trains it, so both would reduce the grads. Build the optimizer first and prepare "
                        "them together: accelerator.prepare(model, optimizer, ...)")
            zero_opts.append(inner)
            # No device placement: Accelerate would round-trip the state dict through
            # .to(accelerator.device), copying offloaded CPU state to the GPU and back for nothing.
            wrapped = prepare_optimizer(optimizer, device_placement=False)
            _report_skipped_steps(wrapped, inner)
            return wrapped
        return prepare_optimizer(optimizer, device_placement=device_placement)

    @contextlib.contextmanager
    def zero_no_sync(model):
        opt = owner_of(_trainable(model.parameters()))
        with (opt.no_sync() if opt is not None else no_sync(model)):
            yield

    def zero_clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = list(parameters)
        trainable = _trainable(params)
        opt = owner_of(trainable)
        if opt is None:
            return clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if {id(p) for p in trainable} != {id(p) for p in opt.engine.trainable}:
            raise NotImplementedError(
                f"zerokern: accelerator.clip_grad_norm_ got a part of {type(opt).__name__}'s params; it clips all of them "
                "by their global norm (opt.clip_grad_norm_). Pass model.parameters(), or use a separate optimizer "
                "for params clipped apart")
        norm = opt.clip_grad_norm_(max_norm, norm_type)
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            norm = norm / scaler.get_scale()  # Accelerate unscales before clipping: its norm is unscaled
        return norm

    def zero_get_state_dict(model, unwrap=True):
        inner = accelerator.unwrap_model(model)
        opt = owner_of(_trainable(inner.parameters()))
        if opt is not None and opt.engine.param_policy.state_dict_is_collective:
            # Stage 3: each rank holds slices; the whole weights are gathered (a collective on every
            # rank, as Accelerate's FSDP and DeepSpeed ZeRO-3 paths) onto the main process, {} elsewhere.
            return full_state_dict(inner)
        sd = get_state_dict(model, unwrap=unwrap)
        if opt is None or not accelerator.is_main_process:
            return sd  # only the main process writes it
        return collections.OrderedDict((k, v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                                       for k, v in sd.items())

    def zero_save_state(output_dir=None, safe_serialization=True, **kwargs):
        if zero_opts:
            # The weights go in torch's format: safetensors' load_model refuses to load into params
            # that are views of a larger buffer (ours are views of flat buckets).
            safe_serialization = False
        with _notes_instead_of_shards(zero_opts):
            location = save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        for i, opt in enumerate(zero_opts):  # every rank
            dcp.save({"optim": opt.state_dict()}, checkpoint_id=os.path.join(location, f"{OPTIMIZER_DIR}_{i}"))
        return location

    def zero_load_state(input_dir=None, load_kwargs=None, **kwargs):
        if input_dir is None and zero_opts:
            input_dir = _latest_checkpoint(accelerator)
        elif input_dir is not None:
            input_dir = os.path.expanduser(input_dir)
        with _loads_skipped(zero_opts):
            out = load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        for i, opt in enumerate(zero_opts):
            sd = {"optim": opt.state_dict()}
            drop_missing_error_feedback(sd, os.path.join(input_dir, f"{OPTIMIZER_DIR}_{i}"))  # saved without
            dcp.load(sd, checkpoint_id=os.path.join(input_dir, f"{OPTIMIZER_DIR}_{i}"))
            opt.load_state_dict(sd["optim"])
        return out

    def zero_free_memory(*args, **kwargs):
        zero_opts.clear()  # Accelerate forgets its optimizers and models here: so do we
        wrapped_in_ddp.clear()
        return free_memory(*args, **kwargs)

    accelerator.prepare_model = zero_prepare_model
    accelerator.prepare_optimizer = zero_prepare_optimizer
    accelerator.no_sync = zero_no_sync
    accelerator.clip_grad_norm_ = zero_clip_grad_norm_
    accelerator.get_state_dict = zero_get_state_dict
    accelerator.save_state = zero_save_state
    accelerator.load_state = zero_load_state
    accelerator.free_memory = zero_free_memory
    accelerator._zerokern_attached = True
    return accelerator


@contextlib.contextmanager
def _notes_instead_of_shards(opts):
    """While Accelerate saves optimizer.bin (rank 0's only): a note of where the state is."""
    for i, opt in enumerate(opts):
        opt.state_dict = lambda i=i: {"state": {}, "param_groups": [], "zerokern": {
            "format": FORMAT, "kind": "elsewhere", "path": f"{OPTIMIZER_DIR}_{i}"}}
    try:
        yield
    finally:
        for opt in opts:
            del opt.state_dict


@contextlib.contextmanager
def _loads_skipped(opts):
    """While Accelerate loads optimizer.bin (the note above): nothing; DCP loads the state after."""
    for opt in opts:
        opt.load_state_dict = lambda state_dict: None
    try:
        yield
    finally:
        for opt in opts:
            del opt.load_state_dict


def _latest_checkpoint(accelerator):
    """The directory Accelerate's load_state(None) picks (automatic checkpoint naming)."""
    if not accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    base = os.path.join(accelerator.project_dir, "checkpoints")
    folders = [os.path.join(base, f) for f in os.listdir(base)]
    return max(folders, key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))


def _broadcast_buffers(model, opt):
    """Rank 0's buffers on every rank, as DDP does when it wraps a model (the optimizer already
    broadcast the params)."""
    if not opt.comm.distributed:
        return
    with torch.no_grad():
        for b in model.buffers():
            if b.is_floating_point() or b.dtype in (torch.int64, torch.int32, torch.bool, torch.uint8):
                opt.comm.wait(opt.comm.broadcast(b, name="broadcast_buffers"))


def _report_skipped_steps(wrapped, opt):
    """Accelerate tells a skipped step (GradScaler overflow) by whether GradScaler called the
    optimizer's step; FusedZeroAdam's step is always called (it skips inside, as torch's fused
    AdamW), so Trainer would step the lr scheduler on skipped steps. Tell it from the optimizer."""
    if getattr(wrapped, "scaler", None) is None or not hasattr(wrapped, "_is_overflow"):
        return
    step = wrapped.step

    def zero_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if wrapped.gradient_state.sync_gradients:
            wrapped._is_overflow = opt.last_step_skipped
        return out

    wrapped.step = zero_step
