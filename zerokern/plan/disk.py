"""The planner's disk: a path's O_DIRECT bandwidth, measured without torch, and what a step with the
optimizer state on disk (OffloadPolicy(device="nvme")) moves and how long the disk takes for it.

    python -m zerokern.plan --params 7e9 --dp 8 --offload-optimizer nvme --measure-disk /local_nvme

A step reads each state array of a rank's shard from one slot and writes it to the other
([Note: NVMe swap] in zerokern/zero/state/swap.py): the state's bytes each way. One disk serves
both, so the disk's time is bytes / read rate + bytes / write rate; the update overlaps it.
"""

import mmap
import os
import time
import uuid
from typing import NamedTuple

BLOCK = 16 << 20  # bytes per I/O, as the optimizer's default chunk


class DiskRate(NamedTuple):
    read_gbs: float
    write_gbs: float
    path: str

    def seconds(self, nbytes_each_way: float) -> float:
        """What one step's reads and writes of `nbytes_each_way` take on this disk."""
        return nbytes_each_way / (self.read_gbs * 1e9) + nbytes_each_way / (self.write_gbs * 1e9)


def measure(path: str, nbytes: int = 256 << 20) -> DiskRate:
    """Write then read `nbytes` at `path` with O_DIRECT (page-aligned buffers from an anonymous map)."""
    if not os.path.isdir(path):
        raise ValueError(f"--measure-disk {path}: not a directory")
    name = os.path.join(path, f".zerokern-disk-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (BLOCK // 4096))
    view = memoryview(buf)
    count = max(1, nbytes // BLOCK)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as e:
        raise ValueError(f"--measure-disk {path}: cannot write there with O_DIRECT ({e.strerror})") from e
    try:
        t = time.perf_counter()
        for k in range(count):
            os.pwritev(fd, [view], k * BLOCK)
        os.fsync(fd)
        write = count * BLOCK / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        for k in range(count):
            os.preadv(fd, [view], k * BLOCK)
        read = count * BLOCK / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)
        os.unlink(name)
        view.release()
        buf.close()
    return DiskRate(read, write, path)


def state_bytes_per_param(dtype: str) -> int:
    """Bytes of optimizer state on disk per param of a rank's shard: Adam's two fp32 moments, and
    the fp32 master of fp16/bf16 params (fp32 params are their own masters, in memory)."""
    return 8 if dtype == "fp32" else 12
