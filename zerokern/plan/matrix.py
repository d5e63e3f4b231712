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
The Muon group's momentum is fp32 whatever --state-precision says (that sets AdamW's moments):
low-bit momentum is not planned. Without fp32 masters (ZeroOptimizer(master_weights=False), bf16
params: [Note: bf16 params without masters] in optim/no_master.py) torch's optimizers keep their
state in bf16: 2 bytes an element of Muon's momentum and Adafactor's statistics
(matrix_state_bytes 2), AdamW's two moments 4 (model.py passes both).
"""

import math
from dataclasses import asdict, dataclass
from typing import List, Sequence, Tuple

from zerokern.zero.core.matrix_layout import plan_matrix_layout

OPTIMIZERS = ("adam", "muon", "adafactor")
NS_STEPS = 5  # torch.optim.Muon's default ns_steps


@dataclass(frozen=True)
class MatrixPlan:
    optimizer: str  # "muon" or "adafactor"
    matrices: int  # tensors the matrix optimizer steps (the 2-D hidden weights)
    matrix_params: int
    elementwise_params: int  # AdamW's: embeddings, norms, biases
    state_bytes: Tuple[float, ...]  # per rank at stages 1-3: matrix state of its matrices + AdamW's of its slice
    state_bytes_unsharded: float  # every rank's at stage 0
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


def plan_matrices(optimizer, shapes, matrices, dp, bucket_cap_elements, adam_bytes_per_param,
                  matrix_state_bytes=4) -> MatrixPlan:
    """The per-rank state and work of `optimizer` ("muon", "adafactor") on `matrices` (indices
    into `shapes`, gradient order) with AdamW on the other tensors, over dp ranks.
    matrix_state_bytes: bytes of one value of the matrix optimizer's state (4: fp32, stepping
    fp32 masters; 2: bf16, without masters)."""
    if optimizer not in OPTIMIZERS[1:]:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS[1:]} here, got {optimizer!r}")
    ml = plan_matrix_layout(shapes, matrices, dp, bucket_cap_elements, cost=optimizer)
    whole = set(matrices)
    numels = [math.prod(s) for s in shapes]

    def state_of(i):  # one matrix's state, bytes
        return matrix_state_bytes * (numels[i] if optimizer == "muon" else sum(shapes[i]))

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
    return MatrixPlan(optimizer=optimizer, matrices=len(whole), matrix_params=matrix_params,
                      elementwise_params=elementwise_params, state_bytes=tuple(state),
                      state_bytes_unsharded=sum(state_of(i) for i in whole) + adam_bytes_per_param * elementwise_params,
                      work=tuple(work), work_unit="flops" if optimizer == "muon" else "elements",
                      padding_params=ml.padding_numel)
