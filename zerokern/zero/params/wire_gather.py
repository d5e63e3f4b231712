"""Param gathers in int8 (gather_precision="int8"): what one param bucket's gather puts on the
wire, and how every rank reads it back (ParamWire). BucketParams (params/gather.py) uses one in
place of its all-gather of the params' own dtype.

[Note: quantized param gathers] Each rank sends its slice of the bucket as blockwise int8 codes
with an fp32 scale per 64 elements ([Note: the wire format] in kernels/wire.py): one uint8
all-gather of one contiguous chunk per rank, nbytes(n) = n + 4 ceil(n / 64) bytes for a slice
of n elements (rounded up to a multiple of 4, so each chunk's scales can be read as fp32 in
place), against 4n for fp32 params (3.76x fewer) and 2n for bf16 (1.88x). Every rank, the owner
of a slice too, writes that slice from the decoded bytes alone, so every rank computes with
bit-identical params: the same bytes, decoded and added by the same ops.
- Stage 3 (gather_weights): what is sent is the owner's slice itself (ZeRO++'s qwZ). The slices
  (the fp32 masters, or the 16-bit params the update writes next to theirs) stay exact; only the
  gathered copy that forward and backward compute with is quantized, and it is freed after.
- Stages 1/2 (gather_delta): the model's full params are the gathered copy, kept between steps,
  so the owner sends the update: delta = master - held, the exact fp32 master minus the value
  every rank holds for the slice (the owner's own slice of the full buffer: held values, never
  the master), and every rank adds decode(delta) to its copy. What one gather's rounding lost is
  in the next delta, so the held params never drift from the master by more than one gather's
  rounding: |master - held| < scale + one rounding of the add, scale = (absmax of the delta's
  block) / 127, per element (tests/zero/params/test_wire_gather.py checks it over hundreds of steps). The
  stores keep the master apart from the params for this (ShardStore's `holds_gathered`).
The rounding is stochastic, as encode_ does it: unbiased (E[decode] = the value sent), so a
param that moves by less than a step between gathers still moves on average, where rounding to
nearest would pin it. It is keyed ([Note: reproducible rounding] in kernels/lowbit.py) by the
bucket's name, the slice's place in it and `updates`, the count of updates of the slices: at
stage 3 the gathers of one step (forward, backward, a checkpoint's recompute) give the same
bytes, so backward computes with the weights forward used, and a rerun gives the same bytes.
`updates` is not in checkpoints: a resumed run's gathers start from 0 again, so they round with
other bits than the run that never stopped (docs/usage.md says so; the masters load exactly).
A non-finite value in a block makes its scale NaN: every element of that block decodes to NaN on
every rank (a step with an inf/nan update shows on every rank's params, as an exact gather's
would; it is never clamped to a finite value). At stages 1/2 the block's held params then stay
NaN (each delta is NaN there) until new weights are loaded: a model.load_state_dict() writes the
params in place, and the master re-reads them ([Note: in-place weights] in unit.py; so does a
load of the model's own values, which loses the master's last sub-step rounding once).
With a mesh the param gathers stay inside a host and are never quantized ([Note: hybrid
sharding] in comm/hybrid.py: only the hop between hosts is, and param gathers never take it). A
(1, N) mesh is one flat group (comm/factory.py), quantized as without a mesh.
The bytes of a gather are made when it is launched and dropped once it is decoded (world x
nbytes(n)), so memory_report() has nothing to count for them between steps; the masters that
fp32 params now keep apart are counted as master_params.
"""

import zlib

import torch

from ...kernels import wire, wire_ops
from ..comm.works import Then

BITS = {"int8": 8}
_STREAM = 2  # the wire's streams: 0 and 1 are the grad reductions' (comm/wire.py)


def chunk_bytes(n: int, bits: int) -> int:
    """Bytes one rank sends for a slice of n elements: the wire format's, to a multiple of 4."""
    return wire.stride(n, bits)


def sent_bytes(n: int, element_size: int, precision) -> int:
    """What one rank puts on the wire for its slice of n elements in one gather (None: as they are)."""
    return n * element_size if precision is None else chunk_bytes(n, BITS[precision])


class ParamWire:
    """How one param bucket's gathers travel in int8 ([Note: quantized param gathers])."""

    def __init__(self, precision: str, name: str, shard_numel: int, rank: int, world: int):
        self.bits = BITS[precision]
        self.n, self.rank, self.world = shard_numel, rank, world
        self.chunk = chunk_bytes(shard_numel, self.bits)
        # the global index of the slice's first element, per bucket (blocks of other buckets get other streams)
        self.base = ((zlib.crc32(name.encode()) & 0xFFFF) << 32) + rank * shard_numel
        self.updates = 0  # the Philox counter's step word: updates of the slices so far

    def gather_weights(self, comm, buf: torch.Tensor, shard: torch.Tensor, name: str):
        """Stage 3: buf (the full buffer, world x n) := every rank's decoded slice."""
        return self._gather(comm, buf, shard.to(torch.float32), name, add=False)

    def gather_delta(self, comm, buf: torch.Tensor, master: torch.Tensor, name: str):
        """Stages 1/2: every rank's slice of buf += its owner's decoded delta (master - held)."""
        held = buf[self.rank * self.n:(self.rank + 1) * self.n]
        delta = master.to(device=buf.device, dtype=torch.float32) - held.to(torch.float32)
        return self._gather(comm, buf, delta, name, add=True)

    def _gather(self, comm, buf, x, name, add: bool):
        if buf.numel() != self.world * self.n:
            raise RuntimeError(f"zerokern internal error: {name}: a buffer of {buf.numel()} elements for "
                               f"{self.world} slices of {self.n}")
        data = torch.zeros(self.world * self.chunk, dtype=torch.uint8, device=buf.device)
        mine = data[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        wire_ops.encode_(x, mine[:wire.nbytes(self.n, self.bits)], self.bits, 0, self.updates, _STREAM, self.base)
        work = comm.all_gather(data, mine, name=name)
        return Then(work, lambda: self._decode(data, buf, add))

    def _decode(self, data, buf, add: bool) -> None:
        """Each rank's slice from its bytes, in rank order; the owner's too."""
        n, size = self.n, wire.nbytes(self.n, self.bits)
        with torch.no_grad():
            for r in range(self.world):
                out = buf[r * n:(r + 1) * n]
                chunk = data[r * self.chunk:r * self.chunk + size]
                if out.dtype == torch.float32:
                    if not add:
                        out.zero_()
                    wire_ops.decode_add_(chunk, n, self.bits, out)
                else:  # in fp32, then rounded to nearest into the 16-bit params (as the update writes them)
                    acc = out.to(torch.float32) if add else torch.zeros(n, dtype=torch.float32, device=buf.device)
                    wire_ops.decode_add_(chunk, n, self.bits, acc)
                    out.copy_(acc)


def quantizes(precision, comm) -> bool:
    """Do the param gathers over `comm` travel in `precision`? Not with a mesh: its gathers stay
    inside a host, whose hop stays full precision ([Note: quantized param gathers])."""
    return precision is not None and comm.distributed and comm.shards is comm


def param_wire(precision, comm, flat, b: int):
    """Bucket b's ParamWire, or None where its gathers travel as they are."""
    if not quantizes(precision, comm):
        return None
    return ParamWire(precision, flat.buckets[b].name, flat.layout.buckets[b].shard_numel, comm.rank, comm.world_size)
