"""Rank functions for tests/zero/test_inplace_weights.py: weights written in place between steps
reach the fp32 masters of fp16/bf16 params ([Note: in-place weights] in zerokern/zero/unit.py)."""

import torch

import zerokern


def _model(dtype, stage, world):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.1, bucket_cap_mb=0.0001,
                                 zero_stage=stage if world > 1 else 0)
    return model, opt


def _step(model, opt, seed, lr=None):
    if lr is not None:
        for g in opt.param_groups:
            g["lr"], g["weight_decay"] = lr, 0.0
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)).float().square().mean().backward()
    opt.step()


def write_between_steps(rank, world, dtype, stage, how):
    """Train, write new weights in place (`how`), take a step with lr=0: the weights must be the
    written ones. A write of the same values keeps the fp32 masters (a round trip is no change)."""
    dtype = getattr(torch, dtype)
    model, opt = _model(dtype, stage, world)
    for s in range(3):
        _step(model, opt, s)
    masters = [t.clone() for st in opt.state.values() for k, t in st.items() if k == "master_param"]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # the same values
    _step(model, opt, 10, lr=0.0)
    kept = all(torch.equal(a, t) for a, t in zip(masters, (t for st in opt.state.values()
                                                             for k, t in st.items() if k == "master_param")))
    with torch.no_grad():
        if how == "load_state_dict":
            model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()})
        elif how == "init":
            for m in (model[0], model[2]):
                torch.nn.init.constant_(m.weight, 0.25)
                torch.nn.init.constant_(m.bias, 0.25)
        elif how == "clamp":
            for p in model.parameters():
                p.clamp_(0.25, 0.25)
        elif how == "one_row":  # a partial load (new token rows): the other rows keep their masters
            sd = model.state_dict()
            sd["0.weight"] = sd["0.weight"].clone()
            sd["0.weight"][0] = 0.25
            model.load_state_dict(sd)
    before = opt.state[model[0].weight]["master_param"].clone()
    _step(model, opt, 11, lr=0.0)
    after = opt.state[model[0].weight]["master_param"]
    if how == "one_row":
        return {"masters_kept": kept and torch.equal(after[8:], before[8:]), "written": bool((after[:8] == 0.25).all())
                and bool((model[0].weight[0] == 0.25).all())}
    return {"masters_kept": kept, "written": all(bool((p == 0.25).all()) for p in model.parameters())}
