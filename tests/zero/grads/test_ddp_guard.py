"""A FusedZeroAdam-trained model wrapped in torch's DistributedDataParallel: DDP's reducer would
write its all-reduce into zerokern's gradient buckets, so every rank raises one error that names
the fix (ZeroTrainer, attach(accelerator), or no wrap; [Note: DDP wrap] in
zerokern/zero/grads/ddp_guard.py). On 2 gloo ranks: plain loops (dist_harness), a plain
transformers.Trainer and a plain Accelerator (torchrun)."""

import pytest
import torch

import ddp_guard_workers as W
import dist_harness
from launch import run_failing_script

FIXES = ("zerokern.integrations.hf.ZeroTrainer", "zerokern.integrations.accelerate.attach(accelerator)",
         "do not wrap the model in DistributedDataParallel")


def _is_the_ddp_error(error):
    assert error is not None, "no error: DDP's all-reduce went into the gradient buckets"
    assert "wrapped in torch's DistributedDataParallel" in error["message"], error
    for fix in FIXES:
        assert fix in error["message"], (fix, error)


@pytest.fixture(scope="module")
def loops():
    return dist_harness.values(dist_harness.run(W.loops, 2, timeout=120))


@pytest.mark.parametrize("case", W.WRAPPED_FROM_THE_START, ids=lambda c: "-".join(map(str, c)))
def test_a_plain_loop_under_ddp_fails_in_the_first_forward(loops, case):
    """Before any backward, on every rank, whatever was built first and at every stage."""
    for rank in loops:
        error = rank["wrapped"][case]
        _is_the_ddp_error(error)
        assert (error["phase"], error["step"], error["type"]) == ("forward", 0, "WrappedInDDPError"), error


@pytest.mark.parametrize("case", W.WRAPPED_AFTER_A_STEP, ids=lambda c: "-".join(map(str, c)))
def test_a_wrap_after_the_first_step_is_still_refused(loops, case):
    """Loose params: DDP's backward ran (its reducer wrote into the grads) before the error; sharded
    ones: the next forward."""
    for rank in loops:
        error = rank["wrapped"][case + ("late",)]
        _is_the_ddp_error(error)
        assert error["step"] == 0, error
        if case[0] == "shard":
            assert error["phase"] == "forward", error


def test_ddp_over_other_params_is_left_alone(loops):
    ranks = [rank["ddp_over_other_params"] for rank in loops]
    for r in ranks:
        base = r["hooks"][0]
        assert r["hooks"] == [base, base + 1, base, base, base], r["hooks"]  # watched until the first step
        assert r["trained"]
    assert torch.equal(ranks[0]["weight"], ranks[1]["weight"])


@pytest.mark.slow  # a Trainer/Accelerate script launched through torchrun (pyproject: slow)
def test_a_plain_trainer_given_fused_zero_adam_fails_saying_zero_trainer(tmp_path):
    pytest.importorskip("transformers")
    errors = run_failing_script("hf_train.py", 2, str(tmp_path / "hf.pt"),
                                ["--optimizer", "zero-plain", "--output-dir", str(tmp_path / "hf")], timeout=180)
    for error in errors:  # every rank
        assert error.startswith("WrappedInDDPError: zerokern: the model is wrapped in torch's "
                                "DistributedDataParallel"), error
        assert "transformers.Trainer: use zerokern.integrations.hf.ZeroTrainer" in error, error


@pytest.mark.slow  # a Trainer/Accelerate script launched through torchrun (pyproject: slow)
def test_a_plain_accelerator_given_fused_zero_adam_fails_saying_attach(tmp_path):
    pytest.importorskip("accelerate")
    errors = run_failing_script("accelerate_train.py", 2, str(tmp_path / "acc.pt"),
                                ["--optimizer", "zero-plain"], timeout=180)
    for error in errors:
        assert error.startswith("WrappedInDDPError: zerokern: the model is wrapped in torch's "
                                "DistributedDataParallel"), error
        assert "Accelerate: call zerokern.integrations.accelerate.attach(accelerator)" in error, error
