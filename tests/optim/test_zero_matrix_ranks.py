"""ZeroOptimizer with a whole-tensor optimizer group (torch.optim.Adafactor on 2 and 4 ranks,
torch.optim.Muon on 4, and on 2 with each rank's share of the batch) beside an AdamW group, stages
1 and 2, 20 steps, against one-process torch optimizers in the rank process (same thread count:
the harness's one). Rank bodies in matrix_rank_workers.py; Muon on 2 ranks on the same batch:
test_zero_muon_ranks.py; at stage 3 and on a mesh: test_zero_muon_units.py.

- every rank on the same batch: the reduced gradient is one process's bit for bit, so the params
  are too (measured 0.0 for both classes, fp32 and bf16 params; the bars are the issue's);
- every rank on its own share of the batch, the reference on the whole batch: the gradients differ
  by the order of their sum, and the tolerances below say what that does to each optimizer;
- every rank bit-identical; opt.matrices_stepped sums over the ranks to params x steps;
- a bad group (empty; one that differs across ranks) is refused on every rank, naming it."""

import re

import pytest
import torch

import dist_harness
import matrix_rank_workers as W

# Measured 2026-12-06 on a 2-core CPU box (W.against_one_process, its diffs printed), max over ranks and stages:
#                          same batch   own share of the batch
#   Adafactor, fp32, 2/4       0.0        5.96e-08
#   Adafactor, bf16 params     0.0        1.95e-03 (one bf16 ulp at |p| < 0.5; stages 1 and 2)
#   Muon, fp32, 4 ranks        0.0        5.17e-03
#   Muon, bf16 params, 4       0.0        3.42e-02
#   Muon, fp32, 2 ranks          -        9.47e-03
#   Muon, bf16 params, 2       0.0        3.42e-02 (same batch: stage 1; own share: stages 1 and 2)
# Same batch: the bars (Adafactor 1e-5, Muon 1e-6); bf16 params against torch's Muon and
# AdamW on fp32 masters rounded to nearest, as zerokern keeps them, so the same bits are expected.
SAME = {("Adafactor", torch.float32): 1e-5, ("Adafactor", torch.bfloat16): 0.0, ("Muon", torch.float32): 1e-6,
        ("Muon", torch.bfloat16): 0.0}
# Own share of the batch. The ranks' grads sum in another order than the one-process backward's:
# fp32 grads differ by a few ulps (~1e-7 relative).
# - Adafactor is fp32 throughout and smooth in the grad (a variance-normalised, RMS-clipped update),
#   so ~1e-7 relative per step, and 20 steps of lr 0.02 stay far below the 1e-5 (measured 6e-8).
# - Muon orthogonalises in bf16 (Newton-Schulz): a ~1e-7 difference can flip one bf16 rounding
#   (2^-8 relative), and the later of the 5 quintic iterations amplify it (slope a = 3.4445 at 0):
#   allow 2^-6 (4 flips) of the largest per-step update, summed over the steps. The update's entries
#   are at most ~1.2 (orthogonalised: singular values <= ~1.2) x lr 0.02 x sqrt(21 / 9) (torch's
#   "original" adjust_lr for the 21 x 9 matrix) = 0.037: 20 x 0.037 x 2^-6 = 1.2e-2 (measured 5.2e-3
#   on 4 ranks; 9.5e-3 on 2, where steps 0-4 are bit for bit one process's and the first flip, at
#   step 5, moves hidden.1.weight by 1.7e-4; the trajectories then part, by at most 3.7e-3 a step).
# - bf16 params (either class): each rank's forward and backward run in bf16 on its 8 or 4 rows, the
#   reference's on 16, so the grads differ by bf16 roundings (2^-8), not a sum order; every step
#   rounds the params to bf16 (one flipped rounding is an ulp: 2^-7 = 7.8e-3 at the LayerNorm
#   weight's |p| ~ 1), and the flips add up over 20 steps: allow 8 ulps at 1.0, 2^-4 = 0.0625.
#   Adafactor: measured 1.95e-3, one ulp at |p| < 0.5.
#   Muon moves further, and not by ulps: the largest diff is a hidden matrix (hidden.4.weight, then
#   hidden.1.weight, |p| < 0.3). A small grad's singular values below ~2^-8 of the largest are
#   rounding noise in bf16, and Newton-Schulz lifts a small singular value by its slope at 0,
#   a^5 = 3.4445^5 ~ 490 over 5 iterations, so that noise becomes a sizeable part of the update,
#   another one in each run: the first step already moves hidden.4.weight by 6.8e-3 = 0.34 lr
#   (2 ranks). The noise differs from step to step, so the differences add like a random walk:
#   2^-4 allows sqrt(20) x 0.7 lr. Measured 0.034 on 2 and 4 ranks.
SPLIT = {("Adafactor", torch.float32): 1e-5, ("Adafactor", torch.bfloat16): 2 ** -4, ("Muon", torch.float32): 1.2e-2,
         ("Muon", torch.bfloat16): 2 ** -4}

# (class, ranks, stage, params' dtype, same: run every rank on the same batch too)
CASES = [pytest.param("Adafactor", world, stage, torch.float32, True, id=f"adafactor-{world}ranks-stage{stage}")
         for world in (2, 4) for stage in (1, 2)]
CASES += [pytest.param("Adafactor", world, 2, torch.bfloat16, True, id=f"adafactor-{world}ranks-stage2-bfloat16")
          for world in (2, 4)]
CASES += [pytest.param("Muon", 4, stage, dtype, True, id=f"muon-4ranks-stage{stage}-{str(dtype)[6:]}")
          for stage in (1, 2) for dtype in (torch.float32, torch.bfloat16)]
# Muon on 2 ranks: each rank's share of the batch only (the same batch is test_zero_muon_ranks.py's)
CASES += [pytest.param("Muon", 2, stage, dtype, False, id=f"muon-2ranks-stage{stage}-{str(dtype)[6:]}-share")
          for stage, dtype in ((1, torch.float32), (2, torch.float32), (2, torch.bfloat16))]


@pytest.mark.parametrize("cls, world, stage, dtype, same", CASES)
def test_matrix_optimizer_on_ranks_is_one_process(cls, world, stage, dtype, same):
    if not hasattr(torch.optim, cls):
        pytest.skip(f"torch.optim.{cls} is not in this torch")
    _check(dist_harness.values(dist_harness.run(W.against_one_process, world, cls, stage, dtype, same, timeout=600)),
           cls, world, stage, dtype)


# Stage 1 with bf16 params: Muon + AdamW on 2 ranks, Adafactor + AdamW on 2 and 4 (every rank on the
# same batch, on its own share, and Adafactor with every param): one process group a world size.
STAGE_1_BF16 = {2: [("Muon", 1, torch.bfloat16, True), ("Adafactor", 1, torch.bfloat16, True)],
                4: [("Adafactor", 1, torch.bfloat16, True)]}


@pytest.mark.parametrize("world", [2, 4])
def test_stage_1_with_bf16_params_on_ranks_is_one_process(world):
    """Stage 1 keeps the grads whole on every rank until the step, stage 2 reduce-scatters them:
    the same bars hold, as the ranks reduce the same sums in both."""
    configs = [c for c in STAGE_1_BF16[world] if hasattr(torch.optim, c[0])]
    out = dist_harness.values(dist_harness.run(W.several, world, configs, timeout=600))
    for k, (cls, stage, dtype, _) in enumerate(configs):
        _check([o[k] for o in out], cls, world, stage, dtype)


def _check(out, cls, world, stage, dtype):
    """out: per rank, W.against_one_process's dict. Each run within its bar of the one-process run,
    every rank bit-identical, each whole param stepped once a step on one rank."""
    bars = {"same": SAME[cls, dtype], "split": SPLIT[cls, dtype], "everything": SAME[cls, dtype]}
    params = len(list(W.net(dtype).parameters()))
    for run, bar in bars.items():
        if run not in out[0]:
            continue
        for rank, o in enumerate(out):
            diff = o[run][0]
            print(f"{cls}, {world} ranks, stage {stage}, {dtype}, {run}: rank {rank}'s params {diff:.3g} away")
            assert diff <= bar, f"{run}: rank {rank}'s params {diff} from the one-process run (bar {bar})"
        # each param of the class's group stepped once a step, on one rank: the five hidden matrices,
        # or every param ("everything": Adafactor steps the 1-D ones whole too)
        whole = params if run == "everything" else len(W.WIDTHS) - 1
        assert sum(o[run][1] for o in out) == W.STEPS * whole, f"{run}: {[o[run][1] for o in out]} param steps"
        for rank, o in enumerate(out[1:], 1):
            for p, q in zip(out[0][run][2], o[run][2]):
                assert torch.equal(p, q), f"{run}: rank {rank}'s params are not rank 0's bit for bit"


@pytest.mark.parametrize("cls, which, message", [
    ("Adafactor", "empty", r"param group 0 \(Adafactor\) has no params"),
    # each rank's members of the group, then the rest of its options up to the closing quote
    ("Adafactor", "differ", r"The ranks differ in .*options .*'param group 0 \(Adafactor\)': \[.*"
                            r"'hidden.4.weight \[9, 11\]'\]}[^\"]*\"; "
                            r"rank 1: .*'hidden.3.weight \[11, 13\]'\]}[^\"]*\""),
    ("Muon", "differ", r"The ranks differ in .*options .*'param group 0 \(Muon\)': \[.*"
                       r"'hidden.4.weight \[9, 11\]'\]}[^\"]*\"; rank 1: .*'hidden.3.weight \[11, 13\]'\]}[^\"]*\"")])
def test_a_bad_group_is_refused_on_every_rank_by_name(cls, which, message):
    """An empty group, or rank 1 putting the last hidden matrix in the AdamW group: every rank
    raises (the harness fails a run that hangs), naming the group and each rank's members."""
    if not hasattr(torch.optim, cls):
        pytest.skip(f"torch.optim.{cls} is not in this torch")
    for rank, (text, untouched) in enumerate(dist_harness.values(dist_harness.run(W.bad_groups, 2, cls, which,
                                                                                  timeout=120))):
        assert text is not None and re.search(message, text), f"rank {rank}: {text}"
        assert untouched, "refused before the engine took the params"


@pytest.mark.parametrize("world, stage", [(2, 1), (2, 2), (4, 2)])
def test_adafactor_state_dict_is_torchs_both_ways_on_ranks(world, stage):
    """Every param in the Adafactor group: every rank's state dict holds each param's step, row_var
    and col_var (variance for a 1-D one) in torch's shapes, gathered from the owners; a one-process
    torch.optim.Adafactor resumes from it, and ZeroOptimizer from torch's, bit for bit."""
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor is torch 2.5+")
    model = W.net(torch.float32)
    want = [{"step": ([], 2.0), "row_var": ([p.shape[0], 1], None), "col_var": ([1, p.shape[1]], None)}
            if p.dim() == 2 else {"step": ([], 2.0), "variance": (list(p.shape), None)} for p in model.parameters()]
    for rank, (layout, one, again) in enumerate(dist_harness.values(
            dist_harness.run(W.checkpoint, world, "Adafactor", stage, timeout=300))):
        assert layout == want, f"rank {rank}: torch's layout, every param's state on every rank"
        assert all(one), f"rank {rank}: torch.optim.Adafactor resumed from it: {one}"
        assert all(again), f"rank {rank}: a {world}-rank ZeroOptimizer resumed from torch's: {again}"
