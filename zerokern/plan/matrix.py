"""Matrix optimizers in the plan: torch.optim.Muon or torch.optim.Adafactor on a transformer's 2-D
hidden weights, AdamW on the rest, each matrix whole on one rank (ZeroOptimizer's layout,
zerokern/zero/core/matrix_layout.py). Pure: shapes and numbers, no torch.

[Note: matrix optimizers in the plan] The planner lays the model's tensors out as ZeroOptimizer
does (plan_matrix_layout over dp ranks, gradient order, the bucket cap in elements of the training
dtype) and reads each rank's share off the layout:
- state: the matrix optimizer's state of the matrices the rank owns (Muon: a momentum buffer of
  the matrix's size, fp32 since it steps the fp32 master, 4 bytes an element; Adafactor: a row and
  a column statistic, (m + n) fp32), plus AdamW's moments (at the chosen state precision) of the
  rank's slice of every element-wise tensor. Stage 0 holds all of it on every rank.
- work: Muon's Newton-Schulz, ns_steps iterations on X (m x n, m <= n after the transpose torch's
  code makes): X X^T (2 m^2 n flops), the quintic's A A (2 m^3) and B X (2 m^2 n), so
  ns_steps (4 m^2 n + 2 m^3) a matrix; Adafactor's is a few passes over m n elements, reported as
  elements. The balance is max / mean of the ranks' work.
- padding: equal shards of buckets whose slots hold whole matrices ([Note: whole matrices in
  equal shards]); reported, and in the sharded columns' bytes it is not counted.
The matrix optimizer's state precision (state_precision here, plan()'s matrix_state_precision,
--matrix-state-precision; --state-precision sets AdamW's moments only):
- "fp32": 4 bytes a value, as above;
- "bf16": without fp32 masters (ZeroOptimizer(master_weights=False), bf16 params: [Note: bf16
  params without masters] in optim/no_master.py) torch's optimizers keep their state in bf16, 2
  bytes a value of Muon's momentum and Adafactor's statistics, and AdamW's two moments 4 (model.py
  passes both);
- "int8": a Muon group's "state_precision": "int8" ([Note: int8 momentum of whole matrices] in
  optim/lowbit_momentum.py): per matrix of m rows and n columns, m n uint8 codes, a bf16 scale a
  row block of INT8_BLOCK elements (m ceil(n / INT8_BLOCK) of them) and an fp32 scale a column
  (n): int8_momentum_bytes, exact, the sizes of the tensors the runtime keeps between steps (a
  step decodes one matrix's fp32 momentum at a time; that transient is headroom, not planned).
  Where the runtime refuses it, so does the plan: Adafactor's state (no int8 form) and bf16 params
  without masters (the codec decodes to an fp32 momentum).
The order of the tensors in the layout (layout here, plan()'s matrix_layout, --matrix-layout):
- "groups": ZeroOptimizer bucketing the params itself (no shard(); stages 1 and 2), given the
  documented two groups [{"params": hidden_matrices, "optimizer": Muon}, {"params": rest}], each
  in registration order. The engine makes one unit of its loose params in the groups' order
  (engine.py: make_unit over self.trainable), and ShardUnit reverses it into backward order, so
  the layout holds the rest in gradient order, then the matrices in gradient order
  (groups_order). Other groupings (the rest split into decay / no-decay groups, a group out of
  registration order) lay out in their own order, which the planner does not model.
- "unit": the model zerokern.shard()ed as one unit (stage 3 needs shard()): registration order
  reversed, the gradient order model_shapes gives.
Both hold the same state in all; which rank holds what differs.
Not counted in any of them: the 0-dim fp32 `step` torch's AdamW keeps a piece (4 bytes a tensor
a rank), nor Muon's and the codec's temporaries during a step.
"""

import math
from dataclasses import asdict, dataclass
from typing import List, Sequence, Tuple

from zerokern.zero.core.matrix_layout import plan_matrix_layout

OPTIMIZERS = ("adam", "muon", "adafactor")
LAYOUTS = ("groups", "unit")  # [Note: matrix optimizers in the plan]: ZeroOptimizer's own order, or a shard() unit's
NS_STEPS = 5  # torch.optim.Muon's default ns_steps
# the matrix optimizer's state: bytes a value ("int8": int8_momentum_bytes, Muon's momentum only)
STATE_PRECISIONS = {"fp32": 4, "bf16": 2, "int8": None}
# lowbit_momentum.BLOCK: elements of a row one bf16 scale covers. The planner imports no torch, and
# that module does; tests/plan/test_plan_matrix.py holds the two equal and int8_momentum_bytes to
# the bytes of the tensors encode_rows makes
INT8_BLOCK = 64


@dataclass(frozen=True)
class MatrixPlan:
    optimizer: str  # "muon" or "adafactor"
    state_precision: str  # of the matrix optimizer's state: "fp32", "bf16" (no masters), "int8" (Muon's momentum)
    matrices: int  # tensors the matrix optimizer steps (the 2-D hidden weights)
    matrix_params: int
    elementwise_params: int  # AdamW's: embeddings, norms, biases
    state_bytes: Tuple[float, ...]  # per rank at stages 1-3: matrix state of its matrices + AdamW's of its slice
    state_bytes_unsharded: float  # every rank's at stage 0
    matrix_state_bytes: float  # the matrix optimizer's state of all the matrices (in both state_bytes columns)
    work: Tuple[float, ...]  # per rank per step: Newton-Schulz flops (muon) or elements (adafactor)
    work_unit: str
    padding_params: int  # elements of padding the matrix-whole layout adds over the whole model

    @property
    def balance(self) -> float:
        total = sum(self.work)
        return max(self.work) * len(self.work) / total if total else 1.0

    def to_dict(self):
        return dict(asdict(self), balance=self.balance)


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Muon's Newton-Schulz on one matrix, one step ([Note: matrix optimizers in the plan])."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def int8_momentum_bytes(shape: Sequence[int]) -> int:
    """Bytes of one matrix's int8 momentum between steps ([Note: int8 momentum of whole matrices]
    in optim/lowbit_momentum.py): codes (uint8, the matrix's shape), rho (bf16, rows x
    ceil(cols / INT8_BLOCK)) and the column scales (fp32, cols)."""
    rows, cols = shape
    return rows * cols + 2 * rows * -(-cols // INT8_BLOCK) + 4 * cols


def model_shapes(arch, layers, hidden, vocab, ffn_hidden=None, heads=None, kv_heads=None):
    """(shapes, matrices): the planner's GPT or Llama (model.py's formulas, tp = pp = 1) tensor by
    tensor in gradient order (the reverse of registration), and the indices of the layers' 2-D
    weights: the matrix optimizer's group. Embeddings and the head stay with AdamW, as Muon's
    authors and torch's docs advise."""
    h = hidden
    reg: List[Tuple[Tuple[int, ...], bool]] = []
    if arch == "gpt":
        f = ffn_hidden or 4 * h
        reg.append(((vocab, h), False))  # tied embedding and head
        for _ in range(layers):
            reg += [((h,), False), ((h,), False), ((3 * h, h), True), ((3 * h,), False), ((h, h), True),
                    ((h,), False), ((h,), False), ((h,), False), ((f, h), True), ((f,), False), ((h, f), True),
                    ((h,), False)]
        reg += [((h,), False), ((h,), False)]
    else:
        f, kv = ffn_hidden, (kv_heads or heads) * (h // heads)
        reg.append(((vocab, h), False))
        for _ in range(layers):
            reg += [((h,), False), ((h, h), True), ((kv, h), True), ((kv, h), True), ((h, h), True), ((h,), False),
                    ((f, h), True), ((f, h), True), ((h, f), True)]
        reg += [((h,), False), ((vocab, h), False)]
    reg.reverse()
    return [s for s, _ in reg], [i for i, (_, m) in enumerate(reg) if m]


def groups_order(n, matrices):
    """The order (indices into a gradient-order list of n tensors) in which ZeroOptimizer lays out
    the two documented groups, matrices first, each in registration order: backward order
    reverses [matrices, rest] into [rest, matrices], each in gradient order ([Note: matrix
    optimizers in the plan])."""
    whole = set(matrices)
    return [i for i in range(n) if i not in whole] + [i for i in range(n) if i in whole]


def plan_matrices(optimizer, shapes, matrices, dp, bucket_cap_elements, adam_bytes_per_param,
                  state_precision="fp32", layout="unit") -> MatrixPlan:
    """The per-rank state and work of `optimizer` ("muon", "adafactor") on `matrices` (indices
    into `shapes`, gradient order) with AdamW on the other tensors, over dp ranks.
    state_precision: the matrix optimizer's state ("fp32": stepping fp32 masters; "bf16": without
    masters; "int8": Muon's momentum in the int8 codec). layout: "unit" (shapes' order, a shard()
    unit's) or "groups" (ZeroOptimizer's own, groups_order), [Note: matrix optimizers in the plan]."""
    if optimizer not in OPTIMIZERS[1:]:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS[1:]} here, got {optimizer!r}")
    if state_precision not in STATE_PRECISIONS:
        raise ValueError(f"state_precision must be one of {', '.join(STATE_PRECISIONS)}, got {state_precision!r}")
    if state_precision == "int8" and optimizer != "muon":
        raise ValueError(f"state_precision='int8' is Muon's momentum in int8; {optimizer}'s state has no int8 form")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "groups":  # the same tensors in the order ZeroOptimizer buckets them
        order = groups_order(len(shapes), matrices)
        at = {i: k for k, i in enumerate(order)}
        shapes, matrices = [shapes[i] for i in order], sorted(at[i] for i in matrices)
    ml = plan_matrix_layout(shapes, matrices, dp, bucket_cap_elements, cost=optimizer)
    whole = set(matrices)
    numels = [math.prod(s) for s in shapes]

    def state_of(i):  # one matrix's state, bytes
        if state_precision == "int8":
            return int8_momentum_bytes(shapes[i])
        return STATE_PRECISIONS[state_precision] * (numels[i] if optimizer == "muon" else sum(shapes[i]))

    def work_of(i):
        return ns_flops(shapes[i]) if optimizer == "muon" else numels[i]

    state, work = [], []
    for rank in range(dp):
        owned = ml.owned(rank)
        pieces = (ml.layout.rank_piece(rank, i) for i in range(len(shapes)) if i not in whole)
        elementwise = sum(p.numel for p in pieces if p is not None)
        state.append(sum(state_of(i) for i in owned) + adam_bytes_per_param * elementwise)
        work.append(float(sum(work_of(i) for i in owned)))
    matrix_params = sum(numels[i] for i in whole)
    elementwise_params = sum(numels) - matrix_params
    matrix_state = sum(state_of(i) for i in whole)
    return MatrixPlan(optimizer=optimizer, state_precision=state_precision, matrices=len(whole),
                      matrix_params=matrix_params, elementwise_params=elementwise_params, state_bytes=tuple(state),
                      state_bytes_unsharded=matrix_state + adam_bytes_per_param * elementwise_params,
                      matrix_state_bytes=matrix_state,
                      work=tuple(work), work_unit="flops" if optimizer == "muon" else "elements",
                      padding_params=ml.padding_numel)
