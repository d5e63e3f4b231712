"""WholeMatrices: which params a matrix optimizer (torch.optim.Muon, torch.optim.Adafactor) steps
whole, and per param the kind of cost its step has ("muon" or "adafactor"), by which owners are
balanced (matrix_layout.py). A leaf of core/: ShardConfig (stage.py) carries it, and flat_plan.py
lays the params out by it.

[Note: a cost per param] One optimizer may step Muon groups and Adafactor groups (and a unit may
hold params of both), so the kind is per param, not per optimizer: each param is balanced by its
own class's work (Muon's Newton-Schulz max(m, n) min(m, n)^2, Adafactor's m n). It names the
params by id(): the unit that holds the config holds the params too, so an id cannot be reused
while it is read. Ids differ between processes, so the ranks agree on agreed(), which keeps per
param its label (name and shape, in the unit's or the groups' order) and its kind and drops the
ids: a param laid out with another kind, or left out, on one rank makes every rank raise, listing
each rank's.

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
from typing import Iterable, Optional, Sequence, Tuple, Union

# the per-matrix costs matrix_layout.matrix_cost knows
COSTS = ("muon", "adafactor")


@dataclass(frozen=True)
class WholeMatrices:
    """The params (by id) that matrix optimizers step whole, each with its cost kind
    (matrix_layout.COSTS: "muon", "adafactor"). Build with WholeMatrices.of."""

    kinds: Tuple[Tuple[str, str], ...]  # per param, in order: (its label, name and shape; its cost kind)
    ids: Tuple[int, ...] = field(default=(), repr=False)  # per entry of kinds, id(param); () once agreed()

    def __post_init__(self):
        if not isinstance(self.kinds, tuple) or not isinstance(self.ids, tuple):
            raise TypeError("WholeMatrices(kinds=..., ids=...) take tuples; build it with WholeMatrices.of")
        for label, kind in self.kinds:
            if kind not in COSTS:
                raise ValueError(f"WholeMatrices: the cost of {label} must be one of {COSTS}, got {kind!r}")
        if self.ids and len(self.ids) != len(self.kinds):
            raise ValueError(f"WholeMatrices: {len(self.ids)} ids for {len(self.kinds)} params")
        object.__setattr__(self, "_kind_of", {i: k for i, (_, k) in zip(self.ids, self.kinds)})

    @classmethod
    def of(cls, cost: Union[str, Sequence[str]], params: Iterable, names: Optional[Sequence[str]] = None
           ) -> "WholeMatrices":
        """cost: one kind for every param, or one per param; names: per param, what errors and
        the ranks' agreement call it (else its position)."""
        params = list(params)
        costs = [cost] * len(params) if isinstance(cost, str) else list(cost)
        if len(costs) != len(params):
            raise ValueError(f"WholeMatrices.of: {len(costs)} costs for {len(params)} params")
        names = [f"params[{k}]" for k in range(len(params))] if names is None else list(names)
        return cls(tuple((f"{n} {list(p.shape)}", c) for n, p, c in zip(names, params, costs)),
                   tuple(id(p) for p in params))

    @property
    def count(self) -> int:
        return len(self.kinds)

    def holds(self, p) -> bool:
        return id(p) in self._kind_of

    def cost_of(self, p) -> Optional[str]:
        """p's cost kind, None where p is not one of these."""
        return self._kind_of.get(id(p))

    def agreed(self) -> "WholeMatrices":
        """What every rank must pass alike: each param's label and kind, not the process-local ids."""
        return WholeMatrices(self.kinds)
