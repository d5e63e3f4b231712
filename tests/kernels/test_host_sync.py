"""The Triton path's per-call constants are computed on the params' device without a copy
from the host (issue 16: torch.tensor(x, device=...) there was a blocking copy whenever
one of lr/step/grad_scale was a tensor and another a number, and it cannot be captured in
a CUDA graph). Checked on the meta device, which stands in for a GPU here: a host tensor
reaching an op on meta tensors is a host-to-device copy, and so is a tensor built from
host data on the device (torch.tensor / torch.as_tensor with a device, which copy below
the dispatcher, so they are watched by name)."""

import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zerokern.kernels.backends.hyper import AdamHyper, coefficients


class HostTensorsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in tree_flatten((args, kwargs))[0]):
            self.ops.append(func)
        return func(*args, **kwargs)


NAMES = ("lr", "step", "grad_scale")


def _no_host_data(monkeypatch):
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def guarded(data, *args, _real=real, _name=name, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "cpu":
                raise AssertionError(f"torch.{_name}(..., device={device}) copies host data to the device")
            return _real(data, *args, **kwargs)

        monkeypatch.setattr(torch, name, guarded)


@pytest.mark.parametrize("as_tensor", [c for k in (1, 2, 3) for c in itertools.combinations(NAMES, k)])
def test_coefficients_copy_nothing_from_the_host(as_tensor, monkeypatch):
    _no_host_data(monkeypatch)
    values = {"lr": 1e-3, "step": 3.0, "grad_scale": 1024.0}
    kw = {k: torch.full((), v, device="meta") if k in as_tensor else v for k, v in values.items()}
    h = AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, **kw)
    with HostTensorsSeen() as seen:
        coef = coefficients(h)
    assert coef.device.type == "meta" and coef.shape == (4,)
    assert seen.ops == [], f"host tensors reached {seen.ops} (a host-to-device copy)"


def test_the_checks_see_host_copies(monkeypatch):
    with HostTensorsSeen() as seen:
        torch.ones(()).to("meta")
    assert seen.ops
    _no_host_data(monkeypatch)
    with pytest.raises(AssertionError, match="copies host data"):
        torch.tensor(1.0, device="meta")
