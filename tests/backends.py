"""Which backends the tests run, and on which device: one place, so a test
never hard-codes a device and every unavailable backend skips visibly."""

import pytest
import torch

from zerokern import ops

HAS_CUDA = torch.cuda.is_available()


def device_for(backend):
    return "cuda" if backend == "cuda" or (backend == "triton" and HAS_CUDA) else "cpu"


def _param(name):
    reason = ops.unavailable_backends().get(name)
    marks = [pytest.mark.skip(reason=f"backend {name!r}: {reason}")] if reason else []
    if name == "triton":
        marks.append(pytest.mark.triton)
    if name == "cuda":
        marks.append(pytest.mark.cuda)
    return pytest.param(name, marks=marks, id=name)


ALL = [_param(n) for n in ("cpu", "cuda", "triton", "torch")]
KERNELS = [_param(n) for n in ("cpu", "cuda", "triton")]  # everything but the reference

# (device, kernel backend) pairs for optimizer tests: the model on the CPU with
# the cpu kernels, and on a GPU (where one is visible) with each GPU kernel.
ON_DEVICE = [pytest.param("cpu", "cpu", id="cpu")] + [
    pytest.param("cuda", b, id=f"cuda-{b}", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not HAS_CUDA, reason="needs a CUDA device")]) for b in ("cuda", "triton")]
