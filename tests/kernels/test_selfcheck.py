"""The CUDA kernels' first-call self-check ([Note: first-call self-check] in
zerokern/kernels/backends/selfcheck.py): each family's check passes on a correct kernel, a kernel
made to disagree raises KernelSelfCheckError naming the kernel, the device and the switch, and the
switch (ZEROKERN_CUDA_KERNELS=0) turns the CUDA backend off so "auto" falls back.

On a CPU the checks run the CPU kernel against the plain-torch reference (the check's logic, inputs
and tolerances); the tests marked cuda run the real thing on a GPU."""

import os
import subprocess
import sys

import pytest
import torch

import zerokern
from zerokern.kernels import lowbit_ops, wire_ops
from zerokern.kernels.backends import native, native_wire, registry, selfcheck
from zerokern.kernels.backends.selfcheck import KernelSelfCheckError

CPU = torch.device("cpu")
needs_cpu_kernels = pytest.mark.skipif(registry.BACKENDS["cpu"].why_not() is not None,
                                       reason="zerokern._C is not built")


@pytest.fixture(autouse=True)
def _fresh():
    selfcheck.forget()
    yield
    selfcheck.forget()


@needs_cpu_kernels
@pytest.mark.parametrize("family", sorted(selfcheck.FAMILIES))
def test_each_family_passes_on_a_correct_kernel(family):
    """The CPU kernel against the torch reference: the check's inputs and tolerances accept a kernel
    the suite holds to the reference, and a passed check is not run again."""
    selfcheck.ensure(family, CPU, backend="cpu", oracle="torch")
    key = (family, "cpu", "cpu")
    assert key in selfcheck.seconds()
    first = selfcheck.seconds()[key]
    selfcheck.ensure(family, CPU, backend="cpu", oracle="torch")
    assert selfcheck.seconds()[key] == first  # not re-run


def _corrupt_adam(monkeypatch):
    real = native.fused_adam_

    def wrong(params, *args, **kwargs):  # a tail bound one short: the last element is not updated
        last = params[-1][-1].clone()
        real(params, *args, **kwargs)
        params[-1][-1] = last
    monkeypatch.setattr(native, "fused_adam_", wrong)


def _corrupt_flat(monkeypatch):
    real = native.flatten_into

    def wrong(tensors, out, offsets):  # a wrong index: the second tensor written one element late
        real(tensors, out, offsets)
        out[offsets[1]:offsets[1] + tensors[1].numel()] = torch.roll(out[offsets[1]:offsets[1] + tensors[1].numel()], 1)
    monkeypatch.setattr(native, "flatten_into", wrong)


def _corrupt_lowbit(monkeypatch):
    real = native.fused_adam_lowbit_

    def wrong(params, grads, exp_avgs, *args, **kwargs):  # lanes 8-31 of one warp quantized wrongly
        real(params, grads, exp_avgs, *args, **kwargs)
        exp_avgs[0][8:32] = (exp_avgs[0][8:32].int() + 3).clamp(0, 255).to(torch.uint8)
    monkeypatch.setattr(native, "fused_adam_lowbit_", wrong)


def _corrupt_wire(monkeypatch):
    real = native_wire.encode_

    def wrong(x, out, *args, **kwargs):  # one code byte of the tail off
        real(x, out, *args, **kwargs)
        out[-1] ^= 1
    monkeypatch.setattr(native_wire, "encode_", wrong)


CORRUPT = {"adam": (_corrupt_adam, "fused_adam_"), "flat": (_corrupt_flat, "flatten/unflatten"),
           "lowbit": (_corrupt_lowbit, "fused_adam_lowbit_"), "wire": (_corrupt_wire, "wire_encode_")}


def test_every_family_has_a_disagreement_test():
    assert set(CORRUPT) == set(selfcheck.FAMILIES)


@needs_cpu_kernels
@pytest.mark.parametrize("family", sorted(CORRUPT))
def test_a_kernel_that_disagrees_raises_naming_the_kernel_the_device_and_the_switch(family, monkeypatch):
    corrupt, kernel = CORRUPT[family]
    corrupt(monkeypatch)
    for _ in range(2):  # a failed check is not remembered as passed: every call raises
        with pytest.raises(KernelSelfCheckError) as info:
            selfcheck.ensure(family, CPU, backend="cpu", oracle="torch")
        msg = str(info.value)
        assert kernel in msg and "on cpu:" in msg and "ZEROKERN_CUDA_KERNELS=0" in msg, msg
        assert "differs at" in msg, msg
    assert not selfcheck.seconds()
    assert issubclass(zerokern.KernelSelfCheckError, RuntimeError)
    assert zerokern.KernelSelfCheckError is KernelSelfCheckError


def test_the_switch_turns_the_cuda_backend_off_and_auto_falls_back(monkeypatch):
    monkeypatch.setenv("ZEROKERN_CUDA_KERNELS", "0")
    registry._resolve.cache_clear()
    try:
        assert "ZEROKERN_CUDA_KERNELS=0" in registry.unavailable_backends()["cuda"]
        cuda = torch.device("cuda")  # resolution only: no tensor is made
        fallback = registry.BACKENDS["triton"].why_not() is None
        assert registry.resolve("auto", cuda).__name__.endswith("triton_ops" if fallback else "torch_ref")
        assert lowbit_ops.lowbit_backend("auto", cuda) is not native
        assert wire_ops.wire_backend("auto", cuda) is not native_wire
        with pytest.raises(zerokern.BackendUnavailableError, match="ZEROKERN_CUDA_KERNELS=0"):
            registry.resolve("cuda", cuda)
    finally:
        monkeypatch.delenv("ZEROKERN_CUDA_KERNELS")
        registry._resolve.cache_clear()


# --- on a GPU: the real kernels, through the real hooks --------------------------------------------

needs_gpu = pytest.mark.skipif(registry.BACKENDS["cuda"].why_not() is not None,
                               reason="needs the CUDA backend and a GPU")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("family", sorted(selfcheck.FAMILIES))
@pytest.mark.parametrize("oracle", ["cpu", "torch"])
def test_the_cuda_kernels_pass_their_self_check(family, oracle):
    device = torch.device("cuda", torch.cuda.current_device())
    selfcheck.ensure(family, device, oracle=oracle)
    assert (family, "cuda", str(device)) in selfcheck.seconds()


@pytest.mark.cuda
@needs_gpu
def test_the_first_cuda_call_checks_and_a_disagreement_raises_there(monkeypatch):
    """Through ops.fused_adam_ on GPU tensors: the first call runs the check (against a CPU kernel
    made wrong here), and raises naming the GPU; after the switch, auto runs another backend."""
    real = native.fused_adam_

    def wrong_on_cpu(params, *args, **kwargs):
        real(params, *args, **kwargs)
        if params and params[0].device.type == "cpu":
            params[0][0] += 1.0
    monkeypatch.setattr(native, "fused_adam_", wrong_on_cpu)
    p = [torch.zeros(64, device="cuda") for _ in range(4)]
    with pytest.raises(KernelSelfCheckError, match=torch.cuda.get_device_name()):
        zerokern.ops.fused_adam_(*[[t] for t in p], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 step=1)
    monkeypatch.setattr(native, "fused_adam_", real)
    zerokern.ops.fused_adam_(*[[t] for t in p], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    assert ("adam", "cuda", str(p[0].device)) in selfcheck.seconds()
    code = ("import torch, zerokern; from zerokern.kernels.backends import registry; "
            "print(registry.resolve('auto', torch.device('cuda')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "ZEROKERN_CUDA_KERNELS": "0"})
    assert out.returncode == 0 and out.stdout.strip().endswith(("triton_ops", "torch_ref")), out
