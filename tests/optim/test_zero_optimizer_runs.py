"""ZeroOptimizer steps torch's element-wise param groups as flat runs of its fp32 master ([Note:
element-wise pieces as runs] in zerokern/optim/flat_runs.py): bit for bit one-process torch, also
when params miss grads in some steps (a group unbound, bound again, or stepped piece by piece)."""

import pytest

import dist_harness
import flat_runs_workers as W


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(W.OPTIMIZERS))
def test_runs_step_as_one_process_torch_bit_for_bit(name, stage):
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.train, 2, name, stage, timeout=120))):
        # every rank on the same batch: the reduced grads are one process's exactly
        assert r["same"], (rank, r["diff"])
        assert all(a == b for a, b in r["scalars"].values()), (rank, r["scalars"])
        assert r["scalars"] or name == "sgd", "Adam's step, NAdam's mu_product: compared"
        assert r["elements"] and all(r["elements"]), (rank, r["elements"])
        assert r["untouched"], "state_dict() hands out copies of the scalars the runs share"
        assert r["runs"] < r["pieces"], r
        a, b, c = zip(*r["bound"])  # per step: groups A, B, C bound to their runs
        assert all(a), "A always steps"
        assert b == (True, False, True, False, True, False), "B unbinds where it has no grad, binds again"
        if name == "sgd":  # no per-param scalars: C binds again as B does
            assert c == b
        else:
            assert c == (True, False, False, False, False, False), "C's scalars differ after its first skip"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(W.OPTIMIZERS))
def test_a_resumed_run_steps_its_runs_as_the_uninterrupted_one(name, stage):
    """load_state_dict gives the inner optimizer new param group dicts (torch's load_state_dict
    replaces them); the runs stepped with the lr of the old ones, the one they were built with, so a
    resumed run under an lr schedule (HF Trainer's) went its own way."""
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.resume, 2, name, stage, 3, timeout=120))):
        assert r["runs"] > 0, "the resumed optimizer steps runs"
        assert r["lr"] == r["ref_lr"], (rank, r["lr"], r["ref_lr"])
        assert r["whole_as_torch"], (rank, r["torch_diff"])
        assert r["resumed_as_whole"], (rank, r["diff"])
        assert r["state_same"], rank
