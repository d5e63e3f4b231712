"""The operator is registered with the dispatcher and passes torch.library.opcheck
(schema and mutation annotations, fake/meta kernel, autograd registration,
AOT dispatch)."""

import pytest
import torch

import zerokern  # noqa: F401  registers torch.ops.zerokern
from backends import HAS_CUDA

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA device"))])


def _args(device, grad_dtype, with_model):
    sizes = [17, 1, 130]
    gen = torch.Generator().manual_seed(0)
    t = lambda n, dt=torch.float32: torch.randn(n, generator=gen).to(device, dt)  # noqa: E731
    args = (
        [t(n) for n in sizes],
        [t(n, grad_dtype) for n in sizes],
        [t(n).abs() for n in sizes],
        [t(n).abs() for n in sizes],
        [t(n, torch.bfloat16) for n in sizes] if with_model else [],
    )
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3.0, adam_w_mode=True,
                  bias_correction=True, grad_scale=1.0)
    return args, kwargs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_model", [False, True])
def test_opcheck_fused_adam(device, grad_dtype, with_model):
    args, kwargs = _args(device, grad_dtype, with_model)
    torch.library.opcheck(torch.ops.zerokern.fused_adam_.default, args, kwargs)


def test_opcheck_with_tensor_hyperparameters():
    args, kwargs = _args("cpu", torch.float16, True)
    kwargs.update(lr_tensor=torch.tensor([1e-3]), step_tensor=torch.tensor([2.0]),
                  found_inf=torch.zeros(1), grad_scale_tensor=torch.tensor([4.0]))
    torch.library.opcheck(torch.ops.zerokern.fused_adam_.default, args, kwargs)


def test_cpu_capability_is_reported():
    assert torch.ops.zerokern.cpu_capability() in ("avx512", "avx2", "baseline")
