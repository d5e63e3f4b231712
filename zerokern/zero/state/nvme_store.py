"""NvmeStore: a bucket shard's optimizer state (and the fp32 master of fp16/bf16 params) in this
rank's swap file ([Note: NVMe swap] in swap.py), streamed through the CPU kernel chunk by chunk.
state_keys: the per-element fp32 state arrays (Adam's two moments; for ZeroOptimizer its inner
optimizer's, optim/inner_stream.py).

The protocol differs from ShardStore's operands()/finish(): an optimizer calls stream(run) to
update (run gets each chunk's operands), and, once every rank's stream() succeeded, commit() (the
new params and the written slot become current); nothing is changed before commit(). The
bookkeeping of a separate master (refresh_master, refresh_params, the round-trip check) is
ShardStore's, over tensors that view the file.

[Note: stage-3 params on disk] With OffloadPolicy(params=True) (stage 3) the param shard is one
more array of each slot, in its own dtype, and FlatParams.param_shards[b] is (set_ in place, so
every holder follows) a view of the current slot's copy through the shared mapping. So everything
that reads or writes a slice (the gathers, DCP's save and load hooks, full_state_dict, the masters'
refresh) works unchanged, through the page cache. The update streams it with the state (fp32
params: it is the master; bf16: the kernel writes it beside the fp32 master) into the other slot,
and commit() re-points the view; nothing in memory holds the whole shard. Reads go at the disk's
speed and memory stays bounded: the stage-3 runtime asks for the shards of the unit after the
one it gathers (prefetch_param: readahead behind the next unit's forward), and a gather drops
the shard's pages once it copied them (release_param), so the backward reads them again.
"""

import concurrent.futures
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from ..core.stage import OffloadPolicy
from .store import ShardStore
from .swap import ALIGN, NvmeOffloadError, SwapFile, open_swap, padded, stream_chunks

if TYPE_CHECKING:  # annotations only
    from ..unit import FlatParams

STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _arrays(dtype: torch.dtype, params_on_disk: bool, state_keys=STATE_KEYS):
    """(name, dtype) of the arrays in one slot of a shard of params of `dtype`."""
    arrays = [(k, torch.float32) for k in state_keys]
    if dtype != torch.float32:
        arrays.append(("master", torch.float32))
    if params_on_disk:
        arrays.append(("param", dtype))
    return arrays


def _stride(n: int, dtype: torch.dtype) -> int:
    """Bytes of one array of n elements in a slot: whole ALIGN blocks."""
    return -(-padded(n) * dtype.itemsize // ALIGN) * ALIGN


def _region_bytes(n: int, dtype: torch.dtype, params_on_disk: bool, state_keys=STATE_KEYS) -> int:
    return 2 * sum(_stride(n, t) for _, t in _arrays(dtype, params_on_disk, state_keys))


class NvmeStore(ShardStore):
    streams = True  # the optimizer updates it with stream() and commit(), not operands()

    def __init__(self, flat: "FlatParams", b: int, swap: SwapFile, rank: int,  # noqa: D107
                 params_on_disk: bool = False, state_keys=STATE_KEYS):
        self.flat, self.b, self.swap, self.rank = flat, b, swap, rank
        self.state_keys = tuple(state_keys)
        self.bucket = flat.buckets[b]
        shard = self._param_shard = flat.param_shard(b)
        self.device = torch.device("cpu")  # where the update runs
        self.offloaded = True
        self.low_precision = shard.dtype != torch.float32
        self.holds_gathered = False
        self.separate_master = self.low_precision  # fp32 params are their own masters (in memory, or "param")
        self.params_on_disk = params_on_disk
        self.n = n = shard.numel()
        self._dtypes = dict(_arrays(shard.dtype, params_on_disk, self.state_keys))
        self.arrays = tuple(self._dtypes)
        self._strides = {k: _stride(n, t) for k, t in self._dtypes.items()}
        self._slot_bytes = sum(self._strides.values())
        self._base = swap.region(2 * self._slot_bytes)
        self._slot = 0
        self._views = [{k: swap.tensor(self._offset(s, k), n, t) for k, t in self._dtypes.items()} for s in (0, 1)]
        swap.ring(len(self.arrays))  # the stated buffers, made now (memory_report counts them)
        self.staging = None if params_on_disk else torch.empty(n, dtype=shard.dtype)  # new params until commit()
        # A separate master is written at the first step (refresh_master), or by a state dict
        # taken before it (fill_unread_master); the moments start as the file's zeros (fallocate).
        self.master_valid = not self.separate_master
        self._filled_version = None

    def move_params_in(self) -> None:
        """[Note: stage-3 params on disk]: the slice is written into the file, and the tensor views it."""
        self._fill("param", self._param_shard)
        self._repoint_param()

    def _offset(self, slot: int, key: str) -> int:
        before = self.arrays[:self.arrays.index(key)]
        return self._base + slot * self._slot_bytes + sum(self._strides[k] for k in before)

    def _repoint_param(self) -> None:
        """param_shards[b] (the same tensor object, so every holder follows) views the current slot."""
        v = self._views[self._slot]["param"]
        self._param_shard.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())

    # the current slot's tensors: what self.state[p] views (FusedZeroAdam re-views after commit())
    @property
    def state(self):
        return {k: self._views[self._slot][k] for k in self.state_keys}

    @property
    def master(self):
        return self._views[self._slot]["master"] if self.separate_master else self._param_shard

    def refresh_master(self) -> None:  # noqa: D102 (ShardStore's, written as _fill writes)
        if self.separate_master:
            self._fill("master", self._param_shard)
        self.master_valid = True

    def _io(self, c: int, key: str):
        """(fp32 units of I/O, byte offset in its array) of chunk c of array `key`: chunk offsets
        are whole blocks (SwapFile.chunk); a 2-byte array's last length is rounded up to one, inside
        the array's stride."""
        size, chunk = self._dtypes[key].itemsize, self.swap.chunk
        nbytes = -(-min(chunk, padded(self.n) - c * chunk) * size // ALIGN) * ALIGN
        return nbytes // 4, c * chunk * size

    def _fill(self, key: str, source: torch.Tensor) -> None:
        """Array `key` of the current slot := source (n values of any dtype), written with O_DIRECT
        chunk by chunk through the ring: at the disk's speed, and without dirty pages in the page
        cache, which a memory limit counts (a copy through the mapping made gigabytes of them).
        A source that is the param shard on disk is read with O_DIRECT too (through the mapping,
        page fault by page fault, a fill ran at 0.12 GB/s). Raises NvmeOffloadError; the swap
        file's progress line counts the bytes."""
        ring, chunk, dtype = self.swap.ring(len(self.arrays)), self.swap.chunk, self._dtypes[key]
        on_disk = self.params_on_disk and source is self._param_shard and key != "param"
        pending = [None] * len(ring)
        try:
            for c in range(-(-padded(self.n) // chunk)):
                k = c % len(ring)
                if pending[k] is not None:
                    pending[k].result()
                floats, offset = self._io(c, key)
                lo, hi = c * chunk, min((c + 1) * chunk, self.n)
                view = ring[k][0].tensor.view(dtype)
                if on_disk:  # into the set's second buffer, the param array's chunk c of this slot
                    got, at = self._io(c, "param")
                    self.swap.read(ring[k][1], got, self._offset(self._slot, "param") + at).result()
                    source_chunk = ring[k][1].tensor.view(self._dtypes["param"])[:hi - lo]
                else:
                    source_chunk = source[lo:hi]
                view[:hi - lo].copy_(source_chunk)
                view[hi - lo:floats * 4 // dtype.itemsize].zero_()  # the pad past the shard
                pending[k] = self.swap.write(ring[k][0], floats, self._offset(self._slot, key) + offset)
                self.swap.progress(floats * 4)
        finally:
            concurrent.futures.wait([f for f in pending if f is not None])
        for f in pending:
            if f is not None:
                f.result()

    def prefetch_param(self) -> None:
        """Start reading the param shard from disk: its unit is gathered soon."""
        if self.params_on_disk:
            self.swap.advise(self._offset(self._slot, "param"), self._strides["param"], need=True)

    def release_param(self) -> None:
        """The gather copied the param shard: its pages leave memory."""
        if self.params_on_disk:
            self.swap.advise(self._offset(self._slot, "param"), self._strides["param"], need=False)

    def operands(self):
        raise NotImplementedError("an NvmeStore streams: call stream() and commit()")

    def finish(self) -> None:
        pass  # commit() wrote the params

    def nbytes(self) -> dict:
        return {"master_params": 0, "adam_state": 0}  # in memory; on disk: disk_bytes()

    def disk_bytes(self) -> int:
        """Bytes of state (and params) this store keeps on disk (one slot: the other is the next step's)."""
        return sum(self.n * t.itemsize for t in self._dtypes.values())

    def stream(self, run: Callable) -> Optional[str]:
        """Update the shard chunk by chunk: run(lo, hi, master, grad, *state, model) (state: a chunk of
        each of state_keys, Adam's exp_avg, exp_avg_sq) on elements [lo, hi) of the shard, with the
        arrays' chunks read from the current slot and, after run, written to the other one. None, or
        what failed (this rank's I/O error)."""
        if self.n == 0:
            return None
        swap, chunk = self.swap, self.swap.chunk
        ring = swap.ring(len(self.arrays))
        grad = self.bucket.reduced_grad()
        if grad.device.type != "cpu":
            grad = grad.to("cpu")  # the update runs on the CPU
        shard, src, dst = self._param_shard, self._slot, 1 - self._slot
        io = self._io

        def read(c, bufs):
            return [swap.read(buf, io(c, key)[0], self._offset(src, key) + io(c, key)[1])
                    for buf, key in zip(bufs, self.arrays)]

        def update(c, bufs):
            lo, hi = c * chunk, min((c + 1) * chunk, self.n)
            bufs = {key: buf.tensor.view(self._dtypes[key])[:hi - lo] for key, buf in zip(self.arrays, bufs)}
            if self.params_on_disk:  # the chunk read holds the params: the update writes them there
                model = bufs["param"]
            else:
                model = self.staging[lo:hi]
                model.copy_(shard[lo:hi])  # elements not updated keep their values
            master = bufs["master"] if self.separate_master else model
            run(lo, hi, master, grad[lo:hi], *(bufs[k] for k in self.state_keys),
                model if self.separate_master else None)

        def write(c, bufs):
            return [swap.write(buf, io(c, key)[0], self._offset(dst, key) + io(c, key)[1])
                    for key, buf in zip(self.arrays, bufs)]

        try:
            stream_chunks(ring, -(-padded(self.n) // chunk), read, update, write)
        except NvmeOffloadError as e:
            return f"rank {self.rank}: {e}"
        return None

    def commit(self) -> None:
        """Every rank streamed: the new params go live and the slot just written becomes current."""
        self._slot = 1 - self._slot
        if self.params_on_disk:
            self._repoint_param()
        elif self.n:
            self._param_shard.copy_(self.staging)


def create(placed, policy: OffloadPolicy, comm, what: str, state_keys=STATE_KEYS) -> List[NvmeStore]:
    """The NvmeStores of this rank's buckets (placed: (FlatParams, bucket index) pairs), in one
    swap file under policy.path (open_swap)."""
    nbytes = sum(_region_bytes(f.param_shard(b).numel(), f.param_shard(b).dtype, policy.params, state_keys)
                 for f, b in placed)
    swap = open_swap(SwapFile, policy, nbytes, max((f.param_shard(b).numel() for f, b in placed), default=1),
                     comm, what)
    rank = swap.rank
    stores = [NvmeStore(f, b, swap, rank, policy.params, state_keys) for f, b in placed]
    if policy.params:  # [Note: stage-3 params on disk]
        problem = None
        try:
            for s in stores:
                s.move_params_in()
        except NvmeOffloadError as e:
            problem = f"rank {rank}: {e}"
        problems = comm.gather_objects(problem, name="nvme_params")
        if any(problems):
            raise NvmeOffloadError(f"zerokern: {what}: could not write the param shards to disk (OffloadPolicy("
                                   "params=True)): " + "; ".join(p for p in problems if p))
        for s in stores:
            if s.flat.shard_io is None:
                s.flat.shard_io = {}
            s.flat.shard_io[s.b] = s  # the stage-3 gathers prefetch and release through it
    swap.progress_done()
    return stores
