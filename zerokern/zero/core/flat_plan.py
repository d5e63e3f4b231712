"""plan_flat: the one place that chooses how a FlatParams lays out its params, plan_layout's
flat buckets or, where an optimizer steps some of them as whole matrices, matrix_layout's buckets
whose per-rank shards hold those whole ([Note: whole matrices in equal shards] in
matrix_layout.py). Pure bookkeeping: shapes in, a FlatLayout out.

Which params those are comes in the ShardConfig (stage.py) that the engine hands its units, as
a WholeMatrices (whole_matrices.py), so FlatParams needs no other argument.
"""

from typing import Sequence

from .layout import FlatLayout, plan_layout
from .matrix_layout import plan_matrix_layout


def plan_flat(params, names: Sequence[str], world_size: int, bucket_cap: int, align: int, breaks: Sequence[int],
              matrices) -> FlatLayout:
    """The layout of `params` (one dtype of a unit, in backward order). matrices: a WholeMatrices
    or None. On one shard (world_size 1) every param is whole in any layout, so plan_layout's is
    kept there, as it is for a FlatParams holding none of the matrices."""
    whole = {i: matrices.cost_of(p) for i, p in enumerate(params) if matrices is not None and matrices.holds(p)}
    if not whole or world_size == 1:
        return plan_layout([p.numel() for p in params], world_size, bucket_cap, align, breaks)
    # each param balanced by its own optimizer's cost ([Note: a cost per param] in whole_matrices.py)
    return plan_matrix_layout([tuple(p.shape) for p in params], whole, world_size, bucket_cap, align,
                              breaks=breaks, names=list(names)).layout
