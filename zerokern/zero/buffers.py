"""zerokern.broadcast_buffers(model): DDP's broadcast_buffers=True for a model zerokern trains.

[Note: buffers across ranks] A model's buffers (BatchNorm's running_mean, running_var,
num_batches_tracked) are not trained: each rank's forward updates its own from its own batch.
zerokern broadcasts rank 0's once, at set-up (stage-3 shard(), Accelerate's attach, ZeroTrainer),
and then leaves them, so they drift apart between ranks (eval then differs by rank). DDP, by
default (broadcast_buffers=True), broadcasts rank 0's buffers before the first forward and
before every forward that follows one run with grad enabled (and not under its no_sync()): each
rank's training forward starts from rank 0's statistics and adds its own batch, and the first
eval forward after training (under no_grad()) uses rank 0's, so every rank evaluates alike. broadcast_buffers() installs that same rule as a
forward pre-hook on the module: one broadcast per dtype and device of its buffers (coalesced, as
DDP's), on the process group given (default: the default group, all ranks, as DDP's). It is a
collective of the user's kind, on the user's group, never between two of zerokern's own
(zero/comm runs those on a group of its own), so every rank must run the same forwards, as
with DDP. Unlike DDP it does not know about opt.no_sync(): the broadcast also runs in the
accumulation forwards (the statistics are then rank 0's before each micro-batch, not only before
the synced one).
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def broadcast_buffers(module: torch.nn.Module, process_group: Optional["dist.ProcessGroup"] = None):
    """Rank 0's buffers overwrite every rank's before the first forward of `module` and before
    every forward that follows one run with grad enabled, as DDP(broadcast_buffers=True) does
    ([Note: buffers across ranks]). Returns a handle: handle.remove() stops it. With no process
    group, or one of size 1, it does nothing."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"zerokern.broadcast_buffers: expected a torch.nn.Module, got {type(module).__name__}")
    return _BufferSync(module, process_group)


class _BufferSync:
    """DDP's rule, kept as DDP keeps it: a flag set after each forward (grad enabled: sync before
    the next one) and read before the next, so the first eval forward after training still gets
    rank 0's statistics, and the eval forwards after it do not broadcast."""

    def __init__(self, module, group):
        self.group, self.sync_next = group, True  # DDP syncs before the first forward
        self._handles = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, module, args):
        if self.sync_next:
            _broadcast(module, self.group)

    def _after(self, module, args, output):
        self.sync_next = torch.is_grad_enabled()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def _broadcast(module, group) -> None:
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_kind = {}
    for b in module.buffers():
        by_kind.setdefault((b.dtype, b.device), []).append(b)
    for bufs in by_kind.values():
        flat = _flatten_dense_tensors(bufs)
        dist.broadcast(flat, src, group=group)
        for b, v in zip(bufs, _unflatten_dense_tensors(flat, bufs)):
            b.copy_(v)
