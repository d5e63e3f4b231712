"""Flat storage built from a FlatLayout: one buffer per bucket, and the
parameters' data and gradients rebound as views into them.

    layout = plan_layout([p.numel() for p in params], world_size, bucket_cap)
    params_buf = FlatBuffers.from_tensors(params, layout)        # copies the values in
    params_buf.bind_params(params)                                 # param.data -> views
    grads_buf = FlatBuffers.zeros(layout, torch.bfloat16, device)
    grads_buf.bind_grads(params)                                   # param.grad -> views

[Note: gradients as bucket views] With param.grad pre-set to a view of the
bucket, autograd's AccumulateGrad adds each new gradient into it in place, so
the gradients land in the flat bucket with no flatten copy at reduce time
(DDP's gradient_as_bucket_view, Megatron's main-grad buffer). The views must
stay: zero the buffer (zero_()) instead of setting .grad to None, which would
let the next backward allocate a fresh, unbound gradient.
"""

from typing import List, Sequence

import torch

from ...kernels.flat_ops import flatten
from ..core.layout import FlatLayout


class FlatBuffers:
    def __init__(self, layout: FlatLayout, buffers: List[torch.Tensor]):
        if len(buffers) != len(layout.buckets):
            raise ValueError(f"{len(buffers)} buffers for {len(layout.buckets)} buckets")
        for b, buf in zip(layout.buckets, buffers):
            if buf.dim() != 1 or buf.numel() != b.padded_numel:
                raise ValueError(f"buffer {b.index} has shape {list(buf.shape)}, bucket {b.index} needs "
                                 f"[{b.padded_numel}]")
        self.layout = layout
        self.buffers = buffers

    @classmethod
    def zeros(cls, layout: FlatLayout, dtype: torch.dtype, device) -> "FlatBuffers":
        return cls(layout, [torch.zeros(b.padded_numel, dtype=dtype, device=device) for b in layout.buckets])

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], layout: FlatLayout, dtype=None) -> "FlatBuffers":
        """Buffers holding the tensors' values (cast to dtype), padding zeroed."""
        tensors = list(tensors)
        _check_count(tensors, layout)
        bufs = []
        for b in layout.buckets:
            members = [tensors[i].detach() for i in b.tensors]
            bufs.append(flatten(members, dtype or members[0].dtype, offsets=layout.offsets(b.index),
                                numel=b.padded_numel))
        return cls(layout, bufs)

    def view(self, index: int, shape) -> torch.Tensor:
        """Tensor `index` as a view into its bucket's buffer."""
        s = self.layout.slots[index]
        return self.buffers[s.bucket][s.offset:s.offset + s.numel].view(shape)

    def shard(self, rank: int, bucket: int) -> torch.Tensor:
        """`rank`'s shard of `bucket`: a contiguous view."""
        start, end = self.layout.rank_range(rank, bucket)
        return self.buffers[bucket][start:end]

    def bind_params(self, params: Sequence[torch.Tensor]) -> None:
        """param.data becomes a view into the buffers (dtypes must match)."""
        _check_count(params, self.layout)
        with torch.no_grad():
            for i, p in enumerate(params):
                view = self.view(i, p.shape)
                if view.dtype != p.dtype:
                    raise TypeError(f"params[{i}] is {p.dtype}, the buffer is {view.dtype}")
                p.data = view

    def bind_grads(self, params: Sequence[torch.Tensor]) -> None:
        """param.grad becomes a view into the buffers; see [Note: gradients as bucket views]."""
        _check_count(params, self.layout)
        for i, p in enumerate(params):
            p.grad = self.view(i, p.shape)

    def zero_(self) -> None:
        for buf in self.buffers:
            buf.zero_()


def _check_count(tensors, layout):
    if len(tensors) != len(layout.slots):
        raise ValueError(f"{len(tensors)} tensors for a layout of {len(layout.slots)}")
