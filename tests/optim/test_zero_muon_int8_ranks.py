"""Int8 Muon momentum ({"optimizer": torch.optim.Muon, "state_precision": "int8"}, [Note: int8
momentum of whole matrices] in zerokern/optim/lowbit_momentum.py) where test_zero_muon_int8.py does
not take it: stage-3 units laid out by zerokern.shard(matrices=...) on 2 ranks, and a 2 x 2
(replicate, shard) mesh. The model, batches and reference are muon_units_workers.py's (two blocks,
4 matrices, 20 steps); the reference is one-process torch.optim.Muon + torch.optim.AdamW whose
momentum is rounded through the same row blocks after every step, as test_zero_muon_int8.py's
oracle. Every rank on the same batch, so the reduced grads are one process's: the params and the
state dict's decoded momentum must be the reference's bit for bit, every rank's params alike, and
torch's Newton-Schulz must run once per matrix and step in each shard group (counted in each rank,
matrices_stepped summed over the group)."""

import pytest
import torch

import dist_harness
import matrix_helpers as H
import muon_units_workers as w

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")


def test_stage_3_units_on_two_ranks_are_one_process_int8_muon():
    cases = [(3, None, torch.float32, "list"), (3, None, torch.bfloat16, "predicate")]
    out = dist_harness.values(dist_harness.run(w.same_batch, 2, cases, False, True, timeout=400))
    H.check_ranks(out, cases, 2, 2, w.STEPS, H.same_bits)


def test_a_2x2_mesh_is_one_process_int8_muon():
    """Stage 2 (the optimizer's layout) and stage 3 (units) in one 4-rank run."""
    cases = [(2, (2, 2), torch.float32, "optimizer"), (3, (2, 2), torch.float32, "list")]
    out = dist_harness.values(dist_harness.run(w.same_batch, 4, cases, False, True, timeout=500))
    H.check_ranks(out, cases, 4, 2, w.STEPS, H.same_bits)
