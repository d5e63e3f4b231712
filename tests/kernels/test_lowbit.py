"""Low-bit state's numbers (zerokern/kernels/lowbit.py): the Philox stream, the dynamic maps and
the blockwise quantizer, stochastic rounding to bf16, and fused_adam_lowbit_ (its reference
backend) against the fp32 kernel and on bad input."""

import math
import os

import pytest
import torch

from zerokern.kernels import lowbit as L
from zerokern.kernels.backends import torch_ref
from zerokern.kernels.backends.hyper import AdamHyper
from zerokern.kernels.lowbit_ops import fused_adam_lowbit_

SIZES = [0, 1, 127, 255, 256, 257, 4097]


# --- Philox -------------------------------------------------------------------

def _words(c, key):
    return [int(w) for w in L.philox4x32(*[torch.tensor([x], dtype=torch.int64) for x in c], key)]


def test_philox_known_answers():
    """Random123's known-answer vectors for philox4x32-10 (kat_vectors)."""
    assert _words([0, 0, 0, 0], 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    m = 0xFFFFFFFF
    assert _words([m] * 4, (m << 32) | m) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert _words([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0x299F31D0 << 32) | 0xA4093822) == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_philox_is_tritons():
    """tl.philox is the same function, so the Triton kernel can draw the reference's numbers."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def draw(out, seed, step, N: tl.constexpr):
        idx = tl.arange(0, N).to(tl.int64) + 1234567890123
        g = idx >> 3
        c0 = (g & 0xFFFFFFFF).to(tl.uint32)
        zero = c0 * 0
        a, b, c, d = tl.philox(seed, c0, (g >> 32).to(tl.uint32), zero + step, zero + 2)
        k = tl.arange(0, N) * 4
        tl.store(out + k, a.to(tl.int64))
        tl.store(out + k + 1, b.to(tl.int64))
        tl.store(out + k + 2, c.to(tl.int64))
        tl.store(out + k + 3, d.to(tl.int64))

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton is not interpreting (TRITON_INTERPRET=1)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.zeros(64 * 4, dtype=torch.int64, device=device)
    seed = 0x123456789ABCDEF0
    draw[(1,)](out, seed, 7, 64)
    g = (torch.arange(64, dtype=torch.int64) + 1234567890123) >> 3
    ref = torch.stack(L.philox4x32(g & 0xFFFFFFFF, g >> 32, torch.full_like(g, 7), torch.full_like(g, 2), seed), 1)
    assert torch.equal(out.cpu() & 0xFFFFFFFF, ref.reshape(-1))


# --- maps and quantizer -------------------------------------------------------

@pytest.mark.parametrize("signed", [True, False])
def test_maps(signed):
    q = L.qmap(signed)
    assert q.numel() == 256 and q.dtype == torch.float32
    assert torch.all(q[1:] >= q[:-1]), "ascending"
    assert q[-1] == 1.0 and (0.0 in q.tolist())
    if signed:
        assert q[0] == -1.0 and torch.equal(q[:127], -q[128:255].flip(0)), "symmetric about 0"
        assert q[255] == q[254] == 1.0  # the unused code repeats 1.0
    else:
        assert q[0] == 0.0 and torch.all(q[1:] > q[:-1])
    # seven decades below the block's largest value
    smallest = q[q > 0].min().item()
    assert smallest <= (1e-6 if signed else 1e-7) * 1.0001


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_quantize_is_nearest_per_block(signed, n):
    torch.manual_seed(n)
    x = torch.randn(n) * torch.logspace(-4, 2, n).clamp(min=1e-6) if n else torch.zeros(0)
    x = x if signed else x.abs()
    codes, scales = L.quantize(x, signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scales.numel() == math.ceil(n / L.BLOCK)
    for b in range(scales.numel()):
        blk = x[b * L.BLOCK:(b + 1) * L.BLOCK]
        assert scales[b] == blk.abs().max()
        normed = blk / scales[b]
        # brute force: the chosen map value is a nearest one
        dist = (L.qmap(signed)[None, :] - normed[:, None]).abs()
        chosen = dist.gather(1, codes[b * L.BLOCK:(b + 1) * L.BLOCK].long()[:, None])[:, 0]
        assert torch.all(chosen <= dist.min(dim=1).values * (1 + 1e-6) + 1e-12)
    y = L.dequantize(codes, scales, signed)
    if n:
        # the largest element of every block is exact (the map holds 1.0, and -1.0 when signed)
        top = x.abs().reshape(-1)[: (n // L.BLOCK) * L.BLOCK].view(-1, L.BLOCK).argmax(1)
        for b, k in enumerate(top.tolist()):
            assert y[b * L.BLOCK + k] == x[b * L.BLOCK + k]


def test_quantize_exact_where_the_math_is():
    """Map values times a power-of-two scale come back bit for bit; an all-zero block has scale 0
    and decodes to zeros; a signed zero block takes the code of 0, not code 0."""
    for signed in (True, False):
        q = L.qmap(signed)
        x = torch.cat([q * 4.0, torch.zeros(L.BLOCK), q[torch.randperm(256)] * 0.125])
        codes, scales = L.quantize(x, signed)
        assert scales.tolist() == [4.0, 0.0, 0.125]
        assert torch.equal(L.dequantize(codes, scales, signed), x)
        assert torch.all(codes[L.BLOCK:2 * L.BLOCK] == (127 if signed else 0))


# --- stochastic rounding ------------------------------------------------------

def _neighbours(x):
    down = x.to(torch.bfloat16)
    lo = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-math.inf, dtype=torch.bfloat16)), down)
    hi = torch.nextafter(lo, torch.tensor(math.inf, dtype=torch.bfloat16))
    return lo, hi


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(40) * 10.0 ** torch.randint(-20, 20, (40,)), torch.tensor([1.0 + 2**-10, -3.0001])])
    draws = 4000
    out = torch.stack([L.stochastic_round_bf16(x, L.random16(5, step, 0, L.element_index(0, x.numel(), "cpu")))
                       for step in range(1, draws + 1)]).float()
    lo, hi = _neighbours(x)
    assert torch.all((out == lo.float()) | (out == hi.float())), "only the two neighbours"
    p = ((x - lo.float()) / (hi.float() - lo.float())).double()  # the chance of rounding up
    up = (out == hi.float()).double().mean(0)
    sigma = (p * (1 - p) / draws).sqrt()
    assert torch.all((up - p).abs() <= 5 * sigma + 1e-3), (up - p).abs().max()
    # the mean of the draws is x, within its statistical bound
    spread = (hi.float() - lo.float()).double() * sigma
    assert torch.all((out.double().mean(0) - x.double()).abs() <= 5 * spread + 1e-30)


def test_stochastic_rounding_specials_and_exact_values():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, math.inf, -math.inf, math.nan, 3.0e38])
    r = torch.full((x.numel(),), 0xFFFF, dtype=torch.int64)
    y = L.stochastic_round_bf16(x, r)
    assert y[:4].float().tolist() == [0.0, -0.0, 1.0, -2.5]  # representable: unchanged for any draw
    assert y[4].item() == math.inf and y[5].item() == -math.inf and math.isnan(y[6].item())


def test_random_stream_is_keyed_by_the_global_index_only():
    """Drawing for a tensor in pieces (as shards do) gives the bits of drawing it whole."""
    whole = L.random16(11, 3, 1, L.element_index(1000, 5000, "cpu"))
    parts = torch.cat([L.random16(11, 3, 1, L.element_index(1000 + a, b - a, "cpu"))
                       for a, b in ((0, 7), (7, 2048), (2048, 5000))])
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, L.random16(11, 4, 1, L.element_index(1000, 5000, "cpu")))  # another step
    assert not torch.equal(whole, L.random16(12, 3, 1, L.element_index(1000, 5000, "cpu")))  # another seed
    assert not torch.equal(whole, L.random16(11, 3, 2, L.element_index(1000, 5000, "cpu")))  # another stream


# --- fused_adam_lowbit_ -------------------------------------------------------

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _tensors(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, \
        torch.rand(n, generator=g) * 0.01


def test_fp32_state_is_the_fp32_kernel():
    for n in SIZES:
        p, g, m, v = _tensors(n)
        a = [t.clone() for t in (p, m, v)]
        b = [t.clone() for t in (p, m, v)]
        fused_adam_lowbit_([a[0]], [g], [a[1]], [a[2]], step=3, backend="torch", **HYPER)
        torch_ref.fused_adam_([b[0]], [g], [b[1]], [b[2]], None, AdamHyper(step=3, **HYPER))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), n


@pytest.mark.parametrize("n", SIZES)
def test_int8_state_is_dequantize_update_requantize(n):
    p, g, m, v = _tensors(n, 1)
    (mc, ms), (vc, vs) = L.encode_moment(m, False), L.encode_moment(v, True)
    m0, v0 = L.decode_moment(mc, ms, False), L.decode_moment(vc, vs, True)
    assert torch.equal(L.dequantize(vc, vs, False) ** 2, v0)  # exp_avg_sq's codes are of its square root
    ref = [p.clone(), m0.clone(), v0.clone()]
    torch_ref.fused_adam_([ref[0]], [g], [ref[1]], [ref[2]], None, AdamHyper(step=2, **HYPER))
    q = p.clone()
    fused_adam_lowbit_([q], [g], [mc], [vc], step=2, exp_avg_scales=[ms], exp_avg_sq_scales=[vs], backend="torch",
                       **HYPER)
    assert torch.equal(q, ref[0])  # the update is the fp32 one on the decoded moments
    for codes, scales, want, second in ((mc, ms, ref[1], False), (vc, vs, ref[2], True)):
        c2, s2 = L.encode_moment(want, second)
        assert torch.equal(codes, c2) and torch.equal(scales, s2)


def test_small_second_moments_survive():
    """[Note: the second moment as its square root]: a gradient 1e-5 of its block's largest keeps
    a non-zero exp_avg_sq (as v itself it would fall below the map's seven decades and decode to 0,
    making the update m / eps)."""
    v = torch.full((256,), 1e-10)
    v[0] = 1.0
    codes, scales = L.encode_moment(v, True)
    back = L.decode_moment(codes, scales, True)
    assert torch.all(back[1:] > 0) and torch.allclose(back[1:], v[1:], rtol=0.2)
    plain, s = L.quantize(v, False)
    assert torch.all(L.dequantize(plain, s, False)[1:] == 0)  # what storing v itself would do


def test_bf16_params_without_master_round_stochastically():
    n = 3000
    p, g, m, v = _tensors(n, 2)
    p16 = p.bfloat16()
    exact = [p16.float(), m.clone(), v.clone()]
    torch_ref.fused_adam_([exact[0]], [g], [exact[1]], [exact[2]], None, AdamHyper(step=1, **HYPER))
    q, mm, vv = p16.clone(), m.clone(), v.clone()
    fused_adam_lowbit_([q], [g], [mm], [vv], step=1, index_bases=[77], seed=9, backend="torch", **HYPER)
    want = L.stochastic_round_bf16(exact[0], L.random16(9, 1, L.STREAM_PARAM, L.element_index(77, n, "cpu")))
    assert torch.equal(q, want) and torch.equal(mm, exact[1]) and torch.equal(vv, exact[2])
    # some elements moved by less than half a bf16 step: round to nearest would have lost them all
    assert not torch.equal(q, exact[0].bfloat16())


def test_found_inf_changes_nothing():
    p, g, m, v = _tensors(600, 3)
    mc, ms = L.quantize(m, True)
    vc, vs = L.encode_moment(v, True)
    p16 = p.bfloat16()
    before = [t.clone() for t in (p16, mc, ms, vc, vs)]
    g[5] = math.inf
    fused_adam_lowbit_([p16], [g], [mc], [vc], step=1, exp_avg_scales=[ms], exp_avg_sq_scales=[vs], index_bases=[0],
                       found_inf=torch.ones(1), **HYPER)
    assert all(torch.equal(a, b) for a, b in zip(before, (p16, mc, ms, vc, vs)))


def test_bad_input_names_the_tensor():
    p, g, m, v = _tensors(300)
    mc, ms = L.quantize(m, True)
    vc, vs = L.encode_moment(v, True)
    with pytest.raises(ValueError, match=r"exp_avg_scales are needed for uint8 state"):
        fused_adam_lowbit_([p], [g], [mc], [vc], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"exp_avg_sq_scales\[0\] has 1 scales, params\[0\] has 300 elements: 2 blocks"):
        fused_adam_lowbit_([p], [g], [mc], [vc], step=1, exp_avg_scales=[ms], exp_avg_sq_scales=[vs[:1]], **HYPER)
    with pytest.raises(ValueError, match="index_bases are needed"):
        fused_adam_lowbit_([p.bfloat16()], [g], [m], [v], step=1, **HYPER)
    with pytest.raises(TypeError, match=r"exp_avgs\[0\] is float16"):
        fused_adam_lowbit_([p], [g], [m.half()], [v], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"model_params are written from fp32 master params"):
        fused_adam_lowbit_([p.bfloat16()], [g], [m], [v], step=1, index_bases=[0], model_params=[p.bfloat16()],
                           **HYPER)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        fused_adam_lowbit_([p], [g], [m], [v], step=1, backend="nope", **HYPER)


# --- the compiled kernels against the reference -------------------------------

def _native_backends():
    """The compiled low-bit backends usable here, marked so bench/device_check.sh's GPU stage
    (-m "cuda or triton") runs the GPU ones."""
    from zerokern.kernels.lowbit_ops import _NATIVE_LOWBIT
    from zerokern.kernels.backends.registry import available_backends

    usable = available_backends()
    marks = {"cuda": [pytest.mark.cuda], "triton": [pytest.mark.triton]}
    return [pytest.param(b, marks=marks.get(b, [])) for b in _NATIVE_LOWBIT if usable.get(b)]


def _state(fmt, n, gen):
    m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    if fmt == "int8":
        (mc, ms), (vc, vs) = L.quantize(m, True), L.encode_moment(v, True)
        return [mc, vc], [ms, vs]
    if fmt == "bf16":
        return [m.bfloat16(), v.bfloat16()], [None, None]
    return [m, v], [None, None]


def _run_backend(backend, p, g, state, scales, model, steps=2):
    p, state = p.clone(), [t.clone() for t in state]
    scales = [None if s is None else s.clone() for s in scales]
    model = None if model is None else model.clone()
    for step in range(1, steps + 1):
        fused_adam_lowbit_([p], [g], [state[0]], [state[1]], step=step, grad_scale=2.0,
                           exp_avg_scales=None if scales[0] is None else [scales[0]],
                           exp_avg_sq_scales=None if scales[1] is None else [scales[1]],
                           model_params=None if model is None else [model], index_bases=[1000003], seed=11,
                           backend=backend, **HYPER)
    return p, state, scales, model


@pytest.mark.parametrize("backend", _native_backends() or [pytest.param("cpu", marks=pytest.mark.skip(
    reason="no compiled low-bit kernel in this build"))])
@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float16)])
def test_compiled_kernel_matches_the_reference(backend, fmt, param_dtype, grad_dtype):
    """The compiled update is adam.h's, whose fp32 roundings differ from the reference's torch ops
    (torch fuses m * beta1 + (1 - beta1) * g into one rounding) by about 1e-7 of the operands;
    decoding, the cells and stochastic rounding are exact. So a code may differ by one where a
    moment lies within that rounding of a midpoint, and a stochastically rounded bf16 value by one
    bf16 step, or by that rounding where a moment cancels to nearly 0: rare (at most 1 in 1000); and
    such a moment moves the next step's param by at most lr times that step."""
    gen = torch.Generator().manual_seed(3)
    interpreted = backend == "triton" and not torch.cuda.is_available()  # TRITON_INTERPRET: slow, small sizes
    device = "cuda" if backend in ("triton", "cuda") and torch.cuda.is_available() else "cpu"
    for n in SIZES[1:] + ([] if interpreted else [70001]):
        p = torch.randn(n, generator=gen).to(param_dtype)
        g = (torch.randn(n, generator=gen) * 4).to(grad_dtype)
        state, scales = _state(fmt, n, gen)
        # fp32 masters write a 16-bit model copy: fp16 with fp16 grads (fp16 training), else bf16
        model_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
        model = torch.empty(n, dtype=model_dtype) if param_dtype == torch.float32 else None
        ref = _run_backend("torch", p, g, state, scales, model)
        on = [None if t is None else t.to(device) for t in (p, g, model)]
        out = _run_backend(backend, on[0], on[1], [t.to(device) for t in state],
                           [None if t is None else t.to(device) for t in scales], on[2])
        out = (out[0].cpu(), [t.cpu() for t in out[1]], [None if t is None else t.cpu() for t in out[2]],
               None if out[3] is None else out[3].cpu())
        for a, b in [(ref[0], out[0])] + list(zip(ref[1], out[1])) + [(ref[3], out[3])]:
            if a is None:
                continue
            if a.dtype == torch.float32:
                # the fp32 rounding, except where a rare neighbouring code or bf16 step of a moment
                # at step 1 moved step 2's update: by at most lr (1e-2) times that step (2**-7)
                off = (a - b).abs() > 1e-7 + 1e-6 * a.abs()
                assert off.float().mean() <= 1e-3 and (a - b).abs().max() <= 1e-2 * 2**-7, n
            elif a.dtype == torch.uint8:  # codes: the same, or the neighbouring code, rarely
                assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() <= 1e-3, n
            else:  # bf16 or fp16: the same, or one bf16 step (2**-7 relative) or the fp32 rounding apart, rarely
                fa, fb = a.float(), b.float()
                bound = fa.abs() * 2**-7 + 1e-6 * fa.abs().max()
                assert torch.all((fa - fb).abs() <= bound) and (a != b).float().mean() <= 1e-3, n
        for a, b in zip(ref[2], out[2]):
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", [b for b in _native_backends() if b.values[0] == "cpu"] or [pytest.param(
    "cpu", marks=pytest.mark.skip(reason="no compiled CPU low-bit kernel in this build"))])
def test_compiled_kernel_same_bits_at_any_thread_count(backend):
    gen = torch.Generator().manual_seed(4)
    n = 300_001
    p, g = torch.randn(n, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    state, scales = _state("int8", n, gen)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(_run_backend(backend, p, g, state, scales, None))
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert torch.equal(other[0], outs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(other[1] + other[2], outs[0][1] + outs[0][2]))


def test_cells_give_the_codes_of_the_search():
    """[Note: quantizing by cells]: the kernels' table lookup picks the same code as the midpoint
    search for every float near a midpoint and for values over seven decades."""
    for signed in (True, False):
        mid = L.midpoints(signed)
        x = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0)),
                       torch.randn(200_000) * torch.logspace(-9, 0, 200_000), torch.tensor([0.0, -0.0, 1.0, -1.0])])
        x = x if signed else x.abs()
        want = torch.bucketize(x, mid, right=False).to(torch.uint8)
        assert torch.equal(L.quantize_by_cells(x, torch.ones_like(x), signed), want)


def test_keys_give_the_codes_of_the_search():
    """[Note: quantizing by keys]: the AVX-512/AVX2 kernels' small table picks the search's code for
    every float near a midpoint, over seven decades, and far below the table's lowest exponent."""
    for signed in (True, False):
        mid = L.midpoints(signed)
        x = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0)),
                       (torch.randn(200_000) * torch.logspace(-12, 0, 200_000)).clamp(-1.99, 1.99),
                       torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, 1.99, -1.99, 1e-30, -1e-30, 1e-40, -1e-40])])
        x = x if signed else x.abs()  # the keyed table's domain: |x| < 2 (x * (1 / absmax) of a finite block)
        want = torch.bucketize(x, mid, right=False).to(torch.uint8)
        assert torch.equal(L.quantize_by_keys(x, signed), want)


@pytest.mark.skipif("cpu" not in [b.values[0] for b in _native_backends()],
                    reason="no compiled CPU low-bit kernel in this build")
def test_inf_and_nan_blocks_take_the_cells_path():
    """An inf gradient (no found_inf) makes its blocks' scales inf and their normalized moments NaN,
    whose exponent is above the keyed table's: those lanes take the cells path. Codes match the
    reference except at NaN moments, which decode to NaN either way (the block's scale is NaN)."""
    n = 1024
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen)
    g[20], g[300], g[600] = math.inf, math.nan, -math.inf
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    outs = []
    for backend in ("torch", "cpu"):
        (mc, ms), (vc, vs) = L.quantize(m, True), L.encode_moment(v, True)
        fused_adam_lowbit_([p.clone()], [g], [mc], [vc], exp_avg_scales=[ms], exp_avg_sq_scales=[vs], index_bases=[0],
                           step=2, backend=backend, **HYPER)
        outs.append((mc, vc, ms, vs))
    (m0, v0, ms0, vs0), (m1, v1, ms1, vs1) = outs
    for s0, s1 in ((ms0, ms1), (vs0, vs1)):  # inf and NaN scales in the same blocks, the rest equal
        assert torch.equal(s0.isnan(), s1.isnan()) and torch.equal(s0[~s0.isnan()], s1[~s1.isnan()])
    for a, b, s0 in ((m0, m1, ms0), (v0, v1, vs0)):
        diff = (a != b).nonzero().flatten()
        assert diff.tolist() == [300], diff.tolist()  # the NaN gradient's element
        assert s0[300 // 256].isnan()
    for which, (a, b) in enumerate(((m0, m1), (v0, v1))):
        d0 = L.decode_moment(a, outs[0][2 + which], bool(which))
        d1 = L.decode_moment(b, outs[1][2 + which], bool(which))
        assert torch.equal(d0.isnan(), d1.isnan()) and torch.equal(d0[~d0.isnan()], d1[~d1.isnan()])
