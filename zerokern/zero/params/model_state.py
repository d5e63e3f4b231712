"""The state dicts of a stage-3 model: model.state_dict(), model.load_state_dict() and
zerokern.full_state_dict(model).

[Note: stage-3 model state dicts] At stage 3 each rank holds a flat slice [s, e) of every
param's flattened values (its piece of the param's bucket), which may begin and end mid-row.
model.state_dict() gives each such param as one tensor marked with torch.distributed.checkpoint's
CheckpointableTensor attributes: its global shape is the param's own, and this rank's slice is
described as the few boxes (N-d chunks) that tile [s, e) in that shape (flat_boxes). So dcp.save
writes a checkpoint whose tensors have the model's own shapes, which dcp.load reads into a model
sharded any other way, at another world size, or not sharded at all.

The marked tensor is a copy (boxes of a flat slice are not one strided view of it): after
dcp.load fills it, model.load_state_dict(sd) (or torch's set_model_state_dict) moves the values
into the shards, as FSDP's docs load. A state dict that was written into but never loaded would
be a silent no-op, so UnitParams remembers the marked tensors it handed out and their version
counters, and the unit's next gather raises if one changed without being loaded.

The marked tensor is the boxes' bounding box (about the size of the slice), and its shape is
never the param's: its last dimension has a padding element (two where one would make it the
param's shape). A tool that ignores the marks and takes each rank's tensor for the whole one
(torch's get_model_state_dict(full_state_dict=True), which gathers only DTensors; v.clone(),
which drops the marks) gets tensors that no model loads: a size mismatch, not weights with holes
in them. zerokern.full_state_dict(model) is the consolidated dict.

model.load_state_dict takes, per param, a marked tensor holding exactly this rank's slice, or a
whole tensor of the param's shape (a consolidated dict, torch.load(..., mmap=True) of one: each
rank copies only its slice). Frozen params and buffers are whole on every rank and load as usual.
"""

import contextlib
import math
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from ..core.dcp_marks import mark_boxes

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def flat_boxes(start: int, end: int, shape) -> List[Box]:
    """The boxes, in flat order, that tile the row-major elements [start, end) of `shape`."""
    shape = tuple(shape)
    if end <= start:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(end, inner)
    if r0 == r1:  # within one row: the boxes of the row, one deep
        return [((r0,) + o, (1,) + z) for o, z in flat_boxes(c0, c1, shape[1:])]
    out = []
    if c0:
        out += [((r0,) + o, (1,) + z) for o, z in flat_boxes(c0, inner, shape[1:])]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:]))
    if c1:
        out += [((r1,) + o, (1,) + z) for o, z in flat_boxes(0, c1, shape[1:])]
    return out


def to_boxes(values: torch.Tensor, start: int, shape) -> torch.Tensor:
    """A marked box tensor holding `values`, the flattened elements [start, start + n) of a
    tensor of `shape`: the boxes' bounding box (about the slice's size: at most a partial row
    more at each end), with padding on the last dimension (never the param's shape)."""
    shape, n = tuple(shape), values.numel()
    if not shape:  # a 0-d param: the rank that holds it gives it whole; the others a (1,) stand-in
        out = values.reshape(()).clone() if n else values.new_zeros(1)
        mark_boxes(out, shape, [((), ())] if n else [], ())
        return out
    boxes = flat_boxes(start, start + n, shape)
    lo = tuple(min(o[d] for o, _ in boxes) for d in range(len(shape))) if boxes else (0,) * len(shape)
    hi = tuple(max(o[d] + z[d] for o, z in boxes) for d in range(len(shape))) if boxes else lo
    local = [h - low for h, low in zip(hi, lo)]
    local[-1] += 1  # never the param's own shape ([Note: stage-3 model state dicts])
    if tuple(local) == shape:
        local[-1] += 1
    out = values.new_zeros(local)
    flat, pos = values.reshape(-1), 0
    for o, z in boxes:
        k = math.prod(z)
        out[tuple(slice(a - low, a - low + b) for a, low, b in zip(o, lo, z))] = flat[pos:pos + k].view(z)
        pos += k
    mark_boxes(out, shape, boxes, lo)
    return out


def is_marked(t) -> bool:
    return getattr(t, "global_offsets", None) is not None and getattr(t, "local_sizes", None) is not None


def from_boxes(t: torch.Tensor) -> torch.Tensor:
    """The flat elements a marked box tensor holds, in order."""
    parts = [t[tuple(slice(o, o + z) for o, z in zip(lo, size))].reshape(-1)
             for lo, size in zip(t.local_offsets, t.local_sizes)]
    return torch.cat(parts) if parts else t.new_zeros(0)


# id(marked tensor) -> the param it is a slice of, while zerokern.full_state_dict collects them
# (keys are no guide: a wrapper such as checkpoint_wrapper renames them after the hooks ran).
_SOURCES: Optional[Dict[int, torch.Tensor]] = None


@contextlib.contextmanager
def collecting_sources():
    """Within: each marked slice model.state_dict() hands out is recorded with its param."""
    global _SOURCES
    outer, _SOURCES = _SOURCES, {}
    try:
        yield _SOURCES
    finally:
        _SOURCES = outer


def note_source(t: torch.Tensor, param: torch.Tensor) -> None:
    if _SOURCES is not None:
        _SOURCES[id(t)] = param


class HandedOut:
    """The marked tensors model.state_dict() gave for one unit, with their versions, so that a
    dcp.load into them that model.load_state_dict() never took is an error, not a no-op."""

    def __init__(self):
        self._given: Dict[int, Tuple[weakref.ref, int, str]] = {}  # id(tensor) -> (ref, version, name)
        self._prune_at = 16  # dropped dicts' entries are pruned when the table doubles: O(1) per add

    def add(self, t: torch.Tensor, name: str) -> None:
        if len(self._given) >= self._prune_at:
            self._given = {k: g for k, g in self._given.items() if g[0]() is not None}
            self._prune_at = 2 * len(self._given) + 16
        self._given[id(t)] = (weakref.ref(t), t._version, name)

    def taken(self, t: torch.Tensor) -> None:
        """load_state_dict read `t`: what it holds now is in the shards."""
        g = self._given.get(id(t))
        if g is not None and g[0]() is t:
            self._given[id(t)] = (g[0], t._version, g[2])

    def check(self, unit_name: str) -> None:
        for r, v, name in self._given.values():
            t = r()
            if t is not None and t._version != v:
                raise RuntimeError(
                    f"zerokern: the state_dict() entry '{name}' of a stage-3 model (unit '{unit_name}') was "
                    "written into but never loaded into the model (at stage 3 state_dict() gives copies of each "
                    "rank's slices). After dcp.load, call model.load_state_dict(sd); to change the dict itself "
                    "(an EMA, an export), change a copy ({k: v.clone() for k, v in sd.items()})")


def load_param(flat, i: int, value, name: str) -> Optional[str]:
    """Copy this rank's slice of `value` into params[i]'s shard. Returns an error text (naming
    the param and the fix) instead of raising, as torch's load_state_dict collects them."""
    shape = tuple(flat.members[i].shape)
    start, n, b, off = flat.my_slice(i)
    if not isinstance(value, torch.Tensor):
        return f"zerokern: '{name}' is a {type(value).__name__}, not a tensor"
    if is_marked(value):
        if tuple(value.global_shape) != shape:
            return (f"zerokern: '{name}' in the state dict is a slice of a tensor of shape "
                    f"{list(value.global_shape)}, but the param has shape {list(shape)}")
        want = flat_boxes(start, start + n, shape)
        have = list(zip(map(tuple, value.global_offsets), map(tuple, value.local_sizes)))
        if have != want:
            return (f"zerokern: '{name}' in the state dict holds another part of the param than this rank's "
                    f"(elements [{start}, {start + n}) of {math.prod(shape)}): a state_dict() from another "
                    "rank, world size or bucket layout. Re-shard with torch.distributed.checkpoint (dcp.save of "
                    "model.state_dict(), dcp.load into this model's), or load zerokern.full_state_dict(model)")
        part = from_boxes(value)
    elif tuple(value.shape) == shape:
        part = value.reshape(-1)[start:start + n]
    else:
        return (f"zerokern: size mismatch for '{name}': the state dict has shape {list(value.shape)}, the param "
                f"{list(shape)}. A stage-3 state_dict() entry is one rank's slice in a padded box; a copy that "
                "lost its DCP marks (v.clone(), torch's get_model_state_dict(full_state_dict=True)) cannot be "
                "placed. Load whole tensors (zerokern.full_state_dict(model)) or the entries themselves "
                "(copy.deepcopy keeps the marks)")
    if n:
        with torch.no_grad():
            dst = flat.param_shards[b][off:off + n]
            if not torch.equal(dst, part.to(dst.device, dst.dtype)):
                flat.changed.add(i)  # new values: a separate fp32 master re-reads them at the next step
            dst.copy_(part)
    return None
