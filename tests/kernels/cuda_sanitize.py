"""zerokern's CUDA kernels on awkward inputs, for compute-sanitizer (not a pytest file).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python tests/kernels/cuda_sanitize.py

Odd sizes, views that start one element into their storage (the unaligned,
scalar path) next to aligned ones (the vector path), tensors that end exactly
where a vector would overrun, mixed dtypes, write-back and a skipped step. With
the caching allocator off, every tensor is its own allocation, so a read or
write one element past a tensor's end is reported. The results are also
checked against the plain-torch backend, so it fails without the sanitizer too.
`--cpu` runs the same checks on the CPU backend (to check this script itself).
"""

import sys

import torch

from zerokern import ops

DEVICE, BACKEND = ("cpu", "cpu") if "--cpu" in sys.argv else ("cuda", "cuda")

SIZES = [1, 3, 4, 5, 127, 1023, 1024, 1025, 4097, 70001]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def tensors(n, dtype, shift, gen):
    """A tensor of n elements, starting `shift` elements into its own allocation (which ends with it)."""
    base = (torch.randn(n + shift, generator=gen) * 0.1).to(device=DEVICE, dtype=dtype)
    return base[shift:]


def adam_case(gen):
    lists = [[], [], [], [], []]
    for i, n in enumerate(SIZES):
        shift = i % 2
        lists[0].append(tensors(n, torch.float32, shift, gen))
        lists[1].append(tensors(n, DTYPES[i % 3], shift, gen))
        lists[2].append(tensors(n, torch.float32, shift, gen).abs_())
        lists[3].append(tensors(n, torch.float32, shift, gen).abs_())
        lists[4].append(tensors(n, (torch.float16, torch.bfloat16)[i % 2], (i // 2) % 2, gen))
    return lists


def check_adam():
    gen = torch.Generator().manual_seed(0)
    ours = adam_case(gen)
    ref = [[t.clone() for t in lst] for lst in ours]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=3, grad_scale=2.0)
    ops.fused_adam_(*ours[:4], model_params=ours[4], backend=BACKEND, **kw)
    ops.fused_adam_(*ref[:4], model_params=ref[4], backend="torch", **kw)
    skipped = [[t.clone() for t in lst] for lst in ours]
    ops.fused_adam_(*skipped[:4], model_params=skipped[4], found_inf=torch.ones(1, device=DEVICE), backend=BACKEND,
                    **kw)
    sync()
    for a, b in zip(ours[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    for a, b in zip(ours[0] + ours[4], skipped[0] + skipped[4]):
        assert torch.equal(a, b), "found_inf changed something"
    for p, out in zip(ours[0], ours[4]):
        assert torch.equal(out, p.to(out.dtype)), "write-back is the master cast"


def check_flat():
    gen = torch.Generator().manual_seed(1)
    for i, (src, dst) in enumerate((s, d) for s in DTYPES for d in DTYPES):
        ts = [tensors(n, src, (i + j) % 2, gen) for j, n in enumerate(SIZES)]
        flat = ops.flatten(ts, dst, backend=BACKEND)
        assert torch.equal(flat, ops.flatten(ts, dst, backend="torch")), (src, dst)
        flat_view = tensors(flat.numel(), dst, 1, gen)  # an unaligned flat buffer
        ops.flatten(ts, out=flat_view, backend=BACKEND)
        assert torch.equal(flat_view, flat)
        back = [tensors(n, src, (i + j + 1) % 2, gen) for j, n in enumerate(SIZES)]
        ops.unflatten_into(flat_view, back, backend=BACKEND)
        want = ops.unflatten(flat, ts, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(back, want)), (src, dst)
    sync()


if __name__ == "__main__":
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --cpu)")
    check_adam()
    check_flat()
    print(f"cuda_sanitize ({BACKEND}): fused_adam_ and flatten/unflatten checked on", len(SIZES), "sizes")
