"""A model and FusedZeroAdam that are dropped are freed with their buckets (a sweep or a notebook
that builds several must not keep every one). torch keeps tensor hooks in C++, where the garbage
collector does not look, so the param hooks hold their unit weakly and the schedule holds the
optimizer weakly; before that, every optimizer ever built stayed alive with its params, grads and
Adam state."""

import gc
import weakref

import pytest
import torch

import dist_harness
import stage3_workers as W
import zerokern


def _train_and_drop(units, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)
    if units:
        zerokern.shard(model[0], stage=2)
        zerokern.shard(model, stage=2)
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16, dtype=dtype)).float().sum().backward()
        opt.step()
    return [weakref.ref(model), weakref.ref(opt), weakref.ref(model[0].weight), weakref.ref(opt.stores[0].exp_avg)]


@pytest.mark.parametrize("units", [False, True], ids=["optimizer-only", "zerokern.shard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_dropped_model_and_optimizer_are_freed(units, dtype):
    refs = _train_and_drop(units, dtype)
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4


def test_a_param_trains_on_after_its_optimizer_is_dropped():
    """The hooks of a dropped optimizer's unit do nothing: a new FusedZeroAdam over the same
    params takes them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    zerokern.FusedZeroAdam(model.parameters(), lr=1e-2)
    gc.collect()
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2)
    before = model.weight.detach().clone()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight)


def test_a_dropped_stage3_model_is_freed():
    for r in dist_harness.values(dist_harness.run(W.dropped_model_is_freed, 2, timeout=120)):
        assert r == [True, True, True], r
