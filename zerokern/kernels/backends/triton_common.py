"""Multi-tensor plumbing shared by the Triton kernels.

A launch covers a batch of tensors: their data pointers go in an int64 table,
each tensor is cut into tiles of BLOCK elements, and a program finds its
tensor by binary search over the tiles' prefix sums (find_tensor). The table
is built on the host and copied to the device, once per distinct set of
pointers and sizes (tile_batch keeps the last few: a training loop calls with
the same tensors every step, so after the first step no copy is made). A call
that misses the cache copies, so unlike the CUDA backend this path cannot be
relied on inside a CUDA graph capture.
"""

import collections
import contextlib
import math

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def group_nonempty(tensors, keys):
    """{key: [indices]} of the non-empty tensors, grouped by keys[i] (a dtype pair: one launch each)."""
    groups = {}
    for i, (t, key) in enumerate(zip(tensors, keys)):
        if t.numel():
            groups.setdefault(key, []).append(i)
    return groups


class TileBatch:
    """Device tables for one launch over `lists` (each a list of tensors of
    equal sizes, index-aligned): table[j * count + i] is lists[j][i]'s pointer."""

    def __init__(self, lists, block, device):
        numel = [t.numel() for t in lists[0]]
        first_tile = [0]
        for n in numel:
            first_tile.append(first_tile[-1] + triton.cdiv(n, block))
        table = [t.data_ptr() for lst in lists for t in lst]
        meta = torch.tensor(table + first_tile + numel, dtype=torch.int64).to(device, non_blocking=True)
        self.count = len(numel)
        self.tiles = first_tile[-1]
        self.table = meta[: len(table)]
        self.first_tile = meta[len(table): len(table) + self.count + 1]
        self.numel = meta[len(table) + self.count + 1:]
        self.search_steps = math.ceil(math.log2(self.count)) if self.count > 1 else 0


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
def find_tensor(first_tile_ptr, n_tensors, tile, SEARCH_STEPS: tl.constexpr):
    """t with first_tile[t] <= tile < first_tile[t + 1]."""
    lo = tl.zeros((), tl.int32)
    hi = n_tensors - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        go = tl.load(first_tile_ptr + mid) <= tile
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even by hand: the same bits as torch's
    .to(bfloat16) everywhere, including under TRITON_INTERPRET, whose cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
