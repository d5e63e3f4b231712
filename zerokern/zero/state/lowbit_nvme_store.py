"""LowBitNvmeStore: LowBitStore's state (int8 codes and their block scales, or bf16 moments; the
fp32 master where there is one) in this rank's swap file ([Note: NVMe swap] in swap.py), streamed
through the CPU kernel chunk by chunk with NvmeStore's protocol: stream(run), then, once every
rank's stream() succeeded, commit(); nothing is changed before commit().

[Note: low-bit chunks on disk]
- A slot holds exp_avg and exp_avg_sq (uint8 codes, 1 byte an element, or bf16, 2 bytes), for int8
  their block scales (fp32, one per lowbit.BLOCK = 256 elements: [Note: int8 shards in blocks]),
  and the fp32 master of bf16 params trained with master_weights=True. Each array is padded on its
  own to whole ALIGN-byte blocks.
- A chunk is a multiple of QUANTUM = ALIGN * BLOCK // 4 = 262,144 elements: then each array's share
  of a chunk is whole ALIGN blocks (codes 256 KiB, scales exactly one 4 KiB block per moment, the
  master 1 MiB, bf16 moments 512 KiB), so every chunk's offset in its array, and in the file, is
  aligned, and the last chunk, which runs to the array's padded end, is whole blocks too. A chunk
  is whole 256-element blocks, so its scales are its own (chunk c's are blocks c * chunk / BLOCK
  on), and a piece (which starts on a block: ShardConfig.align) cut at a chunk's edge starts on one.
- chunk_mb counts elements as NvmeStore does (chunk_mb MB of fp32: chunk_mb * 2**18 elements),
  rounded down to a multiple of QUANTUM, at least one, and no more than the largest shard needs.
- Without a master the bf16 params are the update's params: each chunk is copied to `staging` and
  updated there (stochastically rounded, keyed by the global element index as in memory:
  [Note: reproducible rounding]); commit() copies staging to the params.
"""

from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch

from ...kernels import lowbit
from ..core.stage import OffloadPolicy, StatePolicy
from .store import ShardStore
from .swap import ALIGN, AlignedBuffer, NvmeOffloadError, SwapFile, open_swap, stream_chunks

if TYPE_CHECKING:  # annotations only
    from ..unit import FlatParams

QUANTUM = ALIGN * lowbit.BLOCK // 4  # elements: a chunk's int8 scales fill one ALIGN block exactly


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slot_arrays(n: int, policy: StatePolicy, separate_master: bool) -> Dict[str, Tuple[torch.dtype, int, int]]:
    """{array: (dtype, elements, elements per QUANTUM of the shard)} of one slot of an n-element shard."""
    out = {"exp_avg": (policy.state_dtype, n, QUANTUM), "exp_avg_sq": (policy.state_dtype, n, QUANTUM)}
    if policy.precision == "int8":
        blocks = lowbit.num_blocks(n)
        out.update(exp_avg_scale=(torch.float32, blocks, QUANTUM // lowbit.BLOCK),
                   exp_avg_sq_scale=(torch.float32, blocks, QUANTUM // lowbit.BLOCK))
    if separate_master:
        out["master"] = (torch.float32, n, QUANTUM)
    return out


def _slot_bytes(arrays) -> int:
    return sum(_aligned(count * dtype.itemsize) for dtype, count, _ in arrays.values())


class LowBitSwapFile(SwapFile):
    """A SwapFile whose chunk counts shard elements (a multiple of QUANTUM), with a ring of buffers
    sized per array (bytes per chunk)."""

    def __init__(self, directory, nbytes: int, rank: int, policy: OffloadPolicy, largest: int = 1 << 62):  # noqa: D107
        super().__init__(directory, nbytes, rank, policy, largest)
        want = int(policy.chunk_mb * 2**20) // 4 // QUANTUM * QUANTUM
        self.chunk = max(QUANTUM, min(want, -(-largest // QUANTUM) * QUANTUM))

    def ring(self, sizes: Tuple[int, ...]):
        """buffer_count sets of one aligned buffer per array, of sizes[k] bytes (made once, shared by
        the stores with the same arrays)."""
        if sizes not in self._ring:
            self._ring[sizes] = [[AlignedBuffer(s // 4, self._pin) for s in sizes] for _ in range(self.buffer_count)]
        return self._ring[sizes]

    def buffer_bytes(self) -> int:
        return sum(sum(sizes) * len(ring) for sizes, ring in self._ring.items())


class LowBitNvmeStore(ShardStore):
    """LowBitStore's state on disk ([Note: low-bit chunks on disk]): stream(run) and commit() as
    NvmeStore's; ShardStore's master bookkeeping over tensors that view the file."""

    streams = True  # the optimizer updates it with stream() and commit(), not operands()

    def __init__(self, flat: "FlatParams", b: int, swap: LowBitSwapFile, rank: int,  # noqa: D107
                 policy: StatePolicy):
        self.flat, self.b, self.swap, self.rank, self.policy = flat, b, swap, rank, policy
        self.bucket = flat.buckets[b]
        shard = self._param_shard = flat.param_shard(b)
        self.device = torch.device("cpu")  # where the update runs
        self.offloaded = True
        self.low_precision = shard.dtype != torch.float32
        self.holds_gathered = False  # the engine refuses quantized gathers on disk
        self.separate_master = policy.master_weights and self.low_precision
        self.n = n = shard.numel()
        self.arrays = slot_arrays(n, policy, self.separate_master)
        chunk = swap.chunk // QUANTUM
        self._stride = {k: _aligned(count * dtype.itemsize) for k, (dtype, count, _) in self.arrays.items()}
        self._chunk_bytes = {k: per * chunk * dtype.itemsize for k, (dtype, _, per) in self.arrays.items()}
        self._slot_bytes = sum(self._stride.values())
        self._base = swap.region(2 * self._slot_bytes)
        self._slot = 0
        self._views = [{k: swap.tensor(self._offset(s, k), count, dtype) for k, (dtype, count, _) in self.arrays.items()}
                       for s in (0, 1)]
        if policy.precision == "int8" and n:  # the signed map's 0 is not code 0 (as LowBitStore)
            zero_m, _ = lowbit.quantize(torch.zeros(1), True)
            self._views[0]["exp_avg"].fill_(int(zero_m[0]))  # reaches the file at the first step's flush
        self.staging = torch.empty(n, dtype=shard.dtype)  # the new params, until commit()
        swap.ring(tuple(self._chunk_bytes.values()))  # the stated buffers, made now (memory_report counts them)
        self.refresh_master()
        self.master_valid = not self.separate_master
        self._filled_version = None

    def _offset(self, slot: int, key: str) -> int:
        before = list(self.arrays).index(key)
        return self._base + slot * self._slot_bytes + sum(list(self._stride.values())[:before])

    # the current slot's tensors: what self.state[p] views (FusedZeroAdam re-views after commit())
    @property
    def state(self):
        return {k: self._views[self._slot][k] for k in ("exp_avg", "exp_avg_sq")}

    def scales(self):
        """{state key: fp32 block scales} of int8 state, else None (LowBitStore's)."""
        if self.policy.precision != "int8":
            return None
        return {k: self._views[self._slot][k + "_scale"] for k in ("exp_avg", "exp_avg_sq")}

    @property
    def master(self):
        return self._views[self._slot]["master"] if self.separate_master else self._param_shard

    def refresh_master(self) -> None:
        """ShardStore's, through the mapping, then flushed: the step's O_DIRECT reads see it."""
        super().refresh_master()
        if self.separate_master:
            self.swap.flush()

    def operands(self):
        raise NotImplementedError("a LowBitNvmeStore streams: call stream() and commit()")

    def finish(self) -> None:
        pass  # commit() wrote the params

    def nbytes(self) -> dict:
        return {"master_params": 0, "adam_state": 0}  # in memory; on disk: disk_bytes()

    def disk_bytes(self) -> int:
        """Bytes of state this store keeps on disk (one slot: the other is the next step's)."""
        return sum(count * dtype.itemsize for dtype, count, _ in self.arrays.values())

    def stream(self, run: Callable) -> Optional[str]:
        """Update the shard chunk by chunk: run(lo, hi, params, grad, exp_avg, exp_avg_sq, exp_avg_scales,
        exp_avg_sq_scales, model) on elements [lo, hi) of the shard (params: the fp32 master, else the
        params' staging copy; the scales None for bf16 state; model the staging copy written from a
        master, else None), with the arrays read from the current slot and, after run, written to the
        other one. None, or what failed (this rank's I/O error)."""
        if self.n == 0:
            return None
        swap, chunk, keys = self.swap, self.swap.chunk, list(self.arrays)
        ring = swap.ring(tuple(self._chunk_bytes.values()))
        grad = self.bucket.reduced_grad()
        if grad.device.type != "cpu":
            grad = grad.to("cpu")  # the update runs on the CPU
        shard, src, dst = self._param_shard, self._slot, 1 - self._slot

        def io(op, c, bufs, slot):  # chunk c of every array: whole ALIGN blocks ([Note: low-bit chunks on disk])
            out = []
            for buf, key in zip(bufs, keys):
                step = self._chunk_bytes[key]
                length = min(step, self._stride[key] - c * step)
                out.append(op(buf, length // 4, self._offset(slot, key) + c * step))
            return out

        def update(c, bufs):
            lo, hi = c * chunk, min((c + 1) * chunk, self.n)
            bufs = {key: buf.tensor.view(self.arrays[key][0]) for key, buf in zip(keys, bufs)}
            self.staging[lo:hi].copy_(shard[lo:hi])  # elements not updated keep their values
            blocks = lowbit.num_blocks(hi - lo)
            ms, vs = ((bufs["exp_avg_scale"][:blocks], bufs["exp_avg_sq_scale"][:blocks])
                      if "exp_avg_scale" in bufs else (None, None))
            if self.separate_master:
                params, model = bufs["master"][:hi - lo], self.staging[lo:hi]
            else:
                params, model = self.staging[lo:hi], None
            run(lo, hi, params, grad[lo:hi], bufs["exp_avg"][:hi - lo], bufs["exp_avg_sq"][:hi - lo], ms, vs, model)

        try:
            stream_chunks(ring, -(-self.n // chunk), lambda c, bufs: io(swap.read, c, bufs, src), update,
                          lambda c, bufs: io(swap.write, c, bufs, dst))
        except NvmeOffloadError as e:
            return f"rank {self.rank}: {e}"
        return None

    def commit(self) -> None:
        """Every rank streamed: the new params go live and the slot just written becomes current."""
        if self.n:
            self._param_shard.copy_(self.staging)
        self._slot = 1 - self._slot


def create(placed, offload: OffloadPolicy, policy: StatePolicy, comm, what: str) -> List[LowBitNvmeStore]:
    """The LowBitNvmeStores of this rank's buckets (placed: (FlatParams, bucket index) pairs), in one
    swap file under offload.path, after every rank checked its path: a collective, and every rank
    raises when any rank cannot hold its state (as nvme_store.create)."""
    shards = [f.param_shard(b) for f, b in placed]
    nbytes = sum(2 * _slot_bytes(slot_arrays(s.numel(), policy, policy.master_weights and s.dtype != torch.float32))
                 for s in shards)
    swap = open_swap(LowBitSwapFile, offload, nbytes, max((s.numel() for s in shards), default=1), comm, what)
    return [LowBitNvmeStore(f, b, swap, swap.rank, policy) for f, b in placed]
