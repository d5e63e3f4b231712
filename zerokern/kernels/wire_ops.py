"""The wire format's kernels: encode a chunk for a quantized collective, decode what arrives.

    encode_(x, out, bits, seed, step, stream, base, error=None, stochastic=True, residual=None,
            backend="auto")
    decode_(buf, n, bits, out, accumulate=False, backend="auto")
    decode_add_(buf, n, bits, out, backend="auto")

encode_ writes wire.encode(x, bits, seed, step, stream, base) into `out` (uint8,
wire.nbytes(n, bits)) (stochastic=False: rounded to nearest, seed, step and
stream unused) and, given `error` (fp32 or bf16, n), x - decode(out) with 0 in non-finite blocks
(wire.encode_with_error). x: n float32, bfloat16 or float16 values, read as fp32. Given `residual`
(fp32 or bf16, n), what is encoded is x + residual, summed in fp32 in the same pass ([Note: error
feedback]'s add, without a copy of x); `error` may be `residual` itself (updated in place). decode_ writes
wire.decode(buf, n, bits) into `out` (fp32, n), or adds it (accumulate; decode_add_).
[Note: the wire format] in wire.py defines the bytes; every backend gives them exactly.

Backends: "auto" takes the compiled kernel of the tensors' device (cpu on CPU tensors, cuda on
CUDA ones, else triton there), and the plain-PyTorch reference ("torch") where none can run.
"""

import importlib

import torch

from . import wire
from ._checks import dtype_name
from .backends.registry import BACKENDS, PREFERENCE, BackendUnavailableError

_MODULES = {"cpu": "native_wire", "cuda": "native_wire", "triton": "triton_wire", "torch": "torch_wire"}
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SIDE_DTYPES = (torch.float32, torch.bfloat16)  # of an error or a residual
_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


def encode_(x: torch.Tensor, out: torch.Tensor, bits: int, seed: int, step: int, stream: int, base: int,
            error: torch.Tensor = None, stochastic: bool = True, residual: torch.Tensor = None,
            backend: str = "auto") -> None:
    n = _check_x(x)
    _check_bits(bits)
    _check_buffer(out, "out", torch.uint8, wire.nbytes(n, bits), x.device, f"wire.nbytes({n}, {bits})")
    for name, t in (("error", error), ("residual", residual)):
        if t is not None:
            _check_buffer(t, name, t.dtype if t.dtype in _SIDE_DTYPES else torch.float32, n, x.device, "x",
                          "float32 or bfloat16")
    if error is not None and _overlap(error, x):
        raise ValueError("error overlaps x: the encode reads x while it writes error")
    if error is not None and residual is not None and _overlap(error, residual) and not (
            error.data_ptr() == residual.data_ptr() and error.dtype == residual.dtype):
        raise ValueError("error overlaps residual without being it: pass the same tensor for both (updated in "
                         "place) or two apart")
    seed, stream, base = int(seed), int(stream), int(base)
    if not 0 <= seed <= _M64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    if not 0 <= stream <= _M32 - wire.STREAM_WIRE:
        raise ValueError(f"stream must be in [0, 2**32 - {wire.STREAM_WIRE}], got {stream}")
    if not 0 <= base < (1 << 63) - n:
        raise ValueError(f"base (the global index of x[0]) must be >= 0 and base + n < 2**63, got {base}")
    step = int(step) & _M32  # the Philox counter holds the step's low 32 bits (lowbit.random16)
    module = _backend(backend, x.device)
    module.encode_(x, out, bits, seed, step, stream, base, error, bool(stochastic), residual)


def decode_(buf: torch.Tensor, n: int, bits: int, out: torch.Tensor, accumulate: bool = False,
            backend: str = "auto") -> None:
    n = int(n)
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out is {type(out).__name__}, expected a tensor")
    _check_buffer(out, "out", torch.float32, n, out.device, "n")
    _check_buffer(buf, "buf", torch.uint8, wire.nbytes(n, bits), out.device, f"wire.nbytes({n}, {bits})")
    _backend(backend, out.device).decode_(buf, n, bits, out, bool(accumulate))


def decode_add_(buf: torch.Tensor, n: int, bits: int, out: torch.Tensor, backend: str = "auto") -> None:
    """out += wire.decode(buf, n, bits): a received chunk summed into the reduction's fp32 result."""
    decode_(buf, n, bits, out, accumulate=True, backend=backend)


def wire_backend(backend: str, device: torch.device):
    """The module whose encode_ / decode_ run for `backend` on `device` (for tests and benches)."""
    return _backend(backend, device)


def _backend(backend, device):
    if backend == "auto":
        for name in PREFERENCE.get(device.type, ()):
            if BACKENDS[name].why_not() is None:
                return _module(name)
        return _module("torch")
    b = BACKENDS.get(backend) if isinstance(backend, str) else None
    if b is None:
        raise ValueError(f"unknown backend {backend!r}; choose one of 'auto', " + ", ".join(map(repr, BACKENDS)))
    reason = b.why_not()
    if reason is not None:
        raise BackendUnavailableError(f"backend {backend!r} is not available: {reason}")
    if device.type not in b.devices():
        raise ValueError(f"backend {backend!r} runs on {' or '.join(b.devices())} tensors; the tensors are on "
                         f"{device}")
    return _module(backend)


def _module(name):
    return importlib.import_module(f"{__package__}.backends.{_MODULES[name]}")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_bits(bits):
    if bits not in wire.QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x is {type(x).__name__}, expected a tensor")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"x is {dtype_name(x.dtype)}, expected float32, bfloat16 or float16")
    if not x.is_contiguous():
        raise ValueError("x is not contiguous")
    return x.numel()


def _check_buffer(t, name, dtype, numel, device, what, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} is {type(t).__name__}, expected a tensor")
    if t.dtype != dtype:
        raise TypeError(f"{name} is {dtype_name(t.dtype)}, expected {dtypes or dtype_name(dtype)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} ({what})")
