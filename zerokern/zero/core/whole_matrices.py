"""WholeMatrices: which params a matrix optimizer (torch.optim.Muon, torch.optim.Adafactor) steps
whole, and the cost of one matrix's step that owners are balanced by (matrix_layout.py). A leaf
of core/: ShardConfig (stage.py) carries it, and flat_plan.py lays the params out by it.

It names the params by id(): the unit that holds the config holds the params too, so an id cannot
be reused while it is read. Ids differ between processes, so the ranks agree on agreed() (the
cost and how many), not on the ids; which params they are is agreed through the param groups'
shapes and sizes, which Agreement.same_model_on_every_rank compares already.

[Note: whole matrices in units] A stage-3 unit (zerokern.shard) is laid out, and sharded, before
the optimizer exists, so the optimizer cannot lay its matrices out as it does for the params it
buckets itself. shard(matrices=...) names them instead, and the unit's ShardConfig carries the
WholeMatrices of its own params (each unit its own, so the field is per unit, as bucket_cap_mb
is). The unit's FlatLayout is then plan_matrix_layout's: each matrix whole in one rank's shard,
so the reduce-scatter delivers its whole grad to its owner, the owner's slice kept between
gathers is the whole matrix, and the ordinary gather brings the update back. No byte beyond
ZeRO-3's and the plan's padding. The engine checks that every matrix the optimizer steps whole
lies in a unit that laid it out so, naming the param otherwise. The owners are balanced within
a unit (loads carried across its buckets, not across units).
"""

from dataclasses import dataclass, field
from typing import FrozenSet

# the per-matrix costs matrix_layout.matrix_cost knows
COSTS = ("muon", "adafactor")


@dataclass(frozen=True)
class WholeMatrices:
    """The params (by id) that a matrix optimizer steps whole, and its per-matrix cost
    (matrix_layout.COSTS: "muon", "adafactor")."""

    cost: str
    ids: FrozenSet[int] = field(default=frozenset(), repr=False)
    count: int = -1  # len(ids); kept by agreed(), which drops the ids

    def __post_init__(self):
        if self.cost not in COSTS:
            raise ValueError(f"WholeMatrices(cost=...) must be one of {COSTS}, got {self.cost!r}")
        if not isinstance(self.ids, frozenset):
            raise TypeError(f"WholeMatrices(ids=...) must be a frozenset of id(param), got {type(self.ids).__name__}")
        if self.count == -1:
            object.__setattr__(self, "count", len(self.ids))

    @classmethod
    def of(cls, cost: str, params) -> "WholeMatrices":
        return cls(cost, frozenset(id(p) for p in params))

    def holds(self, p) -> bool:
        return id(p) in self.ids

    def agreed(self) -> "WholeMatrices":
        """What every rank must pass alike: the cost and the count, not the process-local ids."""
        return WholeMatrices(self.cost, frozenset(), self.count)
