"""What torch.optim users rely on, at every stage (issues 25, 26, 30): 2 gloo ranks against
torch.optim.AdamW on one process over the full batch, and one-process checks."""

import re

import pytest
import torch
import torch.nn as nn

import dist_harness
import semantics_workers as W
import zerokern
from zerokern import FusedZeroAdam


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unused_params_follow_torch_in_both_zero_grad_modes(stage, set_to_none):
    """A branch used at the first step only: .grad is None exactly where torch's is, and with
    zero_grad(set_to_none=False) its zero grads are stepped (momentum, weight decay) as torch does."""
    for r in dist_harness.values(dist_harness.run(W.unused_params_and_zero_grad, 2, stage, set_to_none,
                                                  timeout=120)):
        assert r["patterns_equal"], (r["ours"], r["theirs"])
        assert r["diff"] < 1e-6, r["diff"]  # fp32, a different summation order of the batch mean


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_zero_grad_accumulates_or_raises_on_every_rank(stage):
    results = dist_harness.values(dist_harness.run(W.no_zero_grad_at_stage, 2, stage, timeout=120))
    for r in results:
        if stage <= 1:
            assert "error" not in r and r["diff"] < 1e-6, r  # grads accumulate across steps, as torch's
        else:
            assert "before the last step()" in r.get("error", "") and "zero_grad()" in r["error"], r
            # stage 3: params named from the root (a unit's own names would be a bare "weight")
            assert stage == 2 or re.search(r"the gradients of (a|b|extra|head)\.(weight|bias)", r["error"]), r["error"]


def test_stage3_grad_scaler_skips_an_inf_in_one_element_of_one_rank():
    for r in dist_harness.values(dist_harness.run(W.stage3_scaler_inf_in_one_element, 2, timeout=120)):
        for stage in (2, 3):
            assert r[stage]["skipped"] == [False, True, False], (stage, r[stage])
            assert r[stage]["scales"][1] == 512.0, (stage, r[stage]["scales"])
        assert r["equal"], "stage 3 gives stage 2's bits"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_state_dict_rank0_only_is_empty_elsewhere(stage):
    r0, r1 = dist_harness.values(dist_harness.run(W.rank0_only_full_state_dict, 2, stage, timeout=120))
    assert r1["keys"] == [] and len(r0["keys"]) == 8
    ref = {n: tuple(p.shape) for n, p in W.BranchNet().named_parameters()}
    assert r0["shapes"] == ref


def test_full_state_dict_through_checkpoint_wrapper_is_whole():
    for r in dist_harness.values(dist_harness.run(W.checkpoint_wrapper_full_state_dict, 2, timeout=120)):
        assert r["keys_equal"], r
        assert all(a == b for a, b in r["shapes"].values()), r["shapes"]
        assert r["equal"], r


@pytest.mark.parametrize("stage", [2, 3])
def test_one_process_stage_2_and_3_hold_no_full_grad_buffers_after_step(stage):
    model = W.BranchNet()
    if stage == 3:
        for m in (model.a, model.b, model.extra, model.head):
            zerokern.shard(m, stage=3)
        zerokern.shard(model, stage=3)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, zero_stage=None if stage == 3 else stage)
    model(torch.randn(4, 6), use_extra=True).backward()
    assert opt.memory_report()["grads"] > 0
    opt.step()
    assert opt.memory_report()["grads"] == 0


@pytest.mark.parametrize("shard", [False, True])
def test_cast_after_building_names_the_param_at_world_size_1(shard):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if shard:
        zerokern.shard(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"zerokern: (1\.bias|params\[3\]) is now torch.bfloat16.*Move or cast"):
        opt.zero_grad()
        model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()


@pytest.mark.parametrize("call", ["shard", "optimizer"])
def test_torchrun_environment_without_a_process_group_is_refused(call, monkeypatch):
    """torchrun started 2 ranks but init_process_group() was not called yet (HF: the model sharded
    before TrainingArguments): each rank would train alone, unsharded, without a word."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    model = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 but torch.distributed has no process group.*"
                                           r"init_process_group"):
        if call == "shard":
            zerokern.shard(model, stage=3)
        else:
            FusedZeroAdam(model.parameters())


def test_grad_norm_is_exact_over_a_bucket_of_millions():
    """The global norm that max_grad_norm and clip_grad_norm_ use, over one bucket of 4.2M fp32
    elements, agrees with the fp64 norm of the per-param grads (one fp32 norm was ~1e-4 off)."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(1024, 1024)) for _ in range(4)] + [nn.Parameter(torch.zeros(4097))]
    opt = FusedZeroAdam(params, lr=1e-3, zero_stage=0, bucket_cap_mb=25)
    assert len(opt.stores) == 1, "one bucket"
    for p in params:
        p.grad = torch.randn_like(p) * 1e-2
    ref = torch.stack([p.grad.double().norm() for p in params]).norm().item()
    norm = opt.clip_grad_norm_(float("inf")).item()
    assert abs(norm - ref) / ref < 1e-6, (norm, ref)


def test_named_parameters_name_params_in_errors_and_round_trip():
    """FusedZeroAdam(model.named_parameters()) (torch.optim's named form): errors name the param
    as the model does, not params[k], and the state dict (with "param_names") loads back."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = FusedZeroAdam(model.named_parameters(), lr=1e-2, zero_stage=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    opt.load_state_dict(sd)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"zerokern: 1\.bias is now torch.bfloat16"):
        opt.zero_grad()


def test_a_transposed_state_tensor_is_refused_as_torch_does():
    """opt.load_state_dict with exp_avg of the same numel but another shape: an error, as torch's."""
    model = nn.Linear(4, 6)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    full = opt.full_state_dict()
    opt.load_state_dict(full)  # its own full dict loads
    full["state"][0]["exp_avg"] = full["state"][0]["exp_avg"].t().contiguous()
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] has shape \[4, 6\], but param 0 has shape \[6, 4\]"):
        opt.load_state_dict(full)


def test_rolling_back_in_place_into_the_state_dict_is_what_the_update_uses():
    """dcp.load's pattern without opt.load_state_dict(): values copied into opt.state_dict()'s own
    tensors (step included) are what the next update uses, as with torch AdamW."""
    import copy

    def run(make):
        torch.manual_seed(3)
        model = nn.Linear(4, 3)
        opt = make(model.parameters())
        xs = [torch.randn(5, 4) for _ in range(6)]

        def step(x):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for x in xs[:3]:
            step(x)
        snap, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        for x in xs[3:5]:
            step(x)
        live = opt.state_dict()
        for k, st in snap["state"].items():  # in place, as dcp.load fills the tensors it is given
            for key, v in st.items():
                live["state"][k][key].copy_(v)
        model.load_state_dict(weights)
        step(xs[5])
        return [p.detach().clone() for p in model.parameters()], int(live["state"][0]["step"])

    ours, step_ours = run(lambda ps: FusedZeroAdam(ps, lr=1e-2, weight_decay=0.1))
    theirs, step_theirs = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    assert step_ours == step_theirs == 4
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs)) < 1e-6


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4, dtype=torch.bool)))

    def forward(self, x):
        return self.proj(x).masked_fill(~self.mask, 0.0)


def test_meta_init_of_a_bool_buffer_that_init_leaves_unset_is_an_error():
    """A causal mask registered in __init__ on the meta device has no values; an init= that does
    not set it would train with an all-False mask (issue 29): shard() names it instead."""
    with torch.device("meta"):
        model = _Masked()
    with pytest.raises(ValueError, match=r"mask is a bool buffer built on the meta device that init"):
        zerokern.shard(model, stage=3, init=lambda m: m.proj.reset_parameters())

    def init(m):
        m.proj.reset_parameters()
        m.mask.copy_(torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    zerokern.shard(model, stage=3, init=init)
    assert torch.equal(model.mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_units_keep_their_own_bucket_size_and_reshard_after_forward():
    for r in dist_harness.values(dist_harness.run(W.per_unit_options, 2, timeout=120)):
        assert r["diff"] < 1e-6, r


def test_stage3_cast_after_building_names_the_param_on_every_rank():
    for r in dist_harness.values(dist_harness.run(W.stage3_cast_after_building, 2, timeout=120)):
        assert r["error"] and re.search(r"zerokern: (a|b|extra|head)\.(weight|bias) is now torch.bfloat16", r["error"]), r
