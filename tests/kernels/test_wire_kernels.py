"""The wire format's kernels (zerokern.kernels.wire_ops) give wire.py's bytes exactly: codes and
scales, the error output and the decoded values, bit for bit, for int8 and int4, odd lengths,
zero, tiny, inf and NaN blocks, every key of the random stream, and both roundings (stochastic, and
to nearest: [Note: the wire format]). Small sizes: the Triton
kernels run under TRITON_INTERPRET on a CPU-only machine (conftest sets it). The CPU kernel's other
SIMD variants are compared with the default one in tests/kernels/test_cpu_variants.py."""

import pytest
import torch

from backends import ALL, device_for
from zerokern.kernels import wire, wire_ops

# The tiny block's 1 / scale is inf by design, and x * inf NaN in the branch tl.where discards: Triton's
# interpreter (numpy) warns about both.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

BITS = [8, 4]
KEY = (2**64 - 5, 7, 1, 999)  # seed (above 2^63: the op's int64 sees it negative), step, stream, base


def bits_of(t):
    """fp32 as its int32 bit patterns, every NaN as torch's one: -0.0 != 0.0 and NaN == NaN when compared.
    A NaN's payload is no part of the format: x86 keeps the NaN operand's (0 x the NaN scale gives
    0x7FC00000), a GPU writes its canonical 0x7FFFFFFF (seen on an H200, the CUDA and Triton kernels)."""
    t = t.contiguous()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def special_chunk(n=1337, seed=0):
    """n values whose blocks are: random, zeros (and -0.0), an inf and a -inf, a NaN, tiny
    (scale < 2^-128, where 1 / scale is inf), then (n = 1337) a short one holding 3e38."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    B = wire.BLOCK
    x[B:2 * B] = 0.0
    x[B + 5] = -0.0
    x[2 * B + 17] = float("inf")
    x[3 * B + 200] = float("nan")
    x[4 * B:5 * B] = torch.randn(B, generator=gen) * 1e-40
    x[4 * B + 3] = 1e-45  # the smallest subnormal
    x[4 * B + 4] = 0.0
    x[2 * B + 100] = -float("inf")
    if n > 5 * B:
        x[5 * B + 1] = 3e38
    return x


def chunks():
    gen = torch.Generator().manual_seed(1)
    return {
        "1": torch.randn(1, generator=gen),
        "255": torch.randn(255, generator=gen),
        "256": torch.randn(256, generator=gen) * 1e3,
        "257": torch.randn(257, generator=gen),
        "special-1337": special_chunk(),
        "special-1280": special_chunk(1280),  # every block whole
        "empty": torch.zeros(0),
    }


CHUNKS = chunks()


ROUNDINGS = [pytest.param(True, id="stochastic"), pytest.param(False, id="nearest")]


def encode(x, bits, key, backend, error=True, stochastic=True):
    device = device_for(backend)
    x = x.to(device)
    out = torch.full((wire.nbytes(x.numel(), bits),), 0xAB, dtype=torch.uint8, device=device)
    err = torch.full((x.numel(),), 123.0, device=device) if error else None
    wire_ops.encode_(x, out, bits, *key, error=err, stochastic=stochastic, backend=backend)
    return out.cpu(), (err.cpu() if error else None)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", list(CHUNKS))
@pytest.mark.parametrize("stochastic", ROUNDINGS)
def test_encode_matches_the_reference(backend, bits, name, stochastic):
    x = CHUNKS[name]
    ref, ref_err = wire.encode_with_error(x, bits, *KEY, stochastic=stochastic)
    out, err = encode(x, bits, KEY, backend, stochastic=stochastic)
    assert torch.equal(out, ref), f"bytes differ at {(out != ref).nonzero().flatten()[:8].tolist()}"
    assert torch.equal(bits_of(err), bits_of(ref_err))
    out_only, _ = encode(x, bits, KEY, backend, error=False, stochastic=stochastic)
    assert torch.equal(out_only, ref)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", ["257", "special-1337"])
def test_decode_writes_and_accumulates_the_references_values(backend, bits, name):
    x = CHUNKS[name]
    n, device = x.numel(), device_for(backend)
    buf = wire.encode(x, bits, *KEY)
    want = wire.decode(buf, n, bits)
    out = torch.full((n,), 5.0, device=device)
    wire_ops.decode_(buf.to(device), n, bits, out, backend=backend)
    assert torch.equal(bits_of(out.cpu()), bits_of(want))
    start = torch.randn(n, generator=torch.Generator().manual_seed(2))
    acc = start.clone().to(device)
    wire_ops.decode_add_(buf.to(device), n, bits, acc, backend=backend)
    wire_ops.decode_add_(buf.to(device), n, bits, acc, backend=backend)  # two ranks' chunks summed
    assert torch.equal(bits_of(acc.cpu()), bits_of(start + want + want))


KEYS = [
    (0, 1, 0, 0),
    (3, 1, 0, 3),  # a base not on a Philox group of 8
    (3, 2, 0, 3),
    (3, 1, 2, 3),
    (4, 1, 0, 3),
    (3, 2**32 + 1, 0, 3),  # the counter holds the step's low 32 bits: as step 1
    (9, 5, 1, 8 * (1 << 32) - 8 * 37 - 3),  # Philox group 2^32 (the counter's low word wraps) inside a block
]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
def test_every_key_of_the_random_stream(backend, bits):
    x = CHUNKS["special-1337"]
    seen = []
    for key in KEYS:
        out, _ = encode(x, bits, key, backend, error=False)
        assert torch.equal(out, wire.encode(x, bits, *key)), f"key {key}"
        seen.append(out)
    # each of seed, step, stream and base changes the bytes (none is ignored); step 2^32 + 1 is step 1
    assert len({bytes(s.numpy()) for s in seen}) == len(KEYS) - 1
    assert torch.equal(seen[1], seen[5])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
def test_round_to_nearest_reads_no_random_bits(backend, bits):
    x = CHUNKS["special-1337"]
    want = wire.encode(x, bits, *KEYS[0], stochastic=False)
    for key in KEYS:
        out, _ = encode(x, bits, key, backend, error=False, stochastic=False)
        assert torch.equal(out, want), f"key {key}"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stochastic", ROUNDINGS)
def test_half_inputs_are_read_as_fp32(backend, dtype, stochastic):
    x = CHUNKS["special-1337"].clamp(-6e4, 6e4).to(dtype)  # fp16 would turn 3e38 into inf anyway
    for bits in BITS:
        ref, ref_err = wire.encode_with_error(x, bits, *KEY, stochastic=stochastic)
        out, err = encode(x, bits, KEY, backend, stochastic=stochastic)
        assert torch.equal(out, ref)
        assert torch.equal(bits_of(err), bits_of(ref_err))


SIDE = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("res_dtype", SIDE)
@pytest.mark.parametrize("err_dtype", SIDE)
@pytest.mark.parametrize("stochastic", ROUNDINGS)
def test_a_residual_is_added_in_the_encode_and_the_error_may_replace_it(backend, bits, res_dtype, err_dtype,
                                                                         stochastic):
    """[Note: error feedback]'s add in the encode's pass: the bytes of x + residual (one fp32 add),
    its error stored as fp32 or bf16 (rounded to nearest even), and the error written over the
    residual itself when they are one tensor."""
    device = device_for(backend)
    x = CHUNKS["special-1337"].clone()
    x[5 * wire.BLOCK + 1] = 1e30  # no overflow when the residual is added
    res = (torch.randn(x.numel(), generator=torch.Generator().manual_seed(5)) * 0.5).to(res_dtype)
    for xd in (torch.float32, torch.bfloat16, torch.float16):  # every x dtype the encode accepts
        ref, ref_err = wire.encode_with_error(x.to(xd).float() + res.float(), bits, *KEY, stochastic=stochastic)
        ref_err = ref_err.to(err_dtype)
        out = torch.full((wire.nbytes(x.numel(), bits),), 0xAB, dtype=torch.uint8, device=device)
        err = torch.full((x.numel(),), 123.0, dtype=err_dtype, device=device)
        wire_ops.encode_(x.to(xd).to(device), out, bits, *KEY, error=err, residual=res.to(device),
                         stochastic=stochastic, backend=backend)
        assert torch.equal(out.cpu(), ref), f"bytes differ at {(out.cpu() != ref).nonzero().flatten()[:8].tolist()}"
        assert torch.equal(err.cpu().float().view(torch.int32), ref_err.float().view(torch.int32))
        if res_dtype == err_dtype:  # in place: the residual becomes this round's error
            inplace = res.to(device, copy=True)
            out.fill_(0xAB)
            wire_ops.encode_(x.to(xd).to(device), out, bits, *KEY, error=inplace, residual=inplace,
                             stochastic=stochastic, backend=backend)
            assert torch.equal(out.cpu(), ref)
            assert torch.equal(inplace.cpu().float().view(torch.int32), ref_err.float().view(torch.int32))


@pytest.mark.skipif(wire_ops.wire_backend("auto", torch.device("cpu")).__name__.endswith("torch_wire"),
                    reason="the CPU extension is not built")
def test_cpu_same_bytes_at_any_thread_count():
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(3))  # > 2 x 32768: two threads
    threads = torch.get_num_threads()
    got = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            got.append(encode(x, 4, KEY, "cpu"))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0][0], wire.encode(x, 4, *KEY))
    for out, err in got[1:]:
        assert torch.equal(out, got[0][0]) and torch.equal(bits_of(err), bits_of(got[0][1]))


@pytest.mark.skipif(not hasattr(torch.ops.zerokern, "wire_encode_"), reason="the CPU extension is not built")
def test_opcheck():
    x = CHUNKS["special-1337"]
    for bits in BITS:
        out = torch.empty(wire.nbytes(x.numel(), bits), dtype=torch.uint8)
        torch.library.opcheck(torch.ops.zerokern.wire_encode_.default,
                              (x, out, torch.empty(x.numel()), bits, 3, 1, 0, 5))
        torch.library.opcheck(torch.ops.zerokern.wire_encode_.default, (x, out, None, bits, -3, 1, 0, 5))
        torch.library.opcheck(torch.ops.zerokern.wire_encode_.default, (x, out, None, bits, -3, 1, 0, 5, False))
        res = torch.randn(x.numel()).bfloat16()
        torch.library.opcheck(torch.ops.zerokern.wire_encode_.default,
                              (x, out, torch.empty(x.numel(), dtype=torch.bfloat16), bits, 3, 1, 0, 5, False, res))
        torch.library.opcheck(torch.ops.zerokern.wire_encode_.default, (x, out, res, bits, 3, 1, 0, 5, False, res))
        buf = wire.encode(x, bits, 1, 2, 0, 0)
        torch.library.opcheck(torch.ops.zerokern.wire_decode_.default, (buf, x.numel(), bits, torch.zeros(x.numel()),
                                                                         True))


# --- the reference's own rules -----------------------------------------------------------------

def test_a_non_finite_block_has_scale_nan_codes_zero_and_error_zero():
    x = CHUNKS["special-1337"]
    for bits in BITS:
        buf, err = wire.encode_with_error(x, bits, *KEY)
        scales = buf[:4 * wire.num_blocks(x.numel())].view(torch.float32)
        assert scales[2:4].isnan().all() and scales[[0, 1, 4, 5]].isfinite().all()
        codes = buf[4 * wire.num_blocks(x.numel()):]
        B = wire.BLOCK
        zero = 0 if bits == 8 else 0x88
        per = 1 if bits == 8 else 2
        for blk in (2, 3):
            assert (codes[blk * B // per:(blk + 1) * B // per] == zero).all()
            assert (err[blk * B:(blk + 1) * B] == 0).all()
        assert wire.decode(buf, x.numel(), bits)[2 * B:4 * B].isnan().all()


def test_round_to_nearest_is_within_half_a_step_and_stochastic_within_one():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(4))
    for bits in BITS:
        step = wire.scales_of(x, bits).repeat_interleave(wire.BLOCK)
        near = (wire.decode(wire.encode(x, bits, *KEY, stochastic=False), 4096, bits) - x).abs()
        assert (near <= 0.5 * step * 1.0001).all()
        sr = (wire.decode(wire.encode(x, bits, *KEY), 4096, bits) - x).abs()
        assert (sr <= step * 1.0001).all() and (sr > 0.5 * step * 1.0001).any()  # not to nearest


def test_a_tiny_block_is_quantized_like_any_other():
    """scale < 2^-128 (1 / scale is inf): x / scale, so each value decodes within one step of itself
    and a zero stays zero (x * inf gave +-QMAX, and 0 * inf NaN)."""
    x = CHUNKS["special-1337"]
    B = wire.BLOCK
    tiny = x[4 * B:5 * B]
    for bits in BITS:
        buf = wire.encode(x, bits, *KEY)
        scale = buf[16:20].view(torch.float32)
        assert 0 < float(scale) < 2.0**-128
        y = wire.decode(buf, x.numel(), bits)[4 * B:5 * B]
        assert ((y - tiny).abs() <= float(scale) * 1.0001).all()
        assert y[4] == 0


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("bits", BITS)
def test_a_block_whose_scale_underflows_to_zero_sends_zeros(backend, bits):
    """absmax a subnormal under QMAX x 2^-149: absmax / QMAX rounds to 0, so the block has scale 0
    and codes 0, as a block of zeros ([Note: the wire format]), and its error is x. The kernels
    asked top != 0 instead of scale > 0 and divided by that 0: codes from 0 / 0 (an undefined cast)
    and +-inf."""
    x = torch.zeros(3 * wire.BLOCK)
    x[wire.BLOCK + 3], x[wire.BLOCK + 9] = 1e-45, -2.8e-45  # block 1; blocks 0 and 2 ordinary
    x[:wire.BLOCK] = torch.randn(wire.BLOCK, generator=torch.Generator().manual_seed(6))
    x[2 * wire.BLOCK + 1] = 1e-45 * 2**10
    for stochastic in (True, False):
        ref, ref_err = wire.encode_with_error(x, bits, *KEY, stochastic=stochastic)
        assert float(ref[4:8].view(torch.float32)) == 0.0
        out, err = encode(x, bits, KEY, backend, stochastic=stochastic)
        assert torch.equal(out, ref), f"bytes differ at {(out != ref).nonzero().flatten()[:8].tolist()}"
        assert torch.equal(bits_of(err), bits_of(ref_err))


# --- errors name the culprit -----------------------------------------------------------------

def test_bad_arguments_are_named():
    x = torch.randn(300)
    out = torch.empty(wire.nbytes(300, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        wire_ops.encode_(x, out, 2, 0, 1, 0, 0)
    with pytest.raises(ValueError, match=rf"out has {wire.nbytes(300, 8)} elements, expected {wire.nbytes(300, 4)} "
                                         r"\(wire.nbytes\(300, 4\)\)"):
        wire_ops.encode_(x, out, 4, 0, 1, 0, 0)
    with pytest.raises(TypeError, match="error is float16, expected float32 or bfloat16"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, error=torch.empty(300, dtype=torch.float16))
    with pytest.raises(TypeError, match="residual is float64, expected float32 or bfloat16"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, residual=torch.empty(300, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"residual has 299 elements, expected 300 \(x\)"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, residual=torch.empty(299))
    both = torch.zeros(301)
    with pytest.raises(ValueError, match="error overlaps residual without being it"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, error=both[1:], residual=both[:300])
    with pytest.raises(ValueError, match="error overlaps x"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, error=x)
    with pytest.raises(TypeError, match="x is int32"):
        wire_ops.encode_(x.int(), out, 8, 0, 1, 0, 0)
    with pytest.raises(ValueError, match="base"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, -1)
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        wire_ops.encode_(x, out, 8, 0, 1, 0, 0, backend="gpu")
    short = wire.nbytes(300, 8) - 1
    with pytest.raises(ValueError, match=rf"buf has {short} elements, expected {short + 1}"):
        wire_ops.decode_add_(out[:short], 300, 8, torch.zeros(300))
    with pytest.raises(TypeError, match="out is bfloat16, expected float32"):
        wire_ops.decode_add_(out, 300, 8, torch.zeros(300, dtype=torch.bfloat16))
