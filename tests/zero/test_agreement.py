"""Every option that shapes the collectives or the per-step decisions is compared across ranks
at construction: one that differs is a clear error on every rank, listing each rank's value,
never a hang or a gloo abort (issue 12, case 5). Each run is under a timeout."""

import pytest

import agreement_workers as W
import dist_harness


@pytest.mark.parametrize("what", ["bucket_cap_mb", "max_grad_norm", "overlap_comm", "zero_stage", "adam_w_mode",
                                  "groups"])
@pytest.mark.parametrize("world", [2, 4])
def test_options_that_differ_per_rank_fail_on_every_rank(what, world):
    errors = dist_harness.values(dist_harness.run(W.options_differ, world, what, timeout=120))
    for rank, err in enumerate(errors):
        assert err is not None and "every rank must build the optimizer" in err, (rank, err)
        assert f"rank {world - 1}:" in err, err  # it lists what each rank has
