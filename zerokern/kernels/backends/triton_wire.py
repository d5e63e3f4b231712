"""Triton wire-format kernels: one program per block of wire.BLOCK elements, seen as its even and
its odd elements (int4 packs each pair into one byte; int8 stores the two halves apart). The
numbers are wire.py's; the random bits are triton_lowbit's _random16 (tl.philox, the reference's
Philox).

Launched with enable_fp_fusion=False: x * inv + u, x - code * scale and out + code * scale are each
two roundings in the reference, and Triton would otherwise fuse them into one FMA. The scales are
read and written a byte at a time, since a chunk's bytes need not start 4-aligned.
"""

import torch
import triton
import triton.language as tl

from .. import wire
from . import triton_common
from .triton_lowbit import _random16

BLOCK = wire.BLOCK
# every launch's compile options: see the module's docstring (tests/kernels/codegen_triton.py compiles with them too)
OPTIONS = {"enable_fp_fusion": False}


@triton.jit
def _load_f32(ptr, offs, mask, X_BF16: tl.constexpr):
    """x as fp32; bf16 by its bits (Triton's interpreter converts subnormal bf16 wrongly: 4.2e-39
    came back 5.1e-39)."""
    if X_BF16:
        h = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.uint16, bitcast=True)
        return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_side(ptr, offs, v, mask, BF16: tl.constexpr):
    """An error as fp32, or as bf16 rounded to nearest even by its bits (as the reference's cast; the
    values are finite)."""
    if BF16:
        w = v.to(tl.uint32, bitcast=True)
        h = (w + 0x7FFF + ((w >> 16) & 1)) >> 16
        tl.store(ptr + offs, h.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, v, mask=mask)


@triton.jit
def _codes(x, mask, ok, safe, inv, big, seed, step, stream, index, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """int32 codes of one half block ([Note: the wire format]); 0 where the block is not ok."""
    v = tl.where(big, tl.div_rn(x, safe), x * inv)
    if STOCHASTIC:
        u = _random16(seed, step, stream, index).to(tl.float32) * (1.0 / 65536.0)
    else:
        u = 0.5  # round to nearest: floor(v + 0.5)
    t = tl.minimum(tl.maximum(tl.floor(v + u), -QMAX), QMAX)
    return tl.where(ok & mask, t, 0.0).to(tl.int32)


@triton.jit
def _encode_kernel(x_ptr, out_ptr, err_ptr, res_ptr, n, nb, seed, step, stream, base,
                   BITS: tl.constexpr, HAS_ERR: tl.constexpr, X_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                   HAS_RES: tl.constexpr, RES_BF16: tl.constexpr, ERR_BF16: tl.constexpr, BLOCK: tl.constexpr):
    QMAX: tl.constexpr = 127.0 if BITS == 8 else 7.0
    HALF: tl.constexpr = BLOCK // 2
    blk = tl.program_id(0).to(tl.int64)
    even = blk * BLOCK + 2 * tl.arange(0, HALF).to(tl.int64)
    odd = even + 1
    me, mo = even < n, odd < n
    xe = _load_f32(x_ptr, even, me, X_BF16)
    xo = _load_f32(x_ptr, odd, mo, X_BF16)
    if HAS_RES:  # x + residual, read before the error (which may be the residual) is written
        xe = xe + _load_f32(res_ptr, even, me, RES_BF16)
        xo = xo + _load_f32(res_ptr, odd, mo, RES_BF16)
    # absmax as the largest |x| bit pattern (integer order is float order; a NaN is above inf)
    top = tl.maximum(tl.max(xe.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, axis=0),
                     tl.max(xo.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, axis=0))
    finite = top < 0x7F800000
    scale_bits = tl.where(finite, tl.div_rn(top.to(tl.float32, bitcast=True), QMAX).to(tl.uint32, bitcast=True),
                          0x7FC00000)
    scale = scale_bits.to(tl.float32, bitcast=True)
    for k in tl.static_range(4):
        tl.store(out_ptr + 4 * blk + k, ((scale_bits >> (8 * k)) & 0xFF).to(tl.uint8))
    ok = finite & (scale > 0.0)  # not top != 0: a subnormal absmax under QMAX x 2^-149 gives scale 0
    safe = tl.where(ok, scale, 1.0)
    inv = tl.div_rn(1.0, safe)
    big = inv == float("inf")  # scale < 2^-128: divide instead
    ce = _codes(xe, me, ok, safe, inv, big, seed, step, stream, base + even, QMAX, STOCHASTIC)
    co = _codes(xo, mo, ok, safe, inv, big, seed, step, stream, base + odd, QMAX, STOCHASTIC)
    codes_ptr = out_ptr + 4 * nb
    if BITS == 8:
        tl.store(codes_ptr + even, (ce & 0xFF).to(tl.uint8), mask=me)
        tl.store(codes_ptr + odd, (co & 0xFF).to(tl.uint8), mask=mo)
    else:
        packed = (ce + 8) | (tl.where(mo, co + 8, 0) << 4)
        tl.store(codes_ptr + blk * HALF + tl.arange(0, HALF), packed.to(tl.uint8), mask=me)
    if HAS_ERR:
        ee = tl.where(finite, xe - ce.to(tl.float32) * scale, 0.0)
        eo = tl.where(finite, xo - co.to(tl.float32) * scale, 0.0)
        _store_side(err_ptr, even, ee, me, ERR_BF16)
        _store_side(err_ptr, odd, eo, mo, ERR_BF16)


@triton.jit
def _decode_kernel(buf_ptr, out_ptr, n, nb, BITS: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    HALF: tl.constexpr = BLOCK // 2
    blk = tl.program_id(0).to(tl.int64)
    even = blk * BLOCK + 2 * tl.arange(0, HALF).to(tl.int64)
    odd = even + 1
    me, mo = even < n, odd < n
    scale_bits = tl.load(buf_ptr + 4 * blk).to(tl.uint32)
    for k in tl.static_range(1, 4):
        scale_bits = scale_bits | (tl.load(buf_ptr + 4 * blk + k).to(tl.uint32) << (8 * k))
    scale = scale_bits.to(tl.float32, bitcast=True)
    codes_ptr = buf_ptr + 4 * nb
    if BITS == 8:
        ce = tl.load(codes_ptr + even, mask=me, other=0).to(tl.int32)
        co = tl.load(codes_ptr + odd, mask=mo, other=0).to(tl.int32)
        ce = tl.where(ce >= 128, ce - 256, ce)
        co = tl.where(co >= 128, co - 256, co)
    else:
        byte = tl.load(codes_ptr + blk * HALF + tl.arange(0, HALF), mask=me, other=0).to(tl.int32)
        ce = (byte & 0xF) - 8
        co = (byte >> 4) - 8
    ye = ce.to(tl.float32) * scale
    yo = co.to(tl.float32) * scale
    if ACCUMULATE:
        ye = tl.load(out_ptr + even, mask=me, other=0.0) + ye
        yo = tl.load(out_ptr + odd, mask=mo, other=0.0) + yo
    tl.store(out_ptr + even, ye, mask=me)
    tl.store(out_ptr + odd, yo, mask=mo)


def encode_(x, out, bits, seed, step, stream, base, error, stochastic=True, residual=None):
    n = x.numel()
    if n == 0:
        return
    nb = wire.num_blocks(n)
    bf16 = lambda t: t is not None and t.dtype == torch.bfloat16  # noqa: E731
    with triton_common.device_guard(x.device):
        _encode_kernel[(nb,)](x, out, error if error is not None else out, residual if residual is not None else x,
                              n, nb, seed - 2**64 if seed >= 2**63 else seed, step, wire.STREAM_WIRE + stream, base,
                              BITS=bits, HAS_ERR=error is not None, X_BF16=bf16(x), STOCHASTIC=bool(stochastic),
                              HAS_RES=residual is not None, RES_BF16=bf16(residual), ERR_BF16=bf16(error),
                              BLOCK=BLOCK, **OPTIONS)


def decode_(buf, n, bits, out, accumulate):
    if n == 0:
        return
    nb = wire.num_blocks(n)
    with triton_common.device_guard(out.device):
        _decode_kernel[(nb,)](buf, out, n, nb, BITS=bits, ACCUMULATE=accumulate, BLOCK=BLOCK, **OPTIONS)
