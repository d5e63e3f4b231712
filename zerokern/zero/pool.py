"""GradBufferPool: the full gradient buffers of stage-2 buckets, reused.

A stage-2 bucket holds a full buffer only while its gradients are being
accumulated or reduced ([Note: stage-2 memory] in stage2_bucket.py). The
buffers come from here and go back here, so a backward reuses a few buffers
instead of allocating one per bucket, and the pool counts what is held (in
use or kept free) and its peak: bench/train_step.py reports that peak next to
the planner's figure.

[Note: what the pool keeps] Buffers come in size classes: every bucket up to
the largest bucket of several params (`unit`, about bucket_cap_mb) gets a
buffer of that size, a larger bucket (a param over the cap) one of its own
size, and a request takes a free buffer of its class or a new one, never a
larger class's. Free buffers are all kept, so each class holds as many
buffers as a backward ever had in use at once, and after the first backward a
training loop allocates no gradient buffer again: the pool holds what the
backward held at its peak (bench/train_step.py's "buffers peak") between
steps, as DDP keeps its buckets and DeepSpeed its reduce buffers. Dropping
free buffers cost more than it saved on CPUs: a freed buffer over the
allocator's mmap threshold is unmapped, and the next backward page-faults its
way through a new one (the tied embedding's 12 MiB bucket did so every step).
Without classes, a small bucket taking a large free buffer left the large
bucket to allocate again.

[Note: pool and streams] A buffer is released only after its collective was
waited for (Work.wait(): on GPUs the current stream waits for NCCL's), and it
is next written on the current stream, so the reuse is ordered after the
collective without record_stream.
"""

from collections import Counter, defaultdict

import torch


class GradBufferPool:
    def __init__(self, unit=None):
        self.unit = dict(unit or {})  # dtype -> the class size of every bucket up to it, in elements
        self._free = defaultdict(list)  # (numel, dtype, device) -> free buffers of that class
        self._in_use = Counter()  # per class
        self.held_bytes = 0  # in use plus kept free
        self.in_use_bytes = 0
        self.peak_bytes = 0  # of held_bytes, since reset_peak()
        self.allocations = 0  # buffers taken from the allocator (tests and benchmarks read it)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
        """A buffer of at least `numel` elements, its first `numel` zeroed unless `zero` is False
        (give the same tensor back to release()), of its class ([Note: what the pool keeps])."""
        key = (max(numel, self.unit.get(dtype, 0)), dtype, torch.device(device))
        free = self._free[key]
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(key[0], dtype=dtype, device=device)
            self.allocations += 1
            self.held_bytes += buf.numel() * buf.element_size()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self._in_use[key] += 1
        self.in_use_bytes += buf.numel() * buf.element_size()
        if zero:
            buf[:numel].zero_()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        key = (buf.numel(), buf.dtype, buf.device)
        self._in_use[key] -= 1
        self.in_use_bytes -= buf.numel() * buf.element_size()
        self._free[key].append(buf)  # kept ([Note: what the pool keeps])

    def free_bytes(self) -> int:
        return self.held_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drop the free buffers."""
        for free in self._free.values():
            for buf in free:
                self.held_bytes -= buf.numel() * buf.element_size()
            free.clear()

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes
