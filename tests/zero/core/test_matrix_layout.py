"""The matrix-whole layout (zerokern/zero/core/matrix_layout.py): every matrix whole in one rank's
shard, equal aligned shards, every tensor placed once, owners balanced within the stated bound,
over random shapes; the 12-layer GPT's padding and balance (the same shapes as
bench/matrix_layout.py); the large-matrix and few-matrices cases; bad input; and flat buffers
built from the plan, whose shards hold each matrix whole."""

import math
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokern.zero.core.layout import plan_layout
from zerokern.zero.core.matrix_layout import matrix_cost, plan_matrix_layout
from zerokern.zero.params.storage import FlatBuffers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench"))
from matrix_layout import gpt_shapes, llama_shapes  # noqa: E402

MB = 2**20 // 4  # fp32 elements in a MB


def check(plan, shapes, matrices, world, cap, align, breaks=(), cost="muon", span=1):
    """Every property the module docstring promises, read back from the FlatLayout alone."""
    layout, numels = plan.layout, [math.prod(s) for s in shapes]
    matrices = set(matrices)
    assert layout.world_size == world and layout.align == align
    assert [s.index for s in layout.slots] == list(range(len(shapes)))
    assert [s.numel for s in layout.slots] == numels
    assert sorted(i for b in layout.buckets for i in b.tensors) == list(range(len(shapes))), "each tensor once"
    assert plan.numel == sum(numels) and plan.padding_numel == layout.padded_numel - sum(numels)
    runs = []
    for k, b in enumerate(layout.buckets):
        assert b.index == k
        assert b.padded_numel == world * b.shard_numel and b.shard_numel % align == 0 and b.shard_numel > 0, \
            "equal, aligned shards"
        offsets = [layout.slots[i].offset for i in b.tensors]
        assert offsets == sorted(offsets), "bucket.tensors in offset order (flatten's offsets)"
        ends = [(layout.slots[i].offset, layout.slots[i].offset + layout.slots[i].numel) for i in b.tensors]
        for (_, e0), (s1, _) in zip(ends, ends[1:]):
            assert e0 <= s1, "no overlap"
        assert all(layout.slots[i].bucket == k and layout.slots[i].offset % align == 0 for i in b.tensors)
        assert b.numel == max(e for _, e in ends) <= b.padded_numel
        pieces = sorted(list(layout.gaps(k)) + [(lo, hi) for lo, hi in ends if hi > lo])
        assert pieces[0][0] == 0 and pieces[-1][1] == b.padded_numel, "gaps and tensors tile the bucket"
        assert all(e == s for (_, e), (s, _) in zip(pieces, pieces[1:])), "gaps and tensors tile the bucket"
        run = sorted(b.tensors)
        assert run == list(range(run[0], run[-1] + 1)), "a bucket is a run of consecutive tensors"
        assert not any(run[0] < x <= run[-1] for x in breaks), "no bucket crosses a break"
        runs.append(run)
        mats = [i for i in run if i in matrices]
        if len(run) > 1:
            sizes = lambda ts: sum(-(-numels[i] // align) * align for i in ts)  # noqa: E731
            if mats:
                limit = max(cap, span * world * max(sizes([i]) for i in mats))
                assert max(sizes(mats), sizes(set(run) - set(mats))) <= limit, "only a lone tensor may pass the limit"
            else:
                assert b.numel <= cap, "only a lone tensor may exceed the cap"
    assert [r[0] for r in runs] == sorted(r[0] for r in runs), "buckets in gradient order"
    for i in range(len(shapes)):
        if i not in matrices:
            assert plan.owners[i] is None and plan.costs[i] == 0
            continue
        r = plan.owners[i]
        assert 0 <= r < world and plan.costs[i] == matrix_cost(cost, shapes[i])
        for q in range(world):
            pc = layout.rank_piece(q, i)
            if q == r:
                assert pc is not None and pc.tensor_start == 0 and pc.numel == numels[i], f"tensor {i} whole on {r}"
            else:
                assert pc is None, f"tensor {i} (owner {r}) has a piece on rank {q}"
        assert i in plan.owned(r)
    # [Note: balancing the owners]: spread <= the costliest shard of any bucket
    shard_costs = [sum(plan.costs[i] for i in b.tensors if plan.owners[i] == r)
                   for b in layout.buckets for r in range(world)]
    loads = plan.loads
    assert sum(loads) == sum(plan.costs)
    assert max(loads) - min(loads) <= max(shard_costs, default=0)


dims = st.integers(1, 40)
shape = st.one_of(st.tuples(st.integers(0, 300)), st.tuples(dims, dims), st.tuples(dims, dims, st.integers(1, 3)))


@settings(max_examples=250, deadline=None)
@given(shapes=st.lists(shape, min_size=1, max_size=30), data=st.data(), world=st.integers(1, 8),
       cap=st.integers(1, 4000), align=st.sampled_from([1, 4, 16]), cost=st.sampled_from(["muon", "adafactor"]),
       span=st.integers(1, 3))
def test_plan_properties(shapes, data, world, cap, align, cost, span):
    ok = [i for i, s in enumerate(shapes) if math.prod(s) > 0 and (cost == "adafactor" or len(s) == 2)]
    matrices = data.draw(st.lists(st.sampled_from(ok), unique=True) if ok else st.just([]))
    breaks = data.draw(st.lists(st.integers(0, len(shapes) - 1), max_size=3))
    plan = plan_matrix_layout(shapes, matrices, world, cap, align, cost, breaks, span=span)
    check(plan, shapes, matrices, world, cap, align, breaks, cost, span)


def test_no_matrix_is_plan_layout():
    shapes = [(5,), (300,), (7, 3), (0,), (40,)]
    plan = plan_matrix_layout(shapes, [], 4, 100, 16)
    assert plan.layout == plan_layout([5, 300, 21, 0, 40], 4, 100, 16)
    assert plan.owners == (None,) * 5 and plan.balance == 1.0


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_padding_and_balance(world):
    """The issue's 12-layer GPT (d=768), Muon on the 2-D hidden weights, fp32, the default 25 MB
    buckets: the matrix layout pads no more than plan_layout (within 5% of its bytes, the issue's
    bar for bytes per step), and the Newton-Schulz cost per rank is within 1.15 of the mean.
    Measured: no extra padding and balance 1.000 on both (bench/matrix_layout.py prints them)."""
    names, shapes, muon = gpt_shapes(12, 768)
    assert len(muon) == 48 and all(len(shapes[i]) == 2 for i in muon)
    cap = 25 * MB
    plan = plan_matrix_layout(shapes, muon, world, cap, 16, "muon", names=names)
    check(plan, shapes, muon, world, cap, 16)
    flat = plan_layout([math.prod(s) for s in shapes], world, cap, 16)
    assert plan.layout.padded_numel <= 1.05 * flat.padded_numel
    assert plan.balance <= 1.15
    assert sum(len(plan.owned(r)) for r in range(world)) == 48


def test_a_larger_span_tiles_what_one_run_cannot():
    """A small Llama (MLP matrices 224 x 64, attention 64 x 64 and 16 x 64): on 2 ranks a run of
    2 x its largest matrix leaves padding, runs twice as long tile the shards (span=2)."""
    names, shapes, muon = llama_shapes(6, 64, 224, 16, 100)
    plans = [plan_matrix_layout(shapes, muon, 2, 1000, 16, names=names, span=span) for span in (1, 2)]
    for span, plan in zip((1, 2), plans):
        check(plan, shapes, muon, 2, 1000, 16, span=span)
    assert plans[0].padding_numel > 0 and plans[1].padding_numel == 0


def test_loads_are_carried_across_buckets():
    """Four buckets (breaks), each a 32 x 32 and an 8 x 8 matrix on 2 ranks: bucket by bucket the
    costly shard goes to the rank that has less so far, so the 32 x 32s alternate and the loads end
    equal (each bucket alone would give its costly shard to rank 0)."""
    shapes = [(32, 32), (8, 8)] * 4
    plan = plan_matrix_layout(shapes, range(8), 2, 64, 16, breaks=[2, 4, 6])
    check(plan, shapes, range(8), 2, 64, 16, breaks=[2, 4, 6])
    assert len(plan.layout.buckets) == 4
    assert [plan.owners[i] for i in (0, 2, 4, 6)] == [0, 1, 0, 1]
    assert plan.balance == 1.0


def test_matrix_larger_than_a_shard_sets_it_and_neighbours_fill_the_rest():
    """[Note: a matrix larger than a rank's share], first case: a 64 x 64 matrix (4096) against a
    cap of 1024 on 4 ranks (256 a shard): its bucket's shard is the matrix, and the three other
    shards hold its twelve 32 x 32 neighbours, whole: no padding."""
    shapes = [(32, 32)] * 6 + [(64, 64)] + [(32, 32)] * 6
    plan = plan_matrix_layout(shapes, range(13), 4, 1024, 16)
    check(plan, shapes, range(13), 4, 1024, 16)
    assert len(plan.layout.buckets) == 1 and plan.layout.buckets[0].shard_numel == 64 * 64
    assert plan.padding_numel == 0
    assert plan.owned(plan.owners[6]) == (6,)
    assert sorted(len(plan.owned(r)) for r in range(4)) == [1, 4, 4, 4]


def test_one_matrix_above_the_mean_bounds_the_balance():
    """[Note: a matrix larger than a rank's share], second case: one matrix costs more than the
    mean of 4 ranks; its owner carries it alone and no other rank holds any of it."""
    shapes = [(128, 128)] + [(16, 16)] * 6
    plan = plan_matrix_layout(shapes, range(7), 4, 10_000, 16)
    check(plan, shapes, range(7), 4, 10_000, 16)
    big = matrix_cost("muon", (128, 128))
    assert plan.owned(plan.owners[0]) == (0,)
    assert plan.balance == pytest.approx(big / (sum(plan.costs) / 4))


def test_fewer_matrices_than_ranks():
    """[Note: fewer matrices than ranks]: 2 matrices on 4 ranks. Each on one rank (no duplicate),
    none split; the other shards hold the element-wise tensors or padding; shards equal."""
    shapes = [(64,), (32, 32), (48,), (32, 16), (200,)]
    plan = plan_matrix_layout(shapes, [1, 3], 4, 100_000, 16)
    check(plan, shapes, [1, 3], 4, 100_000, 16)
    assert len(plan.layout.buckets) == 1
    assert plan.owners[1] != plan.owners[3]
    assert sorted(plan.loads) == [0, 0, matrix_cost("muon", (32, 16)), matrix_cost("muon", (32, 32))]
    assert plan.balance == pytest.approx(4 * 32 * 32 * 32 / (32 * 32 * 32 + 32 * 16 * 16))
    b = plan.layout.buckets[0]
    assert b.shard_numel == 1024 and plan.padding_numel == 4 * 1024 - sum(math.prod(s) for s in shapes)


def test_one_rank_holds_everything():
    shapes = [(3, 5), (7,), (10, 10)]
    plan = plan_matrix_layout(shapes, [0, 2], 1, 64, 16)
    check(plan, shapes, [0, 2], 1, 64, 16)
    assert plan.owners == (0, None, 0) and plan.balance == 1.0


def test_tiling_shards_cost_no_padding():
    """Matrices that tile the shards exactly (4, 4, 1 + 3 on 3 ranks, sizes in units of 256)
    take the lower bound: no padding at all."""
    u = (16, 16)
    shapes = [(64, 16), (64, 16), u, (48, 16)]
    plan = plan_matrix_layout(shapes, range(4), 3, 1, 16)
    check(plan, shapes, range(4), 3, 1, 16)
    assert plan.padding_numel == 0 and plan.layout.buckets[0].shard_numel == 1024


def test_adafactor_takes_every_shape():
    """torch.optim.Adafactor reads whole tensors of any shape (its norms), so 1-D and 3-D tensors
    may be in its group; cost = numel."""
    shapes = [(10,), (4, 5), (2, 3, 4)]
    plan = plan_matrix_layout(shapes, range(3), 2, 16, 4, cost="adafactor")
    check(plan, shapes, range(3), 2, 16, 4, cost="adafactor")
    assert plan.costs == (10, 20, 24)


def test_plan_is_deterministic():
    names, shapes, muon = gpt_shapes(2, 64, vocab=100, ctx=32)
    assert plan_matrix_layout(shapes, muon, 4, 5000) == plan_matrix_layout(shapes, muon, 4, 5000)


@pytest.mark.parametrize("shapes,matrices,names,match", [
    ([(4, 4), (8,)], [1], ["w", "h.0.ln.weight"], r"tensor 1 \('h.0.ln.weight'\) has shape \[8\].*2-D"),
    ([(4, 4), (2, 2, 2)], [0, 1], None, r"tensor 1 has shape \[2, 2, 2\].*2-D"),
    ([(4, 4), (0, 4)], [1], ["w", "lazy"], r"tensor 1 \('lazy'\) has shape \[0, 4\], no elements"),
    ([(4, 4)], [0, 0], None, r"names tensor 0 twice"),
    ([(4, 4)], [1], None, r"matrices holds 1, not the index"),
    ([(4, 4)], [-1], None, r"matrices holds -1"),
    ([(4, 4)], [0], ["a", "b"], r"2 names for 1 shapes"),
])
def test_bad_input_names_the_culprit(shapes, matrices, names, match):
    with pytest.raises(ValueError, match=match):
        plan_matrix_layout(shapes, matrices, 2, 64, names=names)


def test_bad_arguments():
    with pytest.raises(ValueError, match="cost must be one of"):
        plan_matrix_layout([(4, 4)], [0], 2, 64, cost="lion")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        plan_matrix_layout([(4, 4)], [0], 0, 64)
    with pytest.raises(ValueError, match="bucket_cap must be >= 1"):
        plan_matrix_layout([(4, 4)], [0], 2, 0)
    for span in (0, 1.5, True):
        with pytest.raises(ValueError, match="span must be an int >= 1"):
            plan_matrix_layout([(4, 4)], [0], 2, 64, span=span)


def test_flat_buffers_hold_each_matrix_whole_in_its_owners_shard():
    """The runtime's flat storage takes the plan as it takes plan_layout's: the buffers hold the
    tensors' values at their slots, and the owner's shard (what reduce-scatter hands it) holds
    each of its matrices whole, as a contiguous view of the matrix's shape."""
    names, shapes, muon = gpt_shapes(2, 32, vocab=50, ctx=16)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen) for s in shapes]
    plan = plan_matrix_layout(shapes, muon, 4, 3000, 16, names=names)
    check(plan, shapes, muon, 4, 3000, 16)
    bufs = FlatBuffers.from_tensors(tensors, plan.layout)
    for i, t in enumerate(tensors):
        assert torch.equal(bufs.view(i, t.shape), t)
    for b in plan.layout.buckets:
        held = torch.cat([bufs.shard(r, b.index) for r in range(4)])
        assert torch.equal(held, bufs.buffers[b.index]), "the shards tile the buffer"
        for g0, g1 in plan.layout.gaps(b.index):
            assert not bufs.buffers[b.index][g0:g1].any(), "padding is zero"
    for i in muon:
        r = plan.owners[i]
        pc = plan.layout.rank_piece(r, i)
        shard = bufs.shard(r, pc.bucket)
        assert torch.equal(shard[pc.shard_offset:pc.shard_offset + pc.numel].view(shapes[i]), tensors[i])


def test_one_plan_takes_each_matrix_with_its_own_cost():
    """{index: kind}: Muon and Adafactor matrices in one plan ([Note: a cost per param] in
    whole_matrices.py), each costed by its own class; a 1-D tensor may be Adafactor's only."""
    shapes = [(10,), (32, 8), (8, 8), (16, 4)]
    kinds = {0: "adafactor", 1: "muon", 2: "adafactor", 3: "muon"}
    plan = plan_matrix_layout(shapes, kinds, 2, 64, 4)
    assert plan.costs == (10, 32 * 8 * 8, 64, 16 * 4 * 4)
    assert sum(plan.loads) == sum(plan.costs) and all(r is not None for r in plan.owners)
    with pytest.raises(ValueError, match=r"tensor 0 \('b'\) has shape \[10\]: a Muon param group takes 2-D"):
        plan_matrix_layout(shapes, {0: "muon"}, 2, 64, names=["b", "w", "v", "u"])
    with pytest.raises(ValueError, match=r"tensor 1: cost must be one of \('muon', 'adafactor'\), got 'lion'"):
        plan_matrix_layout(shapes, {1: "lion"}, 2, 64)
