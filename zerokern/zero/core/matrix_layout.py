"""MatrixLayout: a FlatLayout in which every tensor of a matrix optimizer's param groups
(torch.optim.Muon, torch.optim.Adafactor) lies whole inside one rank's shard, the ranks that own
them chosen to balance the optimizer's per-matrix work. Pure bookkeeping, as layout.py: numbers
in, numbers out, no torch.

    plan = plan_matrix_layout(shapes, matrices, world_size, bucket_cap, align=16, cost="muon")
    plan.layout       # a FlatLayout (Slot/Piece/Bucket as plan_layout's): flat buffers,
                      # reduce-scatter and gathers take it unchanged
    plan.owners[i]    # the rank whose shard holds tensor i whole (None: an element-wise tensor)
    plan.loads        # per rank, the summed cost of the matrices it owns
    plan.balance      # max(loads) / mean(loads)
    plan.padding_numel

`shapes` are the tensors' shapes in the order their gradients are expected (as plan_layout's
numels); `matrices` the indices of the tensors the matrix optimizer runs on, or {index: kind}
where several optimizers' matrices share a plan. Cost of a tensor (the work its owner does per
step): "muon", Newton-Schulz, max(m, n) * min(m, n)**2 for an m x n matrix (each of the ns_steps
iterations multiplies an n x n Gram matrix by itself and the matrix, n = min(m, n)); "adafactor",
m * n (row and column statistics, one pass). Both count multiply-adds up to a small constant, so
one rank's load adds them as they are (a d x d matrix costs d^3 under Muon, d^2 under Adafactor:
the Muon matrices dominate a mixed plan, as they dominate its step time). What holds as in
plan_layout: [Note: alignment rule]; each bucket's padded size is world_size * shard with the
shard a multiple of align; rank r owns [r * shard, (r + 1) * shard) of every bucket; buckets are
runs of consecutive tensors in the given order that never cross a break. What differs: how a
bucket is cut and where its tensors sit (below), and that a bucket's tensors (bucket.tensors, in
offset order, as flatten's offsets must be) are not in index order.

[Note: whole matrices in equal shards] A bucket that holds a matrix (a "matrix bucket") puts
every one of its tensors, matrices and element-wise ones alike, whole inside one rank's shard;
the element-wise tensors of the same run (biases, norms) fill what the matrices leave. The
shards of a bucket must stay equal: reduce_scatter and all_gather_into_tensor split a buffer
into world_size equal chunks, and a bucket with a long slot for one rank and short ones for the
others would need per-rank sizes (reduce_scatter_v), which gloo and NCCL's reduce-scatter do
not take. So the shard is the fullest rank's fill, and the other ranks' shortfall is padding,
counted in padding_numel and carried on the wire as plan_layout's padding is (2 (N-1)/N of it
per step at stage 2). Keeping it small is the cutter's job ([Note: cutting the buckets]). A
bucket with no matrix is laid out as plan_layout lays it out (tensors may cross shards).

[Note: cutting the buckets] Which tensors share a shard is a bin packing by bytes: MULTIFIT
(first-fit decreasing into world_size bins, the bin size found by bisection; Coffman, Garey
and Johnson 1978: at most 13/11 of the best shard, plus the bisection's last step). Where the
runs are cut is chosen over all cut points at once (dynamic programming over the n tensors,
each run of at most k tensors packed once: O(n k) packings) to minimise the total padding, ties
to fewer buckets. A run may take up to max(bucket_cap, span x world_size x its largest matrix)
elements of matrices (span = 1 unless given), and as many of other tensors (so that the element-wise tensors between
them can ride along, though they push the shard past the largest matrix); a lone tensor any.
A bucket with no matrix takes up to bucket_cap, as plan_layout's. So a run is cut where its
matrices tile the shards (a GPT layer's 4, 4, 1 and 3 units of d x d tile 4 shards of 4 once
the next layer's first matrix joins it), not where bucket_cap falls. The cost of taking the
fewest bytes: a tensor much larger than the others (a tied embedding under Adafactor) makes a
limit that the whole model fits in, and the cut that fills its padding is one bucket: no
overlap, and the full gradient buffer held until backward ends (docs/matrix_optimizers.md).
Where a model's matrices do not tile world_size shards within one run (Llama-70B's three 28672
x 8192 MLP matrices and its attention's 151M elements: 9.5% more padding than plan_layout on 4
ranks at span 1), a larger span lets runs of two or three layers tile (0% at span 3), for
buckets that much larger and a plan that takes seconds (bench/matrix_layout.py --model).

[Note: a matrix larger than a rank's share] Two cases, neither splits a matrix (a partial
slot) nor runs its optimizer on two ranks:
- larger than bucket_cap / world_size (GPT-2's 3072 x 768 at the default 25 MB and 4 ranks):
  the matrix sets its bucket's shard, and the bucket grows to world_size x its size (the limit
  above); its neighbours in gradient order fill the other ranks' shards. The price is a larger
  grad bucket buffer (up to world_size x the largest matrix, held while the bucket fills at
  stage 2), not bytes on the wire, as long as the neighbours tile the shards.
- larger than a rank's share of the model's matrices (its cost above mean(loads)): its owner's
  load is at least its cost, so balance >= cost / mean; nothing here can do better without
  splitting the optimizer's work on one matrix. Not done here: spreading such a matrix over k
  shards and gathering it to one owner at step time (no padding, but (k - 1)/k of the matrix
  each way per step, and a step-time exchange in the critical path); worth it only where the
  padding it saves is larger, which a later planner can weigh per bucket.
[Note: fewer matrices than ranks] A bucket (or a model) with fewer matrices than ranks leaves
ranks without a matrix: their shards hold the run's element-wise tensors or padding, so the
shards stay equal, every matrix still has one owner (no duplicated Newton-Schulz) and no rank
holds part of one. The padding is counted; balance is then at least world_size / count.

[Note: balancing the owners] The packing fixes which tensors share a shard; which rank takes
which shard changes no byte, so it is chosen for the cost: in each bucket, in bucket order, the
costliest shard goes to the rank with the least load so far (loads carried across buckets),
the next costliest to the next, and so on. Bound: if, before a bucket, max(load) - min(load) <= C
(C the largest cost of one shard of any bucket), then after it too: for ranks i, j with
load_i <= load_j given costs c_i >= c_j, (load_j + c_j) - (load_i + c_i) <= load_j - load_i <= C
and (load_i + c_i) - (load_j + c_j) <= c_i - c_j <= C. So, from all-zero loads,
max(load) - mean(load) <= (world_size - 1) / world_size * C. Measured (bench/matrix_layout.py):
a 12-layer GPT, d = 768, 25 MB buckets, tiles every shard, balance 1.000 on 2 and 4 ranks.

[Note: which tensors are whole] torch.optim.Muon takes 2-D params only (raises otherwise), so a
"muon" tensor that is not 2-D is refused here, naming it. torch.optim.Adafactor reads whole
tensors of any shape: row and column statistics of a tensor's last two dims, and, for every
param, 1-D ones too, the param's norm (its relative step) and the update's norm (its clipping):
so every tensor of an Adafactor param group is "adafactor" here, its cost its numel. A tensor of
no elements is refused (a param not materialised yet, e.g. of shape (0,) under a lazy init,
would silently get no update).
"""

import math
from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .layout import Bucket, FlatLayout, Slot, _round_up, plan_layout
from .whole_matrices import COSTS


def matrix_cost(cost: str, shape: Sequence[int]) -> int:
    """The work one step of the matrix optimizer does on a tensor of `shape` (see the module docstring)."""
    if cost == "muon":
        m, n = shape
        return max(m, n) * min(m, n) ** 2
    if cost == "adafactor":
        return math.prod(shape)
    raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")


@dataclass(frozen=True)
class MatrixLayout:
    layout: FlatLayout
    owners: Tuple[Optional[int], ...]  # by tensor index: the rank holding a matrix whole; None: element-wise
    costs: Tuple[int, ...]  # by tensor index; 0 for element-wise tensors
    numel: int  # elements of all tensors, without padding

    @property
    def loads(self) -> Tuple[int, ...]:
        out = [0] * self.layout.world_size
        for rank, c in zip(self.owners, self.costs):
            if rank is not None:
                out[rank] += c
        return tuple(out)

    @property
    def balance(self) -> float:
        """max / mean of the ranks' loads (1.0 with no cost at all)."""
        loads = self.loads
        total = sum(loads)
        return max(loads) * len(loads) / total if total else 1.0

    @property
    def padding_numel(self) -> int:
        return self.layout.padded_numel - self.numel

    def owned(self, rank: int) -> Tuple[int, ...]:
        """The matrices `rank` holds whole (and runs the optimizer on), in index order."""
        self.layout._check_rank(rank)
        return tuple(i for i, r in enumerate(self.owners) if r == rank)


def plan_matrix_layout(shapes: Sequence[Sequence[int]], matrices: Union[Iterable[int], Mapping[int, str]],
                       world_size: int, bucket_cap: int, align: int = 16, cost: str = "muon",
                       breaks: Sequence[int] = (), names: Optional[Sequence[str]] = None,
                       span: int = 1) -> MatrixLayout:
    """Buckets for tensors of `shapes` (in gradient order) in which each tensor of `matrices` lies
    whole in one rank's shard (module docstring). matrices: tensor indices, each of kind `cost`,
    or {index: kind} where one plan holds matrices of several optimizers ([Note: a cost per
    param] in whole_matrices.py; `cost` is then unused). names: the tensors' names, for the
    errors. span: a bucket may hold up to span x world_size x its largest matrix ([Note: cutting
    the buckets]): larger buckets, less padding, a longer plan."""
    shapes = [tuple(s) for s in shapes]
    numels = [math.prod(s) for s in shapes]
    plan_layout(numels, world_size, bucket_cap, align, breaks)  # its checks of the common arguments
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if isinstance(span, bool) or not isinstance(span, int) or span < 1:
        raise ValueError(f"span must be an int >= 1, got {span!r}")
    kinds = _kinds(shapes, numels, matrices, cost, names)
    whole = [k is not None for k in kinds]
    costs = tuple(matrix_cost(k, s) if k else 0 for s, k in zip(shapes, kinds))
    if not any(whole):
        return MatrixLayout(plan_layout(numels, world_size, bucket_cap, align, breaks), (None,) * len(shapes), costs,
                            sum(numels))
    sizes = [_round_up(n, align) for n in numels]
    slots: List[Optional[Slot]] = [None] * len(shapes)
    owners: List[Optional[int]] = [None] * len(shapes)
    buckets: List[Bucket] = []
    loads = [0] * world_size  # [Note: balancing the owners]: carried across buckets
    for lo, hi in _cut(numels, sizes, whole, world_size, bucket_cap, align, set(breaks), span):
        b = len(buckets)
        if not any(whole[lo:hi]):
            offsets, end, padded = _flat(numels, lo, hi, world_size, align)
            for i, off in zip(range(lo, hi), offsets):
                slots[i] = Slot(i, b, off, numels[i])
            buckets.append(Bucket(b, tuple(range(lo, hi)), end, padded, padded // world_size))
            continue
        shard, bins = _multifit(sizes, range(lo, hi), world_size, align)
        # the costliest shard to the least loaded rank, the next to the next, ...
        bin_cost = [sum(costs[i] for i in members) for members in bins]
        by_cost = sorted(range(world_size), key=lambda k: (-bin_cost[k], min(bins[k], default=len(shapes))))
        by_load = sorted(range(world_size), key=lambda r: (loads[r], r))
        for k, rank in zip(by_cost, by_load):
            loads[rank] += bin_cost[k]
            at = rank * shard
            for i in sorted(bins[k]):
                slots[i] = Slot(i, b, at, numels[i])
                owners[i] = rank if whole[i] else None
                at += sizes[i]
        # in offset order (flatten's offsets must increase); an empty tensor before one at its offset
        members = tuple(sorted(range(lo, hi), key=lambda i: (slots[i].offset, numels[i] > 0, i)))
        end = max(slots[i].offset + numels[i] for i in members)
        buckets.append(Bucket(b, members, end, shard * world_size, shard))
    layout = FlatLayout(world_size, align, tuple(slots), tuple(buckets))
    return MatrixLayout(layout, tuple(owners), costs, sum(numels))


def _kinds(shapes, numels, matrices, cost, names) -> List[Optional[str]]:
    """Per tensor, its cost kind if it is one of `matrices` (None: element-wise): checked, naming
    the culprit ([Note: which tensors are whole])."""
    if names is not None and len(names) != len(shapes):
        raise ValueError(f"{len(names)} names for {len(shapes)} shapes")
    name = (lambda i: f"tensor {i} ({names[i]!r})") if names is not None else (lambda i: f"tensor {i}")  # noqa: E731
    kinds: List[Optional[str]] = [None] * len(shapes)
    pairs = matrices.items() if isinstance(matrices, Mapping) else ((i, cost) for i in matrices)
    for i, kind in pairs:
        if not isinstance(i, int) or not 0 <= i < len(shapes):
            raise ValueError(f"matrices holds {i!r}, not the index of one of the {len(shapes)} tensors")
        if kinds[i] is not None:
            raise ValueError(f"matrices names {name(i)} twice")
        if kind not in COSTS:
            raise ValueError(f"{name(i)}: cost must be one of {COSTS}, got {kind!r}")
        if kind == "muon" and len(shapes[i]) != 2:
            raise ValueError(f"{name(i)} has shape {list(shapes[i])}: a Muon param group takes 2-D tensors only "
                             "(torch.optim.Muon refuses others); put it in the element-wise (AdamW) group")
        if numels[i] == 0:
            raise ValueError(f"{name(i)} has shape {list(shapes[i])}, no elements: a matrix optimizer would give it "
                             "no update (a param not materialised yet?)")
        kinds[i] = kind
    return kinds


def _flat(numels, lo, hi, world_size, align):
    """plan_layout's placement of tensors lo..hi-1 in one bucket: (offsets, end, padded)."""
    offsets, end = [], 0
    for i in range(lo, hi):
        offsets.append(_round_up(end, align) if offsets else 0)
        end = offsets[-1] + numels[i]
    return offsets, end, max(_round_up(end, world_size * align), world_size * align)


def _ffd(order, sizes, bins, shard):
    """First-fit decreasing of the tensors in `order` (sizes descending) into `bins` bins of
    `shard` elements: each bin's tensor indices, or None if one does not fit."""
    fill, out = [0] * bins, [[] for _ in range(bins)]
    for i in order:
        for k in range(bins):
            if fill[k] + sizes[i] <= shard:
                fill[k] += sizes[i]
                out[k].append(i)
                break
        else:
            return None
    return out


def _multifit(sizes, members, world_size, align):
    """(shard, bins): the smallest shard (a multiple of align, at least align) into which
    first-fit decreasing packs `members` in world_size bins, by bisection (MULTIFIT)."""
    order = sorted(members, key=lambda i: (-sizes[i], i))
    total = sum(sizes[i] for i in order)
    lo = max(sizes[order[0]], _round_up(-(-total // world_size), align), align)
    bins = _ffd(order, sizes, world_size, lo)
    if bins is not None:
        return lo, bins  # the lower bound: no packing has a smaller shard
    hi = lo
    while bins is None:
        hi = max(_round_up(2 * hi, align), align)
        bins = _ffd(order, sizes, world_size, hi)
    # bisect (lo, hi]: lo fails, hi fits; to within align (sizes are multiples of align)
    while hi - lo > align:
        mid = _round_up((lo + hi) // 2, align)
        if mid >= hi:
            break
        got = _ffd(order, sizes, world_size, mid)
        if got is None:
            lo = mid
        else:
            hi, bins = mid, got
    return hi, bins


def _cut(numels, sizes, whole, world_size, bucket_cap, align, breaks, span):
    """The runs [lo, hi) of consecutive tensors that make the buckets: [Note: cutting the buckets].
    Minimises the buckets' summed padded size (the tensors' elements are the same in every cut)."""
    n = len(sizes)
    reach = max(bucket_cap, span * world_size * max(s for s, w in zip(sizes, whole) if w))  # no run is longer
    best: List[Optional[Tuple[int, int]]] = [(0, 0)] + [None] * n  # (padded, buckets): best cut of tensors 0..hi-1
    start = [0] * (n + 1)
    for hi in range(1, n + 1):
        matrix, other, largest = 0, 0, 0  # the run's elements of matrices and of the rest, its largest matrix
        for lo in range(hi - 1, -1, -1):
            if lo < hi - 1 and lo + 1 in breaks:
                break  # tensor lo + 1 starts a bucket
            if whole[lo]:
                matrix += sizes[lo]
                largest = max(largest, sizes[lo])
            else:
                other += sizes[lo]
            if lo < hi - 1 and max(matrix, other) > reach:
                break
            end = matrix + other - sizes[hi - 1] + numels[hi - 1]  # plan_layout's end: the last one unaligned
            over = max(matrix, other) > max(bucket_cap, span * world_size * largest) if largest else end > bucket_cap
            if lo < hi - 1 and over:
                continue
            if largest:
                padded = _multifit(sizes, range(lo, hi), world_size, align)[0] * world_size
            else:
                padded = max(_round_up(end, world_size * align), world_size * align)
            got = (best[lo][0] + padded, best[lo][1] + 1)
            if best[hi] is None or got < best[hi]:
                best[hi], start[hi] = got, lo
    runs, hi = [], n
    while hi > 0:
        runs.append((start[hi], hi))
        hi = start[hi]
    return runs[::-1]
