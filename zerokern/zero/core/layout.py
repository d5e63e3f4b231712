"""FlatLayout: where every parameter lives in flat, sharded buckets. Pure
bookkeeping (numbers in, numbers out, no tensors), so it is tested on its own.

Given the parameters' element counts in the order their gradients are expected
(about reverse registration order, the order backward produces them), a world
size, a bucket cap and an alignment, the layout says:
- which bucket holds each tensor and at which element offset;
- each bucket's padded size, divisible by world_size * align, so that it splits
  into world_size equal shards;
- for each rank, the range of each bucket it owns (rank r owns
  [r * shard, (r + 1) * shard)) and which (tensor, slice) pairs fall inside.

[Note: alignment rule] Every tensor starts at a multiple of `align` elements
in its bucket, and every rank's shard does too (shard = padded / world_size is
a multiple of align). With the default align = 16 elements that is 64 bytes in
an fp32 buffer and 32 bytes in a 16-bit one, so with the allocators' base
alignment (64 B on CPU, 512 B on CUDA) every tensor view and every shard
starts 16-byte aligned in both the fp32 master buffer and the fp16/bf16
param/grad buffers that share this layout: the vectorised kernels' fast path
(16-byte loads) applies everywhere, a shard boundary never splits a vector,
and reduce-scatter hands each rank an aligned chunk. The cost is at most
align - 1 elements per tensor and world_size * align - 1 per bucket.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Slot:
    """Tensor `index` lives at elements [offset, offset + numel) of bucket `bucket`."""

    index: int
    bucket: int
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """Elements [tensor_start, tensor_start + numel) of tensor `index` (flattened)
    sit at [shard_offset, shard_offset + numel) of a rank's shard of `bucket`."""

    index: int
    bucket: int
    tensor_start: int
    shard_offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    tensors: Tuple[int, ...]  # tensor indices, in bucket order
    numel: int  # end of the last tensor
    padded_numel: int  # a multiple of world_size * align
    shard_numel: int  # padded_numel // world_size


@dataclass(frozen=True)
class FlatLayout:
    world_size: int
    align: int
    slots: Tuple[Slot, ...]  # by tensor index
    buckets: Tuple[Bucket, ...]

    def rank_range(self, rank: int, bucket: int) -> Tuple[int, int]:
        """The elements [start, end) of `bucket` that `rank` owns."""
        self._check_rank(rank)
        shard = self.buckets[bucket].shard_numel
        return rank * shard, (rank + 1) * shard

    def gaps(self, bucket: int) -> Tuple[Tuple[int, int], ...]:
        """The elements [start, end) of `bucket` no tensor holds (alignment and padding), in order."""
        out, at = [], 0
        for s in sorted((self.slots[i] for i in self.buckets[bucket].tensors), key=lambda s: s.offset):
            if s.offset > at:
                out.append((at, s.offset))
            at = max(at, s.offset + s.numel)
        if self.buckets[bucket].padded_numel > at:
            out.append((at, self.buckets[bucket].padded_numel))
        return tuple(out)

    def rank_pieces(self, rank: int, bucket: int) -> Tuple[Piece, ...]:
        """The (tensor, slice) pairs inside `rank`'s shard of `bucket`, in order."""
        pieces = (self.rank_piece(rank, i) for i in self.buckets[bucket].tensors)
        return tuple(pc for pc in pieces if pc is not None)

    def rank_piece(self, rank: int, index: int) -> Optional[Piece]:
        """The part of tensor `index` inside `rank`'s shard of its bucket, or None."""
        s = self.slots[index]
        start, end = self.rank_range(rank, s.bucket)
        lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
        return Piece(index, s.bucket, lo - s.offset, lo - start, hi - lo) if lo < hi else None

    def offsets(self, bucket: int) -> List[int]:
        """Offsets of the bucket's tensors, in bucket order (for flatten/unflatten)."""
        return [self.slots[i].offset for i in self.buckets[bucket].tensors]

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)

    def _check_rank(self, rank):
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def plan_layout(numels: Sequence[int], world_size: int, bucket_cap: int, align: int = 16,
                breaks: Sequence[int] = ()) -> FlatLayout:
    """Buckets for tensors of `numels` elements, taken in the order given.

    A bucket is closed when the next tensor would take it past bucket_cap
    elements; a tensor larger than the cap gets a bucket of its own. Empty
    tensors take no space but still get a slot. `breaks`: tensor indices that
    must start a new bucket (where the run of tensors is interrupted by
    another unit's, so one bucket never waits on a gradient that backward
    produces much later; see zerokern.zero.unit).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_cap < 1:
        raise ValueError(f"bucket_cap must be >= 1 element, got {bucket_cap}")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    for i, n in enumerate(numels):
        if n < 0:
            raise ValueError(f"numels[{i}] is negative ({n})")

    slots: List[Slot] = []
    buckets: List[Bucket] = []
    members: List[int] = []
    end = 0

    def close():
        nonlocal members, end
        if members:
            padded = max(_round_up(end, world_size * align), world_size * align)
            buckets.append(Bucket(len(buckets), tuple(members), end, padded, padded // world_size))
        members, end = [], 0

    breaks = set(breaks)
    for i, n in enumerate(numels):
        offset = _round_up(end, align)
        if members and (offset + n > bucket_cap or i in breaks):
            close()
            offset = 0
        slots.append(Slot(i, len(buckets), offset, n))
        members.append(i)
        end = offset + n
    close()
    return FlatLayout(world_size, align, tuple(slots), tuple(buckets))
