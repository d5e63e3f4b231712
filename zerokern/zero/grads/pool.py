"""GradBufferPool: the full gradient buffers of stage-2 buckets, reused.

A stage-2 bucket holds a full buffer only while its gradients are being
accumulated or reduced ([Note: stage-2 memory] in grads/released.py). The
buffers come from here and go back here, so a backward reuses a few buffers
instead of allocating one per bucket, and the pool counts what is held (in
use or kept free) and its peak: bench/train_step.py reports that peak next to
the planner's figure.

[Note: what the pool keeps] Every bucket up to the largest bucket of several
params (`unit`, about bucket_cap_mb) gets a buffer of that one size, a larger
bucket (a param over the cap) one of its own size; a request takes the
smallest free buffer that fits (its own size when one is free), else a new
one. Up to `keep` free buffers stay in the pool between backwards (the
planner's allowance: IN_FLIGHT_BUCKETS + 2 buckets and the tied embedding's),
the least recently released dropped first. So a training loop allocates no
gradient buffer after its first backward, and after a no_sync accumulation
(every bucket's buffer in use at once) the pool shrinks back to `keep`.
Dropping more cost more than it saved on CPUs: a freed buffer over the
allocator's mmap threshold is unmapped, and the next backward page-faults its
way through a new one (the tied embedding's 12 MiB bucket did so every step
when the pool kept 3 and dropped the largest). With buffers of one size, a
small bucket never takes the large buffer the tied embedding needs next.

[Note: pool and streams] A buffer is released only after its collective was
waited for (Work.wait(): on GPUs the current stream waits for NCCL's), and it
is next written on the current stream, so the reuse is ordered after the
collective without record_stream.
"""

import torch

IN_FLIGHT_BUCKETS = 2  # reductions in flight at once in a stage-2 backward (each holds a full buffer)


class GradBufferPool:
    def __init__(self, keep: int, unit=None):
        self.keep = keep  # free buffers kept, all sizes together
        self.unit = dict(unit or {})  # dtype -> the size of every bucket up to it, in elements
        self._free = []  # free buffers, the least recently released first
        self.held_bytes = 0  # in use plus kept free
        self.in_use_bytes = 0
        self.peak_bytes = 0  # of held_bytes, since reset_peak()
        self.allocations = 0  # buffers taken from the allocator (tests and benchmarks read it)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
        """A buffer of at least `numel` elements, its first `numel` zeroed unless `zero` is False
        (give the same tensor back to release()) ([Note: what the pool keeps])."""
        size, device = max(numel, self.unit.get(dtype, 0)), torch.device(device)
        best = None  # the smallest free buffer that fits, the least recently released of equals
        for k, b in enumerate(self._free):
            if b.dtype == dtype and b.device == device and b.numel() >= size and (
                    best is None or b.numel() < self._free[best].numel()):
                best = k
        if best is not None:
            buf = self._free.pop(best)
        else:
            buf = torch.empty(size, dtype=dtype, device=device)
            self.allocations += 1
            self.held_bytes += buf.numel() * buf.element_size()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.in_use_bytes += buf.numel() * buf.element_size()
        if zero:
            buf[:numel].zero_()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel() * buf.element_size()
        self._free.append(buf)
        while len(self._free) > self.keep:  # [Note: what the pool keeps]
            old = self._free.pop(0)
            self.held_bytes -= old.numel() * old.element_size()

    def free_bytes(self) -> int:
        return self.held_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drop the free buffers."""
        for buf in self._free:
            self.held_bytes -= buf.numel() * buf.element_size()
        self._free.clear()

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes
