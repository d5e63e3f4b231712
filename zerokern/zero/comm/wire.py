"""Collectives in a lower precision than the values: the codec a bucket's values go through
(GradWire for grads, with its error feedback; ParamWire for param gathers) and the collectives
that send grads that way (reduce_scatter, all_reduce below).

[Note: one codec] Grads and params that travel quantized take one interface: a bucket's wire (a
Codec), handed to the Comm's collective as `wire=`, for reduce_scatter, all_reduce and all_gather
alike. The reductions launch the wire's own collectives (an all-to-all of codes, [Note: quantized
reductions]); a gather has the wire encode this rank's values and gathers the bytes through the
same Comm (so in its backend's way, gloo's broadcasts, and past any wrapper around it), decoding
them when waited for. One key for the rounding (key(): the bucket's name, the rank where ranks
encode the same elements, each value's offset and a count), and one rule for the bytes sent: all
are written, the codes and zeros past them (_slots; a buffer of short or empty chunks is made
zeroed), never leftover process memory.

[Note: quantized reductions] reduce_precision="int8"/"int4" ([Note: the wire format] in
kernels/wire.py) sends each rank's grads as blockwise codes and sums them only after decoding,
in fp32, by the rank that needs the sum: a reduce-scatter is one all-to-all of the quantized
chunks (each rank keeps its own chunk exact: it never leaves the rank), never a ring that
re-quantizes partial sums at every hop (ZeRO++'s qgZ does the same with an all-to-all). An
all-reduce, whose sum every rank needs:
- on 2 ranks, one all-gather of each rank's whole quantized tensor, every rank decoding both in
  rank order: the same bytes as the two-phase ring, and no second rounding;
- on more, the reduce-scatter above, then each rank quantizes its chunk of the sum and the chunks
  are all-gathered. Every rank, the owner too, takes the decoded bytes, so every rank holds the
  same sum (hybrid sharding's replicas must do the same update).
Sums are taken in rank order, so a result is the same whatever order the bytes arrive in.

[Note: error feedback] What quantization loses is kept by the rank that lost it and added to what
it sends next time (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", 2019),
so the rounding errors do not pile up across steps: over many steps the params move by the sum of
the true grads, up to one step's rounding. A bucket keeps one residual for what it sends (the
size of what it quantizes: the whole bucket in a flat group; its shard with hybrid sharding,
where only the replica all-reduce is quantized) and, on more than 2 ranks of an all-reduce, one
for its chunk of the sum. Residuals are kept in bf16 (they are below one quantization step, so
bf16's 8 bits of mantissa lose nothing that matters; fp32 ones measured no better,
docs/measured.md) and counted by memory_report() as "error_feedback". The encode kernel adds the
residual to the bucket's values and writes the new one (bf16) in its one pass over the bucket: the
bucket is not copied to fp32 first (for 3.45M values on one CPU thread here, that copy and add
took 12 ms and the encode 2 ms; `python bench/wire_collectives.py` times the collectives, in
docs/measured.md). A round's residual is
pending until step(): it becomes the one the next round adds when the step updates, and is
dropped when the step is skipped (an inf/nan on some rank) or the grads are zeroed without a
step, so a skipped step loses nothing, the residual it consumed included. A second reduction of
the same bucket in one round (a second synced backward at stage 2/3, a grad that came after the
launch) adds the pending residual, as it adds to what the first one sent; at stage 1, whose
second reduction replaces the first, it adds the committed one again. Residuals are in the units
of the grads as reduced: under a GradScaler whose scale changes between two steps, the one
carried over is off by that factor for one step (it is below one quantization step of those
grads, so the effect is that of one step's rounding; a fixed scale, or bf16 without a scaler,
carries it exactly). Checkpoints keep the committed residuals as the gradient they still owe,
folded over the ranks ([Note: error feedback in checkpoints] in optim/wire_checkpoint.py), not as
each rank's own tensors, which fit one world size only.

[Note: rounding with error feedback] With residuals the codes are rounded to nearest; without
them (ZEROKERN_ERROR_FEEDBACK=0), stochastically ([Note: the wire format]). Stochastic rounding
makes each round's sum unbiased, which is what a run without feedback needs, at the price of
variance (up to a whole quantization step where round to nearest errs by at most half of one).
Error feedback already carries each round's error into the next, so over steps the sum is exact
up to one residual whatever the rounding: stochastic rounding would only add its variance, and
the residual it leaves is up to twice as large (it is what the next round must add, and it
widens that round's absmax, so its scale). Round to nearest with feedback is the usual pairing
(1-bit Adam, LoCo); on bench/lowbit_loss.py it is also what measured better (docs/measured.md).
A rerun is reproducible either way: round to nearest uses no random bits.
"""

import os
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ...kernels import wire, wire_ops
from .works import DONE, Then

# torch 2.14 renamed the flat-tensor all-gather; 2.11 has only the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_BITS = {"int8": 8, "int4": 4}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RESIDUAL_DTYPE = torch.bfloat16


class Residual:
    """One residual of [Note: error feedback]: the committed one and this round's pending one."""

    def __init__(self):
        self.committed: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None

    def take(self, numel: int, device, replaces: bool) -> Optional[torch.Tensor]:
        """What to add to this reduction's input (None: nothing yet)."""
        r = self.committed if replaces or self.pending is None else self.pending
        if r is not None and r.numel() != numel:
            raise RuntimeError(f"zerokern internal error: a residual of {r.numel()} elements for {numel}")
        return r

    def out(self, numel: int, device) -> torch.Tensor:
        """Where this reduction's error is written: the pending residual (after take(), which may
        have returned it: the encode reads each block of it before writing that block)."""
        if self.pending is None or self.pending is self.committed:
            self.pending = torch.empty(numel, dtype=RESIDUAL_DTYPE, device=device)
        elif self.pending.numel() != numel:
            raise RuntimeError(f"zerokern internal error: a residual of {self.pending.numel()} elements for {numel}")
        return self.pending

    def settle(self, updated: bool) -> None:
        if updated and self.pending is not None:
            self.committed, self.pending = self.pending, self.committed
        self.pending = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.committed, self.pending) if t is not None)


def key(name: str, rank: int = 0) -> int:
    """The base of a bucket's random stream ([Note: reproducible rounding] in kernels/lowbit.py):
    16 bits of the bucket's name above the 32 of a value's offset, and above those the rank where
    ranks encode the same elements (a reduction's: ranks must not round alike, or their errors
    would not average out; a gather's slices are apart already)."""
    return (rank << 48) | ((zlib.crc32(name.encode()) & 0xFFFF) << 32)


class Codec:
    """What a bucket's values go through when they travel quantized ([Note: one codec]): `bits`,
    and the key of the rounding: `seed`, `count` (the Philox counter's step word), `base` (key())
    plus each value's offset, a stream per collective."""

    seed = 0
    stochastic = True  # ([Note: the wire format]); GradWire's: [Note: rounding with error feedback]

    def encode(self, x: torch.Tensor, out: torch.Tensor, stream: int, offset: int, sides=(None, None), lo: int = 0,
               hi: Optional[int] = None):
        """x[lo:hi] (plus its residual) into `out`, its error into the error buffer's [lo:hi] (sides:
        GradWire.sides() over x; none by default)."""
        carried, error = sides
        wire_ops.encode_(x[lo:hi], out, self.bits, self.seed, self.count, stream, self.base + offset,
                         error=None if error is None else error[lo:hi],
                         residual=None if carried is None else carried[lo:hi], stochastic=self.stochastic)


class GradWire(Codec):
    """How one bucket's grads travel when reduce_precision is set: cast to a dtype (fp32, bf16),
    or quantized (int8, int4) with error feedback. `name` and `rank` key the random stream of the
    rounding, with a count of the bucket's reductions ([Note: reproducible rounding])."""

    def __init__(self, precision: str, name: str, rank: int, seed: int = 0):
        self.precision = precision
        self.bits = _BITS.get(precision)
        self.dtype = _DTYPES.get(precision)
        self.seed = seed
        self.base = key(name, rank)  # a stream per (rank, bucket)
        # reductions so far (the Philox counter's step word): as the residuals, a skipped round's are
        # forgotten, so a run with a skipped step rounds as the same run without that batch
        self.count = self.committed_count = 0
        self.sent, self.summed = Residual(), Residual()
        self.replaces = False  # set by the bucket per launch ([Note: error feedback], stage 1)
        # ZEROKERN_ERROR_FEEDBACK=0: no residuals (the control run of bench/lowbit_loss.py, to see what they buy)
        self.feedback = os.environ.get("ZEROKERN_ERROR_FEEDBACK", "1") != "0"
        # [Note: rounding with error feedback]: to nearest with residuals, stochastic without
        self.stochastic = not self.feedback

    @staticmethod
    def of(precision, name, rank, seed=0) -> Optional["GradWire"]:
        return None if precision is None else GradWire(precision, name, rank, seed)

    def settle(self, updated: bool) -> None:
        """The round ended: its residuals are kept if the step updated, else dropped."""
        self.sent.settle(updated)
        self.summed.settle(updated)
        if updated:
            self.committed_count = self.count
        self.count = self.committed_count

    def nbytes(self) -> int:
        return self.sent.nbytes() + self.summed.nbytes()

    # --- the collectives (Comm launches them through the wire it is handed) ----

    def reduce_scatter(self, output, input, group, rank: int, world: int):
        return reduce_scatter(output, input, group, rank, world, self)

    def all_reduce(self, tensor, group, rank: int, world: int):
        return all_reduce(tensor, group, rank, world, self)

    # --- encoding --------------------------------------------------------------

    def sides(self, res: Residual, numel: int, device):
        """(what to add to this reduction's input, where to write what it loses) for `res`; None
        for either where there is nothing: the encode adds the one and writes the other in its own
        pass over the input ([Note: error feedback]), so the input is never copied to add them."""
        if not self.feedback:
            return None, None
        carried = res.take(numel, device, self.replaces)  # before out(), which may replace the pending one
        return carried, res.out(numel, device)

    @staticmethod
    def own(x: torch.Tensor, sides, lo: int, hi: int) -> torch.Tensor:
        """x[lo:hi] plus its residual in fp32 (a copy): the chunk a rank sums without sending it, so
        it loses nothing (its error is 0; the residual may have carried something from a checkpoint)."""
        carried, error = sides
        out = x[lo:hi].to(torch.float32, copy=True)
        if carried is not None:
            out.add_(carried[lo:hi])
        if error is not None:
            error[lo:hi].zero_()  # after the read above: it may be the same tensor
        return out


stride = wire.stride  # a chunk's bytes in a collective's buffer (aligned: kernels/wire.py)
PARAM_STREAM = 2  # the wire's streams: 0 and 1 are the grad reductions' (below)


class ParamWire(Codec):
    """How one param bucket's gathers travel in int8 ([Note: quantized param gathers] in
    params/gather.py): each rank's slice of `shard_numel` values, keyed by the bucket's name,
    the slice's place in the bucket and `count`, the updates of the slices so far (a new key for
    each update; the gathers of one update give the same bytes). adds: what a rank sends is an
    update of its slice, which every rank adds to its copy (stages 1/2), else the slice's values,
    which every rank writes (stage 3)."""

    def __init__(self, precision: str, name: str, shard_numel: int, rank: int, world: int, adds: bool):
        self.bits = _BITS[precision]
        self.n, self.rank, self.world, self.adds = shard_numel, rank, world, adds
        self.chunk, self.used = stride(shard_numel, self.bits), wire.nbytes(shard_numel, self.bits)
        self.base = key(name)
        self.count = 0

    def all_gather(self, comm, output, input, name: str):
        """Comm.all_gather(output, input, wire=self): `input` (this rank's n values, fp32) as codes
        in this rank's slot of a byte buffer, the bytes gathered through `comm`, and every rank's
        slice of `output` written from them when waited for, this rank's too: every rank computes
        with the same bits."""
        if output.numel() != self.world * self.n:
            raise RuntimeError(f"zerokern internal error: {name}: a buffer of {output.numel()} elements for "
                               f"{self.world} slices of {self.n}")
        data = _slots(self.world, self.chunk, self.used, output.device)
        mine = data[self.rank * self.chunk:(self.rank + 1) * self.chunk]
        self.encode(input, mine[:self.used], PARAM_STREAM, self.rank * self.n)
        return Then(comm.all_gather(data, mine, name), lambda: self._decode(data, output))

    def _decode(self, data, output) -> None:
        """Each rank's slice from its bytes, in rank order."""
        n = self.n
        with torch.no_grad():
            for r in range(self.world):
                out = output[r * n:(r + 1) * n]
                chunk = data[r * self.chunk:r * self.chunk + self.used]
                if out.dtype == torch.float32:
                    if not self.adds:
                        out.zero_()
                    wire_ops.decode_add_(chunk, n, self.bits, out)
                else:  # in fp32, then rounded to nearest into the 16-bit params (as the update writes them)
                    acc = out.to(torch.float32) if self.adds else torch.zeros(n, dtype=torch.float32,
                                                                              device=output.device)
                    wire_ops.decode_add_(chunk, n, self.bits, acc)
                    out.copy_(acc)


def gather_bytes(n: int, element_size: int, precision) -> int:
    """What one rank puts on the wire for its slice of n elements in one param gather (None: as they are)."""
    return n * element_size if precision is None else stride(n, _BITS[precision])


def all_reduce_bytes(part, world: int, w: Optional[GradWire]) -> int:
    """What one rank sends in an all-reduce of `part` over `world` ranks (a ring's 2 (w - 1) / w
    of it; [Note: quantized reductions]'s own ways when quantized)."""
    n = part.numel()
    if w is not None and w.bits is not None:
        if world == 2:
            return stride(n, w.bits)
        return 2 * (world - 1) * stride(-(-n // world), w.bits)
    size = part.element_size() if w is None or w.dtype is None else torch.finfo(w.dtype).bits // 8
    return n * size * 2 * (world - 1) // world


def _fp32_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t flat, if a sum can be decoded straight into it (fp32, contiguous), else None."""
    return t.view(-1) if t.dtype == torch.float32 and t.is_contiguous() else None


def _slots(world: int, chunk: int, used: int, device) -> torch.Tensor:
    """A send buffer of `world` slots of `chunk` bytes (stride(n)) for `used` bytes of codes each
    (nbytes(n)), each slot's pad tail (up to 3 bytes past the codes) zeroed: the bytes that cross
    a link are all written, never leftover process memory."""
    send = torch.empty(world * chunk, dtype=torch.uint8, device=device)
    if chunk > used:
        send.view(world, chunk)[:, used:].zero_()
    return send


def _decode_sum(recv, w: GradWire, chunk_bytes: int, n: int, world: int, rank: int, own,
                into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 sum, in rank order, of the `world` chunks in recv (rank's own: `own`, exact), written
    into `into` (fp32, n) if given. [Note: the first term of a sum]"""
    acc = torch.empty(n, dtype=torch.float32, device=recv.device) if into is None else into
    for r in range(world):
        if r == rank:
            if r == 0:
                torch.add(own, 0.0, out=acc)
            else:
                acc.add_(own)
        else:
            wire_ops.decode_(recv[r * chunk_bytes:r * chunk_bytes + wire.nbytes(n, w.bits)], n, w.bits, acc,
                             accumulate=r > 0)
    return acc


# [Note: the first term of a sum] A sum is taken from zero in rank order, but its first term is
# written, not added to a tensor of zeros, and the sum goes straight into the caller's fp32 tensor,
# not into a new one then copied: that saves three passes over the values. The bits are those of
# 0 + term + ...: 0 + y is y for every y but -0.0, and a decoded value is never -0.0 (a block's
# codes are 0 where its scale is 0, and a non-zero code times a positive scale does not underflow);
# a rank's own term may be, so it is added to 0 (own + 0.0, the same sum). One exception: with
# denormals flushed (torch.set_flush_denormal(True)) a subnormal scale reads as 0 and a negative
# code decodes to -0.0, so a sum may end in -0.0 where 0 + y gives +0.0: the same value to Adam,
# and the same bits on every rank, which all decode the same bytes.


def reduce_scatter(output, input, group, rank: int, world: int, w: GradWire):
    """Launch the quantized SUM reduce-scatter of `input` (world x output.numel()) into `output`
    on `group` ([Note: quantized reductions]); returns a Work that writes `output` when waited.
    `input` is read before this returns."""
    n = output.numel()
    x = input.reshape(-1).contiguous()
    if x.numel() != world * n:  # every element of the new residual is written below
        raise RuntimeError(f"zerokern internal error: a reduce-scatter of {x.numel()} elements into {world} x {n}")
    sides = w.sides(w.sent, x.numel(), x.device)
    chunk, used = stride(n, w.bits), wire.nbytes(n, w.bits)
    send = _slots(world, chunk, used, x.device)  # the own slot is not encoded: all_to_all copies it locally
    for r in range(world):
        if r != rank:
            w.encode(x, send[r * chunk:r * chunk + used], 0, r * n, sides, r * n, (r + 1) * n)
    own = w.own(x, sides, rank * n, (rank + 1) * n)
    w.count += 1
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish():
        into = _fp32_view(output)
        acc = _decode_sum(recv, w, chunk, n, world, rank, own, into)
        if into is None:
            output.copy_(acc.view_as(output))
    return Then(work, finish)


def all_reduce(tensor, group, rank: int, world: int, w: GradWire):
    """The quantized SUM all-reduce of `tensor`, in place ([Note: quantized reductions]). On 2
    ranks it is one all-gather, and the Work returned finishes it; on more it runs both phases
    before returning (the caller must say it blocks: comm/check.py never plans it)."""
    n = tensor.numel()
    x = tensor.reshape(-1).contiguous()
    sides = w.sides(w.sent, n, x.device)
    if world == 2:
        size, used = stride(n, w.bits), wire.nbytes(n, w.bits)
        mine = _slots(1, size, used, x.device)
        w.encode(x, mine[:used], 0, 0, sides, 0, n)
        w.count += 1
        both = torch.empty(2 * size, dtype=torch.uint8, device=x.device)
        work = _all_gather(both, mine, group=group, async_op=True)

        def finish():  # [Note: the first term of a sum]
            into = _fp32_view(tensor)
            acc = torch.empty(n, dtype=torch.float32, device=x.device) if into is None else into
            for r in range(2):
                wire_ops.decode_(both[r * size:r * size + used], n, w.bits, acc, accumulate=r > 0)
            if into is None:
                tensor.copy_(acc.view_as(tensor))
        return Then(work, finish)
    c = -(-n // world)  # chunk r: [r c, min(n, (r + 1) c)); the last ones may be short or empty
    bounds = [(min(n, r * c), min(n, (r + 1) * c)) for r in range(world)]
    chunk = stride(c, w.bits)
    send = torch.zeros(world * chunk, dtype=torch.uint8, device=x.device)
    for r, (a, b) in enumerate(bounds):
        if r != rank and b > a:
            w.encode(x, send[r * chunk:r * chunk + wire.nbytes(b - a, w.bits)], 0, a, sides, a, b)
    a, b = bounds[rank]
    own = w.own(x, sides, a, b)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    acc = _decode_sum(recv, w, chunk, b - a, world, rank, own)  # in rank order ([Note: quantized reductions])
    summed = w.sides(w.summed, b - a, x.device)
    mine = torch.zeros(chunk, dtype=torch.uint8, device=x.device)
    if b > a:
        w.encode(acc, mine[:wire.nbytes(b - a, w.bits)], 1, a, summed, 0, b - a)
    w.count += 1
    gathered = torch.empty(world * chunk, dtype=torch.uint8, device=x.device)
    _all_gather(gathered, mine, group=group)
    flat, into = tensor.view(-1), _fp32_view(tensor)
    for r, (lo, hi) in enumerate(bounds):
        if hi > lo:  # [Note: the first term of a sum]: one term
            out = torch.empty(hi - lo, dtype=torch.float32, device=x.device) if into is None else into[lo:hi]
            wire_ops.decode_(gathered[r * chunk:r * chunk + wire.nbytes(hi - lo, w.bits)], hi - lo, w.bits, out)
            if into is None:
                flat[lo:hi].copy_(out)
    return DONE
