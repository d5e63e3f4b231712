"""GradScaler with FusedZeroAdam on several ranks: an inf/nan in one rank's local grads only
skips the step on every rank, every rank's scaler backs off alike, and training goes on as
AdamW with that step skipped (issue 12, case 4). Where that cannot hold with a plain
torch.amp.GradScaler (every backward under no_sync), a clear error on every rank."""

import pytest
import torch

import dist_harness
import scaler_workers as W

EXPECTED_SCALES = [1024.0, 512.0, 512.0, 512.0]
EXPECTED_CHANGED = [True, False, True, True]


def _check(results, dtype):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rank, r in enumerate(dist_harness.values(results)):
        assert r["error"] is None, (rank, r["error"])
        assert [s for s, _ in r["log"]] == EXPECTED_SCALES, (rank, r["log"])
        assert [c for _, c in r["log"]] == EXPECTED_CHANGED, (rank, r["log"])
        assert r["diff"] < tol, (rank, r["diff"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["synced", "accumulate"])
def test_torch_grad_scaler_agrees_after_a_synced_backward(dtype, pattern):
    _check(dist_harness.run(W.overflow_on_one_rank, 2, dtype, "torch", pattern, timeout=120), dtype)


@pytest.mark.parametrize("stage", [1, 2])
def test_torch_grad_scaler_agrees_on_four_ranks(stage):
    _check(dist_harness.run(W.overflow_on_one_rank, 4, torch.float32, "torch", "synced", stage, timeout=180),
           torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["synced", "no_sync"])
def test_zerokern_grad_scaler_agrees_also_under_no_sync(dtype, pattern):
    _check(dist_harness.run(W.overflow_on_one_rank, 2, dtype, "zerokern", pattern, timeout=120), dtype)


@pytest.mark.parametrize("stage", [0, 2])
def test_torch_grad_scaler_under_no_sync_only_is_a_clear_error_on_every_rank(stage):
    results = dist_harness.values(dist_harness.run(W.overflow_on_one_rank, 2, torch.float32, "torch", "no_sync",
                                                   stage, timeout=120))
    for rank, r in enumerate(results):
        assert r["error"] is not None and "zerokern.GradScaler" in r["error"], (rank, r)
        assert [s for s, _ in r["log"]] == EXPECTED_SCALES[:1], (rank, r["log"])


def test_scalers_with_different_scales_are_a_clear_error_on_every_rank():
    for rank, err in enumerate(dist_harness.values(dist_harness.run(W.different_scales, 2, timeout=120))):
        assert err is not None and "different scales" in err, (rank, err)


@pytest.mark.parametrize("scaler_kind", ["torch", "zerokern"])
def test_no_sync_backward_reaching_other_params_per_rank_keeps_the_ranks_in_step(scaler_kind):
    results = dist_harness.values(dist_harness.run(W.synced_then_partial_no_sync, 2, scaler_kind, timeout=120))
    assert results[0]["scales"] == results[1]["scales"], results
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_stage2_without_a_scaler_stops_checking_after_the_first_step():
    for r in dist_harness.values(dist_harness.run(W.overflow_checks_without_a_scaler, 2, timeout=120)):
        assert r["calls_after_each_step"] == [1, 1, 1], r
