"""The wire format in plain PyTorch (wire.py's functions into the caller's buffers): the reference
the other backends are tested against, and the fallback that runs anywhere (slowly: its Philox is
a few dozen int64 tensor ops per element)."""

import torch

from .. import wire


def encode_(x, out, bits, seed, step, stream, base, error, stochastic=True, residual=None):
    with torch.no_grad():
        if residual is not None:  # one fp32 add, read before `error` (which may be `residual`) is written
            x = x.reshape(-1).float() + residual.reshape(-1).float()
        if error is None:
            out.view(-1).copy_(wire.encode(x, bits, seed, step, stream, base, stochastic))
        else:
            buf, err = wire.encode_with_error(x, bits, seed, step, stream, base, stochastic)
            out.view(-1).copy_(buf)
            error.view(-1).copy_(err)


def decode_(buf, n, bits, out, accumulate):
    with torch.no_grad():
        y = wire.decode(buf.view(-1), n, bits)
        if accumulate:
            out.view(-1).add_(y)
        else:
            out.view(-1).copy_(y)
