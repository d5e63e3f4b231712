"""The runtime for the parameters of one dtype: flat buckets, gradient hooks,
reductions launched as buckets complete, the fused update of this rank's shard
and the all-gather of the updated parameters.

[Note: bucket lifecycle]
- Construction: params (in backward order) get a FlatLayout; their .data
  becomes views into one param buffer per bucket (so an all-gather into that
  buffer updates the model in place, and fp32 params need no private copy).
- Backward: each param's post-accumulate-grad hook makes sure its .grad is a
  view into the bucket's grad buffer (copying a freshly allocated grad in
  once), marks it ready, and launches the reduce-scatter of every bucket that
  is complete *in bucket order* (so every rank issues the same collectives in
  the same order, whatever its unused parameters). The first hook of a
  backward queues finalize() to run when backward ends: it launches the
  buckets still waiting (those holding params that got no grad here), waits
  for all of them and turns sums into averages.
- step(): the fused kernel updates this rank's shard (fp32 master, Adam state;
  fp16/bf16 params written in the same pass), then the param buckets are
  all-gathered and waited for before step() returns. [Note: streams] in
  comm.py says what waiting means on GPUs.
- Between steps, stage 1 keeps the full grad buffers (grads stay views);
  stage 2 frees them and keeps the reduced shards only, and the next backward
  allocates them again.
The grad buffer of a bucket is never written while its reduce-scatter is in
flight: finalize() waits for it before backward returns, and zero_grad()/step()
call finalize() first.
"""

from typing import List, Optional

import torch

from ..flat_storage import FlatBuffers
from ..layout import plan_layout


class FlatGroup:
    def __init__(self, params: List[torch.Tensor], indices: List[int], comm, zero_stage: int, bucket_cap_bytes: float,
                 on_backward, align: int = 16):
        # Backward produces grads roughly in reverse registration order.
        self.params = params[::-1]
        self.indices = indices[::-1]  # global param index of each local param
        self.comm = comm
        self.stage = zero_stage
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        shard_world = comm.world_size if zero_stage >= 1 else 1
        cap = max(1, int(bucket_cap_bytes // self.params[0].element_size()))
        self.layout = plan_layout([p.numel() for p in self.params], shard_world, cap, align)
        self.rank = comm.rank if zero_stage >= 1 else 0
        nb = len(self.layout.buckets)

        self.param_bufs = FlatBuffers.from_tensors(self.params, self.layout)
        self.param_bufs.bind_params(self.params)
        self.low_precision = self.dtype != torch.float32
        # fp32 master weights of this rank's shard (low-precision params only),
        # made at the first step from the params as they are then (see FusedZeroAdam's docstring).
        self.master: List[Optional[torch.Tensor]] = [None] * nb
        self.exp_avg = [torch.zeros(b.shard_numel, device=self.device) for b in self.layout.buckets]
        self.exp_avg_sq = [torch.zeros(b.shard_numel, device=self.device) for b in self.layout.buckets]
        self.grad_full: List[Optional[torch.Tensor]] = [None] * nb
        sharded = self.comm.distributed and zero_stage >= 1
        self.grad_shard = [torch.zeros(b.shard_numel, dtype=self.dtype, device=self.device) if sharded else None
                           for b in self.layout.buckets]
        self.work = [None] * nb
        self.ready = [set() for _ in range(nb)]  # params whose hook ran in the current synced backward
        self.got = [False] * len(self.params)  # a grad is in the bucket since the last step / zero_grad
        self.next_bucket = 0  # buckets launch in this order, so ranks agree on collective order
        self.on_backward = on_backward  # called by the first hook of a synced backward
        self.reduced = False  # a reduction round has run since the last step
        self.sync = True  # False inside no_sync()
        self.overlap = True
        self._bound = [None] * len(self.params)  # the bucket view each param's .grad was last set to
        self._bind_grads_all()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    # --- gradients ---------------------------------------------------------

    def _full(self, b):
        if self.grad_full[b] is None:
            self.grad_full[b] = torch.zeros(self.layout.buckets[b].padded_numel, dtype=self.dtype, device=self.device)
        return self.grad_full[b]

    def _view(self, i):
        s = self.layout.slots[i]
        return self._full(s.bucket)[s.offset:s.offset + s.numel].view(self.params[i].shape)

    def _bind_grads_all(self):
        for i, p in enumerate(self.params):
            p.grad = self._bound[i] = self._view(i)

    def _is_view(self, i):
        g = self.params[i].grad
        s = self.layout.slots[i]
        full = self.grad_full[s.bucket]
        return (g is not None and full is not None and g.data_ptr() == full.data_ptr() + s.offset * full.element_size()
                and g.shape == self.params[i].shape)

    def _adopt(self, i):
        """Make params[i].grad the bucket view, holding the grad it has now."""
        p = self.params[i]
        if not self._is_view(i):
            view = self._view(i)
            view.copy_(p.grad)  # a fresh grad replaces (the old .grad was reset to None)
            p.grad = self._bound[i] = view

    def _hook(self, i):
        def hook(p):
            self._adopt(i)
            self.got[i] = True
            if self.sync:  # under no_sync() grads just accumulate in the buckets
                self.ready[self.layout.slots[i].bucket].add(i)
                self.on_backward()
                if self.overlap:
                    self._launch_complete()
        return hook

    def adopt_manual_grads(self):
        """Grads assigned by hand (no backward, so no hook): bring them into the buckets.
        Runs every step: a .grad that is still the view we bound is skipped on identity alone."""
        for i, (p, bound) in enumerate(zip(self.params, self._bound)):
            g = p.grad
            if g is not None and g is not bound and not self._is_view(i):
                self._adopt(i)
                self.got[i] = True
                self.ready[self.layout.slots[i].bucket].add(i)

    # --- reductions --------------------------------------------------------

    def _launch(self, b):
        bucket = self.layout.buckets[b]
        full = self._full(b)
        for i in bucket.tensors:
            if not self.got[i]:
                # No grad since the last step: contribute zeros, not a stale value.
                s = self.layout.slots[i]
                full[s.offset:s.offset + s.numel].zero_()
        self.ready[b].clear()
        if not self.comm.distributed:
            return
        if self.stage >= 1:
            self.work[b] = self.comm.reduce_scatter(self.grad_shard[b], full, name=f"reduce_scatter[{b}]")
        else:
            self.work[b] = self.comm.all_reduce(full, name=f"all_reduce[{b}]")

    def _launch_complete(self):
        buckets = self.layout.buckets
        while self.next_bucket < len(buckets) and len(self.ready[self.next_bucket]) == len(
                buckets[self.next_bucket].tensors):
            self._launch(self.next_bucket)
            self.next_bucket += 1

    def finalize(self):
        """Launch what is left, in order; wait for all; sums -> averages.
        Every rank runs this once per synced backward (or in step()), so all
        ranks issue the same collectives in the same order."""
        self.reduced = True
        for b in range(self.next_bucket, len(self.layout.buckets)):
            self._launch(b)
        self.next_bucket = 0
        for b, w in enumerate(self.work):
            if w is not None:
                self.comm.wait(w)
                self.work[b] = None
                (self.grad_shard[b] if self.stage >= 1 else self.grad_full[b]).div_(self.comm.world_size)

    def shard_grad(self, b):
        """This rank's reduced grad for bucket b."""
        if self.grad_shard[b] is not None:
            return self.grad_shard[b]
        start, end = self.layout.rank_range(self.rank, b)
        return self._full(b)[start:end]

    def zero_grads(self):
        for b, full in enumerate(self.grad_full):
            if full is not None:
                full.zero_()
        self.got = [False] * len(self.params)
        for r in self.ready:
            r.clear()

    def release_grads(self):
        """Stage 2 between steps: drop the full grad buffers (the .grad views go with them)."""
        for p in self.params:
            p.grad = None
        self._bound = [None] * len(self.params)
        self.grad_full = [None] * len(self.grad_full)
        self.got = [False] * len(self.params)

    # --- parameters --------------------------------------------------------

    def param_shard(self, b):
        return self.param_bufs.shard(self.rank, b)

    def ensure_master(self):
        if self.low_precision:
            for b in range(len(self.master)):
                if self.master[b] is None:
                    self.master[b] = self.param_shard(b).float()

    def master_shard(self, b):
        """The fp32 weights the kernel updates: the param shard itself for fp32 params."""
        return self.master[b] if self.low_precision else self.param_shard(b)

    def all_gather_params(self):
        if not (self.comm.distributed and self.stage >= 1):
            return
        works = [self.comm.all_gather(buf, self.param_shard(b), name=f"all_gather[{b}]")
                 for b, buf in enumerate(self.param_bufs.buffers)]
        for w in works:
            self.comm.wait(w)

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
