"""Loads the compiled operator libraries and remembers why one did not load.

Importing zerokern never fails for want of a GPU or a build: a library that is
missing leaves its backend unavailable, with the reason kept here for
zerokern.ops.unavailable_backends().
"""

import torch

try:
    from . import _build_info
except ImportError:  # running from a source tree that was never built
    _build_info = None

cpu_error = None
cuda_error = None

try:
    from . import _C  # noqa: F401  registers torch.ops.zerokern.* and their CPU kernels
except ImportError as e:
    cpu_error = f"the C++ extension zerokern._C is not importable ({e}); run `pip install --no-build-isolation -e .`"

if cpu_error is None:
    if _build_info is not None and not _build_info.CUDA_BUILT:
        cuda_error = f"the CUDA extension was not built: {_build_info.CUDA_REASON}"
    else:
        try:
            from . import _C_cuda  # noqa: F401  registers the CUDA kernels
        except ImportError as e:
            cuda_error = f"the CUDA extension zerokern._C_cuda is not importable ({e})"
else:
    cuda_error = cpu_error


if cpu_error is None:
    # Fake (meta) kernels: let FakeTensor, torch.compile and opcheck reason about
    # the ops without running them. Mutating ops with no outputs return None.
    @torch.library.register_fake("zerokern::fused_adam_")
    def _fused_adam_fake(params, grads, exp_avgs, exp_avg_sqs, model_params, **kwargs):
        return None

    @torch.library.register_fake("zerokern::stream_roof_")
    def _stream_roof_fake(params, grads, exp_avgs, exp_avg_sqs, model_params):
        return None

    @torch.library.register_fake("zerokern::flatten")
    def _flatten_fake(tensors, dtype, offsets=None, numel=None):
        if numel is None:
            if offsets is None:
                numel = sum(t.numel() for t in tensors)
            else:
                numel = offsets[-1] + tensors[-1].numel()
        return tensors[0].new_empty((numel,), dtype=dtype)

    @torch.library.register_fake("zerokern::flatten_into_")
    def _flatten_into_fake(tensors, out, offsets=None):
        return None

    @torch.library.register_fake("zerokern::unflatten")
    def _unflatten_fake(flat, like, offsets=None):
        return [t.new_empty(t.shape) for t in like]

    @torch.library.register_fake("zerokern::unflatten_into_")
    def _unflatten_into_fake(flat, targets, offsets=None):
        return None

if cpu_error is None and hasattr(torch.ops.zerokern, "wire_encode_"):  # a library built before the wire ops lacks them
    @torch.library.register_fake("zerokern::wire_encode_")
    def _wire_encode_fake(x, out, error, bits, seed, step, stream, base, stochastic=True, residual=None):
        return None

    @torch.library.register_fake("zerokern::wire_decode_")
    def _wire_decode_fake(buf, n, bits, out, accumulate):
        return None
