"""plan_flat (zerokern/zero/core/flat_plan.py, whole_matrices.py): which layout a FlatParams gets. plan_layout's
unless some of its params are stepped as whole matrices on several shards; then every one of
those lies whole in one rank's shard. And WholeMatrices as ShardConfig carries it: the ranks
agree on each param's name, shape and cost, never on the process-local ids."""

import dataclasses

import pytest
import torch

from zerokern.zero.core.flat_plan import plan_flat
from zerokern.zero.core.whole_matrices import WholeMatrices
from zerokern.zero.core.layout import plan_layout
from zerokern.zero.core.matrix_layout import plan_matrix_layout
from zerokern.zero.core.stage import ShardConfig


def _params():
    # gradient order of a tiny block: a bias, two odd matrices, a norm weight, a third matrix
    shapes = [(33,), (33, 7), (5, 33), (5,), (17, 5)]
    return [torch.zeros(s) for s in shapes], [f"p{i}" for i in range(len(shapes))]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_without_matrices_or_on_one_shard_it_is_plan_layout(world):
    params, names = _params()
    flat = plan_layout([p.numel() for p in params], world, 64, 16, [3])
    assert plan_flat(params, names, world, 64, 16, [3], None) == flat
    assert plan_flat(params, names, world, 64, 16, [3], WholeMatrices.of("muon", [torch.zeros(2, 2)])) == flat
    if world == 1:
        assert plan_flat(params, names, 1, 64, 16, [3], WholeMatrices.of("muon", params[1:3])) == flat


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_matrix_lies_whole_in_one_shard(world):
    params, names = _params()
    matrices = WholeMatrices.of("muon", [params[1], params[2], params[4]])
    layout = plan_flat(params, names, world, 64, 16, [], matrices)
    covered = {}
    for rank in range(world):
        for b in range(len(layout.buckets)):
            for pc in layout.rank_pieces(rank, b):
                covered.setdefault(pc.index, []).append(pc.numel)
    for i, p in enumerate(params):
        assert sum(covered[i]) == p.numel(), f"params[{i}] held entire, over the ranks"
        if matrices.holds(p):
            assert covered[i] == [p.numel()], f"params[{i}] whole on one rank, got pieces {covered[i]}"


def test_a_matrix_param_that_is_not_2d_is_named():
    params, names = _params()
    with pytest.raises(ValueError, match=r"tensor 3 \('p3'\) has shape \[5\]: a Muon param group takes 2-D"):
        plan_flat(params, names, 2, 64, 16, [], WholeMatrices.of("muon", [params[1], params[3]]))


def test_the_ranks_agree_on_each_params_name_shape_and_cost_not_ids():
    a, b = [torch.zeros(3, 3) for _ in range(2)], [torch.zeros(3, 3) for _ in range(2)]
    ca, cb = ShardConfig(2, matrices=WholeMatrices.of("muon", a)), ShardConfig(2, matrices=WholeMatrices.of("muon", b))
    assert ca != cb, "the ids tell the params apart in one process"
    assert ca.agreed() == cb.agreed() and ca.agreed().matrices.count == 2
    assert ShardConfig(2, matrices=WholeMatrices.of("muon", a[:1])).agreed() != ca.agreed()
    assert dataclasses.replace(ca, matrices=None).agreed() == ShardConfig(2)
    # [Note: a cost per param]: one param of another kind, name or shape is a difference
    mixed = WholeMatrices.of(["muon", "adafactor"], b, ["w", "v"])
    assert mixed.agreed() != WholeMatrices.of(["muon", "muon"], a, ["w", "v"]).agreed()
    assert mixed.agreed() != WholeMatrices.of(["muon", "adafactor"], a, ["w", "u"]).agreed()
    assert mixed.agreed() == WholeMatrices.of(["muon", "adafactor"], a, ["w", "v"]).agreed()
    assert mixed.agreed().kinds == (("w [3, 3]", "muon"), ("v [3, 3]", "adafactor"))
    assert mixed.cost_of(b[1]) == "adafactor" and mixed.cost_of(a[1]) is None


def test_each_param_is_balanced_by_its_own_cost():
    """A Muon matrix and Adafactor params in one plan: the costs are each one's own class's."""
    params, names = _params()
    matrices = WholeMatrices.of(["adafactor", "muon", "muon", "adafactor"], params[:4])
    layout = plan_flat(params, names, 2, 64, 16, [], matrices)
    want = plan_matrix_layout([tuple(p.shape) for p in params], {0: "adafactor", 1: "muon", 2: "muon", 3: "adafactor"},
                              2, 64, 16)
    assert layout == want.layout
    assert want.costs == (33, 33 * 7 * 7, 33 * 5 * 5, 5, 0)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"the cost of params\[0\] \[2\] must be one of"):
        WholeMatrices.of("lamb", [torch.zeros(2)])
    with pytest.raises(ValueError, match="2 costs for 1 params"):
        WholeMatrices.of(["muon", "muon"], [torch.zeros(2, 2)])
    with pytest.raises(TypeError, match="matrices must be None or a WholeMatrices"):
        ShardConfig(2, matrices={"muon"})
