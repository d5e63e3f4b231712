"""zerokern.GradScaler: torch.amp.GradScaler whose inf check agrees across ranks.

A plain torch.amp.GradScaler works with FusedZeroAdam when the backward before
each scaler.step() is synced: the optimizer shares an overflow across ranks at
the end of that backward ([Note: overflow on any rank]). When every backward of
a step ran under no_sync(), the reduction happens inside step(), after each
scaler has looked at its own rank's local grads only; this subclass then makes
the found_inf every scaler records (and backs off by) the same on every rank,
as torch's ShardedGradScaler does for FSDP.
"""

import torch


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler (same arguments) for FusedZeroAdam on several ranks."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        share = getattr(optimizer, "share_found_inf", None)  # FusedZeroAdam; other optimizers: as torch
        if share is not None:
            share(per_device)
        return per_device
