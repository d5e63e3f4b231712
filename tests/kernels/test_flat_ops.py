"""flatten / unflatten / unflatten_into on every backend against the torch reference."""

import re

import pytest
import torch

from backends import ALL, HAS_CUDA, KERNELS, device_for
from zerokern import ops

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [(0,), (1,), (3,), (127,), (4097,), (70001,), (5, 7), (2, 3, 4)]


def make(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Values that overflow fp16 and need rounding in bf16, plus exact ones.
    out = []
    for s in shapes:
        t = torch.randn(s, generator=gen) * 300
        if t.numel() > 2:
            t.view(-1)[:3] = torch.tensor([70000.0, -1e-8, 0.5])
        out.append(t.to(device, dtype))
    return out


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_flatten_matches_reference_bitwise(backend, src, dst):
    device = device_for(backend)
    tensors = make(SIZES, src, device)
    got = ops.flatten(tensors, dst, backend=backend)
    want = ops.flatten(tensors, dst, backend="torch")
    assert got.dtype == dst and got.shape == want.shape and got.is_contiguous()
    # Both round to nearest even: the same bits (NaN-free input here).
    assert torch.equal(got.view(torch.int16 if dst != torch.float32 else torch.int32),
                       want.view(torch.int16 if dst != torch.float32 else torch.int32))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("flat_dtype", FLOATS)
@pytest.mark.parametrize("like_dtype", FLOATS)
def test_unflatten_matches_reference_bitwise(backend, flat_dtype, like_dtype):
    device = device_for(backend)
    like = make(SIZES, like_dtype, device)
    flat = ops.flatten(make(SIZES, torch.float32, device, seed=1), flat_dtype, backend="torch")
    got = ops.unflatten(flat, like, backend=backend)
    want = ops.unflatten(flat, like, backend="torch")
    for i, (g, w, t) in enumerate(zip(got, want, like)):
        assert g.shape == t.shape and g.dtype == t.dtype, i
        assert torch.equal(g, w), f"tensor {i}"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_round_trip_exact_where_representable(backend, low):
    device = device_for(backend)
    tensors = make(SIZES, low, device)                # every value representable in fp32
    flat = ops.flatten(tensors, torch.float32, backend=backend)
    back = ops.unflatten(flat, tensors, backend=backend)
    for a, b in zip(tensors, back):
        assert torch.equal(a, b)
    # and fp32 -> low matches torch's rounding
    f32 = make(SIZES, torch.float32, device, seed=2)
    for a, b in zip(ops.unflatten(ops.flatten(f32, low, backend=backend), f32, backend=backend), f32):
        assert torch.equal(a, b.to(low).to(torch.float32))


@pytest.mark.parametrize("backend", ALL)
def test_non_contiguous_inputs_and_targets(backend):
    device = device_for(backend)
    base = torch.arange(60, dtype=torch.float32, device=device).view(6, 10)
    inputs = [base.t(), base[:, ::3], torch.ones(4, device=device, dtype=torch.bfloat16), base[2:4]]
    flat = ops.flatten(inputs, torch.float32, backend=backend)
    assert torch.equal(flat, torch.cat([t.reshape(-1).float() for t in inputs]))
    targets_base = torch.zeros(6, 10, device=device, dtype=torch.bfloat16)
    targets = [targets_base.t(), torch.zeros(6, 10, device=device)[:, ::3], torch.zeros(4, device=device),
               torch.zeros(2, 10, device=device)]
    ops.unflatten_into(flat, targets, backend=backend)
    for t, i in zip(targets, inputs):
        assert torch.equal(t, i.to(t.dtype))
    assert torch.equal(targets_base, base.bfloat16())  # the transposed view wrote through to its base


@pytest.mark.parametrize("backend", ALL)
def test_offsets_with_gaps(backend):
    device = device_for(backend)
    tensors = make([(3,), (5,), (0,), (2, 2)], torch.bfloat16, device)
    offsets = [0, 4, 12, 12]
    flat = ops.flatten(tensors, torch.float32, offsets=offsets, numel=20, backend=backend)
    want = torch.zeros(20, device=device)
    for t, o in zip(tensors, offsets):
        want[o:o + t.numel()] = t.reshape(-1).float()
    assert torch.equal(flat, want)  # the gaps are zero
    back = ops.unflatten(flat, tensors, offsets=offsets, backend=backend)
    for a, b in zip(back, tensors):
        assert torch.equal(a, b)
    targets = [torch.empty_like(t) for t in tensors]
    ops.unflatten_into(flat, targets, offsets=offsets, backend=backend)
    for a, b in zip(targets, tensors):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", KERNELS)
def test_many_tiny_tensors(backend):
    """More tensors than one CUDA launch batch holds, of mixed dtypes and sizes."""
    device = device_for(backend)
    shapes = [((i * 7) % 13,) for i in range(700)]
    tensors = [t.to(FLOATS[i % 3]) for i, t in enumerate(make(shapes, torch.float32, device))]
    flat = ops.flatten(tensors, torch.bfloat16, backend=backend)
    assert torch.equal(flat, ops.flatten(tensors, torch.bfloat16, backend="torch"))
    targets = [torch.empty_like(t) for t in tensors]
    ops.unflatten_into(flat, targets, backend=backend)
    for a, t in zip(targets, tensors):
        assert torch.equal(a, t.to(torch.bfloat16).to(t.dtype))


def test_empty_list():
    assert ops.flatten([], torch.float16).shape == (0,)
    assert ops.unflatten(torch.empty(0), []) == []


def _bad(device):
    a, b = torch.ones(3, device=device), torch.ones(2, 2, device=device)
    return [
        ("too-short", lambda be: ops.unflatten(torch.ones(6, device=device), [a, b], backend=be), ValueError,
         r"^flat has 6 elements, the like hold 7$"),
        ("too-long", lambda be: ops.unflatten_into(torch.ones(8, device=device), [a, b], backend=be), ValueError,
         r"^flat has 8 elements, the targets hold 7$"),
        ("int-input", lambda be: ops.flatten([a, torch.ones(2, dtype=torch.int64, device=device)], backend=be),
         TypeError, r"^tensors\[1\] is int64, expected float32, float16 or bfloat16$"),
        ("int-dtype", lambda be: ops.flatten([a], torch.int32, backend=be), TypeError,
         r"^dtype is int32, expected float32, float16 or bfloat16$"),
        ("2d-flat", lambda be: ops.unflatten(torch.ones(7, 1, device=device), [a, b], backend=be), ValueError,
         r"^flat must be a 1-D contiguous tensor, got shape \[7, 1\]$"),
        ("overlap", lambda be: ops.flatten([a, b], offsets=[0, 2], backend=be), ValueError,
         r"^offsets\[1\] = 2 overlaps tensors\[0\] \(offsets\[0\] = 0, 3 elements\); offsets must increase$"),
        ("negative", lambda be: ops.flatten([a, b], offsets=[-1, 4], backend=be), ValueError,
         r"^offsets\[0\] = -1 is negative$"),
        ("offsets-len", lambda be: ops.flatten([a, b], offsets=[0], backend=be), ValueError,
         r"^offsets has 1 entries, tensors has 2$"),
        ("past-end", lambda be: ops.unflatten(torch.ones(8, device=device), [a, b], offsets=[0, 5], backend=be),
         ValueError, r"^like\[1\] ends at element 9, past flat's 8$"),
        ("small-numel", lambda be: ops.flatten([a, b], numel=5, backend=be), ValueError,
         r"^numel 5 is less than the 7 elements the tensors need$"),
    ]


CASE_IDS = [c[0] for c in _bad("cpu")]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", CASE_IDS)
def test_bad_input_names_the_culprit(backend, case):
    _, call, exc, pattern = next(c for c in _bad(device_for(backend)) if c[0] == case)
    with pytest.raises(exc) as info:
        call(backend)
    assert re.search(pattern, str(info.value).splitlines()[0]), str(info.value)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device to mix devices")
def test_mixed_devices_are_named():
    with pytest.raises(ValueError, match=r"^tensors\[1\] is on cpu, tensors\[0\] is on cuda:0"):
        ops.flatten([torch.ones(2, device="cuda"), torch.ones(2)])
    with pytest.raises(ValueError, match=r"^targets\[0\] is on cpu, flat is on cuda:0"):
        ops.unflatten_into(torch.ones(2, device="cuda"), [torch.ones(2)])


DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_flat_ops(device):
    tensors = [torch.randn(3, 4, device=device), torch.randn(5, device=device).half(), torch.randn(0, device=device)]
    torch.library.opcheck(torch.ops.zerokern.flatten.default, (tensors, torch.bfloat16))
    torch.library.opcheck(torch.ops.zerokern.flatten.default, (tensors, torch.float32), {"offsets": [0, 16, 21],
                                                                                           "numel": 24})
    flat = torch.randn(17, device=device)
    torch.library.opcheck(torch.ops.zerokern.unflatten.default, (flat, tensors))
    targets = [torch.empty_like(t) for t in tensors]
    torch.library.opcheck(torch.ops.zerokern.unflatten_into_.default, (flat, targets))
    torch.library.opcheck(torch.ops.zerokern.flatten_into_.default, (tensors, flat))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_flatten_into_existing_buffer(backend, out_dtype):
    device = device_for(backend)
    tensors = make(SIZES, torch.bfloat16, device)
    out = torch.full((sum(t.numel() for t in tensors),), 7.0, device=device, dtype=out_dtype)
    assert ops.flatten(tensors, out=out, backend=backend) is out
    assert torch.equal(out, ops.flatten(tensors, out_dtype, backend="torch"))
    # with offsets the gaps keep what they held
    gapped = torch.full((12,), 7.0, device=device, dtype=out_dtype)
    ops.flatten([torch.ones(2, device=device), torch.ones(3, device=device)], out=gapped, offsets=[1, 8],
                backend=backend)
    assert gapped.tolist() == [7, 1, 1, 7, 7, 7, 7, 7, 1, 1, 1, 7]
    with pytest.raises(ValueError, match=r"^out has 4 elements, the tensors hold 5"):
        ops.flatten([torch.ones(2, device=device), torch.ones(3, device=device)],
                    out=torch.empty(4, device=device), backend=backend)


@pytest.mark.parametrize("src", FLOATS)
@pytest.mark.parametrize("dst", FLOATS)
def test_large_casts_stream_exactly(src, dst):
    """Existing destinations over 1 MB (flatten(out=), unflatten_into) take the
    streaming-store path (cast_isa.inc): head to the first aligned byte, 4 KB chunks,
    tail. Odd offsets make head and tail non-empty."""
    tensors = make([(600_001,), (3,), (700_003,)], src, "cpu", seed=4)
    offsets = [5, 600_011, 600_021]
    got = ops.flatten(tensors, out=torch.zeros(1_300_031, dtype=dst), offsets=offsets, backend="cpu")
    want = ops.flatten(tensors, dst, offsets=offsets, numel=1_300_031, backend="torch")
    assert torch.equal(ops.flatten(tensors, dst, offsets=offsets, numel=1_300_031, backend="cpu"), want)
    assert torch.equal(got.view(torch.int16 if dst != torch.float32 else torch.int32),
                       want.view(torch.int16 if dst != torch.float32 else torch.int32))
    back = [torch.empty_like(t)[1:] for t in tensors]  # targets starting one element in: unaligned
    ops.unflatten_into(got, back, offsets=[o + 1 for o in offsets], backend="cpu")
    for b, t in zip(back, tensors):
        assert torch.equal(b, t.to(dst).to(src)[1:])
