"""zerokern.FusedAdam (the unsharded optimizer) against torch.optim, on every device here."""

import copy

import pytest
import torch

from backends import ON_DEVICE
from zerokern import FusedAdam


def model(device, dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 7)).to(device, dtype)


def batches(device, steps=10):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(24, 13, generator=g).to(device), torch.randn(24, 7, generator=g).to(device))
            for _ in range(steps)]


def loss_fn(m, x, y):
    return (m(x.to(next(m.parameters()).dtype)).float() - y).square().mean()


@pytest.mark.parametrize("device, backend", ON_DEVICE)
@pytest.mark.parametrize("adam_w", [True, False])
def test_matches_torch_optim(device, backend, adam_w):
    ours, ref = model(device), model(device)
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.05, adam_w_mode=adam_w, backend=backend)
    ref_opt = (torch.optim.AdamW if adam_w else torch.optim.Adam)(ref.parameters(), lr=1e-2, weight_decay=0.05)
    for x, y in batches(device):
        for m, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_fn(m, x, y).backward()
            o.step()
    # fp32 throughout; only the order of operations differs (see test_adam.py's TOL)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert opt.state[next(ours.parameters())]["step"].item() == 10


@pytest.mark.parametrize("device, backend", ON_DEVICE)
def test_bf16_params_keep_fp32_masters(device, backend):
    """bf16 params: the update runs on fp32 master copies and writes the rounded result back."""
    ours = model(device, torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_() for p in ours.parameters()]
    opt = FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.05, backend=backend)
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.05)
    for x, y in batches(device, 5):
        opt.zero_grad()
        loss_fn(ours, x, y).backward()
        for m, p in zip(masters, ours.parameters()):
            m.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, m in zip(ours.parameters(), masters):
        torch.testing.assert_close(opt.state[p]["master_param"], m.detach(), rtol=0, atol=1e-6)
        assert torch.equal(p, opt.state[p]["master_param"].to(torch.bfloat16)), "the param is its master, rounded"


@pytest.mark.parametrize("device, backend", ON_DEVICE)
def test_grad_scaler_skip_changes_nothing(device, backend):
    ours = model(device, torch.float16)
    opt = FusedAdam(ours.parameters(), lr=1e-2, backend=backend)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=1024.0)
    log = []
    for i, (x, y) in enumerate(batches(device, 3)):
        before = copy.deepcopy(ours.state_dict())
        opt.zero_grad()
        loss = loss_fn(ours, x, y) * (float("inf") if i == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        log.append(any(not torch.equal(v, ours.state_dict()[k]) for k, v in before.items()))
    assert log == [True, False, True]
    assert opt.state[next(ours.parameters())]["step"].item() == 2, "the skipped step did not count"
