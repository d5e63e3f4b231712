"""Multi-tensor plumbing shared by the Triton kernels.

A launch covers a batch of tensors: their data pointers go in an int64 table,
each tensor is cut into tiles of BLOCK elements, one program per tile. A
program finds its tensor with one load from a tile -> tensor map (a binary
search over the tiles' prefix sums would be a chain of dependent loads before
the first data load), then loads that tensor's pointers, first tile and size,
all independent of each other. The tables are built on the host and copied to
the device once per distinct set of pointers and sizes (tile_batch keeps the
last few: a training loop calls with the same tensors every step, so after the
first step nothing is copied and nothing waits: see [Note: host cost]).

[Note: vector access in Triton]
Triton vectorizes a load or store when it can prove the address alignment and
that the mask is constant over a vector. Pointers read from a table prove
nothing, so the host checks them: when every pointer of a launch is 16-byte
aligned the kernel is compiled with ALIGNED and hints it (tl.multiple_of).
Full tiles run unmasked; only a tensor's last, partial tile is masked.
tests/kernels/test_codegen.py compiles every variant for sm_90 and reads the PTX.
"""

import collections
import contextlib
import itertools

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def aligned16(tensors):
    """Whether every tensor's data starts on a 16-byte boundary (vector access possible)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def group_nonempty(tensors, keys):
    """{key: [indices]} of the non-empty tensors, grouped by keys[i] (a dtype pair: one launch each)."""
    groups = {}
    for i, (t, key) in enumerate(zip(tensors, keys)):
        if t.numel():
            groups.setdefault(key, []).append(i)
    return groups


class TileBatch:
    """Device tables for one launch over `lists` (each a list of tensors of
    equal sizes, index-aligned): table[j * count + i] is lists[j][i]'s pointer,
    first_tile[i] / numel[i] tensor i's first tile and size, tile_tensor[k] the
    tensor tile k belongs to. `aligned`: every pointer is a multiple of 16 bytes."""

    def __init__(self, lists, block, device):
        numel = [t.numel() for t in lists[0]]
        tiles = [triton.cdiv(n, block) for n in numel]
        first_tile = [0, *itertools.accumulate(tiles)]
        table = [t.data_ptr() for lst in lists for t in lst]
        host = torch.tensor(table + first_tile + numel, dtype=torch.int64)
        tile_tensor = torch.repeat_interleave(torch.arange(len(numel), dtype=torch.int32), torch.tensor(tiles))
        if device.type == "cuda":
            # Pinned, so the copies are asynchronous; kept (self._host) until the batch goes.
            host, tile_tensor = host.pin_memory(), tile_tensor.pin_memory()
        self._host = (host, tile_tensor)
        meta = host.to(device, non_blocking=True)
        self.tile_tensor = tile_tensor.to(device, non_blocking=True)
        self.count = len(numel)
        self.tiles = first_tile[-1]
        self.aligned = all(ptr % 16 == 0 for ptr in table)  # callers group by alignment (aligned16)
        self.table = meta[: len(table)]
        self.first_tile = meta[len(table): len(table) + self.count + 1]
        self.numel = meta[len(table) + self.count + 1:]


def device_guard(device):
    """Triton launches on the current CUDA device, not on its arguments': a launch for tensors on
    cuda:1 while cuda:0 is current must switch first, as the CUDA backend's device guard does."""
    if device is not None and device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


_BATCHES = collections.OrderedDict()
_CACHED_BATCHES = 64  # a model's dtype groups times a few buckets; each entry is a small device tensor


def tile_batch(lists, block, device):
    """The TileBatch for `lists`, reused while the pointers, sizes and device are the same.
    Reuse is exact: the table holds nothing but those pointers and sizes."""
    key = (tuple(t.data_ptr() for lst in lists for t in lst), tuple(t.numel() for t in lists[0]), block,
           str(device))
    batch = _BATCHES.get(key)
    if batch is None:
        batch = _BATCHES[key] = TileBatch(lists, block, device)
        if len(_BATCHES) > _CACHED_BATCHES:
            _BATCHES.popitem(last=False)
    else:
        _BATCHES.move_to_end(key)
    return batch


@triton.jit
def tensor_pointer(table_ptr, j, n_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer j of tensor t (lists[j][t] of the TileBatch), typed, with the alignment the host proved."""
    ptr = tl.load(table_ptr + j * n_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # on the pointer: a hint on the integer is lost in the cast (sm_90 PTX stays scalar)
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even by hand: the same bits as torch's
    .to(bfloat16) everywhere, including under TRITON_INTERPRET, whose cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
