"""Marks that tell torch.distributed.checkpoint which piece of a larger tensor a local tensor
holds (its CheckpointableTensor protocol: global_shape, global_offsets, local_offsets,
local_sizes). Both the optimizer's sharded state (optim/state_dict.py) and a stage-3 model's
state dict (params/model_state.py) are saved as such pieces."""

import importlib.util

import torch

# torch.distributed.checkpoint reads the marks below from torch 2.14 on; before that it would
# take each rank's slice for a whole tensor and keep one rank's.
HAS_PROTOCOL = importlib.util.find_spec("torch.distributed.checkpoint.protocol") is not None


class _NeedsProtocol:
    """What an older DCP calls to plan the save of a marked slice: a clear error instead of
    keeping one rank's slice of every param."""

    def __call__(self, fqn, obj):
        raise RuntimeError(
            f"zerokern: '{fqn}' is one rank's slice of sharded FusedZeroAdam state, and this torch "
            f"({torch.__version__}) has no torch.distributed.checkpoint.protocol to save it as one (torch 2.14 "
            "has); DCP would keep one rank's slices. Save opt.full_state_dict() (a collective; the whole state "
            "on rank 0, loadable at any world size), or torch.save(opt.state_dict()) on every rank")


# a marked slice saved with torch.save still loads with weights_only=True
torch.serialization.add_safe_globals([_NeedsProtocol])


def mark_boxes(t, shape, boxes, origin) -> None:
    """Mark `t` as holding the boxes [(offsets, sizes)] of a tensor of `shape`, each at its
    offsets minus `origin` in `t` (DCP's CheckpointableTensor attributes)."""
    t.global_shape = tuple(shape)
    t.global_offsets = tuple(tuple(o) for o, _ in boxes)
    t.local_sizes = tuple(tuple(z) for _, z in boxes)
    t.local_offsets = tuple(tuple(a - b for a, b in zip(o, origin)) for o, _ in boxes)
    if not HAS_PROTOCOL:
        t.__create_write_items__ = _NeedsProtocol()


def mark_slice(t, start, n, numel):
    """Mark `t` (n elements) as the slice [start, start + n) of a flattened tensor of `numel`."""
    mark_boxes(t, (numel,), [((start,), (n,))] if n else [], (start,))


