"""The numbers of low-bit optimizer state, defined once in plain PyTorch: blockwise 8-bit
quantization with a dynamic map, a counter-based random stream, and stochastic rounding to
bf16. Every backend of fused_adam_lowbit_ must give these bits (the reference backend is this
file; tests compare the others against it).

[Note: blockwise 8-bit state] (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", 2021.) A moment tensor is cut into blocks of BLOCK elements, counted from the
tensor's first element (the last block may be short). Each block keeps one fp32 scale, its
absmax, and one uint8 code per element: the index of the map value nearest to x / absmax.
The maps are "dynamic": each decade (10^-E, 10^-(E+1)] gets its own linear grid, finer near
1 and coarser further down, so one code covers seven decades below the block's largest value.
The signed map (Adam's exp_avg) has 127 values of each sign and 0 (code 255 repeats 1.0 and is
never produced); the unsigned one (exp_avg_sq) 255 positive values and 0. x / absmax is computed
as x * (1 / absmax) in fp32 (one division per block), and the nearest map value is decided against
the midpoints between map values, computed once in fp32: code = how many midpoints are below it (a
tie goes to the smaller value). An all-zero block has scale 0 and every code that of 0.

[Note: reproducible rounding] Stochastic rounding draws from Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; Triton's tl.philox is the same
function), keyed by the seed and counted by (element index // 8, step, stream): one call gives
four 32-bit words, so eight elements each take a 16-bit half. The element index is global,
counted over the optimizer's params in order (not over buckets or shards), so a run draws the
same numbers at every world size, stage, backend and thread count.
"""

import functools

import torch

BLOCK = 256  # elements per quantization block (torchao's AdamW8bit uses 256 too)

STREAM_PARAM, STREAM_EXP_AVG, STREAM_EXP_AVG_SQ = 0, 1, 2  # Philox counter word 3: what is rounded

_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)


# --- the maps -----------------------------------------------------------------

def _decades(fraction_bits):
    """The dynamic map's positive values: decade E (E = 0, 1, ...) holds 2**fraction_bits[E]
    points spaced evenly over (0.1, 1] * 10^-E, its top exactly 10^-E."""
    out = []
    for e, f in enumerate(fraction_bits):
        n = 2 ** f
        out += [10.0 ** -e * (0.1 + 0.9 * (j + 1) / n) for j in range(n)]
    return out


@functools.lru_cache(maxsize=None)
def _map_cpu(signed: bool) -> torch.Tensor:
    if signed:
        pos = _decades([6, 5, 4, 3, 2, 1, 0])  # 127 values
        values = sorted([-v for v in pos] + [0.0] + pos) + [1.0]  # code 255: unused
    else:
        values = sorted([0.0] + _decades([7, 6, 5, 4, 3, 2, 1, 0]))  # 255 + 1
    t = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    assert t.numel() == 256
    return t


def qmap(signed: bool, device=None) -> torch.Tensor:
    """The 256 map values (fp32, ascending): code c stands for qmap[c] * the block's scale."""
    t = _map_cpu(signed)
    return t if device is None else t.to(device)


def midpoints(signed: bool, device=None) -> torch.Tensor:
    """The 255 fp32 midpoints between neighbouring map values (the quantizer's thresholds)."""
    m = _map_cpu(signed)
    return ((m[:-1] + m[1:]) * 0.5).to(device if device is not None else m.device)


CELL_SHIFT = 16  # a float's cell: its top 16 bits (sign, exponent, 7 mantissa bits)


@functools.lru_cache(maxsize=None)
def _cells(signed: bool):
    """[Note: quantizing by cells] A binary search over 255 midpoints is 8 dependent loads per
    element. The kernels look up the float's cell instead (its top 16 bits): cells[c] is how many
    midpoints lie below the cell's smallest value, and no cell holds more than one midpoint (the
    map's steps are wider than the cells, checked here), so code = cells[c] + (mid[cells[c]] < x):
    the same code as the search, from two table reads. Returns (cells int32 [65536], the midpoints
    padded with +inf to 256)."""
    mid = midpoints(signed)
    top = torch.arange(1 << 16, dtype=torch.int64)
    # each cell's smallest and largest value: positive cells run up in magnitude, negative down
    lo_bits, hi_bits = top << CELL_SHIFT, (top << CELL_SHIFT) | ((1 << CELL_SHIFT) - 1)
    neg = top >= (1 << 15)
    smallest = torch.where(neg, hi_bits, lo_bits)
    largest = torch.where(neg, lo_bits, hi_bits)

    def as_float(b):
        return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)

    lo, hi = as_float(smallest), as_float(largest)
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    cells = torch.bucketize(lo, mid, right=False)
    inside = torch.bucketize(hi, mid, right=False) - cells  # midpoints in [lo, hi)... at most one
    assert int(inside[finite].max()) <= 1, "a cell holds two midpoints: the map's steps are too fine"
    padded = torch.cat([mid, torch.tensor([float("inf")])])
    return cells.to(torch.int32), padded


# (lowbit.h's kKeyExpLo and kKeyEntries: the kernels compute the same rows)
KEY_EXP_LO = 96  # the keyed table's lowest exponent (2^-31): every midpoint lies above 2^-26
KEY_ENTRIES = 1 << 13  # sign, 32 exponents (96 .. 127), the top 7 mantissa bits


def key_index(xbits: torch.Tensor) -> torch.Tensor:
    """The keyed table's row of each fp32 bit pattern (int64, as unsigned 32-bit) whose exponent is
    at most 127 (|x| < 2): sign, exponent clamped below at KEY_EXP_LO, top 7 mantissa bits."""
    e = ((xbits >> 23) & 0xFF).clamp(min=KEY_EXP_LO) - KEY_EXP_LO
    return ((xbits >> 31) << 12) | (e << 7) | ((xbits >> CELL_SHIFT) & 0x7F)


def _key(xbits: torch.Tensor) -> torch.Tensor:
    """The low 16 bits of a float, flipped for negative floats: within one cell, key order is float
    order (negative floats run down in magnitude)."""
    return (xbits & 0xFFFF) ^ torch.where(xbits >> 31 == 1, 0xFFFF, 0)


@functools.lru_cache(maxsize=None)
def _keyed(signed: bool) -> torch.Tensor:
    """[Note: quantizing by keys] The AVX-512 and AVX2 kernels' cell table, small enough for L1
    (32 KiB, int32; the cells table is 256 KiB): cells at or below 2^-31 all hold the same count
    (no midpoint is that small), so only 32 exponents need rows; and instead of the midpoint's
    float each row holds its key (its low 16 bits, ordered), which decides the compare within the
    cell. Row r = count | threshold << 8: code = count + (key(x) > threshold), where threshold
    is the key of the cell's midpoint, or 0xFFFF (never exceeded) when no midpoint lies in the
    cell. Elements with exponent above 127 (|x| >= 2: only an inf or NaN block reaches it) use
    the cells table. One gather per element instead of two."""
    cells, mid = _cells(signed)
    assert float(mid[:255].abs().min()) > 2.0 ** (KEY_EXP_LO - 127 + 5), "a midpoint below the keyed table"
    row = torch.arange(KEY_ENTRIES, dtype=torch.int64)
    top = ((row >> 12) << 15) | ((((row >> 7) & 31) + KEY_EXP_LO) << 7) | (row & 0x7F)  # the cell's top 16 bits
    count = cells.long()[top]
    mbits = mid.view(torch.int32).to(torch.int64)[count] & 0xFFFFFFFF
    threshold = torch.where((mbits >> CELL_SHIFT) == top, _key(mbits), 0xFFFF)
    return (count | (threshold << 8)).to(torch.int32)


def quantize_by_keys(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """The keyed table's codes of x (flat fp32, |x| < 2): for the tests."""
    xbits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    entry = _keyed(signed).long()[key_index(xbits)]
    return ((entry & 0xFF) + (_key(xbits) > (entry >> 8)).long()).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _maps(device: str):
    if device != "cpu":  # the CPU's tables, copied: built once per process (~0.2 s), however many devices
        return [t.to(device) for t in _maps("cpu")]
    out = []
    for signed in (True, False):
        cells, mid = _cells(signed)
        out += [qmap(signed, device), mid.to(device), cells.to(device)]
    return out + [_keyed(True).to(device), _keyed(False).to(device)]


def maps(device) -> list:
    """[signed map, its midpoints (padded), its cells, the same three unsigned, the signed and the
    unsigned keyed tables] on `device`: the tables compiled kernels read ([Note: quantizing by
    cells], [Note: quantizing by keys])."""
    return _maps(str(torch.device(device)))


def quantize_by_cells(x: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """The kernels' way to the codes of x * (1 / scale) (flat, scale per element): for the tests."""
    cells, mid = _cells(signed)
    inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    normed = x * inv
    c = cells[(normed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> CELL_SHIFT].long()
    return (c + (mid[c] < normed).long()).to(torch.uint8)


# --- quantization ---------------------------------------------------------------

def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def block_absmax(x: torch.Tensor) -> torch.Tensor:
    """The absmax of each BLOCK-element block of flat fp32 `x` (the last one may be short)."""
    n = x.numel()
    pad = num_blocks(n) * BLOCK - n
    a = torch.nn.functional.pad(x.abs(), (0, pad)) if pad else x.abs()
    return a.view(-1, BLOCK).amax(dim=1) if n else x.new_zeros(0)


def quantize(x: torch.Tensor, signed: bool):
    """(codes uint8 like x, scales fp32 [num_blocks]) of flat fp32 `x`."""
    x = x.reshape(-1)
    scales = block_absmax(x)
    # x times the fp32 reciprocal of its block's absmax (one division per block); 0 in an all-zero block
    inv = torch.where(scales > 0, 1.0 / torch.where(scales > 0, scales, torch.ones_like(scales)),
                      torch.zeros_like(scales))
    normed = x * inv.repeat_interleave(BLOCK)[:x.numel()]
    codes = torch.bucketize(normed, midpoints(signed, x.device), right=False)
    return codes.to(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of `codes` (flat) with their blocks' `scales`."""
    codes = codes.reshape(-1)
    per = scales.repeat_interleave(BLOCK)[:codes.numel()]
    return qmap(signed, codes.device)[codes.long()] * per


# [Note: the second moment as its square root] An element whose gradient is 1e-4 of its block's
# largest has exp_avg 1e-4 of the block's absmax, but exp_avg_sq 1e-8: below the unsigned map's
# seven decades, so it decoded to 0 and the update m / (sqrt(0) + eps) blew up (a GPT on text
# diverged from step 100 on). int8 exp_avg_sq therefore holds sqrt(exp_avg_sq), with the range of
# exp_avg; the update needs the square root anyway. (bf16 and fp32 state hold exp_avg_sq itself.)

def encode_moment(x: torch.Tensor, second: bool):
    """(codes, scales) of Adam's exp_avg (second=False, signed map) or exp_avg_sq (its square root,
    unsigned map)."""
    return quantize(x.sqrt() if second else x, signed=not second)


def decode_moment(codes: torch.Tensor, scales: torch.Tensor, second: bool) -> torch.Tensor:
    """fp32 exp_avg or exp_avg_sq of int8 codes (encode_moment's inverse, up to its rounding)."""
    y = dequantize(codes, scales, signed=not second)
    return y * y if second else y


# --- the random stream ----------------------------------------------------------

def _mulhilo(a: int, b: torch.Tensor):
    """(high, low) 32-bit words of a * b, a a 32-bit constant, b int64 holding uint32 values.
    The product needs 64 unsigned bits, more than int64 holds, so b is split in 16-bit halves."""
    bh, bl = b >> 16, b & 0xFFFF
    hi_part, lo_part = a * bh, a * bl  # each < 2**48
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return hi, lo


def philox4x32(c0, c1, c2, c3, seed: int, rounds: int = 10):
    """Philox4x32 (counters: int64 tensors holding uint32 values; key: the seed's two 32-bit
    halves). Returns the four output words the same way."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return c0, c1, c2, c3


def random16(seed: int, step: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 65536)) for each global element index in `index` (int64)."""
    group = index >> 3
    words = philox4x32(group & _M32, (group >> 32) & _M32, torch.full_like(group, step & _M32),
                       torch.full_like(group, stream), seed)
    which = (index >> 1) & 3
    word = torch.where(which == 0, words[0], torch.where(which == 1, words[1],
                                                         torch.where(which == 2, words[2], words[3])))
    return (word >> (16 * (index & 1))) & 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, rand16: torch.Tensor) -> torch.Tensor:
    """fp32 `x` rounded to bf16 up or down with probability given by its distance to each: the 16
    random bits are added to the fp32 bit pattern, which is then cut to its top 16 bits (the
    expectation is x). NaN stays NaN; inf stays inf."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    top = ((bits + rand16) >> 16) & 0xFFFF
    top = torch.where(torch.isnan(x), torch.full_like(top, 0x7FC0), top)
    top = torch.where(torch.isinf(x), bits >> 16, top)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16)


def element_index(base: int, n: int, device) -> torch.Tensor:
    return torch.arange(base, base + n, dtype=torch.int64, device=device)
