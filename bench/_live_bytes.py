"""Activation memory of one forward + backward on CPU, measured three ways (shared by
bench/activation_memory.py and tests/plan/test_plan_activations.py, so the test checks what the bench reports).

[Note: measuring activations on CPU] The CPU allocator keeps no statistics (no
torch.cuda.max_memory_allocated); tracemalloc sees none of torch's allocations, and the resident
size keeps what glibc caches after a free unless told otherwise (rss, below). So two measures
count tensor storages themselves, and a third checks them from below torch:

  saved  torch.autograd.graph.saved_tensors_hooks sees every tensor autograd keeps for
         backward. Summing unique storages (by data pointer, the whole storage's bytes, so a view
         counts its base once) that are not parameters gives the bytes forward leaves alive for
         backward: Korthikanti et al.'s "activation memory".
  peak   A TorchDispatchMode sees every op's outputs, in forward and in backward (the autograd
         engine runs backward's ops through the same dispatcher). Each new storage is added to a
         running count when it appears (an output whose storage is an input's, a view or an
         in-place result, is not new memory) and taken off when its last reference dies (a weakref
         finalizer on the storage's Python object, which torch keeps for the storage's life). A
         parameter's gradient leaves the count once accumulated (a post-accumulate-grad hook):
         it is a model state, which the planner counts as grads. The count's maximum is the peak
         of activation bytes (kept ones and backward's temporaries: the gradients flowing
         back, the loss's fp32 copies) on top of the model states, what a GPU needs beyond them.

saved and peak count bytes of live tensors, as torch.cuda.memory_allocated does, not the
allocator's rounding or cache. Parameters, created before either starts, are never counted.

  rss    A check from below torch: with glibc's mmap threshold lowered (MALLOC_MMAP_THRESHOLD_,
         set before the process starts) every large tensor is its own mapping, mapped when
         allocated and unmapped when freed, so the kernel's resident high-water mark (VmHWM,
         reset through /proc/self/clear_refs) less the resident size before the step is the
         step's peak as the OS saw it. It agreed with `peak` within 0.3% on six of the bench's
         seven shapes and within 3% on the seventh (bench/results/activation_memory_cpu_*.log).
"""

import gc
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of the storages created while active, less params' gradients."""

    def __init__(self, params=()):
        super().__init__()
        self.live = {}  # data_ptr -> bytes, for storages counted now
        self.now = self.peak = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._to_grads) for p in params if p.requires_grad]

    def _free(self, key):
        self.now -= self.live.pop(key, 0)

    def _add(self, storage):
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self.live:
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _to_grads(self, p):
        self._free(p.grad.untyped_storage().data_ptr())  # a model state from here on

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place op returns an input's storage: not new memory (and a view of a
        # parameter must not be counted as if it were one)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs:
                self._add(t.untyped_storage())
        return out

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)


def measure(model, batch, loss_fn):
    """{'saved': bytes kept for backward at the end of forward, 'peak': the peak of activation
    bytes through forward and backward} for loss_fn(model, batch), one step on CPU."""
    params = list(model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            saved[st.data_ptr()] = st.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with LiveBytes(params) as live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model, batch)
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return {"saved": sum(saved.values()), "peak": live.peak}


def _status_bytes(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def rss_peak(model, batch, loss_fn):
    """The resident high-water mark of one step over the resident size before it ([Note: measuring
    activations on CPU]); None where it cannot mean that (no MALLOC_MMAP_THRESHOLD_, not Linux)."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ or not os.access("/proc/self/clear_refs", os.W_OK):
        return None
    model.zero_grad(set_to_none=True)
    gc.collect()
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the present VmRSS
    loss_fn(model, batch).backward()
    peak = _status_bytes("VmHWM") - before
    model.zero_grad(set_to_none=True)
    return peak
