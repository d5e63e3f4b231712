"""Every __global__ kernel of csrc/cuda, executed: their host build on the SIMT emulator
(tests/kernels/simt_emu.py, [Note: the SIMT emulator] in csrc/emu/simt.h) against the torch reference and,
where the CPU kernel does the same fp32 arithmetic, against the CPU kernel bit for bit.

What is compared, and how exactly:
- Adam: the emulated kernel rounds every product (no FMA, as the CPU build), so it equals the CPU
  kernel bit for bit, and the reference within test_adam.py's tolerance. (On a GPU nvcc fuses some
  products into FMAs: there the last bit may differ, which the GPU tests' tolerance allows.)
- casts: torch's .to() bit for bit, except a NaN converted to fp16/bf16, which CUDA makes its
  canonical NaN (0x7FFF) and torch 0x7E00/0x7FC0: compared as NaN there.
- low-bit: the CPU kernel bit for bit (same update, same codes, same random bits), the reference
  within test_lowbit.py's bounds.
- wire: wire.py's bytes and errors bit for bit (every rounding is spelled out in the kernel).
Sizes hit the edges, not the bulk: tails that are not a multiple of the vector width or the block,
views whose offset breaks 16-byte alignment (each stream on its own), tensor lists that span
several launches, grids of 1, 3 and one block per tile (grid-stride loops that turn or not), and
every tensor sits between guard bytes that must come back untouched (a write past either end).
"""

import math
import pathlib
import re

import pytest
import torch

import simt_emu as emu
from zerokern import ops
from zerokern.kernels import lowbit as L
from zerokern.kernels import wire
from zerokern.kernels.lowbit_ops import fused_adam_lowbit_

ROOT = pathlib.Path(__file__).resolve().parents[2]
HAS_CPU = ops.available_backends().get("cpu", False)
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
ADAM_TOL = (2e-6, 1e-7)  # test_adam.py's TOL: the same fp32 arithmetic in another order (bias correction)
# Guard elements before each tensor (64 or 32 bytes: the view's start stays 16-byte aligned at offset 0) and
# after it (more than a tile: a tail that takes the vector path writes up to a tile past the end).
GUARD, GUARD_AFTER = 16, 4096
SENTINEL = 0xA5  # the first tensor's guard byte; the next ones' differ (a copy of a guard is a change)


@pytest.fixture(scope="module", autouse=True)
def built():
    emu.library()  # build (or find) it once; skips without the CUDA headers


class Arena:
    """Tensors placed between guard bytes, at an element offset from a 64-byte aligned start."""

    def __init__(self):
        self.placed = []

    def put(self, values, offset=0, after=GUARD_AFTER):
        values = values.reshape(-1)
        n = values.numel()
        buf = torch.empty(GUARD + offset + n + after, dtype=values.dtype)
        sentinel = (SENTINEL + 37 * len(self.placed)) & 0xFF
        buf.view(torch.uint8).fill_(sentinel)
        view = buf[GUARD + offset:GUARD + offset + n]
        view.copy_(values)
        assert offset % (16 // buf.element_size()) != 0 or view.data_ptr() % 16 == 0
        self.placed.append((buf, GUARD + offset, GUARD + offset + n, sentinel))
        return view

    def check(self):
        for i, (buf, lo, hi, sentinel) in enumerate(self.placed):
            raw, size = buf.view(torch.uint8), buf.element_size()
            outside = torch.cat([raw[:lo * size], raw[hi * size:]])
            assert bool((outside == sentinel).all()), f"tensor {i}: a write outside it, at bytes " \
                f"{(outside != sentinel).nonzero().flatten()[:8].tolist()} of its guards"


def batches(groups, per_launch):
    """The launches a list takes: its non-empty tensors grouped by dtypes, per_launch to a launch."""
    counts = {}
    for key, n in groups:
        if n:
            counts[key] = counts.get(key, 0) + 1
    return sum(-(-c // per_launch) for c in counts.values())


def launched(log, kernel, at_least=1):
    runs = [entry for entry in log if entry[0] == kernel]
    assert len(runs) >= at_least, f"{kernel} launched {len(runs)} times, expected >= {at_least}: {log}"
    return runs


def same_bits(a, b):
    if a.dtype in (torch.float32, torch.float16, torch.bfloat16):
        view = torch.int32 if a.element_size() == 4 else torch.int16
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def same_values(a, b):
    """Bit for bit but a NaN's payload, which a format may leave to the hardware (wire.h: a GPU
    writes 0x7FFFFFFF where x86 keeps the operand's)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and same_bits(a[~nan], b[~nan])


def assert_same_bits(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert same_bits(a, b), f"{what}[{i}] differs at {(a != b).nonzero().flatten()[:8].tolist()}"


# --- fused Adam: adam_kernel<GradT, OutT>, 9 instantiations -------------------------------------------

# (numel, offset of p, g, m, v, model): tails of the 4- and 8-wide tiles (1024, 2048 elements), a
# whole tile, empty, and each stream alone misaligned (the tensor then takes the scalar path).
ADAM_CASES = [(1, 0, 0, 0, 0, 0), (5, 0, 1, 0, 0, 0), (1023, 0, 0, 0, 0, 0), (1024, 0, 0, 0, 0, 0),
              (2048, 0, 0, 0, 0, 0), (2049, 0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0), (4100, 1, 0, 0, 0, 0),
              (3000, 0, 0, 2, 0, 0), (1500, 0, 0, 0, 3, 0), (4096 + 17, 0, 0, 0, 0, 0), (2100, 0, 1, 0, 0, 0)]


def adam_state(cases, grad_dtype, model_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, *_ in cases:
        out.append([torch.randn(n, generator=gen), (torch.randn(n, generator=gen) * 0.1).to(grad_dtype),
                    torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-3,
                    torch.zeros(n, dtype=model_dtype) if model_dtype else None])
    return out


def adam_on_emulator(arena, state, cases, steps, **kw):
    """Puts the state in the arena at the cases' offsets and runs `steps` emulated steps."""
    placed = [[None if t is None else arena.put(t, off) for t, off in zip(tensors, case[1:])]
              for tensors, case in zip(state, cases)]
    lists = list(zip(*placed))
    gen = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        for g in lists[1]:
            g.copy_(torch.randn(g.shape, generator=gen) * 0.1)
        emu.fused_adam(*lists[:4], model_params=list(lists[4]) if lists[4][0] is not None else None, step=step,
                       **{**HYPER, **kw})
    return lists


def adam_on_backend(backend, state, steps, **kw):
    lists = [[None if t is None else t.clone() for t in col] for col in zip(*state)]
    gen = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        for g in lists[1]:
            g.copy_(torch.randn(g.shape, generator=gen) * 0.1)
        ops.fused_adam_(*lists[:4], model_params=lists[4] if lists[4][0] is not None else None, step=step,
                        backend=backend, **{**HYPER, **kw})
    return lists


@pytest.mark.parametrize("grad_dtype", FLOATS)
@pytest.mark.parametrize("model_dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_adam_kernel_every_dtype_tail_and_misaligned_stream(grad_dtype, model_dtype, adam_w_mode):
    arena = Arena()
    state = adam_state(ADAM_CASES, grad_dtype, model_dtype)
    with emu.emulated() as log:
        got = adam_on_emulator(arena, state, ADAM_CASES, steps=2, adam_w_mode=adam_w_mode)
    launched(log, "adam_kernel", 2)
    arena.check()
    want = adam_on_backend("torch", state, 2, adam_w_mode=adam_w_mode)
    for k in (0, 2, 3):  # params, exp_avgs, exp_avg_sqs
        for i, (a, b) in enumerate(zip(got[k], want[k])):
            torch.testing.assert_close(a, b, rtol=ADAM_TOL[0], atol=ADAM_TOL[1], msg=lambda m: f"[{k}][{i}]: {m}")
    if model_dtype is not None:  # the write-back is the rounding of the kernel's own masters
        assert_same_bits(got[4], [p.to(model_dtype) for p in got[0]], "model_params")
    if HAS_CPU:
        cpu = adam_on_backend("cpu", state, 2, adam_w_mode=adam_w_mode)
        for k in (0, 2, 3, 4):
            if model_dtype is not None or k != 4:
                assert_same_bits(got[k], cpu[k], f"list {k} against the CPU kernel")


@pytest.mark.parametrize("device", [pytest.param(1, id="1-block"), pytest.param(2, id="block-per-tile")])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_adam_kernel_any_grid_and_order_same_bits(device, reverse):
    """The grid-stride walk: one block for every tile, or a block per tile; threads and blocks
    in reverse order. The same bits as the default grid of 3 blocks."""
    cases = ADAM_CASES[:6]
    state = adam_state(cases, torch.bfloat16, torch.bfloat16, seed=1)
    with emu.emulated():
        base = adam_on_emulator(Arena(), state, cases, steps=1)
    arena = Arena()
    with emu.emulated(device=device, reverse=reverse) as log:
        got = adam_on_emulator(arena, state, cases, steps=1)
    grid = launched(log, "adam_kernel")[0][1][0]
    tiles = sum(-(-n // 2048) for n, *_ in cases)
    assert grid == (1 if device == 1 else tiles)
    arena.check()
    for k in (0, 2, 3, 4):
        assert_same_bits(got[k], base[k], f"list {k}")


def test_adam_kernel_lists_span_launches():
    """More tensors than a launch holds (224), in three grad dtypes: several launches per dtype
    pair; the CPU kernel's bits (and the reference's numbers)."""
    sizes = [(7 * i) % 61 for i in range(800)]
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(n, generator=gen) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 0.1).to(FLOATS[i % 3]) for i, n in enumerate(sizes)]
    m, v = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    model = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    want = [[t.clone() for t in lst] for lst in (params, grads, m, v, model)]
    arena = Arena()
    params, grads, m, v, model = ([arena.put(t, after=64) for t in lst] for lst in (params, grads, m, v, model))
    with emu.emulated() as log:
        emu.fused_adam(params, grads, m, v, model, step=1, **HYPER)
    assert len(launched(log, "adam_kernel")) == batches([(i % 3, n) for i, n in enumerate(sizes)], 224) == 6
    arena.check()
    ops.fused_adam_(*want[:4], model_params=want[4], step=1, backend="cpu" if HAS_CPU else "torch", **HYPER)
    if HAS_CPU:
        for k, got in enumerate((params, m, v, model)):
            assert_same_bits(got, [want[0], want[2], want[3], want[4]][k], f"list {k}")
    else:
        for a, b in zip(params, want[0]):
            torch.testing.assert_close(a, b, rtol=ADAM_TOL[0], atol=ADAM_TOL[1])


def test_adam_kernel_reads_lr_step_scale_and_found_inf_from_memory():
    """The device-pointer hyper-parameters (a CUDA graph's): the same bits as numbers; found_inf
    non-zero changes nothing (model params included), zero steps as usual."""
    cases = [(1000, 0, 0, 0, 0, 0), (33, 0, 1, 0, 0, 0)]
    state = adam_state(cases, torch.float16, torch.float16, seed=3)
    arena = Arena()
    a = [[arena.put(t, off) for t, off in zip(tensors, case[1:])] for tensors, case in zip(state, cases)]
    b = [[arena.put(t, off) for t, off in zip(tensors, case[1:])] for tensors, case in zip(state, cases)]
    for tensors in b:
        tensors[1].copy_((tensors[1].float() * 1024).half())  # exact: a power of two
    cols = lambda s: [list(c) for c in zip(*s)]  # noqa: E731
    ca, cb = cols(a), cols(b)
    kw = {k: v for k, v in HYPER.items() if k != "lr"}
    with emu.emulated() as log:
        emu.fused_adam(*ca[:4], ca[4], lr=0.01, step=3, **kw)
        emu.fused_adam(*cb[:4], cb[4], lr=0.5, step=9, grad_scale=3.0, lr_tensor=torch.tensor([0.01]),
                       step_tensor=torch.tensor([3.0]), grad_scale_tensor=torch.tensor([1024.0]), **kw)
    launched(log, "adam_kernel", 2)
    for k in (0, 2, 3, 4):
        assert_same_bits(ca[k], cb[k], f"list {k}")
    before = [[t.clone() for t in col] for col in ca]
    with emu.emulated():
        emu.fused_adam(*ca[:4], ca[4], lr=0.01, step=4, found_inf=torch.ones(1), **kw)
    for k in range(5):
        assert_same_bits(ca[k], before[k], f"list {k} after a skipped step")
    with emu.emulated():
        emu.fused_adam(*ca[:4], ca[4], lr=0.01, step=4, found_inf=torch.zeros(1), **kw)
    assert not torch.equal(ca[0][0], before[0][0])
    arena.check()


def test_adam_kernel_inf_and_nan_grads_as_the_cpu_kernel():
    """Without found_inf an inf or NaN grad reaches the update: NaN where the CPU kernel has NaN."""
    cases = [(2100, 0, 0, 0, 0, 0), (77, 0, 1, 0, 0, 0)]
    state = adam_state(cases, torch.float32, torch.bfloat16, seed=4)
    state[0][1][[3, 1500]] = torch.tensor([math.inf, math.nan])
    state[1][1][[10]] = -math.inf
    arena = Arena()
    placed = [[arena.put(t, off) for t, off in zip(tensors, case[1:])] for tensors, case in zip(state, cases)]
    lists = [list(c) for c in zip(*placed)]
    with emu.emulated():
        emu.fused_adam(*lists[:4], lists[4], step=1, **HYPER)
    arena.check()
    want = [[t.clone() for t in col] for col in zip(*state)]
    ops.fused_adam_(*want[:4], model_params=want[4], step=1, backend="cpu" if HAS_CPU else "torch", **HYPER)
    for k in (0, 2, 3, 4):
        for a, b in zip(lists[k], want[k]):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
            if HAS_CPU:
                fin = a.isfinite()
                assert same_bits(a[fin], b[fin])


# --- casts: cast_kernel<SrcT, DstT>, 9 instantiations ---------------------------------------------------

def cast_values(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 300
    specials = torch.tensor([70000.0, -1e-8, 0.5, math.inf, -math.inf, math.nan, -0.0, 6e-8, 1.00390625, 65520.0,
                             3e38, 1e-40])
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    return x.to(dtype)


# (numel, src offset, dst offset): tails of 8- and 16-wide... tiles (2048 / 4096 elements a tile),
# whole tiles, and misaligned sources and destinations.
CAST_CASES = [(1, 0, 0), (13, 1, 0), (2047, 0, 0), (2048, 0, 0), (4096, 0, 0), (4097, 0, 1), (4100, 3, 0),
              (0, 0, 0), (6000, 0, 0), (9000, 0, 2)]


def cast_equal(got, src, dtype):
    want = src.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    if src.dtype == dtype:  # raw bits moved: NaN payloads too
        return same_bits(got, src)
    return same_bits(got[~nan], want[~nan])


@pytest.mark.parametrize("src_dtype", FLOATS)
@pytest.mark.parametrize("dst_dtype", FLOATS)
def test_cast_kernel_every_dtype_pair_bitwise(src_dtype, dst_dtype):
    arena = Arena()
    srcs = [arena.put(cast_values(n, src_dtype, i), so) for i, (n, so, _) in enumerate(CAST_CASES)]
    dsts = [arena.put(torch.zeros(n, dtype=dst_dtype), do) for n, _, do in CAST_CASES]
    with emu.emulated() as log:
        emu.cast_copy(srcs, dsts)
    launched(log, "cast_kernel")
    arena.check()
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        assert cast_equal(d, s, dst_dtype), f"segment {i} ({CAST_CASES[i]})"


@pytest.mark.parametrize("device", [1, 2])
def test_cast_kernel_flatten_many_segments_spans_launches(device):
    """A flatten of 700 tensors of three dtypes into one bf16 buffer (segments at every offset of
    the flat buffer, most of them misaligned): more segments than a launch holds (320)."""
    sizes = [(i * 7) % 13 + (300 if i % 50 == 0 else 0) for i in range(700)]
    srcs = [cast_values(n, FLOATS[i % 3], i) for i, n in enumerate(sizes)]
    arena = Arena()
    flat = arena.put(torch.zeros(sum(sizes), dtype=torch.bfloat16))
    dsts = list(torch.split(flat, sizes))
    with emu.emulated(device=device) as log:
        emu.cast_copy(srcs, dsts)
    arena.check()
    assert len(launched(log, "cast_kernel")) == batches([(i % 3, n) for i, n in enumerate(sizes)], 320) == 3
    want = ops.flatten(srcs, torch.bfloat16, backend="torch")
    nan = want.isnan()
    assert torch.equal(flat.isnan(), nan) and same_bits(flat[~nan], want[~nan])
    # and back, unflatten_into's direction: one dtype pair, several launches
    back = [arena.put(torch.zeros(n)) for n in sizes]
    with emu.emulated(device=device) as log:
        emu.cast_copy(dsts, back)
    arena.check()
    assert len(launched(log, "cast_kernel")) == batches([(0, n) for n in sizes], 320) == 3
    for i, (b, s) in enumerate(zip(back, dsts)):
        assert same_bits(b, s.float()), f"segment {i}"


# --- low-bit Adam: lowbit_kernel<G>, 3 instantiations, int8 / bf16 / fp32 state ---------------------------

LOWBIT_SIZES = [(1, 0), (255, 1), (256, 0), (257, 0), (700, 3), (0, 0)]  # (numel, offset): one element a thread
LOWBIT_BASES = [1000003, 5, 77, 8 * (1 << 32) - 3, 0, 9]  # odd global indices; one straddles Philox group 2^32


def lowbit_inputs(fmt, param_dtype, grad_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n, _ in LOWBIT_SIZES:
        p = torch.randn(n, generator=gen).to(param_dtype)
        g = (torch.randn(n, generator=gen) * 4).to(grad_dtype)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        if fmt == "int8":
            (mc, ms), (vc, vs) = L.encode_moment(m, False), L.encode_moment(v, True)
            state, scales = [mc, vc], [ms, vs]
        else:
            state, scales = ([m.bfloat16(), v.bfloat16()] if fmt == "bf16" else [m, v]), [None, None]
        # fp32 masters write a 16-bit model copy (fp16 with fp16 grads), but with fp32 grads none
        model_dtype = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
        with_model = param_dtype == torch.float32 and grad_dtype != torch.float32
        model = torch.zeros(n, dtype=model_dtype) if with_model else None
        rows.append([p, g, state[0], state[1], scales[0], scales[1], model])
    return rows


def lowbit_run(rows, runner, arena=None, steps=2):
    """Runs `steps` updates; runner: "emulated" or a backend of fused_adam_lowbit_. Returns the columns."""
    cols = [[None if t is None else (arena.put(t, off) if arena else t.clone()) for t in row]
            for row, (_, off) in zip(rows, LOWBIT_SIZES)]
    p, g, m, v, ms, vs, model = (list(c) for c in zip(*cols))
    int8 = ms[0] is not None
    for step in range(1, steps + 1):
        kw = dict(exp_avg_scales=ms if int8 else None, exp_avg_sq_scales=vs if int8 else None,
                  model_params=model if model[0] is not None else None, index_bases=LOWBIT_BASES, seed=11,
                  step=step, grad_scale=2.0, **HYPER)
        if runner == "emulated":
            emu.fused_adam_lowbit(p, g, m, v, maps=L.maps("cpu"), **kw)
        else:
            fused_adam_lowbit_(p, g, m, v, backend=runner, **kw)
    return [p, m, v, ms, vs, model]


def assert_near_reference(got, ref):
    """test_lowbit.py's bounds: adam.h's roundings against torch's fused ones, rarely a code or a
    bf16 step apart (see test_compiled_kernel_matches_the_reference)."""
    for a, b in zip(ref, got):
        if a is None:
            continue
        if a.dtype == torch.float32:
            off = (a - b).abs() > 1e-7 + 1e-6 * a.abs()
            assert off.float().mean() <= 1e-3 and (a - b).abs().max() <= 1e-2 * 2**-7
        elif a.dtype == torch.uint8:
            assert (a.int() - b.int()).abs().max() <= 1 and (a != b).float().mean() <= 1e-3
        else:
            fa, fb = a.float(), b.float()
            assert torch.all((fa - fb).abs() <= fa.abs() * 2**-7 + 1e-6 * fa.abs().max())


@pytest.mark.parametrize("fmt", ["int8", "bf16", "fp32"])
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float16)])
def test_lowbit_kernel_every_format_and_dtype(fmt, param_dtype, grad_dtype):
    rows = lowbit_inputs(fmt, param_dtype, grad_dtype, seed=3)
    arena = Arena()
    with emu.emulated() as log:
        got = lowbit_run(rows, "emulated", arena)
    assert len(launched(log, "lowbit_kernel")) == 2 * sum(1 for n, _ in LOWBIT_SIZES if n)  # one per tensor
    arena.check()
    if HAS_CPU:  # the same update, codes and random bits: the CPU kernel's bits
        cpu = lowbit_run(rows, "cpu")
        for k, (a, b) in enumerate(zip(got, cpu)):
            if a[0] is not None:
                assert_same_bits(a, b, f"column {k} against the CPU kernel")
    ref = lowbit_run(rows, "torch")
    for k in range(len(rows)):
        if rows[k][0].numel():
            assert_near_reference([c[k] for c in got], [c[k] for c in ref])


def test_lowbit_kernel_inf_and_nan_blocks_as_the_reference():
    """An inf or NaN gradient (no found_inf): its block's new absmax is NaN or inf in the reference
    (torch's amax propagates NaN), so the block's scales and decoded moments are NaN there; the
    other blocks are untouched by it."""
    n = 1024
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen)
    g[20], g[300], g[600] = math.inf, math.nan, -math.inf
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    outs = []
    for runner in ("torch", "emulated"):
        (mc, ms), (vc, vs) = L.encode_moment(m, False), L.encode_moment(v, True)
        kw = dict(exp_avg_scales=[ms], exp_avg_sq_scales=[vs], index_bases=[0], seed=0, step=2, **HYPER)
        with emu.emulated():
            if runner == "emulated":
                arena = Arena()
                mc, vc, ms, vs = (arena.put(t) for t in (mc, vc, ms, vs))
                kw.update(exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
                emu.fused_adam_lowbit([arena.put(p)], [arena.put(g)], [mc], [vc], maps=L.maps("cpu"), **kw)
                arena.check()
            else:
                fused_adam_lowbit_([p.clone()], [g], [mc], [vc], backend="torch", **kw)
        outs.append((mc, vc, ms, vs))
    (m0, v0, ms0, vs0), (m1, v1, ms1, vs1) = outs
    for which, (s0, s1) in enumerate(((ms0, ms1), (vs0, vs1))):
        assert torch.equal(s0.isnan(), s1.isnan()), f"{'exp_avg_sq' if which else 'exp_avg'} scales: NaN in " \
            f"blocks {s0.isnan().nonzero().flatten().tolist()} (reference), {s1.isnan().nonzero().flatten().tolist()}"
        assert torch.equal(s0[~s0.isnan()], s1[~s1.isnan()])
    for which, (a, b) in enumerate(((m0, m1), (v0, v1))):
        d0 = L.decode_moment(a, outs[0][2 + which], bool(which))
        d1 = L.decode_moment(b, outs[1][2 + which], bool(which))
        assert torch.equal(d0.isnan(), d1.isnan()) and torch.equal(d0[~d0.isnan()], d1[~d1.isnan()])


# --- wire: wire_encode_kernel<T> (3 instantiations) and wire_decode_kernel -----------------------------------

KEY = (2**64 - 5, 7, 1, 999)  # seed, step, stream, base (test_wire_kernels.py's)
WIRE_KEYS = [(0, 1, 0, 0), (3, 1, 0, 3), (3, 2**32 + 1, 0, 3), (9, 5, 1, 8 * (1 << 32) - 8 * 37 - 3)]


def special_chunk(n, seed=0):
    """test_wire_kernels.py's blocks: random, zeros and -0.0, inf and -inf, NaN, tiny (1 / scale inf),
    a huge value; n need not be a multiple of the block (64)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 3
    B = wire.BLOCK
    x[B:2 * B] = 0.0
    x[B + 5] = -0.0
    x[2 * B + 17], x[2 * B + 100] = math.inf, -math.inf
    x[3 * B + 20] = math.nan
    x[4 * B:5 * B] = torch.randn(B, generator=gen) * 1e-40
    x[4 * B + 3], x[4 * B + 4] = 1e-45, 0.0
    if n > 5 * B + 1:
        x[5 * B + 1] = 3e38
    return x


_gen = torch.Generator().manual_seed(1)
WIRE_CHUNKS = {"1": torch.randn(1, generator=_gen), "63": torch.randn(63, generator=_gen) * 1e3,
               "65": torch.randn(65, generator=_gen), "254": torch.randn(254, generator=_gen),  # an even tail
               "special-397": special_chunk(397), "special-384": special_chunk(384)}  # whole blocks only


def emulated_encode(arena, x, bits, key, stochastic, error_dtype=None, residual=None, x_offset=1, out_offset=1):
    xs = arena.put(x, x_offset)
    out = arena.put(torch.full((wire.nbytes(x.numel(), bits),), 0xAB, dtype=torch.uint8), out_offset)
    err = arena.put(torch.full((x.numel(),), 123.0, dtype=error_dtype), 1) if error_dtype else None
    res = arena.put(residual, 0) if residual is not None else None
    emu.wire_encode(xs, out, bits, *key, error=err, stochastic=stochastic, residual=res)
    return out, err


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_wire_encode_kernel_every_dtype_and_chunk_bitwise(bits, x_dtype, stochastic):
    """x at an odd element offset, the bytes at an odd byte offset (the scales are written a byte at a time)."""
    arena = Arena()
    with emu.emulated() as log:
        for i, (name, x) in enumerate(WIRE_CHUNKS.items()):
            x = x.clamp(-6e4, 6e4).to(x_dtype) if x_dtype != torch.float32 else x
            error_dtype = (torch.float32, torch.bfloat16)[i % 2]
            ref, ref_err = wire.encode_with_error(x.float(), bits, *KEY, stochastic=stochastic)
            out, err = emulated_encode(arena, x, bits, KEY, stochastic, error_dtype)
            assert torch.equal(out, ref), f"{name}: bytes differ at {(out != ref).nonzero().flatten()[:8].tolist()}"
            assert same_bits(err.float(), ref_err.to(error_dtype).float()), name
            out_only, _ = emulated_encode(arena, x, bits, KEY, stochastic, out_offset=0)
            assert torch.equal(out_only, ref), name
    launched(log, "wire_encode_kernel", 2 * len(WIRE_CHUNKS))
    arena.check()


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_encode_kernel_every_key_of_the_random_stream(bits):
    x = WIRE_CHUNKS["special-397"]
    arena = Arena()
    with emu.emulated(reverse=True) as log:
        for key in WIRE_KEYS:
            out, _ = emulated_encode(arena, x, bits, key, True)
            assert torch.equal(out, wire.encode(x, bits, *key)), f"key {key}"
    launched(log, "wire_encode_kernel", len(WIRE_KEYS))
    arena.check()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("err_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wire_encode_kernel_adds_a_residual_and_may_write_the_error_over_it(bits, res_dtype, err_dtype):
    x = special_chunk(397)
    x[5 * wire.BLOCK + 1] = 1e30
    res = (torch.randn(x.numel(), generator=torch.Generator().manual_seed(5)) * 0.5).to(res_dtype)
    arena = Arena()
    with emu.emulated() as log:
        for xd in FLOATS:
            xx = x.clamp(-6e4, 6e4).to(xd) if xd == torch.float16 else x.to(xd)
            ref, ref_err = wire.encode_with_error(xx.float() + res.float(), bits, *KEY)
            out, err = emulated_encode(arena, xx, bits, KEY, True, err_dtype, residual=res)
            assert torch.equal(out, ref) and same_bits(err.float(), ref_err.to(err_dtype).float()), xd
            if res_dtype == err_dtype:  # in place: the residual becomes this round's error
                inplace = arena.put(res, 1)
                out2 = arena.put(torch.zeros(wire.nbytes(x.numel(), bits), dtype=torch.uint8), 3)
                emu.wire_encode(arena.put(xx, 0), out2, bits, *KEY, error=inplace, residual=inplace)
                assert torch.equal(out2, ref) and same_bits(inplace.float(), ref_err.to(err_dtype).float())
    launched(log, "wire_encode_kernel", 3)
    arena.check()


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_decode_kernel_writes_and_accumulates_bitwise(bits):
    arena = Arena()
    with emu.emulated() as log:
        for name, x in WIRE_CHUNKS.items():
            n = x.numel()
            buf = arena.put(wire.encode(x, bits, *KEY), 1)
            want = wire.decode(buf.clone(), n, bits)
            out = arena.put(torch.full((n,), 5.0), 1)
            emu.wire_decode(buf, n, bits, out)
            assert same_values(out, want), name
            start = torch.randn(n, generator=torch.Generator().manual_seed(2))
            acc = arena.put(start, 3)
            emu.wire_decode(buf, n, bits, acc, accumulate=True)
            emu.wire_decode(buf, n, bits, acc, accumulate=True)  # two ranks' chunks summed
            assert same_values(acc, start + want + want), name
    launched(log, "wire_decode_kernel", 3 * len(WIRE_CHUNKS))
    arena.check()


# --- every __global__ has a test here ----------------------------------------------------------------

# kernel -> the tests that launch it (each asserts the launch from the emulator's log)
COVERED = {
    "adam_kernel": ["test_adam_kernel_every_dtype_tail_and_misaligned_stream",
                    "test_adam_kernel_any_grid_and_order_same_bits", "test_adam_kernel_lists_span_launches",
                    "test_adam_kernel_reads_lr_step_scale_and_found_inf_from_memory"],
    "cast_kernel": ["test_cast_kernel_every_dtype_pair_bitwise",
                    "test_cast_kernel_flatten_many_segments_spans_launches"],
    "lowbit_kernel": ["test_lowbit_kernel_every_format_and_dtype"],
    "wire_encode_kernel": ["test_wire_encode_kernel_every_dtype_and_chunk_bitwise",
                           "test_wire_encode_kernel_every_key_of_the_random_stream",
                           "test_wire_encode_kernel_adds_a_residual_and_may_write_the_error_over_it"],
    "wire_decode_kernel": ["test_wire_decode_kernel_writes_and_accumulates_bitwise"],
}
GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


def test_every_global_kernel_has_an_emulated_test():
    found = {}
    for path in sorted((ROOT / "csrc" / "cuda").glob("*.cu*")):
        text = path.read_text()
        names = GLOBAL.findall(text)
        assert len(names) == text.count("__global__"), f"{path.name}: a __global__ this listing does not read"
        for name in names:
            found[name] = path.name
    assert found, "no __global__ found in csrc/cuda"
    missing = sorted(set(found) - set(COVERED))
    assert not missing, f"kernels with no emulated test: {[f'{k} ({found[k]})' for k in missing]}"
    assert not set(COVERED) - set(found), f"COVERED names kernels that are gone: {sorted(set(COVERED) - set(found))}"
    for kernel, tests in COVERED.items():
        for name in tests:
            assert callable(globals().get(name)), f"{kernel}: no test {name}"
