"""FusedZeroAdam follows the model ([Note: ownership] in zerokern/zero/unit.py): whatever
users do to params, grads or param groups after the optimizer was built trains the same
numbers as torch.optim.AdamW (one process, full batch, the same actions) or raises an
error that names the param and the fix. 1 and 2 gloo ranks, every run under a timeout."""

import copy

import pytest
import torch

import dist_harness
import ownership_workers as W
import runtime_workers as R
from zerokern import FusedZeroAdam

# fp32: the sharded sum of per-rank grads differs from the full-batch grad by rounding
# only, which a few Adam steps at lr 1e-2 turn into a few 1e-6 on params of order 1.
FP32_TOL = 2e-5
STAGES_WORLDS = [(0, 2), (1, 2), (2, 2), (2, 1)]


@pytest.mark.parametrize("how", ["to_cpu0", "to_empty", "data", "assign"])
@pytest.mark.parametrize("stage, world", STAGES_WORLDS)
def test_params_moved_after_construction_keep_training(stage, world, how):
    results = dist_harness.values(dist_harness.run(W.moved_after_construction, world, stage, how, timeout=120))
    for r in results:
        assert r["diff"] < FP32_TOL, r


def test_cast_after_construction_names_the_param():
    for msg in dist_harness.values(dist_harness.run(W.cast_after_construction, 2, timeout=120)):
        assert msg is not None and "is now torch.bfloat16" in msg and "build the optimizer" in msg, msg


@pytest.mark.parametrize("stage, world", STAGES_WORLDS)
def test_grad_set_to_none_skips_the_param(stage, world):
    for r in dist_harness.values(dist_harness.run(W.grad_set_to_none, world, stage, timeout=120)):
        assert r["diff"] < FP32_TOL, r
        assert r["skipped_step"] == 3.0, "5 steps, 2 of them skipped for this param"


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reentrant_checkpoint_with_a_shared_layer(stage, overlap):
    for r in dist_harness.values(dist_harness.run(W.reentrant_shared_layer, 2, stage, overlap, timeout=120)):
        assert r["diff"] < FP32_TOL, r


def test_rank0_params_are_broadcast_at_construction():
    for r in dist_harness.values(dist_harness.run(W.broadcast_at_construction, 2, timeout=120)):
        assert r["diff"] < FP32_TOL, r


@pytest.mark.parametrize("stage, world", STAGES_WORLDS)
def test_clip_grad_norm_matches_ddp_clipping(stage, world):
    for r in dist_harness.values(dist_harness.run(W.clip_grad_norm, world, stage, timeout=120)):
        assert r["diff"] < FP32_TOL, r
        torch.testing.assert_close(r["norms"], r["ref_norms"], rtol=1e-5, atol=0)
        assert max(r["ref_norms"]) > 0.5, "the clip was active"


def test_frozen_param_unfrozen_later_says_what_to_do():
    for msg in dist_harness.values(dist_harness.run(W.frozen_then_unfrozen, 2, timeout=120)):
        assert msg is not None and "was frozen" in msg and "Build the optimizer after unfreezing" in msg, msg


def test_scheduler_resumes_after_load_state_dict():
    """Every param-group key round-trips (LambdaLR's initial_lr), as with torch.optim.AdamW."""
    f = lambda k: 0.5 ** k  # noqa: E731
    model = R.gpt()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for seq in R.tokens(3):
        opt.zero_grad()
        R.gpt_loss(model, seq).backward()
        opt.step()
        sched.step()
    sd = opt.state_dict()
    twin = copy.deepcopy(model)
    opt2 = FusedZeroAdam(twin.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    torch.optim.lr_scheduler.LambdaLR(opt2, f, last_epoch=2)  # resumes at epoch 3 (KeyError without initial_lr)
    assert opt2.param_groups[0]["initial_lr"] == 1e-2
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3


def test_weight_decay_defaults_to_zero_as_adam_and_fused_adams():
    """0 unless given, in both modes, as torch.optim.Adam, apex's and DeepSpeed's FusedAdam (issue 50;
    it was AdamW's 0.01). The numbers: test_fused_zero_adam.py's test_no_weight_decay_given_is_torch_adam."""
    ps = list(R.gpt().parameters())
    assert FusedZeroAdam(ps[:2]).defaults["weight_decay"] == torch.optim.Adam(ps[:2]).defaults["weight_decay"] == 0.0
    assert FusedZeroAdam(ps[2:4], adam_w_mode=False).defaults["weight_decay"] == 0.0


def test_compiled_training_step_does_not_recompile_per_step():
    """torch.compile of a step that calls opt.step(): step() is opaque ([Note: compile]), so
    the compiled parts stay the same graphs however many steps run."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = R.gpt()
    ref = copy.deepcopy(model)
    opt = FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)

    @torch.compile(backend="eager")
    def train_step(seq):
        opt.zero_grad()
        loss = R.gpt_loss(model, seq)
        loss.backward()
        opt.step()
        return loss

    seqs = R.tokens(8)
    graphs = []
    for seq in seqs:
        train_step(seq)
        graphs.append(counters["stats"]["unique_graphs"])
        ref_opt.zero_grad()
        R.gpt_loss(ref, seq).backward()
        ref_opt.step()
    assert graphs[-1] == graphs[2], f"graphs compiled per step: {graphs}"
    assert R.max_diff(model, ref) < FP32_TOL


def test_replaced_parameters_without_shard_are_not_silent():
    """load_state_dict(assign=True) after building the optimizer over a param list: the optimizer
    holds the old Parameter objects (as any torch optimizer does); step() says so instead of
    silently updating nothing."""
    model = R.gpt()
    opt = FusedZeroAdam(model.parameters(), lr=1e-2)
    model.load_state_dict(R.gpt(7).state_dict(), assign=True)
    R.gpt_loss(model, R.tokens(1)[0]).backward()
    with pytest.warns(UserWarning, match="no parameter had a gradient on any rank"):
        opt.step()
