"""No silent SGD (issue 51 item 8): Newton-Schulz, counted where torch's Muon calls it, ran exactly
once per matrix per optimizer step, on exactly the one rank that owns the matrix, and
opt.matrices_stepped agrees; a step that a GradScaler skips (an inf in one rank's grads only) runs
no NS on any rank and changes no param and no optimizer state, at stages 1, 2 and 3; under no_sync
accumulation at stages 1, 2 and 3, NS runs once per optimizer step, not per micro-batch; and an inf
that reaches one rank's grad in a no_sync micro-batch only skips the step on every rank alike. Every
rank on the same batch, 2 ranks, fp32 (the skip with fp16 params too, trained through zerokern's
fp32 masters), Muon on the blocks' matrices and AdamW on the rest (muon_units_workers' model),
against one-process torch.optim.Muon + torch.optim.AdamW. Bodies in muon_count_workers.py."""

import pytest
import torch

import dist_harness
import muon_count_workers as W
import muon_units_workers as units

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

# Every rank reduces the same grads, so Muon and AdamW see one process's: the bar, 1e-6, for
# fp32 params, Muon's momentum and (fp16 params) the fp32 masters. The reference scales its loss by
# the scale the GradScaler used that step and divides its fp32 grads by it, as zerokern unscales: a
# power of 2, exact in fp32, but not a no-op for fp16 grads, which the scale keeps out of fp16's
# subnormals (without it, AdamW's update of the grads that underflow put the masters about lr, 3e-3,
# from zerokern's).
TOL = 1e-6
# fp16 params are the masters rounded to 11 significant bits, so masters within TOL of the
# reference's round to the same fp16 value or, at a rounding boundary, a neighbour: one fp16 ulp,
# 2^-9 for 2 <= |w| < 4, where the largest params (the embedding's, about 2.8) lie.
PARAMS_TOL = {torch.float32: TOL, torch.float16: 2 ** -9}
MATRICES = len(units.hidden(units.Net()))


def _check_counts(out, good_steps, case, params_tol=TOL):
    """Per good step each rank ran NS on each matrix it owns, once; the ranks own disjoint sets
    that cover every matrix; NS calls == matrices_stepped's increase."""
    owned = [o[1] for o in out]
    assert sorted(t for ts in owned for t in ts) == list(range(MATRICES)), f"{case}: owners {owned}"
    assert all(owned), f"{case}: a rank owns no matrix: {owned}"
    for rank, o in enumerate(out):
        for t, entry in enumerate(o[0]):
            calls, stepped = entry[:2]
            want = len(owned[rank]) if t in good_steps else 0
            assert calls == stepped == want, f"{case}, rank {rank}, step {t}: {calls} NS calls, " \
                                             f"matrices_stepped +{stepped}, expected {want}"
    for rank, o in enumerate(out):
        print(f"{case}, rank {rank}: owns {owned[rank]}, NS calls per step {[e[0] for e in o[0]]}, params "
              f"{o[2]:.3g} and momentum {o[3]:.3g} from one process")
        assert o[2] <= params_tol, f"{case}, rank {rank}: params {o[2]} from one-process Muon + AdamW"
        assert o[3] <= TOL, f"{case}, rank {rank}: momentum {o[3]} from one-process Muon's"
        for n, v in o[4].items():
            assert torch.equal(v, out[0][4][n]), f"{case}: rank {rank}'s {n} is not rank 0's bit for bit"


def _check_skip(out, case, dtype):
    """The skipped step BAD: every rank ran no NS and stepped no matrix in it, and every other step
    its own once (_check_counts); every rank backed off the scale there; the params, optimizer state
    and fp32 masters are unchanged by it and changed by every other step; the masters are within TOL
    of the reference's that skipped the same step."""
    steps = len(out[0][0])
    _check_counts(out, set(range(steps)) - {W.BAD}, case, PARAMS_TOL[dtype])
    for rank, o in enumerate(out):
        print(f"{case}, rank {rank}: its fp32 masters {o[5]:.3g} from the reference's")
        assert o[5] <= TOL, f"{case}, rank {rank}: fp32 masters {o[5]} from one-process Muon + AdamW's"
        scales = [e[2] for e in o[0]]
        want = [1024.0 if t < W.BAD else 512.0 for t in range(steps)]
        assert scales == want, f"{case}, rank {rank}: every rank backs off at step {W.BAD}: {scales}"
        changed = [e[3] for e in o[0]]
        assert changed == [t != W.BAD for t in range(steps)], f"{case}, rank {rank}: params changed per step: {changed}"
        state = [e[4] for e in o[0]]
        assert state == [t != W.BAD for t in range(steps)], \
            f"{case}, rank {rank}: optimizer state or masters changed per step: {state}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_the_grad_scaler_skips_runs_no_newton_schulz_on_any_rank(stage, dtype):
    out = dist_harness.values(dist_harness.run(W.scaler_skip, 2, stage, dtype, timeout=300))
    _check_skip(out, f"stage {stage}, {dtype}", dtype)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation_runs_newton_schulz_once_per_step(stage):
    out = dist_harness.values(dist_harness.run(W.accumulate, 2, stage, timeout=300))
    _check_counts(out, set(range(len(out[0][0]))), f"stage {stage}, 2 micro-batches")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_inf_in_a_no_sync_micro_batch_skips_the_step_on_every_rank(stage, dtype):
    """The inf reaches rank 1's grad in the first micro-batch, under no_sync, only: rank 1's local
    accumulation must carry it into the synced micro-batch and the step's overflow agreement, so
    every rank skips step BAD as one process that skipped it."""
    out = dist_harness.values(dist_harness.run(W.accumulate, 2, stage, 5, 2, dtype, True, timeout=300))
    _check_skip(out, f"stage {stage}, {dtype}, inf under no_sync", dtype)
