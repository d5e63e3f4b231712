"""Rank functions for tests/zero/grads/test_ddp_guard.py (run by dist_harness on 2 gloo ranks): plain
training loops that wrap a FusedZeroAdam-trained model in torch's DistributedDataParallel,
each reporting where it failed and with what."""

import gc

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import zerokern

# (layout, zero_stage, which is built first, DDP's gradient_as_bucket_view)
WRAPPED_FROM_THE_START = [
    ("loose", 0, "ddp", False),
    ("loose", 1, "opt", False),
    ("loose", 1, "opt", True),
    ("loose", 2, "opt", False),
    ("loose", 2, "ddp", True),
    ("shard", 2, "opt", False),
    ("shard", 3, "ddp", False),
]
# wrapped only after a first plain step: at stages 1/2 the loose params are caught after
# DDP's backward ran (its reducer wrote into the grads), the sharded ones in the next forward
WRAPPED_AFTER_A_STEP = [("loose", 1), ("loose", 2), ("shard", 2)]


def _model(layout, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if layout == "shard":
        for m in (model[0], model[2], model):
            zerokern.shard(m, stage=stage, bucket_cap_mb=0.0001)
    return model


def _opt(model, stage):
    return zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=stage, bucket_cap_mb=0.0001)


def _train(model, opt, steps):
    """steps of a plain loop; where it failed (phase, step) and the error, or None."""
    phase, step = "forward", 0
    try:
        for step in range(steps):
            phase = "forward"
            loss = model(torch.randn(3, 4)).square().sum()
            phase = "backward"
            loss.backward()
            phase = "step"
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001  reported to the test
        return {"phase": phase, "step": step, "type": type(e).__name__, "message": str(e)}
    return None


def loops(rank, world):
    """Every case below on one process group (one spawn: the imports cost more than the cases)."""
    return {"wrapped": _wrapped(), "ddp_over_other_params": _ddp_over_other_params()}


def _wrapped():
    out = {}
    for layout, stage, first, view in WRAPPED_FROM_THE_START:
        model = _model(layout, stage)
        if first == "ddp":
            ddp = DDP(model, gradient_as_bucket_view=view)
            opt = _opt(model, stage)
        else:
            opt = _opt(model, stage)
            ddp = DDP(model, gradient_as_bucket_view=view)
        out[(layout, stage, first, view)] = _train(ddp, opt, 2)
        del ddp, opt, model
    for layout, stage in WRAPPED_AFTER_A_STEP:
        model = _model(layout, stage)
        opt = _opt(model, stage)
        assert _train(model, opt, 1) is None
        out[(layout, stage, "late")] = _train(DDP(model), opt, 2)
        del opt, model
    return out


def _ddp_over_other_params():
    """DDP may wrap a model whose zerokern-trained params it ignores (here the first Linear, trained
    by FusedZeroAdam; the second by DDP + SGD): no error, and the watch on the loose params (a global
    module hook) is there until the first step() only. Module hooks counted before the optimizer,
    after each backward and at the end."""
    hooks = torch.nn.modules.module._global_forward_pre_hooks
    gc.collect()  # the optimizers of the cases before, dropped: their watches went with them
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["0.weight", "0.bias"])
    before = model[0].weight.detach().clone()
    hooks_counted = [len(hooks)]
    opt = zerokern.FusedZeroAdam(model[0].parameters(), lr=1e-2, zero_stage=2)
    ddp = DDP(model)
    sgd = torch.optim.SGD(model[2].parameters(), lr=1e-2)
    for step in range(3):
        ddp(torch.randn(3, 4)).square().sum().backward()
        hooks_counted.append(len(hooks))
        opt.step()
        sgd.step()
        opt.zero_grad()
        sgd.zero_grad()
    hooks_counted.append(len(hooks))
    return {"hooks": hooks_counted, "weight": model[0].weight.detach().clone(),
            "trained": not torch.equal(model[0].weight, before)}
