"""GradBufferPool: the full gradient buffers of stage-2 buckets, reused.

A stage-2 bucket holds a full buffer only while its gradients are being
accumulated or reduced ([Note: stage-2 memory] in stage2_bucket.py). The
buffers come from here and go back here, so a backward reuses a few buffers
instead of allocating one per bucket, and the pool counts what is held (in
use or kept free) and its peak: bench/train_step.py reports that peak next to
the planner's figure. At most `keep` free buffers are kept per dtype and
device; more are dropped to the allocator.

[Note: pool and streams] A buffer is released only after its collective was
waited for (Work.wait(): on GPUs the current stream waits for NCCL's), and it
is next written on the current stream, so the reuse is ordered after the
collective without record_stream.
"""

from collections import defaultdict

import torch


class GradBufferPool:
    def __init__(self, keep: int):
        self.keep = keep  # free buffers kept per dtype and device
        self._free = defaultdict(list)
        self.held_bytes = 0  # in use plus kept free
        self.in_use_bytes = 0
        self.peak_bytes = 0  # of held_bytes, since reset_peak()

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, zero: bool = True) -> torch.Tensor:
        """A buffer of at least `numel` elements, its first `numel` zeroed unless `zero` is False
        (give the same tensor back to release()). Reuses the smallest free buffer that is large enough: buckets are
        mostly of one size (bucket_cap_mb); a larger one (a param over the cap) gets its own."""
        free = self._free[(dtype, torch.device(device))]
        fits = [b for b in free if b.numel() >= numel]
        if fits:
            buf = min(fits, key=lambda b: b.numel())
            _remove(free, buf)
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.held_bytes += buf.numel() * buf.element_size()
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.in_use_bytes += buf.numel() * buf.element_size()
        if zero:
            buf[:numel].zero_()
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.in_use_bytes -= buf.numel() * buf.element_size()
        free = self._free[(buf.dtype, buf.device)]
        free.append(buf)
        if len(free) > self.keep:  # give the largest back to the allocator
            big = max(free, key=lambda b: b.numel())
            _remove(free, big)
            self.held_bytes -= big.numel() * big.element_size()

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


def _remove(buffers, buf):
    """list.remove by identity (== on tensors compares values)."""
    del buffers[next(k for k, b in enumerate(buffers) if b is buf)]
