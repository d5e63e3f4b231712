"""Stages 1/2: small param buckets gathered as one collective after the update.

[Note: coalesced param gathers] After each update every rank holds new values of its own slice
of every param bucket, and the other ranks' slices are brought by one all-gather per bucket. A
collective costs a fixed latency whatever its size, and on gloo a gather of N ranks is N
broadcasts ([Note: gather as broadcasts] in comm/gloo.py): 6 buckets of 0.5 MB on 4 ranks are 24
broadcasts a step, where DDP's step has no gather at all. So where step() waits for the gathers
at once (no overlap_param_gather, which waits unit by unit in the next forward), buckets that
follow one another in the gather order, hold one dtype on one device and travel as they are (no
int8 wire: its codes are per bucket) are gathered together, as DeepSpeed's stage 1/2 gathers its
partitions in allgather_bucket_size groups:
- each rank copies its slice of each bucket of the group, back to back, into its slice of one
  staging buffer of world x (the group's shard elements), all-gathers that (in place, so gloo
  still gathers as broadcasts), and copies every rank's part into every bucket's buffer.
- the bytes on the wire are the buckets' own (the same slices, no padding added); what is added
  is one copy of the group's params in and out, and the staging buffer while the gather runs:
  groups stop at LIMIT_BYTES, and at most two groups are in flight (the next one's gather is
  launched before the last one is waited for), so the staging buffers never hold more than
  twice that (a bucket that alone reaches the limit gathers as before, without a copy).
- the result is the per-bucket gathers' bit for bit: a gather copies bytes.
plan_groups is the pure plan; CoalescedGather runs one group, Alone a bucket on its own.
"""

from typing import Hashable, List, Sequence

import torch

LIMIT_BYTES = 16 << 20  # a group's gathered bytes at most: its staging buffer's size (two in flight)


def plan_groups(nbytes: Sequence[int], keys: Sequence[Hashable], limit: int = LIMIT_BYTES) -> List[List[int]]:
    """Buckets (indices in gather order) in groups gathered as one collective: consecutive
    buckets with equal keys (dtype, device; None: never coalesced), whose gathered bytes
    `nbytes` add up to at most `limit`. A bucket that cannot join its neighbours is a group of
    its own (gathered alone, as without coalescing)."""
    if len(nbytes) != len(keys):
        raise ValueError(f"zerokern internal error: {len(nbytes)} bucket sizes for {len(keys)} keys")
    groups: List[List[int]] = []
    total = 0
    for b, (n, key) in enumerate(zip(nbytes, keys)):
        last = groups[-1] if groups else None
        if last is not None and key is not None and keys[last[0]] == key and total + n <= limit:
            last.append(b)
            total += n
        else:
            groups.append([b])
            total = n
    return groups


class CoalescedGather:
    """One group of stage-1/2 param buckets (BucketParams, params/gather.py) gathered as one
    all-gather ([Note: coalesced param gathers])."""

    def __init__(self, buckets, comm, rank: int, world: int):
        """buckets: BucketParams of one dtype and device, each with equal shards of `world`
        ranks, `rank` this rank's place in them (the layout's)."""
        self.buckets, self.comm, self.rank, self.world = buckets, comm, rank, world
        self.sizes = [bp.flat.layout.buckets[bp.b].shard_numel for bp in buckets]
        self.total = sum(self.sizes)
        first = buckets[0]
        names = [bp.flat.buckets[bp.b].name for bp in buckets]
        self.name = f"all_gather[{names[0]}..{names[-1].rsplit(':', 1)[-1]}]"  # e.g. params:float32:0..5
        self.dtype, self.device = first.buffer.dtype, first.buffer.device

    def launch(self) -> None:
        """The group's one all-gather, of the slices the update wrote (the caller released the buckets)."""
        staging = torch.empty(self.world * self.total, dtype=self.dtype, device=self.device)
        self._rows = staging.view(self.world, self.total)
        with torch.no_grad():
            torch.cat([bp.own_slice() for bp in self.buckets], out=self._rows[self.rank])
        self._work = self.comm.all_gather(staging, self._rows[self.rank], name=self.name)

    def wait(self) -> None:
        """Every bucket of the group -> GATHERED; the staging buffer goes."""
        self.comm.wait(self._work)
        rows, at = self._rows, 0
        with torch.no_grad():
            for bp, n in zip(self.buckets, self.sizes):
                bp.buffer.view(self.world, n).copy_(rows[:, at:at + n])
                at += n
                bp.filled()
        self._rows = self._work = None


class Alone:
    """A bucket that coalesces with no neighbour, in a list of groups: gathered as it is."""

    def __init__(self, bp):
        self.bp = bp

    def launch(self) -> None:
        self.bp.launch()

    def wait(self) -> None:
        self.bp.wait()
