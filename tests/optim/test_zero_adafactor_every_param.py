"""ZeroOptimizer(torch.optim.Adafactor) with every param in the Adafactor group (no AdamW group:
the embedding, the head, biases and norms are stepped whole too; docs/matrix_optimizers.md
"Adafactor's groups may hold 1-D params"), 2 ranks, 4 ranks and a 2 x 2 mesh, each rank on its own
share of every batch, the reference one-process torch.optim.Adafactor on the whole batch: stages
1, 2 and 3 (units from shard(matrices=)), fp32 and bf16 params, 20 steps. Stage 3 on 2 ranks runs
with every rank on the same batch too (bit for bit; stages 1-2 on the same batch:
test_zero_matrix_ranks.py's "everything" run). Every rank's params bit-identical, each param
stepped once a step on one rank (in each shard group), and the params and state (torch's layout,
every rank's state_dict()) within the bars below. Bodies in
matrix_kinds_workers.py (scenario "every"): one process group a world size."""

import pytest
import torch

import dist_harness
import matrix_helpers as H
import matrix_kinds_workers as K

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is torch 2.5+")

# Own share of the batch: rank r trains on rows [4r, 4r + 4) of each batch of 8, the reference on
# all 8; the mean of the two ranks' means is the whole batch's, so the reduced grad differs from
# one process's only by the order of its sums.
# - fp32: the bar for Adafactor, 1e-5. Adafactor is fp32 throughout and smooth in the grad
#   (variance-normalised, RMS-clipped), so a few ulps of grad stay a few ulps of param. Measured
#   2026-12-06 (2-core CPU, gloo, torch 2.14.1), the same at stages 1, 2 and 3: 3.58e-7, three ulps
#   of blocks.0.norm.weight (|p| ~ 1.27) after 20 steps, 2.4e-7 (one ulp of the embedding, |p| ~ 2.5)
#   before; state 1.9e-9.
# - bf16 params: each rank's bf16 forward and backward on its 4 rows round otherwise than the
#   reference's on 8 (2^-8 relative), and every step rounds the params to bf16, so an update near
#   half an ulp can land one ulp apart, and such flips add up over 20 steps: 8 ulps at |p| = 1,
#   2^-4 (test_zero_adafactor_units.py's SPLIT, for the same reasons). The embedding (|p| up to
#   2.7, ulp 2^-6 there) holds the largest diff here: measured 1.56e-2 after step 1 and 7.8e-3 after
#   step 20; state 1.1e-5.
SPLIT = {torch.float32: 1e-5, torch.bfloat16: 2 ** -4}


def _split_bars(dtype):
    # The state is averages of squared grads (row_var, col_var, variance): held to the params' bar,
    # as test_zero_adafactor_units.py does. It is the check that sees a wrong grad scale: Adafactor's
    # update is invariant to the grad's scale and a power-of-two scale is exact, so with the 1/world
    # averaging removed from zerokern's reductions (tried) the params still end 0.0 and 3.58e-7
    # away, while the variances are 4x torch's (0.025 away).
    return SPLIT[dtype], SPLIT[dtype]


def test_every_param_in_adafactor_on_a_batch_share_per_rank_is_one_process_adafactor():
    # stages 1-2: the optimizer lays the params out; stage 3: the blocks and the root are units,
    # their params named to shard() as {param: "adafactor"} (fp32) and by a predicate (bf16)
    split = [(1, None, torch.float32, "optimizer"), (2, None, torch.float32, "optimizer"),
             (3, None, torch.float32, "dict"), (1, None, torch.bfloat16, "optimizer"),
             (2, None, torch.bfloat16, "optimizer"), (3, None, torch.bfloat16, "predicate")]
    same = [(3, None, torch.float32, "dict"), (3, None, torch.bfloat16, "predicate")]
    out = dist_harness.values(dist_harness.run(K.same_batch, 2, "every", same + split,
                                               [False] * len(same) + [True] * len(split), timeout=300))
    params = len(list(K.U._net(torch.float32).parameters()))
    assert all(r.whole == params for o in out for r in o), "every param in the Adafactor group, stepped whole"
    H.check_ranks([o[:len(same)] for o in out], same, 2, 2, K.U.STEPS, H.same_bits)
    H.check_ranks([o[len(same):] for o in out], split, 2, 2, K.U.STEPS, _split_bars)


def test_every_param_in_adafactor_on_four_ranks_and_a_2x2_mesh_with_a_batch_share_per_rank_is_one_process():
    # 4 ranks, each on a quarter of the batch: the wide blocks (muon_units_workers'; 4 matrices a
    # block) without a mesh, stages 1-3; the 2 x 2 (replicate, shard) mesh on the narrow ones, its
    # grads averaged over the replicas too. One process group for the 4-rank cases; SPLIT's bars.
    # Measured 2026-12-06 (2-core CPU, gloo, torch 2.14.1), the same at stages 1, 2 and 3, every
    # rank alike: fp32 3.58e-7 (4 ranks) and 2.38e-7 (mesh), state 1.4e-9; bf16 7.8e-3 (4 ranks:
    # the embedding, |p| ~ 2.4, one ulp; 1.56e-2 on the way) and 2.34e-2 (mesh), state 2.5e-5.
    # The mesh's is there from the first step and does not grow: Adafactor's first variance is
    # g^2, so its first update is lr x RMS(p) x sign(g), and blocks.0.norm.weight[14]'s grad
    # (-2.5e-5 on the whole batch) is within the bf16 roundings of 0 on 2 rows a rank: averaged
    # over the ranks it is 0 and the param stays at 1.0 where the reference's moves to 1.0234,
    # 3 ulps. Later steps average it away into the variance and it stays 2-3 ulps; 2^-4 is 8.
    mesh = (2, 2)
    flat = [(1, None, torch.float32, "optimizer"), (2, None, torch.float32, "optimizer"),
            (3, None, torch.float32, "dict"), (1, None, torch.bfloat16, "optimizer"),
            (2, None, torch.bfloat16, "optimizer"), (3, None, torch.bfloat16, "predicate")]
    on_mesh = [(stage, mesh, dtype, how) for stage, _, dtype, how in flat]
    out = dist_harness.values(dist_harness.run(K.same_batch, 4, "every", flat + on_mesh, True, timeout=600))
    for wide, cases, shard_size, k in ((True, flat, 4, 0), (False, on_mesh, 2, len(flat))):
        params = len(list(K.U._net(torch.float32, wide).parameters()))
        assert all(r.whole == params for o in out for r in o[k:k + len(cases)]), "every param stepped whole"
        H.check_ranks([o[k:k + len(cases)] for o in out], cases, 4, shard_size, K.U.STEPS, _split_bars)
