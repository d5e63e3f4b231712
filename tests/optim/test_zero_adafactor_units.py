"""ZeroOptimizer with a torch.optim.Adafactor group (the blocks' matrices, biases and norms: 1-D
params too) beside an AdamW group, where zerokern.shard() lays the params out: stage 3 on 2 ranks
with shard(matrices={param: "adafactor"}) or fn(name, param) -> "adafactor" ([Note: a cost per
param] in zerokern/zero/core/whole_matrices.py), and a 2 x 2 (replicate, shard) mesh at stages
1-3, fp32 and bf16 params (stage 3 on 4 ranks too). Every rank on the same batch: after 20 steps
the params equal one-process torch.optim.Adafactor + torch.optim.AdamW bit for bit, on every rank
alike, and each Adafactor param was stepped once a step in each shard group. Every rank on its own
share of the batch: within the bars below (SPLIT). Bodies in matrix_kinds_workers.py."""

import re

import pytest
import torch

import dist_harness
import matrix_helpers as H
import matrix_kinds_workers as K
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is torch 2.5+")


@pytest.mark.parametrize("dtype, how", [(torch.float32, "dict"), (torch.bfloat16, "predicate")])
def test_stage_3_on_two_ranks_is_one_process_adafactor_and_adamw(dtype, how):
    cases = [(3, None, dtype, how)]
    out = dist_harness.values(dist_harness.run(K.same_batch, 2, "adafactor", cases, timeout=300))
    H.check_ranks(out, cases, 2, 2, K.U.STEPS, H.same_bits)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_2x2_mesh_is_one_process_adafactor_and_adamw(stage):
    cases = [(stage, (2, 2), torch.float32, "optimizer" if stage < 3 else "dict")]
    out = dist_harness.values(dist_harness.run(K.same_batch, 4, "adafactor", cases, timeout=400))
    H.check_ranks(out, cases, 4, 2, K.U.STEPS, H.same_bits)


# Each rank on its own share of the batch (2 ranks: 4 of the 8 sequences, 4 ranks: 2), the reference
# on all 8. The bars are test_zero_matrix_ranks.py's SPLIT[Adafactor, ...], and their reasons hold
# for this model (the same lr 0.02, 20 steps):
# - fp32: the grads differ by their sum order (~1e-7 relative); Adafactor's update is smooth in the
#   grad (fp32 throughout, variance-normalised, RMS-clipped), so 20 steps stay far below the
#   issue's 1e-5.
# - bf16 params: each rank's bf16 forward and backward on fewer rows round otherwise (2^-8), and
#   every step rounds the params to bf16: flips of an ulp (2^-7 at the norm weights' |p| ~ 1) that
#   add up over 20 steps; 8 ulps at 1.0: 2^-4.
# - state (fp32): Adafactor's row and column variances are averages of squared grads, AdamW's moments
#   averages of grads and their squares: held to the params' bar, as test_zero_muon_units.py does.
SPLIT = {torch.float32: 1e-5, torch.bfloat16: 2 ** -4}


def _split_bars(dtype):
    return SPLIT[dtype], SPLIT[dtype]


def _run_and_check(world, shard_size, same, split, timeout):
    """One process group: the cases in same with every rank on the same batch (bit for bit), then
    the ones in split with each rank on its own share of it (within SPLIT)."""
    out = dist_harness.values(dist_harness.run(K.same_batch, world, "adafactor", same + split,
                                               [False] * len(same) + [True] * len(split), timeout=timeout))
    if same:
        H.check_ranks([o[:len(same)] for o in out], same, world, shard_size, K.U.STEPS, H.same_bits)
    H.check_ranks([o[len(same):] for o in out], split, world, shard_size, K.U.STEPS, _split_bars)


def test_stage_3_with_a_batch_share_per_rank_is_one_process_within_the_bar():
    _run_and_check(2, 2, [], [(3, None, torch.float32, "dict"), (3, None, torch.bfloat16, "predicate")], 300)


def test_stage_3_on_four_ranks_is_one_process_adafactor_and_adamw():
    """Both ways, fp32 and bf16 params: the wide blocks (4 matrices, 3 biases and norms each)."""
    cases = [(3, None, torch.float32, "dict"), (3, None, torch.bfloat16, "predicate")]
    _run_and_check(4, 4, cases, cases, 500)


def test_a_2x2_mesh_with_bf16_params_or_a_batch_share_per_rank_is_one_process_within_the_bars():
    """Stages 1-3: bf16 params on the same batch, and fp32 and bf16 params with a quarter of the
    batch a rank (averaged over the replicas too)."""
    mesh = (2, 2)
    bf16 = [(1, mesh, torch.bfloat16, "optimizer"), (2, mesh, torch.bfloat16, "optimizer"),
            (3, mesh, torch.bfloat16, "predicate")]
    fp32 = [(1, mesh, torch.float32, "optimizer"), (2, mesh, torch.float32, "optimizer"),
            (3, mesh, torch.float32, "dict")]
    _run_and_check(4, 2, bf16, fp32 + bf16, 600)


@pytest.mark.parametrize("which, message", [
    ("missing", r"ZeroOptimizer steps blocks\.\d\.(up\.bias|norm\.weight|norm\.bias) as a whole matrix, so on 2 "
                r"ranks it must lie whole in one rank's shard, but unit 'blocks\.\d' was laid out by "
                r"zerokern\.shard\(\) without it\. Pass matrices= to every zerokern\.shard\(\) call "
                r"\(.*\{param: \"muon\" \| \"adafactor\"\}"),
    ("muon cost", r"ZeroOptimizer steps blocks\.\d\.(up|down)\.weight with Adafactor, but unit 'blocks\.\d' laid it "
                  r"out by Muon's cost, so its owners are balanced by the wrong work\. Pass matrices= .*naming it "
                  r"\"adafactor\""),
    ("differ", r"zerokern\.shard\(_Layer, stage=3\): the ranks shard different params or options.*"
               r"\('up\.weight \[21, 9\]', 'adafactor'\).*rank 1: .*\('up\.weight \[21, 9\]', 'muon'\)")])
def test_units_laid_out_otherwise_are_refused_by_name_on_every_rank(which, message):
    """A unit without an Adafactor param, one laid out by Muon's cost, and ranks that lay a param
    out with different costs: every rank raises (the harness fails a run that hangs), naming it."""
    for rank, text in enumerate(dist_harness.values(dist_harness.run(K.refused, 2, "adafactor", which,
                                                                      timeout=120))):
        assert text is not None and re.search(message, text, re.S), f"rank {rank}: {text}"


def test_shard_names_a_param_given_an_unknown_optimizer():
    model = K.U._net(torch.float32)
    with pytest.raises(ValueError, match=r"zerokern.shard\(matrices=...\): up.bias is given 'lamb'; a param's entry "
                                         r"is \"muon\" or \"adafactor\""):
        zerokern.shard(model.blocks[0], stage=2, matrices={model.blocks[0].up.bias: "lamb"})
    with pytest.raises(ValueError, match=r"zerokern.shard\(matrices=...\): norm.weight has shape \[21\]; a matrix "
                                         r"optimizer \(torch.optim.Muon\) steps 2-D params only"):
        zerokern.shard(model.blocks[0], stage=2, matrices=lambda name, p: "muon" if name.startswith("norm") else None)
    assert not isinstance(model.blocks[0], zerokern.zero.api.ZeroModule), "refused before the unit was made"

