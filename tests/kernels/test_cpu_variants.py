"""Every SIMD variant of the CPU kernel gives the same bits.

The variant is chosen once per process from the CPU's features, or forced with
ZEROKERN_CPU_CAPABILITY, so each one runs in a subprocess.
"""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import sys, torch
from zerokern import ops
out = {"capability": torch.ops.zerokern.cpu_capability()}
dtypes = [torch.float32, torch.float16, torch.bfloat16]
for gd in dtypes:
    for md in [None, torch.float16, torch.bfloat16]:
        gen = torch.Generator().manual_seed(0)
        sizes = [0, 1, 15, 16, 17, 1000, 40001]
        p = [torch.randn(n, generator=gen) * 100 for n in sizes]
        g = [(torch.randn(n, generator=gen) * 1e-3).to(gd) for n in sizes]
        m = [torch.zeros(n) for n in sizes]; v = [torch.zeros(n) for n in sizes]
        o = [torch.empty(n, dtype=md) for n in sizes] if md else None
        for step in (1, 2, 3):
            ops.fused_adam_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                            step=step, model_params=o, grad_scale=3.0, backend="cpu")
        out[(gd, md)] = (p, m, v, o)
# casts big enough for the streaming-store path, every dtype pair
gen = torch.Generator().manual_seed(1)
big = [torch.randn(n, generator=gen) * 100 for n in (300_001, 5, 400_003)]
for s in dtypes:
    for d in dtypes:
        flat = ops.flatten([t.to(s) for t in big], out=torch.zeros(700_021, dtype=d), offsets=[3, 300_007, 300_013],
                           backend="cpu")
        out[(s, d)] = ([flat], [], [], None)
# low-bit Adam: int8 and bf16 state, fp32 masters and bf16 params without, sizes around a block
from zerokern.kernels import lowbit as L
from zerokern.kernels.lowbit_ops import fused_adam_lowbit_
for fmt in ("int8", "bf16"):
    for pd in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(2)
        sizes = [1, 255, 257, 4097, 70001]
        # the last base puts Philox group 2^32 (its counter's low word wrapping) inside a block
        bases = [7 * n for n in sizes[:-1]] + [8 * (1 << 32) - 8 * 37 - 3]
        p = [torch.randn(n, generator=gen).to(pd) for n in sizes]
        g = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
        if fmt == "int8":
            q = [L.quantize(torch.randn(n, generator=gen) * 0.1, True) for n in sizes]
            r = [L.encode_moment(torch.rand(n, generator=gen) * 0.01, True) for n in sizes]
            m, ms, v, vs = [c for c, _ in q], [s for _, s in q], [c for c, _ in r], [s for _, s in r]
        else:
            m = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
            v = [torch.rand(n, generator=gen).bfloat16() for n in sizes]
            ms = vs = None
        for step in (1, 2):
            fused_adam_lowbit_(p, g, m, v, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=step,
                               exp_avg_scales=ms, exp_avg_sq_scales=vs, index_bases=bases, seed=3,
                               backend="cpu")
        out[("lowbit", fmt, pd)] = (p, m, v, (ms or []) + (vs or []))
# the wire format (tests/kernels/test_wire_kernels.py checks the default variant against wire.py): blocks of
# random, zero, inf and NaN, tiny (1 / scale is inf) values and a short one; a base that puts Philox
# group 2^32 inside a block; both roundings
from zerokern.kernels import wire, wire_ops
gen = torch.Generator().manual_seed(4)
x = torch.randn(1337, generator=gen) * 3
x[256:512] = 0.0; x[600] = float("inf"); x[800] = float("nan"); x[1024:1280] *= 1e-40
for dtype in (torch.float32, torch.bfloat16):
    for bits, stochastic in ((8, True), (4, True), (4, False)):
        buf = torch.empty(wire.nbytes(x.numel(), bits), dtype=torch.uint8); err = torch.empty(x.numel())
        wire_ops.encode_(x.to(dtype), buf, bits, 2**64 - 5, 7, 1, 8 * (1 << 32) - 8 * 37 - 3, error=err,
                         stochastic=stochastic, backend="cpu")
        acc = torch.ones(x.numel())
        wire_ops.decode_add_(buf, x.numel(), bits, acc, backend="cpu")
        # NaN: by bits
        out[("wire", bits, dtype, stochastic)] = ([buf], [err.view(torch.int32)], [acc.view(torch.int32)], None)
        # a bf16 residual added and overwritten in place by the bf16 error (error feedback's path)
        res = (torch.randn(x.numel(), generator=gen) * 0.1).bfloat16()
        wire_ops.encode_(x.to(dtype), buf, bits, 2**64 - 5, 7, 1, 0, error=res, residual=res,
                         stochastic=stochastic, backend="cpu")
        out[("wire residual", bits, dtype, stochastic)] = ([buf], [res.view(torch.int16)], [], None)
torch.save(out, sys.argv[1])
"""


def _run(tmp_path, capability):
    path = tmp_path / f"{capability or 'default'}.pt"
    env = dict(os.environ)
    env.pop("ZEROKERN_CPU_CAPABILITY", None)
    if capability:
        env["ZEROKERN_CPU_CAPABILITY"] = capability
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 and "lacks the instructions" in proc.stderr:
        pytest.skip(f"this CPU cannot run the {capability} variant")
    assert proc.returncode == 0, proc.stderr
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The variant the CPU picks, run once for every variant to be compared with."""
    return _run(tmp_path_factory.mktemp("default"), None)


@pytest.mark.parametrize("capability", ["avx2", "baseline"])
def test_variant_matches_default_bit_for_bit(tmp_path, default_run, capability):
    default = dict(default_run)  # a copy: the capability is popped below
    other = _run(tmp_path, capability)
    default_capability = default.pop("capability")
    assert other.pop("capability") == capability
    for key, (p, m, v, o) in default.items():
        p2, m2, v2, o2 = other[key]
        for name, a_list, b_list in (("params", p, p2), ("exp_avgs", m, m2), ("exp_avg_sqs", v, v2),
                                     ("model_params", o or [], o2 or [])):
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                assert torch.equal(a, b), f"{key}: {name}[{i}] differs between {default_capability} and {capability}"


def test_unknown_capability_is_refused(tmp_path):
    env = dict(os.environ, ZEROKERN_CPU_CAPABILITY="sse9")
    proc = subprocess.run([sys.executable, "-c", "import torch, zerokern; print(torch.ops.zerokern.cpu_capability())"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ZEROKERN_CPU_CAPABILITY=sse9 is not one of avx512, avx2, baseline" in proc.stderr
