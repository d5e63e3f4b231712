"""SwapFile: one rank's scratch file for optimizer state on a local disk (OffloadPolicy(device="nvme")),
its checks, and the aligned buffers and threads that stream it.

[Note: NVMe swap]
- One file per rank, holding that rank's shard only, so the ranks' disks add up (ZeRO-Infinity's
  bandwidth-centric partitioning). Each store (a bucket's shard) has a region of two slots; a slot
  holds its state arrays (exp_avg, exp_avg_sq, and the fp32 master of fp16/bf16 params), each
  padded to ALIGN bytes (low-bit state: [Note: low-bit chunks on disk] in lowbit_nvme_store.py). A step reads slot s and writes slot 1 - s, so a step that fails part way
  (an I/O error on any rank) leaves slot s, and the params, as they were: nothing half-updated.
  Only when every rank's writes are done does each store flip to the new slot
  (NvmeStore.commit; FusedZeroAdam._update_streamed). ZeroOptimizer's inner torch optimizer keeps
  its per-element fp32 state as the arrays instead ([Note: inner state on disk] in
  optim/inner_stream.py).
- The step streams: a ring of `buffer_count` buffer sets of one chunk per array; chunk i+1.. is read
  while chunk i updates and chunk i-1 is written, by `io_threads` threads (os.preadv/pwritev on an
  O_DIRECT descriptor release the GIL; O_DIRECT skips the page cache, so the state does not come
  back into memory behind our back). Offsets, lengths and buffer addresses are ALIGN-aligned.
- The file is created, fully allocated (posix_fallocate: a full disk fails here, before training,
  not mid-step) and unlinked at once: it is scratch, and it goes away when the process ends, even
  when the process is killed. Checkpoints read the state through a shared mmap of the same file
  (the state tensors self.state[p] are views of it), so state_dict(), DCP and load_state_dict work
  unchanged; what they write is msync'ed before the next step reads the file.
- Before the first step every rank checks its path (exists, a writable directory, not tmpfs or
  ramfs, O_DIRECT works, enough free space) and every rank raises if any rank cannot
  (check_path; NvmeStores.create in nvme_store.py).
"""

import concurrent.futures
import ctypes
import errno
import mmap
import os
import struct
import sys
import time
import uuid
import weakref
from typing import Callable, List, Optional

import torch

ALIGN = 4096  # bytes: the largest logical block size O_DIRECT asks alignment to, and a page
FLOATS = ALIGN // 4
PROGRESS_EVERY = 5.0  # seconds: a long first fill of the file says how far it got, this often
_RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}  # statfs f_type magics


class NvmeOffloadError(RuntimeError):
    """A path for OffloadPolicy(device="nvme") that cannot hold the state, or an I/O error in a step."""


def padded(n: int) -> int:
    """n fp32 elements rounded up to whole ALIGN-byte blocks."""
    return -(-n // FLOATS) * FLOATS


def _filesystem(path: str) -> Optional[str]:
    """The name of a RAM-backed filesystem `path` is on (tmpfs, ramfs), else None (or unknown)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs: f_type (a long) first
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
        return _RAM_FILESYSTEMS.get(struct.unpack_from("l", buf.raw)[0] & 0xFFFFFFFF)
    except (OSError, AttributeError):
        return None


def check_path(path, nbytes: int) -> Optional[str]:
    """Why `path` cannot hold `nbytes` of this rank's swap file, or None."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return f"{path} does not exist (create the directory, on a local disk)"
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this process"
    ram = _filesystem(path)
    if ram is not None:
        return (f"{path} is on {ram}, which is memory: the state would stay in RAM (use a directory on a "
                "local disk, or OffloadPolicy(device='cpu'))")
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        return f"{path} has {free:,} bytes free, and this rank's state needs {nbytes:,}"
    probe = os.path.join(path, f".zerokern-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return f"{path} does not support O_DIRECT (a network or RAM-backed filesystem?)"
        return f"{path}: cannot create a file there ({e.strerror})"
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    return None


def _pread(fd, view, offset):  # the I/O calls, one place (tests make them fail here)
    return os.preadv(fd, [view], offset)


def _pwrite(fd, view, offset):
    return os.pwritev(fd, [view], offset)


class AlignedBuffer:
    """An ALIGN-aligned CPU tensor of `n` fp32 elements (pinned where CUDA is usable) and the
    memoryview the I/O calls fill."""

    def __init__(self, n: int, pin: bool):
        nbytes = n * 4
        self._raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
        start = (-self._raw.data_ptr()) % ALIGN
        self.tensor = self._raw[start:start + nbytes].view(torch.float32)
        self._c = (ctypes.c_char * nbytes).from_address(self.tensor.data_ptr())
        self.view = memoryview(self._c).cast("B")


class SwapFile:
    """One rank's scratch file (see the Note): regions handed out by `region`, state tensors viewed
    through a shared mmap, chunks moved by `read`/`write` on the I/O threads."""

    def __init__(self, directory, nbytes: int, rank: int, policy, largest: int = 1 << 62):
        self.directory = os.fspath(directory)
        self.nbytes, self.rank = nbytes, rank
        self._fill = None  # (start, last line, bytes) of a first fill in progress (progress())
        name = f"zerokern-swap-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self.path = os.path.join(self.directory, name)
        fd = dfd = -1
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # a full disk fails here, not mid-step
            dfd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        except OSError as e:
            for f in (fd, dfd):
                if f >= 0:
                    os.close(f)
            if os.path.exists(self.path):
                os.unlink(self.path)
            raise NvmeOffloadError(f"{self.path}: could not create {nbytes:,} bytes ({e.strerror})") from e
        os.unlink(self.path)  # scratch: gone with the last descriptor, even if the process is killed
        self._fd, self._dfd = fd, dfd
        self._mm = mmap.mmap(fd, max(nbytes, ALIGN), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._used = 0
        # elements per array and chunk: as asked, but no larger than the largest shard needs, and a
        # multiple of 2 * FLOATS, so that a chunk of a 2-byte array (bf16 params on disk) is whole blocks too
        unit = 2 * FLOATS
        self.chunk = max(unit, min(int(policy.chunk_mb * 2**20) // 4 // unit * unit, -(-largest // unit) * unit))
        self.buffer_count = policy.buffer_count
        self._pin = policy.pin_memory and torch.cuda.is_available()
        self._ring = {}  # arrays per chunk -> the ring of buffer sets, made at the first step
        self._pool = concurrent.futures.ThreadPoolExecutor(policy.io_threads, thread_name_prefix="zerokern-nvme")
        self._finalizer = weakref.finalize(self, SwapFile._close, self._mm, self._pool, fd, dfd)

    @staticmethod
    def _close(mm, pool, fd, dfd):
        pool.shutdown(wait=True)
        try:
            mm.close()
        except BufferError:  # state tensors still view it: the mapping goes with the process
            pass
        for f in (fd, dfd):
            os.close(f)

    def region(self, nbytes: int) -> int:
        """The byte offset of a new region of `nbytes` (a multiple of ALIGN)."""
        offset, self._used = self._used, self._used + nbytes
        assert nbytes % ALIGN == 0 and self._used <= self.nbytes, (nbytes, self._used, self.nbytes)
        return offset

    def tensor(self, offset: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """n elements of the file at byte `offset`, through the shared mapping (frombuffer refuses 0)."""
        if n == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=n, offset=offset)

    def advise(self, offset: int, nbytes: int, need: bool) -> None:
        """Tell the kernel what of the file the mapping reads next: need=True starts reading
        [offset, offset + nbytes) into the page cache now (asynchronous readahead); need=False
        says it was read and goes out of memory (its pages leave this process and the page
        cache; a page written through the mapping is kept until it is on disk)."""
        if nbytes <= 0:
            return
        if need:
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
        else:
            if offset % mmap.PAGESIZE == 0:  # regions are ALIGN-aligned: a page here, not with 64 KB pages
                self._mm.madvise(mmap.MADV_DONTNEED, offset, nbytes)
            os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)

    def flush(self) -> None:
        """Write what went through the mapping (a loaded state dict, a refreshed master) to the
        file, before the O_DIRECT reads."""
        self._mm.flush()

    def progress(self, nbytes: int) -> None:
        """Count `nbytes` of a first fill of the file (params moved in, masters written): one that
        takes longer than PROGRESS_EVERY seconds says so on stderr, every PROGRESS_EVERY seconds."""
        now = time.monotonic()
        start, last, done = self._fill or (now, now, 0)
        done += nbytes
        if now - last >= PROGRESS_EVERY:
            print(f"zerokern: rank {self.rank}: writing the first values of {self.path}: {done / 1e9:.2f} GB so far, "
                  f"{done / 1e9 / max(now - start, 1e-6):.2f} GB/s", file=sys.stderr, flush=True)
            last = now
        self._fill = (start, last, done)

    def progress_done(self) -> None:
        """The fill is over: a fill that printed progress says it ended."""
        if self._fill is not None:
            start, last, done = self._fill
            if last > start:
                print(f"zerokern: rank {self.rank}: wrote {done / 1e9:.2f} GB into {self.path} in "
                      f"{time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
        self._fill = None

    def ring(self, arrays: int):
        """buffer_count sets of `arrays` aligned chunk buffers (made once, then reused by every store)."""
        if arrays not in self._ring:
            self._ring[arrays] = [[AlignedBuffer(self.chunk, self._pin) for _ in range(arrays)]
                                  for _ in range(self.buffer_count)]
        return self._ring[arrays]

    def buffer_bytes(self) -> int:
        return sum(len(s) * self.chunk * 4 for ring in self._ring.values() for s in ring)

    def read(self, buf: AlignedBuffer, n: int, offset: int):
        """A future: n fp32 of the file at `offset` into buf."""
        return self._pool.submit(self._io, "read", buf.view[:n * 4], offset)

    def write(self, buf: AlignedBuffer, n: int, offset: int):
        return self._pool.submit(self._io, "write", buf.view[:n * 4], offset)

    def _io(self, op, view, offset):
        done, total = 0, len(view)
        call = _pread if op == "read" else _pwrite
        while done < total:
            try:
                got = call(self._dfd, view[done:], offset + done)
            except OSError as e:
                raise NvmeOffloadError(f"{op} of {total - done:,} bytes at byte {offset + done:,} of {self.path} "
                                       f"(an unlinked scratch file): {e.strerror or e}") from e
            if got <= 0:
                raise NvmeOffloadError(f"{op} of {total - done:,} bytes at byte {offset + done:,} of {self.path}: "
                                       "the file ended")
            done += got


def stream_chunks(ring, count: int, read: Callable, update: Callable, write: Callable) -> None:
    """The step's pipeline over `count` chunks ([Note: NVMe swap]), for both stores: chunk c uses the
    buffer set ring[c % len(ring)]; read(c, bufs) and write(c, bufs) issue its I/O (lists of
    futures), update(c, bufs) runs between them. Reads run len(ring) - 1 chunks ahead, and a set is
    read into again only once the writes from it are done, so chunk c + 1 reads and chunk c - 1
    writes while chunk c updates. An NvmeOffloadError cancels or waits for every outstanding I/O
    (nothing runs on into the buffers after it returns) and propagates."""
    reads: List[Optional[list]] = [None] * count
    writes: List[Optional[list]] = [None] * len(ring)  # per buffer set: the writes from it in flight

    def start_read(c):
        k = c % len(ring)
        for f in writes[k] or ():  # the set's last chunk must be on disk before it is reused
            f.result()
        writes[k] = None
        reads[c] = read(c, ring[k])

    try:
        for c in range(min(len(ring) - 1, count)):
            start_read(c)
        for c in range(count):
            for f in reads[c]:
                f.result()
            reads[c] = None
            update(c, ring[c % len(ring)])
            writes[c % len(ring)] = write(c, ring[c % len(ring)])
            if c + len(ring) - 1 < count:  # into the set of chunk c - 1, once its writes (issued a chunk
                start_read(c + len(ring) - 1)  # ago, during this chunk's update) are done
        for fs in writes:
            for f in fs or ():
                f.result()
    except NvmeOffloadError:
        pending = [f for fs in reads + writes for f in fs or ()]
        for f in pending:
            f.cancel()
        concurrent.futures.wait(pending)
        raise


def open_swap(swap_class, policy, nbytes: int, largest: int, comm, what: str) -> "SwapFile":
    """This rank's swap file of `nbytes` under policy.path, after every rank checked its path: a
    collective, and every rank raises when any rank cannot hold its state (both stores' create())."""
    rank = comm.rank if comm.distributed else 0
    problem = check_path(policy.path, nbytes)
    swap = None
    if problem is None:
        try:
            swap = swap_class(policy.path, nbytes, rank, policy, largest=largest)
        except NvmeOffloadError as e:
            problem = str(e)
    problems = comm.gather_objects(problem and f"rank {rank}: {problem}", name="nvme_path")
    if any(problems):
        raise NvmeOffloadError(
            f"zerokern: {what}(offload=OffloadPolicy(device='nvme', path={policy.path!r})) cannot keep the optimizer "
            "state on disk: " + "; ".join(p for p in problems if p)
            + f". Each rank needs two slots of its shard's state ({ALIGN}-byte aligned); pass a directory on a "
            "local disk with room, on every rank")
    return swap
