"""HF Trainer with zerokern's ZeroTrainer on 2 gloo ranks (torchrun, CPU): a tiny GPT-2 trained
20 steps with gradient accumulation 2, max_grad_norm=1.0 and a linear warmup schedule gives
the losses and params of the same Trainer run with torch AdamW under DDP; a checkpoint at
step 10 resumes exactly on 2 ranks, and on 1 rank. Each launch runs under a timeout."""

import pytest
import torch

from launch import max_diff as _max_diff
from launch import run_script

pytestmark = pytest.mark.slow  # end-to-end jobs launched through torchrun/accelerate (pyproject: slow)

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _launch(tmp, name, world, optimizer, resume=None, zero_stage=2, timeout=300):
    args = ["--optimizer", optimizer, "--output-dir", str(tmp / name), "--zero-stage", str(zero_stage)]
    return run_script("hf_train.py", world, str(tmp / f"{name}.pt"), args + (["--resume", resume] if resume else []),
                      timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    ref = _launch(tmp, "ddp_adamw", 2, "torch")
    zero = _launch(tmp, "zero", 2, "zero")
    ckpt = str(tmp / "zero" / "checkpoint-10")
    return {"tmp": tmp, "ref": ref, "zero": zero, "ckpt": ckpt}


def test_trainer_matches_ddp_adamw(runs):
    ref, zero = runs["ref"], runs["zero"]
    assert zero["optimizer"] == "FusedZeroAdam" and zero["wrapped"] != "DistributedDataParallel", zero["wrapped"]
    assert ref["wrapped"] == "DistributedDataParallel"
    assert sorted(zero["losses"]) == list(range(1, 21))
    worst = max(abs(zero["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    print(f"\nTrainer, 2 ranks: loss {ref['losses'][1]:.4f} -> {ref['losses'][20]:.4f} (DDP+AdamW), "
          f"{zero['losses'][1]:.4f} -> {zero['losses'][20]:.4f} (ZeroTrainer); worst loss diff {worst:.2e}, "
          f"worst param diff {_max_diff(zero['params'], ref['params']):.2e}")
    assert worst < 1e-4, (worst, zero["losses"], ref["losses"])
    assert ref["losses"][20] < ref["losses"][1] - 0.3, "the reference run trains"
    for s in ref["grad_norms"]:  # the pre-clip global norm Trainer logs
        assert abs(zero["grad_norms"][s] - ref["grad_norms"][s]) < 1e-4 * max(1.0, ref["grad_norms"][s]), s
    assert _max_diff(zero["params"], ref["params"]) < 1e-4
    # gradient accumulation 2 through opt.no_sync(): one reduce-scatter per bucket per step
    assert zero["reductions"] == zero["buckets"] * 20, (zero["reductions"], zero["buckets"])


def test_trainer_resume_on_two_ranks_continues_exactly(runs):
    resumed = _launch(runs["tmp"], "resume2", 2, "zero", resume=runs["ckpt"])
    print(f"\nresumed on 2 ranks: worst loss diff {max(abs(resumed['losses'][s] - runs['zero']['losses'][s]) for s in range(11, 21)):.2e}, "
          f"param diff {_max_diff(resumed['params'], runs['zero']['params']):.2e}")
    for s in range(11, 21):
        assert abs(resumed["losses"][s] - runs["zero"]["losses"][s]) < 1e-6, s
    assert _max_diff(resumed["params"], runs["zero"]["params"]) < 1e-6


def test_trainer_resume_on_one_rank(runs):
    resumed = _launch(runs["tmp"], "resume1", 1, "zero", resume=runs["ckpt"])
    print(f"\nresumed on 1 rank: worst loss diff {max(abs(resumed['losses'][s] - runs['zero']['losses'][s]) for s in range(11, 21)):.2e}, "
          f"param diff {_max_diff(resumed['params'], runs['zero']['params']):.2e}")
    assert resumed["world"] == 1
    for s in range(11, 21):
        assert abs(resumed["losses"][s] - runs["zero"]["losses"][s]) < 1e-4, s
    assert _max_diff(resumed["params"], runs["zero"]["params"]) < 1e-4


@pytest.fixture(scope="module")
def stage3(runs):
    """ZeroTrainer over a model sharded at stage 3 (each GPT-2 block, then the root) on 2 ranks."""
    return {"zero": _launch(runs["tmp"], "zero3", 2, "zero", zero_stage=3),
            "ckpt": str(runs["tmp"] / "zero3" / "checkpoint-10")}


def _losses_match_ddp(zero, ref, optimizer, label):
    """The run used `optimizer`, not wrapped in DDP, and its 20 losses are DDP + AdamW's (1e-4)."""
    assert zero["optimizer"] == optimizer and zero["wrapped"] != "DistributedDataParallel", zero["wrapped"]
    assert sorted(zero["losses"]) == list(range(1, 21))
    worst = max(abs(zero["losses"][s] - ref["losses"][s]) for s in ref["losses"])
    print(f"\n{label}, 2 ranks: worst loss diff {worst:.2e}, "
          f"worst param diff {_max_diff(zero['params'], ref['params']):.2e}")
    assert worst < 1e-4, (worst, zero["losses"], ref["losses"])


def test_trainer_at_stage3_matches_ddp_adamw(runs, stage3):
    ref, zero = runs["ref"], stage3["zero"]
    _losses_match_ddp(zero, ref, "FusedZeroAdam", "Trainer at stage 3")
    for s in ref["grad_norms"]:
        assert abs(zero["grad_norms"][s] - ref["grad_norms"][s]) < 1e-4 * max(1.0, ref["grad_norms"][s]), s
    assert zero["params"].keys() == ref["params"].keys()
    assert _max_diff(zero["params"], ref["params"]) < 1e-4


@pytest.mark.parametrize("world,zero_stage,tol", [(2, 3, 1e-6), (1, 2, 1e-4)], ids=["2ranks-stage3", "1rank"])
def test_trainer_resumes_a_stage3_checkpoint(runs, stage3, world, zero_stage, tol):
    """The checkpoint's weights were gathered whole (model.safetensors, loadable anywhere); resumed
    at stage 3 on 2 ranks the run continues exactly, on 1 rank within reduction-order noise."""
    resumed = _launch(runs["tmp"], f"resume3_{world}", world, "zero", resume=stage3["ckpt"], zero_stage=zero_stage)
    for s in range(11, 21):
        assert abs(resumed["losses"][s] - stage3["zero"]["losses"][s]) < tol, s
    assert _max_diff(resumed["params"], stage3["zero"]["params"]) < tol


@pytest.fixture(scope="module")
def zero_optimizer3(runs):
    """Issue 39: ZeroTrainer given optimizers=(zerokern.ZeroOptimizer(groups, torch.optim.AdamW), schedule)
    over a model sharded at stage 3 on 2 ranks; the run's checkpoint at step 10 resumed on 2 ranks.
    Each run ends with save_model() on every rank and from_pretrained on rank 0."""
    zero = _launch(runs["tmp"], "zeroopt3", 2, "zero-opt", zero_stage=3)
    resumed = _launch(runs["tmp"], "zeroopt3_resume", 2, "zero-opt", zero_stage=3,
                      resume=str(runs["tmp"] / "zeroopt3" / "checkpoint-10"))
    return {"zero": zero, "resumed": resumed}


def test_trainer_with_a_zero_optimizer_at_stage3_matches_ddp_adamw(runs, zero_optimizer3):
    ref, zero = runs["ref"], zero_optimizer3["zero"]
    _losses_match_ddp(zero, ref, "ZeroOptimizer", "Trainer + ZeroOptimizer(AdamW) at stage 3")
    assert zero["params"].keys() == ref["params"].keys()
    assert _max_diff(zero["params"], ref["params"]) < 1e-4


def test_trainer_with_a_zero_optimizer_saves_the_whole_model(zero_optimizer3):
    """save_model wrote rank 0's slices (lm_head.weight (96, 65), ...) and from_pretrained failed:
    the ZeroOptimizer was not recognised, so Trainer's own save ran."""
    zero = zero_optimizer3["zero"]
    assert zero["pretrained"].keys() == zero["params"].keys()
    assert all(torch.equal(zero["pretrained"][n], zero["params"][n]) for n in zero["params"])


def test_trainer_with_a_zero_optimizer_resumes_bit_for_bit(zero_optimizer3):
    """The optimizer (DCP directory) and the scheduler of the checkpoint at step 10 are loaded:
    steps 11-20 are those of the uninterrupted run, exactly."""
    zero, resumed = zero_optimizer3["zero"], zero_optimizer3["resumed"]
    assert all(resumed["losses"][s] == zero["losses"][s] for s in range(11, 21)), (resumed["losses"], zero["losses"])
    assert resumed["params"].keys() == zero["params"].keys()
    assert all(torch.equal(resumed["params"][n], zero["params"][n]) for n in zero["params"])
    assert all(torch.equal(resumed["pretrained"][n], zero["params"][n]) for n in zero["params"])


def test_zero_trainer_takes_hyperparameters_from_training_arguments(tmp_path):
    from transformers import TrainingArguments

    from zerokern.integrations.hf import ZeroTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"set TrainingArguments\(max_grad_norm=...\) instead"):
        ZeroTrainer(model=torch.nn.Linear(2, 2), args=args, zero_kwargs={"max_grad_norm": 1.0})


def test_zero_optimizer_reaches_memory_report_under_the_wrapper(tmp_path):
    """trainer.optimizer is Accelerate's AcceleratedOptimizer, which has no memory_report()
    (issue 38: the README's opt.memory_report() raised AttributeError there); trainer.zero_optimizer
    is the FusedZeroAdam under it. One process, one step of a Linear."""
    from transformers import TrainingArguments

    from zerokern import FusedZeroAdam
    from zerokern.integrations.hf import ZeroTrainer

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels):
            return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}

    data = [{"x": torch.randn(4), "labels": torch.tensor(1.0)} for _ in range(2)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = ZeroTrainer(model=Tiny(), args=args, train_dataset=data)
    assert trainer.zero_optimizer is None  # built by train()
    trainer.train()
    assert not hasattr(trainer.optimizer, "memory_report")  # the wrapper
    assert isinstance(trainer.zero_optimizer, FusedZeroAdam)
    assert trainer.zero_optimizer.memory_report()["total"] > 0
