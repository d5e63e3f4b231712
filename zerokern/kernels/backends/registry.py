"""Which kernel backends exist, where each runs, and why one cannot run here.

An explicitly requested backend that cannot run raises with the reason; "auto"
takes the first usable backend in the device's preference order and logs
(at INFO, once per reason) when it had to pass one over.
"""

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

log = logging.getLogger("zerokern")


class BackendUnavailableError(RuntimeError):
    """A backend that exists but cannot run in this process."""


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # zerokern.backends.<module> implements the ops
    devices: Callable[[], Tuple[str, ...]]  # device types it accepts
    why_not: Callable[[], Optional[str]]  # None when usable, else the reason
    description: str


def _ext():
    from ... import _ext

    return _ext


def _cpu_why_not():
    return _ext().cpu_error


def _cuda_why_not():
    if os.environ.get("ZEROKERN_CUDA_KERNELS", "1").strip() == "0":  # [Note: first-call self-check]
        return "turned off by ZEROKERN_CUDA_KERNELS=0 (auto takes the Triton kernels, else plain torch)"
    if _ext().cuda_error:
        return _ext().cuda_error
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _triton_import_error():
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton is not importable ({e})"
    return None


def _triton_why_not():
    if _triton_import_error():
        return _triton_import_error()
    if not torch.cuda.is_available() and not _interpreting():
        return "no CUDA device is visible (set TRITON_INTERPRET=1 to run it on the CPU, slowly)"
    return None


BACKENDS = {
    b.name: b
    for b in (
        Backend("cuda", "native", lambda: ("cuda",), _cuda_why_not, "C++/CUDA extension (zerokern._C_cuda)"),
        Backend("triton", "triton_ops",
                lambda: ("cuda", "cpu") if _interpreting() else ("cuda",),
                _triton_why_not, "Triton kernels, compiled at run time"),
        Backend("cpu", "native", lambda: ("cpu",), _cpu_why_not, "C++ SIMD + OpenMP extension (zerokern._C)"),
        Backend("torch", "torch_ref", lambda: ("cpu", "cuda"), lambda: None, "plain PyTorch reference"),
    )
}

# "auto" tries these in order for tensors on each device type.
PREFERENCE = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}


def available_backends():
    """{backend name: usable in this process}."""
    return {name: b.why_not() is None for name, b in BACKENDS.items()}


def unavailable_backends():
    """{backend name: why it cannot run here}, for the unusable ones only."""
    return {name: reason for name, b in BACKENDS.items() if (reason := b.why_not()) is not None}


@functools.lru_cache(maxsize=None)
def _log_once(message):
    log.info(message)


def resolve(name: str, device: torch.device):
    """The module implementing backend `name` for tensors on `device`."""
    return _resolve(name if isinstance(name, str) else repr(name), device.type)


@functools.lru_cache(maxsize=None)  # failures raise, so only successes are kept
def _resolve(name: str, device: str):
    if name == "auto":
        for candidate in PREFERENCE.get(device, ("torch",)):
            reason = BACKENDS[candidate].why_not()
            if reason is None:
                return importlib.import_module(f"{__package__}.{BACKENDS[candidate].module}")
            _log_once(f"zerokern: backend {candidate!r} skipped for {device} tensors: {reason}")
        raise BackendUnavailableError(f"no zerokern backend runs on {device} tensors")
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; choose one of 'auto', " + ", ".join(map(repr, BACKENDS)))
    reason = backend.why_not()
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}")
    if device not in backend.devices():
        raise ValueError(f"backend {name!r} runs on {' or '.join(backend.devices())} tensors; "
                         f"params[0] is on {device}")
    return importlib.import_module(f"{__package__}.{backend.module}")
