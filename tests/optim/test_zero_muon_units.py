"""ZeroOptimizer with a torch.optim.Muon group beside an AdamW group where zerokern.shard() lays the
params out: stage 3 on 2 and 4 ranks (units laid out with shard(matrices=...), [Note: whole
matrices in units] in zerokern/zero/core/whole_matrices.py) and a 2 x 2 (replicate, shard) mesh.
Every rank on the same batch, so the reduced grads are one process's bit for bit: after 20 steps
the params equal one-process torch.optim.Muon + torch.optim.AdamW (same thread count: the
harness's one), every rank's alike bit for bit, and Newton-Schulz ran once per matrix and step in
each shard group. Then every rank on its own share of the batch (stage 3 on 2 and 4 ranks, the
mesh at stages 1-3, fp32 and bf16 params), the reference on the whole batch: within the bars below. Bodies in
muon_units_workers.py."""

import re

import pytest
import torch

import dist_harness
import matrix_helpers as H
import muon_units_workers as w
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

# every rank reduces the same grads, so Muon and AdamW see one process's inputs: the bar is
# 1e-6; measured 0.0. bf16 params: the reference steps fp32 masters as zerokern does, so the same
# bits are expected (0.0).
TOL = {torch.float32: 1e-6, torch.bfloat16: 0.0}
# Each rank on its own share of the batch (2 ranks: 4 of the 8 sequences, 4 ranks: 2), the
# reference on all 8: the grads differ, so Muon's bf16 Newton-Schulz sees other inputs.
# - fp32 params: the grads differ by the order of their sum (a few ulps, ~1e-7 relative). The bar is
#   test_zero_matrix_ranks.py's SPLIT[Muon, fp32] and its derivation holds here unchanged: the
#   widest matrix is 21 x 9 here too, at lr 0.02, for 20 steps, so 20 x 0.037 x 2^-6 = 1.2e-2.
#   Measured: 1.49e-7 at stage 3 on 2 ranks (no bf16 rounding in NS flipped); 4.98e-3 on the mesh
#   (stages 1-3 alike).
# - bf16 params: each rank's forward and backward run in bf16 on its rows, the reference's on all 8,
#   so the grads differ by bf16 roundings, 2^-8 relative (one process, the first batch: 3.0e-3).
#   The bar and its reason are test_zero_matrix_ranks.py's SPLIT[Muon, bf16], 2^-4: Newton-Schulz
#   lifts the noise in a grad's small singular values (slope a^5 ~ 490 at 0). Here
#   blocks.1.down.weight's grad (9 x 13) is nearly rank 1 (its other singular values ~1e-8 of the
#   largest in fp32, ~5e-4 in bf16): the first step moves it by 8.8e-3 = 0.44 lr, and after 20
#   steps it is 4.98e-2 away (a random walk would give sqrt(20) x 8.8e-3 = 3.9e-2).
# - state (fp32): Muon's momentum holds at most 10 grads (momentum 0.9) with the differences above,
#   AdamW's moments their averages and squares; held to the params' bar (measured, Muon's momentum
#   and AdamW's moments together: 1.49e-8 fp32, 1.12e-3 bf16).
SPLIT = {torch.float32: 1.2e-2, torch.bfloat16: 2 ** -4}
# - fp32 params, the wide model (stage 3 on 4 ranks): 1.2e-2 assumes a flipped bf16 rounding moves
#   NS's output by a few 2^-8 of it, as for a grad with no tiny singular values. Measured 1.39e-2
#   here, so we looked: the largest diff is blocks.1.down.weight (9 x 13), whose grad is rank 3 (step
#   0: its 4th singular value 6.8e-8 of the largest). Its other directions are then the bf16
#   rounding of NS's input, and moving one entry of that grad by one bf16 ulp moves NS's output by
#   up to 0.39, its largest entry being 0.41 (each entry in turn; up.weight, of full rank: 0.046 of
#   0.59). So one flip changes that matrix's step by about a step, as with bf16 params: the bf16
#   bar and its reason (a random walk of steps up to 0.7 lr: sqrt(20) x 0.7 lr ~ 2^-4) hold. The
#   same run with NS in float64 (the same sum orders) ends 2.1e-6 away: the rest is NS's bf16.
#   Measured: the first flip at step 0 (blocks.0.mix.weight, 2.7e-4); blocks.1.down.weight 1.39e-2
#   after 20 steps, its largest move in one step 5.5e-3 = 0.27 lr (step 8).
SPLIT_LOW_RANK = {torch.float32: 2 ** -4, torch.bfloat16: 2 ** -4}


def _check(out, cases, world, shard_size, split=False):
    # the state (Muon's fp32 momentum, AdamW's moments) is held to the params' bar: TOL's fp32 one
    # for bf16 params too, as it is the fp32 masters' state. split: SPLIT, or a dict like it.
    split = SPLIT if split is True else split
    bars = (lambda dtype: (split[dtype], split[dtype])) if split else (lambda dtype: (TOL[dtype], TOL[torch.float32]))
    H.check_ranks(out, cases, world, shard_size, w.STEPS, bars)


@pytest.mark.parametrize("stage, dtype, how", [(3, torch.float32, "list"), (3, torch.bfloat16, "predicate"),
                                               (3, torch.float32, "meta"), (2, torch.float32, "list")])
def test_units_on_two_ranks_are_one_process_muon_and_adamw(stage, dtype, how):
    """Units from shard(matrices=...): at stage 3 (fp32, bf16, a meta-device model) and stage 2."""
    cases = [(stage, None, dtype, how)]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 2, cases, timeout=400)), cases, 2, 2)


def test_stage_3_on_four_ranks_is_one_process_muon_and_adamw():
    """Four matrices a block (the model is wide on 4 ranks), so each unit's plan gives every rank one."""
    cases = [(3, None, torch.float32, "list"), (3, None, torch.bfloat16, "predicate")]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 4, cases, timeout=500)), cases, 4, 4)


@pytest.mark.parametrize("stage, dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16),
                                          (3, torch.float32), (3, torch.bfloat16)])
def test_a_2x2_mesh_is_one_process_muon_and_adamw(stage, dtype):
    cases = [(stage, (2, 2), dtype, "optimizer" if stage < 3 else "predicate" if dtype == torch.bfloat16 else "list")]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 4, cases, timeout=500)), cases, 4, 2)


@pytest.mark.parametrize("dtype, how", [(torch.float32, "list"), (torch.bfloat16, "predicate")])
def test_stage_3_with_a_batch_share_per_rank_is_one_process_within_the_bar(dtype, how):
    cases = [(3, None, dtype, how)]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 2, cases, True, timeout=400)), cases, 2, 2, split=True)


def test_a_2x2_mesh_with_a_batch_share_per_rank_is_one_process_within_the_bar():
    """Stages 1-3 in one run (4 ranks): a share of a quarter of the batch per rank, averaged over
    the replicas too."""
    cases = [(1, (2, 2), torch.float32, "optimizer"), (2, (2, 2), torch.float32, "optimizer"),
             (3, (2, 2), torch.float32, "list")]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 4, cases, True, timeout=500)), cases, 4, 2, split=True)


def test_stage_3_on_four_ranks_with_a_batch_share_per_rank_is_one_process_within_the_bar():
    """The wide model (four matrices a block), 2 of the 8 sequences a rank: fp32 and bf16 params."""
    cases = [(3, None, torch.float32, "list"), (3, None, torch.bfloat16, "predicate")]
    _check(dist_harness.values(dist_harness.run(w.same_batch, 4, cases, True, timeout=500)), cases, 4, 4,
           split=SPLIT_LOW_RANK)


def test_a_2x2_mesh_with_bf16_params_is_one_process_within_the_bars():
    """bf16 params on the mesh in one process group: stage 1 with every rank on the same batch
    (stages 2 and 3: test_a_2x2_mesh_is_one_process_muon_and_adamw), then stages 1-3 with a
    quarter of the batch a rank."""
    mesh = (2, 2)
    same = [(1, mesh, torch.bfloat16, "optimizer")]
    split = [(1, mesh, torch.bfloat16, "optimizer"), (2, mesh, torch.bfloat16, "optimizer"),
             (3, mesh, torch.bfloat16, "predicate")]
    out = dist_harness.values(dist_harness.run(w.same_batch, 4, same + split, [False] + [True] * len(split),
                                               timeout=500))
    _check([o[:len(same)] for o in out], same, 4, 2)
    _check([o[len(same):] for o in out], split, 4, 2, split=True)


@pytest.mark.parametrize("stage", [2, 3])
def test_units_without_a_matrix_are_refused_by_name_on_every_rank(stage):
    for text in dist_harness.values(dist_harness.run(w.unlaid, 2, stage, timeout=120)):
        assert text is not None and re.search(
            r"ZeroOptimizer steps blocks\.\d\.(up|down)\.weight as a whole matrix, so on 2 ranks it must lie whole "
            r"in one rank's shard, but unit 'blocks\.\d' was laid out by zerokern\.shard\(\) without it\. Pass "
            r"matrices= to every zerokern\.shard\(\) call", text), text


def test_shard_refuses_matrices_that_are_not_2d_by_name():
    model = w.Net()
    with pytest.raises(ValueError, match=r"zerokern.shard\(matrices=...\): up.bias has shape \[21\]; a matrix "
                                         r"optimizer \(torch.optim.Muon\) steps 2-D params only"):
        zerokern.shard(model.blocks[0], stage=2, matrices=lambda name, p: name.startswith("up"))
    with pytest.raises(TypeError, match=r"takes an iterable of params, .* or fn\(name, param\) -> .*, got one tensor"):
        zerokern.shard(model.blocks[0], stage=2, matrices=model.blocks[0].up.weight)
    assert not isinstance(model.blocks[0], zerokern.zero.api.ZeroModule), "refused before the unit was made"


def test_units_with_matrices_on_one_process_are_torch_muon():
    """shard(matrices=) on one process changes no layout (every param is whole on one shard)."""
    ref = w.Net()
    model = w.Net()
    model.load_state_dict(ref.state_dict())
    mine = w.hidden(model)
    for b in model.blocks:
        zerokern.shard(b, stage=3, matrices=mine)
    zerokern.shard(model, stage=3, matrices=mine)
    mine, rest = w._groups(model)
    opt = zerokern.ZeroOptimizer([{"params": mine, "optimizer": torch.optim.Muon, **w.MUON},
                                  {"params": rest, **w.ADAMW}], torch.optim.AdamW)
    ref_opt = w._Reference(ref)
    for x in w._batches()[:4]:
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    assert opt.matrices_stepped == 4 * len(mine)


@pytest.mark.parametrize("stage, how", [(3, "list"), (2, "optimizer")])
def test_a_run_resumed_from_its_state_dicts_takes_the_same_steps(stage, how):
    """At stage 3 the momentum is gathered from its owner and handed back to it, as at stage 2."""
    shapes = {k: list(p.shape) for k, p in enumerate(w.hidden(w.Net()))}
    for same, saved in dist_harness.values(dist_harness.run(w.resume, 2, stage, how, timeout=300)):
        assert all(same.values()), [n for n, ok in same.items() if not ok]
        assert saved == shapes, "each matrix's whole momentum on every rank, keyed by its index"
