"""The compiled wire-format kernels, "cpu" (zerokern._C) and "cuda" (zerokern._C_cuda): the ops
torch.ops.zerokern.wire_encode_ / wire_decode_, whose tensors' device picks the kernel.
wire_ops validated the arguments."""

import torch

from . import selfcheck


def encode_(x, out, bits, seed, step, stream, base, error, stochastic=True, residual=None):
    if x.device.type == "cuda":  # [Note: first-call self-check]
        selfcheck.ensure("wire", x.device)
    # the op's seed is an int64: the same 64 bits
    torch.ops.zerokern.wire_encode_(x, out, error, bits, seed - (1 << 64) if seed >= 1 << 63 else seed, step,
                                    stream, base, stochastic, residual)


def decode_(buf, n, bits, out, accumulate):
    if out.device.type == "cuda":
        selfcheck.ensure("wire", out.device)
    torch.ops.zerokern.wire_decode_(buf, n, bits, out, accumulate)
