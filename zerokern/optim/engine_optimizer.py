"""EngineOptimizer: what every zerokern optimizer over a ZeroEngine shares (FusedZeroAdam,
ZeroOptimizer): the step protocol around the subclass's update, and the calls torch.optim users
make that the engine answers. A subclass builds self.engine and implements _update(had, divisor)."""

import warnings

import torch

from ..zero.state.swap import NvmeOffloadError


class EngineOptimizer(torch.optim.Optimizer):
    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale and found_inf; the engine agrees on them
    max_grad_norm = None  # the subclass's clip, if any
    _constructing = False  # True while torch.optim.Optimizer.__init__ adds the param groups
    _warned_no_grads = False

    # the engine's, for integrations, benchmarks and tests
    comm = property(lambda self: self.engine.comm)
    strategy = property(lambda self: self.engine.strategy)
    zero_stage = property(lambda self: self.engine.zero_stage)
    units = property(lambda self: self.engine.units)
    stores = property(lambda self: self.engine.stores)
    schedule = property(lambda self: self.engine.schedule)
    param_gather = property(lambda self: self.engine.param_gather)
    stage3 = property(lambda self: self.engine.stage3)
    last_grad_norm = property(lambda self: self.engine.last_grad_norm)
    last_step_skipped = property(lambda self: self.engine.last_step_skipped)
    _trainable = property(lambda self: self.engine.trainable)

    def add_param_group(self, param_group):
        if not self._constructing:
            raise NotImplementedError(
                f"{type(self).__name__}.add_param_group after construction is not supported: its params would need "
                "new buckets on every rank. Build the optimizer with all param groups (a group may start with lr=0)")
        super().add_param_group(param_group)

    # [Note: compile] step() is opaque to torch.compile: a compiled training step graph-breaks
    # here once per call instead of recompiling for every new step count and bucket state.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.engine.begin_step(getattr(self, "found_inf", None), getattr(self, "grad_scale", None),
                                      self.max_grad_norm)
        if step.had and not any(step.had) and not self._warned_no_grads:
            self._warned_no_grads = True
            warnings.warn(f"{type(self).__name__}.step(): no parameter had a gradient on any rank, so nothing was "
                          "updated. If the model's Parameters were replaced after the optimizer was built "
                          "(load_state_dict(..., assign=True) without zerokern.shard), build the optimizer after "
                          "that, as with any torch optimizer", stacklevel=3)
        if step.updates:
            try:
                self._update(step.had, step.divisor)
            except NvmeOffloadError:  # on every rank, nothing applied ([Note: NVMe swap])
                step.updates = False  # the round ends as a skipped step's: grads released, no gather
                self.engine.finish_step(step)
                raise
        self.engine.finish_step(step)
        return loss

    def _update(self, had, divisor):
        """Update this rank's shards: had[t] says which trainable params had a grad on some rank;
        divisor (None or a 1-element tensor) is the loss scale times the clip factor."""
        raise NotImplementedError

    @torch.compiler.disable  # [Note: compile]: it swaps .grad placeholders, whose faking fails at stage 3
    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim: every .grad None (a param no backward reaches then is not stepped), or
        with set_to_none=False a zero grad that the next step() uses ([Note: grads after step])."""
        self.engine.zero_grad(set_to_none)

    def no_sync(self):
        """Backward passes inside accumulate locally, with no communication."""
        return self.engine.no_sync()

    @torch.compiler.disable  # [Note: compile]: a collective over the sharded grads
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """torch.nn.utils.clip_grad_norm_ for the sharded grads (a collective; see ZeroEngine.clip_grad_norm_)."""
        return self.engine.clip_grad_norm_(max_norm, norm_type)

    def share_found_inf(self, found_inf_per_device):
        """zerokern.GradScaler's inf check, agreed across ranks."""
        self.engine.share_found_inf(found_inf_per_device)

    def finish_param_gather(self):
        """Wait until every param holds the last step's values (needed only with overlap_param_gather=True,
        before code that reads params directly between step() and the next forward)."""
        self.engine.finish_param_gather()

    def reload_master_weights(self):
        """fp16/bf16 params: re-read the fp32 master weights from the model's params."""
        self.engine.reload_master_weights()

    def memory_report(self):
        """Bytes this rank holds, by kind (docs/usage.md explains each)."""
        return self.engine.memory_report()


def zero_optimizer_in(optimizer):
    """The zerokern optimizer (FusedZeroAdam, ZeroOptimizer: any EngineOptimizer) that `optimizer`
    is, or that it wraps (Accelerate's AcceleratedOptimizer keeps it as .optimizer); else None.
    How every integration recognises one (zerokern/integrations/)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, EngineOptimizer) else None
