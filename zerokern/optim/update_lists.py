"""The operand lists of the fused update, built from shard stores: one piece of
FusedZeroAdam.step(), apart so the optimizer reads as bookkeeping."""

import operator


class UniformCalls:
    """The usual step for one store (every param had a grad, one step count): the
    kernel operands per param group. A store whose params are all in one param group
    is one call over the whole shard (padding is zero and stays zero under Adam);
    otherwise the shard is split at its params in one call (torch.split), each
    param group picking its pieces."""

    def __init__(self, store, pieces, group_of):
        groups = [group_of[t] for t, _, n, _ in pieces if n]
        self.single = groups[0] if groups and len(set(groups)) == 1 else None
        self.empty = not groups
        sizes, end = [], 0
        for t, off, n, _ in pieces:
            if n:
                sizes += [off - end, n]
                end = off + n
        sizes.append(store.exp_avg.numel() - end)
        self.sizes = sizes
        self.pick = {}
        k = 0
        for t, off, n, _ in pieces:
            if n:
                self.pick.setdefault(group_of[t], []).append(2 * k + 1)
                k += 1
        self.pick = {g: operator.itemgetter(*idx, idx[0]) for g, idx in self.pick.items()}  # always a tuple

    def lists(self, operands):
        if self.empty:
            return {}
        if self.single is not None:
            return {self.single: [None if x is None else [x] for x in operands]}
        split = [None if x is None else x.split(self.sizes) for x in operands]
        return {g: [None if s is None else pick(s)[:-1] for s in split] for g, pick in self.pick.items()}


def extend_calls(calls, key, lists):
    dst = calls.setdefault(key, ([], [], [], [], []))
    for d, src in zip(dst, lists):
        if src is not None:  # no model params (fp32)
            d.extend(src)
