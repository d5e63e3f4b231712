"""The numbers of quantized collectives, defined once in plain PyTorch: what a rank puts on the
wire for a chunk of fp32 values at int8 or int4, and what the receiver reads back. Every backend
of wire_ops must give these bytes (tests compare them against this file).

[Note: the wire format] A chunk of n fp32 values is cut into blocks of BLOCK elements, counted
from its first element (the last block may be short). Each block keeps one fp32 scale,
absmax / QMAX (QMAX = 127 for int8, 7 for int4), and one signed code per element,
floor(x * inv + u) with inv = 1 / scale, in one of two roundings: stochastic (the default), u =
r / 65536 with r the 16 random bits of [Note: reproducible rounding] (lowbit.py) for the
element's global index, the reduction's step and the stream, so E[code * scale] = x and a rerun
gives the same bytes; or to nearest (stochastic=False), u = 0.5 (r = 2^15; ties round up), which
reads no random bits. Grad reductions round to nearest when they keep error feedback and
stochastically when not ([Note: rounding with error feedback] in zero/comm/wire.py). The
codes are clamped to [-QMAX, QMAX] (x * inv may round a hair past QMAX). A block of zeros has
scale 0 and codes 0. A block holding an inf or a NaN gets scale NaN and codes 0, so every value it
decodes to is NaN: an overflow on one rank reaches every rank's reduced grads, and the step is
skipped everywhere, as it is without quantization. A block whose scale is below 2^-128 (absmax
under ~3.7e-37) has 1 / scale = inf: there x * inv is x / scale instead.
(Both last rules were added with the kernels: before, x * inf gave every non-zero element of such
a tiny block +-QMAX (1e-40 beside 3e-38 decoded as 3e-38), and 0 * inf or inf * 0 gave NaN, whose
cast to int is undefined: the codes of those elements were whatever the device's cast makes.)
The bytes of a chunk: its fp32 scales (4 per block), then its codes: int8 one byte each
(two's complement); int4 two to a byte, code + 8 (1..15), the even element in the low nibble.
One chunk is one contiguous uint8 tensor, so a collective moves codes and scales together.
"""

import torch

from . import lowbit

# elements per scale: 64, where the low-bit state's blocks are 256. int4 grads with error feedback
# and stochastic rounding cost a byte-level GPT 0.73-0.98% of its eval loss after 300 steps in blocks
# of 256, 0.27-0.63% in blocks of 64; rounded to nearest in blocks of 64, 0.12-0.14% (2 seeds,
# bench/lowbit_loss.py, 2026-12-03). The scales take 0.5 bits per value (int4: 4.5 in all).
BLOCK = 64
QMAX = {8: 127, 4: 7}
STREAM_WIRE = 8  # the Philox counter's word 3 is STREAM_WIRE + the stream a caller passes (lowbit's are 0-2)


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def code_nbytes(n: int, bits: int) -> int:
    return n if bits == 8 else (n + 1) // 2


def nbytes(n: int, bits: int) -> int:
    """Bytes of an encoded chunk of n values."""
    return 4 * num_blocks(n) + code_nbytes(n, bits)


def stride(n: int, bits: int) -> int:
    """The bytes a chunk of n values takes in a collective's buffer: nbytes rounded up to 4, so
    every chunk's fp32 scales start 4-byte aligned (an int4 or int8 chunk of odd length would not)."""
    return -(-nbytes(n, bits) // 4) * 4


def _check_bits(bits):
    if bits not in QMAX:
        raise ValueError(f"zerokern: wire precision of {bits} bits; int8 (8) and int4 (4) are offered")


def scales_of(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Each block's scale (fp32): absmax / QMAX, NaN where the block is not finite."""
    n = x.numel()
    pad = num_blocks(n) * BLOCK - n
    a = torch.nn.functional.pad(x.abs(), (0, pad)) if pad else x.abs()
    absmax = a.view(-1, BLOCK).amax(dim=1) if n else x.new_zeros(0)
    scale = absmax / QMAX[bits]
    return torch.where(torch.isfinite(absmax), scale, torch.full_like(scale, float("nan")))


def codes_of(x: torch.Tensor, scales: torch.Tensor, bits: int, seed: int, step: int, stream: int,
             base: int, stochastic: bool = True) -> torch.Tensor:
    """int32 codes of flat fp32 `x` under `scales`, rounded stochastically or to nearest
    ([Note: the wire format])."""
    n, q = x.numel(), QMAX[bits]
    ok = torch.isfinite(scales) & (scales > 0)
    safe = torch.where(ok, scales, torch.ones_like(scales))
    inv = 1.0 / safe
    per = lambda t: t.repeat_interleave(BLOCK)[:n]  # noqa: E731  a block's value for each element
    # x * (1 / scale), one division per block; x / scale where 1 / scale overflows; 0 where not ok
    v = torch.where(per(torch.isinf(inv)), x / per(safe), x * per(inv))
    v = torch.where(per(ok), v, torch.zeros_like(v))
    if stochastic:
        r = lowbit.random16(seed, step, STREAM_WIRE + stream, lowbit.element_index(base, n, x.device))
        u = r.to(torch.float32) * (1.0 / 65536.0)
    else:
        u = torch.full_like(v, 0.5)  # r = 2^15 for every element: floor(v + 0.5)
    return torch.floor(v + u).clamp_(-q, q).to(torch.int32)


def encode(x: torch.Tensor, bits: int, seed: int, step: int, stream: int, base: int,
           stochastic: bool = True) -> torch.Tensor:
    """The wire bytes (uint8, nbytes(n, bits)) of flat fp32 `x`; base: the global index of x[0].
    stochastic=False: round to nearest (seed, step and stream are then unused)."""
    _check_bits(bits)
    x = x.reshape(-1).float()
    scales = scales_of(x, bits)
    codes = codes_of(x, scales, bits, seed, step, stream, base, stochastic)
    if bits == 8:
        packed = codes.to(torch.int8).view(torch.uint8)
    else:
        nib = (codes + 8).to(torch.uint8)
        if nib.numel() % 2:
            nib = torch.cat([nib, nib.new_zeros(1)])
        packed = nib[0::2] | (nib[1::2] << 4)
    return torch.cat([scales.view(torch.uint8), packed])


def decode(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The fp32 values (n) of wire bytes `buf`: code * scale."""
    _check_bits(bits)
    nb = num_blocks(n)
    scales = buf[:4 * nb].view(torch.float32)
    packed = buf[4 * nb:4 * nb + code_nbytes(n, bits)]
    if bits == 8:
        codes = packed.view(torch.int8).to(torch.float32)
    else:
        nib = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:n]
        codes = nib.to(torch.float32) - 8.0
    return codes * scales.repeat_interleave(BLOCK)[:n]


def encode_with_error(x: torch.Tensor, bits: int, seed: int, step: int, stream: int, base: int,
                      stochastic: bool = True):
    """(wire bytes, what they lose: x - decode(bytes)). The error is 0 in a block that is not
    finite (its values are skipped with the step, not carried)."""
    buf = encode(x, bits, seed, step, stream, base, stochastic)
    err = x.reshape(-1).float() - decode(buf, x.numel(), bits)
    return buf, torch.nan_to_num(err, nan=0.0, posinf=0.0, neginf=0.0)
