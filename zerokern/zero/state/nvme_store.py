"""NvmeStore: a bucket shard's optimizer state (and the fp32 master of fp16/bf16 params) in this
rank's swap file ([Note: NVMe swap] in swap.py), streamed through the CPU kernel chunk by chunk.
state_keys: the per-element fp32 state arrays (Adam's two moments; for ZeroOptimizer its inner
optimizer's, optim/inner_stream.py).

The protocol differs from ShardStore's operands()/finish(): an optimizer calls stream(run) to
update (run gets each chunk's operands), and, once every rank's stream() succeeded, commit() (the
new params and the written slot become current); nothing is changed before commit(). The
bookkeeping of a separate master (refresh_master, refresh_params, the round-trip check) is
ShardStore's, over tensors that view the file."""

import concurrent.futures
from typing import TYPE_CHECKING, Callable, List, Optional

import torch

from ..core.stage import OffloadPolicy
from .store import ShardStore
from .swap import ALIGN, NvmeOffloadError, SwapFile, check_path, padded

if TYPE_CHECKING:  # annotations only
    from ..unit import FlatParams

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class NvmeStore(ShardStore):
    streams = True  # the optimizer updates it with stream() and commit(), not operands()

    def __init__(self, flat: "FlatParams", b: int, swap: SwapFile, rank: int,  # noqa: D107
                 state_keys=STATE_KEYS):
        self.flat, self.b, self.swap, self.rank = flat, b, swap, rank
        self.state_keys = tuple(state_keys)
        self.bucket = flat.buckets[b]
        shard = self._param_shard = flat.param_shard(b)
        self.device = torch.device("cpu")  # where the update runs
        self.offloaded = True
        self.low_precision = shard.dtype != torch.float32
        self.holds_gathered = False
        self.separate_master = self.low_precision  # fp32 params are their own masters, in memory
        self.n = n = shard.numel()
        self.arrays = self.state_keys + (("master",) if self.separate_master else ())
        self._stride = padded(n) * 4  # bytes of one array in one slot
        self._base = swap.region(2 * len(self.arrays) * self._stride)
        self._slot = 0
        self._views = [{k: swap.tensor(self._offset(s, k), n) for k in self.arrays} for s in (0, 1)]
        self.staging = torch.empty(n, dtype=shard.dtype)  # the new params, until commit()
        swap.ring(len(self.arrays))  # the stated buffers, made now (memory_report counts them)
        self.refresh_master()
        self.master_valid = not self.separate_master
        self._filled_version = None

    def _offset(self, slot: int, key: str) -> int:
        return self._base + (slot * len(self.arrays) + self.arrays.index(key)) * self._stride

    # the current slot's tensors: what self.state[p] views (FusedZeroAdam re-views after commit())
    @property
    def state(self):
        return {k: self._views[self._slot][k] for k in self.state_keys}

    @property
    def master(self):
        return self._views[self._slot]["master"] if self.separate_master else self._param_shard

    def operands(self):
        raise NotImplementedError("an NvmeStore streams: call stream() and commit()")

    def finish(self) -> None:
        pass  # commit() wrote the params

    def nbytes(self) -> dict:
        return {"master_params": 0, "adam_state": 0}  # in memory; on disk: disk_bytes()

    def disk_bytes(self) -> int:
        """Bytes of state this store keeps on disk (one slot: the other is the next step's)."""
        return len(self.arrays) * self.n * 4

    def stream(self, run: Callable) -> Optional[str]:
        """Update the shard chunk by chunk: run(lo, hi, master, grad, *state, model) (state: a chunk of
        each of state_keys, Adam's exp_avg, exp_avg_sq) on elements [lo, hi) of the shard, with the
        state chunks read from the current slot and, after run, written to the other one. None, or
        what failed (this rank's I/O error)."""
        if self.n == 0:
            return None
        swap, chunk = self.swap, self.swap.chunk
        ring = swap.ring(len(self.arrays))
        grad = self.bucket.reduced_grad()
        if grad.device.type != "cpu":
            grad = grad.to("cpu")  # the update runs on the CPU
        shard, src, dst = self._param_shard, self._slot, 1 - self._slot
        total = padded(self.n)
        count = -(-total // chunk)
        reads: List[Optional[list]] = [None] * count
        writes: List[Optional[list]] = [None] * len(ring)  # per buffer set: the writes from it in flight

        def length(c):
            return min(chunk, total - c * chunk)

        def start_read(c):
            k = c % len(ring)
            if writes[k] is not None:  # the set's last chunk must be on disk before it is reused
                for f in writes[k]:
                    f.result()
                writes[k] = None
            reads[c] = [swap.read(buf, length(c), self._offset(src, key) + c * chunk * 4)
                        for buf, key in zip(ring[k], self.arrays)]

        try:
            for c in range(min(len(ring) - 1, count)):
                start_read(c)
            for c in range(count):
                for f in reads[c]:
                    f.result()
                reads[c] = None
                bufs = dict(zip(self.arrays, ring[c % len(ring)]))
                lo, hi = c * chunk, min((c + 1) * chunk, self.n)
                self.staging[lo:hi].copy_(shard[lo:hi])  # elements not updated keep their values
                if self.separate_master:
                    master, model = bufs["master"].tensor[:hi - lo], self.staging[lo:hi]
                else:
                    master, model = self.staging[lo:hi], None
                run(lo, hi, master, grad[lo:hi], *(bufs[k].tensor[:hi - lo] for k in self.state_keys), model)
                writes[c % len(ring)] = [swap.write(bufs[key], length(c), self._offset(dst, key) + c * chunk * 4)
                                         for key in self.arrays]
                if c + len(ring) - 1 < count:  # into the set of chunk c - 1, once its writes (issued a chunk
                    start_read(c + len(ring) - 1)  # ago, during this chunk's update) are done
            for fs in writes:
                for f in fs or ():
                    f.result()
        except NvmeOffloadError as e:
            pending = [f for fs in reads + writes for f in fs or ()]
            for f in pending:
                f.cancel()
            concurrent.futures.wait(pending)  # nothing runs on into the buffers after we return
            return f"rank {self.rank}: {e}"
        return None

    def commit(self) -> None:
        """Every rank streamed: the new params go live and the slot just written becomes current."""
        if self.n:
            self._param_shard.copy_(self.staging)
        self._slot = 1 - self._slot


def create(placed, policy: OffloadPolicy, comm, what: str, state_keys=STATE_KEYS) -> List[NvmeStore]:
    """The NvmeStores of this rank's buckets (placed: (FlatParams, bucket index) pairs), in one
    swap file under policy.path, after every rank checked its path: a collective, and every rank
    raises when any rank cannot hold its state."""
    sizes = []
    for f, b in placed:
        shard = f.param_shard(b)
        arrays = len(state_keys) + (shard.dtype != torch.float32)
        sizes.append(2 * arrays * padded(shard.numel()) * 4)
    nbytes = sum(sizes)
    rank = comm.rank if comm.distributed else 0
    problem = check_path(policy.path, nbytes)
    swap = None
    if problem is None:
        try:
            swap = SwapFile(policy.path, nbytes, rank, policy,
                            largest=max((f.param_shard(b).numel() for f, b in placed), default=1))
        except NvmeOffloadError as e:
            problem = str(e)
    problems = comm.gather_objects(problem and f"rank {rank}: {problem}", name="nvme_path")
    if any(problems):
        raise NvmeOffloadError(
            f"zerokern: {what}(offload=OffloadPolicy(device='nvme', path={policy.path!r})) cannot keep the optimizer "
            "state on disk: " + "; ".join(p for p in problems if p)
            + f". Each rank needs two slots of its shard's state ({ALIGN}-byte aligned); pass a directory on a "
            "local disk with room, on every rank")
    return [NvmeStore(f, b, swap, rank, state_keys) for f, b in placed]
