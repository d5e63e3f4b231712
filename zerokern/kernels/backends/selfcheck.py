"""The CUDA kernels' first-call self-check: before a kernel family's first launch on a GPU in this
process, a tiny launch of it is compared with zerokern's CPU kernel on the same inputs.

[Note: first-call self-check] The CUDA kernels are the default path of every GPU user, and CI has
no GPU, so the first run on a new GPU, driver or toolkit is where a wrong index, a tail bound or a
reduction bug would show up: as a crash, or as silently wrong training. (The first H200 run found
one: the low-bit kernel's absmax reduction reached lanes 0-7 of each warp only.) So each family
(FAMILIES) checks itself once per process and device: odd sizes, a tail, a view that breaks
16-byte alignment, one skipped step. A mismatch raises KernelSelfCheckError naming the kernel, the
GPU and the switch (ZEROKERN_CUDA_KERNELS=0) that makes "auto" take the Triton kernels, or plain
torch where Triton is missing; never a silent fallback.

The oracle is zerokern's CPU kernel, not the plain-torch reference: the suite holds every CPU kernel
to the reference on every CI run (bit for bit where the reference is exact), and the reference
itself costs 7 ms (wire) to 260 ms (low-bit Philox in int64 tensor ops) where the CPU kernel costs
tens of microseconds. The tolerances are the suite's own for a compiled kernel against the
reference (tests/kernels/test_adam.py, test_lowbit.py): fp32 rounding order may differ, a wrong element
may not.

Not checked: a launch inside CUDA graph capture or torch.compile tracing (no synchronous copy is
allowed there); such a call leaves the family unchecked, and its next eager call checks it.
"""

import time
from typing import Callable, Dict, Optional, Tuple

import torch

from .. import lowbit, ops, wire, wire_ops
from ..lowbit_ops import fused_adam_lowbit_

SWITCH = "ZEROKERN_CUDA_KERNELS"  # "0": the cuda backend reports itself unavailable (registry.py)


class KernelSelfCheckError(RuntimeError):
    """A compiled kernel disagreed with zerokern's CPU kernel in its first-call self-check."""


_passed = set()  # (family, backend, torch.device): checked in this process (or being checked: it re-enters)
_seconds: Dict[Tuple[str, str, str], float] = {}  # how long each passed check took


def ensure(family: str, device: torch.device, backend: str = "cuda", oracle: str = "cpu") -> None:
    """Check `family`'s kernels of `backend` on `device` once per process; raise on a mismatch."""
    key = (family, backend, device)  # hashed as it comes: this runs before every launch of the family
    if key in _passed:
        return
    if torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return  # see the Note: the next eager call checks
    _passed.add(key)  # first: the check's own launches come back through here
    start = time.perf_counter()
    try:
        problem = FAMILIES[family][1](device, backend, oracle)
    except BaseException:
        _passed.discard(key)
        raise
    if problem is not None:
        _passed.discard(key)  # every later call raises too
        raise KernelSelfCheckError(_message(family, device, backend, oracle, problem))
    _seconds[(family, backend, str(device))] = time.perf_counter() - start


def seconds() -> Dict[Tuple[str, str, str], float]:
    """{(family, backend, device): seconds its check took} for the checks passed in this process."""
    return dict(_seconds)


def forget() -> None:
    """Check every family again at its next call (tests, bench/self_check_cost.py)."""
    _passed.clear()
    _seconds.clear()


_ORACLES = {"cpu": "zerokern's CPU kernel", "torch": "the plain-torch reference"}


def _message(family, device, backend, oracle, problem):
    where = str(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where += f" ({props.name}, sm_{props.major}{props.minor}, CUDA {torch.version.cuda})"
    return (f"zerokern: the {backend} kernel {FAMILIES[family][0]} gave wrong results in its first-call "
            f"self-check on {where}: {problem}, against {_ORACLES.get(oracle, oracle)} on the same inputs. "
            f"Set {SWITCH}=0 to run zerokern's Triton kernels instead (or plain torch where Triton is "
            "missing), and please report this with the GPU named here ([Note: first-call self-check] in "
            "zerokern/kernels/backends/selfcheck.py)")


# --- inputs ------------------------------------------------------------------------------------


def _randn(n, gen, scale=1.0):
    return torch.randn(n, generator=gen) * scale


def _on(t: torch.Tensor, device, shift: int) -> torch.Tensor:
    """t's values on `device`, starting `shift` elements into an allocation of its own: a shift of
    1 breaks the 16-byte alignment the vector paths need, so the scalar head and tail run."""
    buf = torch.empty(t.numel() + shift, dtype=t.dtype, device=device)
    out = buf[shift:]
    out.copy_(t)
    return out


def _pair(values, device, shifts):
    """The same tensors twice: on `device` (the kernel checked) and on the CPU (the oracle)."""
    return ([_on(v, device, s) for v, s in zip(values, shifts)],
            [_on(v, "cpu", s) for v, s in zip(values, shifts)])


# --- comparisons: None, or what differs ----------------------------------------------------------


def _differs(name, got, want, rtol=0.0, atol=0.0, share=0.0):
    """None where got matches want: bit for bit (rtol = atol = 0, NaN == NaN), or within
    atol + rtol * |want| at all but a `share` of the elements."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name} is {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    if torch.equal(got, want) or (got.is_floating_point() and (rtol or atol) and torch.allclose(
            got, want, rtol=rtol, atol=atol, equal_nan=True)):
        return None  # the usual case, in one or two ops (this check's cost is paid by every GPU process)
    if rtol == 0 and atol == 0:
        if got.is_floating_point():
            off = ~((got == want) | (got.isnan() & want.isnan()))
        else:
            off = got != want
    else:
        g, w = got.double(), want.double()
        off = (g - w).abs() > atol + rtol * w.abs()
        off &= ~(g.isnan() & w.isnan())
    bad = int(off.sum())
    if bad <= share * off.numel():
        return None
    first = int(off.nonzero()[0, 0])
    return (f"{name} differs at {bad} of {off.numel()} elements (first [{first}]: {got.reshape(-1)[first].item()!r}, "
            f"expected {want.reshape(-1)[first].item()!r})")


def _first(*problems):
    return next((p for p in problems if p is not None), None)


# --- the families --------------------------------------------------------------------------------

# Sizes: 3 (all tail), 1029 (vectors, a chunk boundary past 1024 and a tail); each list has one
# tensor shifted by one element.
_SIZES, _SHIFTS = (3, 1029), (0, 1)
# fp32 masters after one step, compiled kernel against compiled kernel: the rounding order of
# adam.h's arithmetic may differ by a few ulps (tests/kernels/test_adam.py's TOL after a few steps)
_ADAM_TOL = dict(rtol=2e-6, atol=1e-7)


def _adam(device, backend, oracle):
    gen = torch.Generator().manual_seed(0)
    values = [[_randn(n, gen) for n in _SIZES], [_randn(n, gen).bfloat16() for n in _SIZES],
              [_randn(n, gen, 0.1) for n in _SIZES], [_randn(n, gen, 0.01).abs() for n in _SIZES],
              [torch.zeros(n, dtype=torch.bfloat16) for n in _SIZES]]
    on, ref = zip(*(_pair(v, device, _SHIFTS) for v in values))
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3, grad_scale=2.0)
    ops.fused_adam_(*on[:4], model_params=on[4], backend=backend, **hyper)
    ops.fused_adam_(*ref[:4], model_params=ref[4], backend=oracle, **hyper)
    skipped = [[t.clone() for t in lst] for lst in on]
    ops.fused_adam_(*skipped[:4], model_params=skipped[4], found_inf=torch.ones(1, device=device),
                    backend=backend, **hyper)
    cat = [torch.cat(lst) for lst in on]  # each list as one tensor: one comparison a list
    problems = []
    for k, name in enumerate(("params", "grads", "exp_avgs", "exp_avg_sqs")):
        tol = {} if k == 1 else _ADAM_TOL  # the grads are read only
        problems.append(_differs(f"{name} (sizes {_SIZES}, concatenated)", cat[k], torch.cat(ref[k]), **tol))
        problems.append(_differs(f"{name} after a skipped step", torch.cat(skipped[k]), cat[k]))
    # the bf16 copy is the kernel's own masters, rounded to nearest
    problems.append(_differs("model_params", cat[4], cat[0].cpu().bfloat16()))
    return _first(*problems)


def _flat(device, backend, oracle):
    gen = torch.Generator().manual_seed(1)
    values = [_randn(5, gen), _randn(130, gen).bfloat16(), _randn(1027, gen)]
    on, ref = _pair(values, device, (0, 0, 1))
    offsets, numel = [0, 8, 200], 1240
    out = _on(torch.full((numel,), 7.0), device, 1)  # the gaps keep what they held
    want = _on(torch.full((numel,), 7.0), "cpu", 1)
    ops.flatten(on, out=out, offsets=offsets, backend=backend)
    ops.flatten(ref, out=want, offsets=offsets, backend=oracle)
    back = [torch.zeros_like(t) for t in on]
    ops.unflatten_into(out, back, offsets=offsets, backend=backend)
    bf16 = ops.flatten(on, torch.bfloat16, offsets=offsets, numel=numel, backend=backend)
    bf16_want = ops.flatten(ref, torch.bfloat16, offsets=offsets, numel=numel, backend=oracle)
    return _first(_differs("flatten(out=fp32)", out, want), _differs("flatten(bfloat16)", bf16, bf16_want),
                  *(_differs(f"unflatten_into[{i}]", b, r) for i, (b, r) in enumerate(zip(back, ref))))


def _lowbit(device, backend, oracle):
    gen = torch.Generator().manual_seed(2)
    n = 2 * lowbit.BLOCK + 44  # two whole blocks and a tail
    blocks = lowbit.num_blocks(n)
    # any codes and positive scales are a state (drawn, not quantized: lowbit.quantize costs 10 ms here)
    mc, vc = (torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for _ in range(2))
    ms, vs = torch.rand(blocks, generator=gen) * 0.1, torch.rand(blocks, generator=gen) * 0.01
    values = [_randn(n, gen), _randn(n, gen, 4.0), mc, vc, ms, vs, torch.zeros(n, dtype=torch.bfloat16)]
    # the codes and scales stay aligned (the kernel's block layout); the params start one element in
    shifts = (1, 1, 0, 0, 0, 0, 1)
    runs = []
    for where, name in ((device, backend), ("cpu", oracle)):
        p, g, m, v, m_s, v_s, model = [_on(t, where, s) for t, s in zip(values, shifts)]
        for step in (1, 2):
            fused_adam_lowbit_([p], [g], [m], [v], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                               step=step, grad_scale=2.0, exp_avg_scales=[m_s], exp_avg_sq_scales=[v_s],
                               model_params=[model], index_bases=[1000003], seed=11, backend=name)
        runs.append((p, m, v, m_s, v_s, model))
    (p, m, v, m_s, v_s, model), want = runs
    # tests/kernels/test_lowbit.py's bounds for a compiled kernel: a code may move to its neighbour, and so a
    # param by lr x 2^-7, where a moment lies within fp32 rounding of a cell's edge: rarely (at most
    # 1 in 100 here, on 556 elements; the absmax bug above moved 3 in 4)
    rare = 0.01
    return _first(_differs("params", p, want[0], rtol=1e-6, atol=1e-7, share=rare),
                  _differs("params", p, want[0], atol=1e-2 * 2 ** -7),
                  _differs("exp_avg codes", m, want[1], share=rare), _differs("exp_avg_sq codes", v, want[2], share=rare),
                  _differs("exp_avg codes", m.int(), want[1].int(), atol=1),
                  _differs("exp_avg_sq codes", v.int(), want[2].int(), atol=1),
                  _differs("exp_avg scales", m_s, want[3], rtol=1e-6, share=rare),
                  _differs("exp_avg_sq scales", v_s, want[4], rtol=1e-6, share=rare),
                  _differs("model_params", model, want[5], rtol=2 ** -7, share=rare))


def _wire(device, backend, oracle):
    gen = torch.Generator().manual_seed(3)
    n = 3 * wire.BLOCK + 9  # whole blocks and an odd tail (int4 packs two codes a byte)
    x = _randn(n, gen)
    x[wire.BLOCK:2 * wire.BLOCK] *= 1e-3  # blocks of other scales
    problems = []
    for bits in (8, 4):
        (xs,), (xr,) = _pair([x], device, [1])
        outs, errs = [], []
        for where, t, name in ((device, xs, backend), ("cpu", xr, oracle)):
            out = torch.empty(wire.nbytes(n, bits), dtype=torch.uint8, device=where)
            err = torch.empty(n, device=where)
            wire_ops.encode_(t, out, bits, 5, 7, 1, 12345, error=err, backend=name)
            outs.append(out)
            errs.append(err)
        dec = torch.full((n,), 3.0, device=device)
        wire_ops.decode_(outs[0], n, bits, dec, accumulate=True, backend=backend)
        want = torch.full((n,), 3.0)
        wire_ops.decode_(outs[1], n, bits, want, accumulate=True, backend=oracle)
        problems += [_differs(f"int{bits} encode bytes", outs[0], outs[1]),
                     _differs(f"int{bits} encode error", errs[0], errs[1]),
                     _differs(f"int{bits} decode", dec, want)]
    return _first(*problems)


# family -> (the kernels it covers, as the error names them; the check)
FAMILIES: Dict[str, Tuple[str, Callable[[torch.device, str, str], Optional[str]]]] = {
    "adam": ("fused_adam_", _adam),
    "flat": ("flatten/unflatten (cast_copy)", _flat),
    "lowbit": ("fused_adam_lowbit_", _lowbit),
    "wire": ("wire_encode_/wire_decode_", _wire),
}
