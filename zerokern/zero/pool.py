"""GradBufferPool: the full gradient buffers of stage-2 buckets, reused.

A stage-2 bucket holds a full buffer only while its gradients are being
accumulated or reduced ([Note: stage-2 memory] in stage2_bucket.py). The
buffers come from here and go back here, so a backward reuses a few buffers
instead of allocating one per bucket, and the pool counts what is held (in
use or kept free) and its peak: bench/train_step.py reports that peak next to
the planner's figure. One buffer per key is sized for the largest bucket of
that dtype and device; a bucket uses a prefix of it. At most `keep` free
buffers are kept; more are dropped to the allocator.

[Note: pool and streams] A buffer is released only after its collective was
waited for (Work.wait(): on GPUs the current stream waits for NCCL's), and it
is next written on the current stream, so the reuse is ordered after the
collective without record_stream.
"""

from collections import defaultdict

import torch


class GradBufferPool:
    def __init__(self, keep: int):
        self.keep = keep
        self._numel = {}  # (dtype, device) -> size of a buffer
        self._free = defaultdict(list)
        self.held_bytes = 0  # in use plus kept free
        self.in_use_bytes = 0
        self.peak_bytes = 0  # of held_bytes, since reset_peak()

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """A bucket of `numel` elements will draw from this pool."""
        key = (dtype, torch.device(device))
        if numel > self._numel.get(key, 0):
            self._numel[key] = numel
            for buf in self._free[key]:  # too small for the new largest bucket
                self.held_bytes -= buf.numel() * buf.element_size()
            self._free[key] = []

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer of at least `numel` elements (give the same tensor back to release())."""
        key = (dtype, torch.device(device))
        size = max(self._numel.get(key, 0), numel)
        self._numel[key] = size
        free = self._free[key]
        buf = free.pop() if free else None
        if buf is None or buf.numel() < size:
            if buf is not None:
                self.held_bytes -= buf.numel() * buf.element_size()
            buf = torch.empty(size, dtype=dtype, device=device)
            self.held_bytes += buf.numel() * buf.element_size()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.in_use_bytes += buf.numel() * buf.element_size()
        buf[:numel].zero_()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        self.in_use_bytes -= nbytes
        free = self._free[(buf.dtype, buf.device)]
        if len(free) < self.keep:
            free.append(buf)
        else:
            self.held_bytes -= nbytes

    def free_bytes(self) -> int:
        return self.held_bytes - self.in_use_bytes

    def clear(self) -> None:
        """Drop the free buffers (opt.release_memory())."""
        for free in self._free.values():
            for buf in free:
                self.held_bytes -= buf.numel() * buf.element_size()
            free.clear()

    def reset_peak(self) -> None:
        self.peak_bytes = self.held_bytes
