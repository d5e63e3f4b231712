"""InnerSet: ZeroOptimizer's inner torch optimizers when its param groups name several classes
(a Muon group beside AdamW ones: docs/matrix_optimizers.md, "Mixed groups"), answering as the
one inner optimizer does: param_groups in the outer groups' order, state by piece, step(),
load_state_dict() of a dict numbered over all of them. Each class keeps its own torch optimizer,
so each runs its own code on its own groups; nothing here knows what they compute.
"""



class _States:
    """piece -> its optimizer's state (torch's defaultdict: a piece without state gets {})."""

    def __init__(self, owner_of):
        self._owner_of = owner_of  # id(piece) -> the torch optimizer whose groups hold it

    def __getitem__(self, piece):
        return self._owner_of[id(piece)].state[piece]

    def get(self, piece, default=None):
        return self._owner_of[id(piece)].state.get(piece, default)

    def values(self):
        return [st for o in dict.fromkeys(self._owner_of.values()) for st in o.state.values()]

    def __len__(self):
        return sum(len(o.state) for o in dict.fromkeys(self._owner_of.values()))


class InnerSet:
    def __init__(self, parts):
        """parts: per group, in the outer groups' order, (class, kwargs, group dict): one torch
        optimizer per class, over its groups (in that order), built with that class's kwargs."""
        self.optimizers, self._slots = [], []  # _slots: per group, (optimizer, its group index there)
        made = {}
        for cls, kwargs, group in parts:
            if cls not in made:
                made[cls] = (cls, kwargs, [])
            made[cls][2].append(group)
        built = {cls: cls(groups, **kwargs) for cls, (_, kwargs, groups) in made.items()}
        self.optimizers = list(built.values())
        count = {cls: 0 for cls in built}
        for cls, _, _ in parts:
            self._slots.append((built[cls], count[cls]))
            count[cls] += 1
        self.state = _States({id(p): o for o in self.optimizers for g in o.param_groups for p in g["params"]})

    @property
    def param_groups(self):
        return [o.param_groups[k] for o, k in self._slots]

    def step(self):
        for o in self.optimizers:
            o.step()

    def load_state_dict(self, state_dict):
        """state_dict: {"state": {index: ...}, "param_groups": [...]}, indexed over every group's
        params in order, as one optimizer's would be: each optimizer takes its groups' share,
        renumbered."""
        per = {id(o): {"state": {}, "param_groups": [None] * len(o.param_groups)} for o in self.optimizers}
        at = {id(o): 0 for o in self.optimizers}
        for (o, k), group in zip(self._slots, state_dict["param_groups"]):
            mine = per[id(o)]
            renumbered = []
            for index in group["params"]:
                if index in state_dict["state"]:
                    mine["state"][at[id(o)]] = state_dict["state"][index]
                renumbered.append(at[id(o)])
                at[id(o)] += 1
            mine["param_groups"][k] = {**group, "params": renumbered}
        for o in self.optimizers:
            o.load_state_dict(per[id(o)])


def make_initial_state(inner, pieces, make):
    """make (inner_state.make_initial_state) for each torch optimizer in `inner` (one, or an InnerSet)."""
    for o in getattr(inner, "optimizers", (inner,)):
        make(o, pieces)


def slots(inner):
    """Per param group of `inner` (one torch optimizer, or an InnerSet), (the torch optimizer that
    holds it, the group's index there)."""
    if isinstance(inner, InnerSet):
        return list(inner._slots)
    return [(inner, k) for k in range(len(inner.param_groups))]
