"""FlatRuns: ZeroOptimizer's element-wise pieces stepped as a few flat runs of its fp32 master.

[Note: element-wise pieces as runs] ZeroOptimizer hands its inner torch optimizer one piece per
param and rank, an empty one where the rank holds none of the param's elements. torch's
single-tensor loop (what it picks for CPU tensors) costs the same per piece whether it holds a
hundred elements or none, so a GPT's ~100 norms, biases and embeddings cost ~100 loop turns a
step on every rank, most of them on empty pieces (measured: a quarter of the Muon + AdamW step's
CPU time beside Newton-Schulz). The pieces of one param group that lie back to back in a store's
master are one run: a flat view of the master that torch's optimizer (the same class, with the
group's options) steps once. That gives the pieces' numbers bit for bit when
- the class is one of torch's element-wise ones (each element's update reads that element's
  grad, param and state, and the group's options; ZeroOptimizer's per-piece results already rest
  on this, a piece being any slice of a param);
- every piece of the group steps this step (had), so each piece would have taken the step, and
  its per-param scalars (Adam's step, NAdam's mu_product, ...) would have advanced alike;
- those scalars are equal across the group's pieces (they are, from construction on, as long as
  every param always has a grad).
So each piece's state is bound to its run's: its per-element tensors are views of the run's, its
scalars the run's own objects (a group's empty pieces share its first run's). The state torch's
checkpoint code and users see (self.state[p], state_dict()) keeps its per-param layout. A step where
some piece of a group is not stepped (no grad anywhere), or scalars that differ (a loaded state),
unbinds the group: its scalars become each piece's own copy and its pieces step one by one, as
without runs; a later step binds it again once its scalars agree. load_state_dict replaces every
piece's state, so every group is bound again at its next step. It replaces the inner optimizer's
param group dicts too (torch's Optimizer.load_state_dict builds new ones), so the runs find their
groups' options by position at each step, never through a dict kept from construction: one kept
stepped a resumed run with the lr it was built with, not its LR scheduler's.
"""

import torch


class _Run:
    """A flat view of one store's master over back-to-back pieces of one param group."""

    def __init__(self, grad_at, param, members):
        self.grad_at = grad_at  # (store index, start, end) in that store's grad
        self.param = param  # the view the run optimizer steps
        self.members = members  # [(piece, start, end)] relative to the run; empty pieces (0, 0)
        self.shared = {}  # the run's state as its pieces last got it (key -> object)


class _Group:
    def __init__(self, runs, ts):
        self.runs, self.ts = runs, ts  # ts: the group's trainable param indices
        self.pieces = [piece for run in runs for piece, _, _ in run.members]
        self.bound = False


class FlatRuns:
    """One torch optimizer (the class of the groups it takes) over the runs of those groups' pieces."""

    def __init__(self, optimizer_class, kwargs, groups, inner):
        """groups: per inner param group to run, (its index in inner.param_groups, [(t, piece, store
        index, master, offset, numel)]). inner: the inner optimizer (or InnerSet), whose .state keeps
        the pieces' state and whose .param_groups their options."""
        self._owner, self._at, self._groups, run_groups = inner, [], [], []
        for position, pieces in groups:
            spans, empty = [], []  # spans: [store, start, end, master, pieces]
            for _, piece, s, master, off, n in sorted(pieces, key=lambda x: (x[2], x[4])):
                if n == 0:
                    empty.append(piece)
                elif spans and spans[-1][0] == s and spans[-1][2] == off:
                    spans[-1][2] = off + n
                    spans[-1][4].append(piece)
                else:
                    spans.append([s, off, off + n, master, [piece]])
            if not spans:  # no element of the group here: an empty run still advances its scalars
                spans.append([pieces[0][2], 0, 0, pieces[0][3], []])
            runs = []
            for s, lo, hi, master, members in spans:
                at = [0] * (len(members) + 1)
                for k, piece in enumerate(members):
                    at[k + 1] = at[k] + piece.numel()
                runs.append(_Run((s, lo, hi), master[lo:hi], [(p, at[k], at[k + 1]) for k, p in enumerate(members)]))
            runs[0].members += [(piece, 0, 0) for piece in empty]
            self._groups.append(_Group(runs, [t for t, *_ in pieces]))
            self._at.append(position)
            run_groups.append({**_options(inner.param_groups[position]), "params": [run.param for run in runs]})
        self.optimizer = optimizer_class(run_groups, **kwargs)

    def unbind_all(self):
        """After the pieces' state was replaced (load_state_dict): bind again at the next step."""
        for g in self._groups:
            g.bound = False

    def set_grads(self, had, grads):
        """Give each bound run its grad for this step (grads: per store, this step's fp32 grad);
        returns the trainable indices of the groups that step piece by piece this time."""
        rest, every = [], all(had)  # every param had a grad: no group needs its own look
        for g in self._groups:
            if (every or all(had[t] for t in g.ts)) and (g.bound or self._bind(g)):
                for run in g.runs:
                    s, lo, hi = run.grad_at
                    run.param.grad = grads[s][lo:hi]
            else:
                self._unbind(g)
                rest += g.ts
        return rest

    def step(self):
        """Step the runs given grads, with the inner groups' options (LR schedulers change those)."""
        groups = self._owner.param_groups  # today's dicts: load_state_dict replaces them
        for k, run_group in zip(self._at, self.optimizer.param_groups):
            run_group.update(_options(groups[k]))
        self.optimizer.step()
        for g in self._groups:
            for run in g.runs:
                if run.param.grad is not None:
                    run.param.grad = None
                    merged = self.optimizer.state[run.param]
                    if len(merged) != len(run.shared) or any(run.shared.get(k) is not v for k, v in merged.items()):
                        self._share(run, merged)  # state the step made or replaced (SGD's first momentum)

    def _bind(self, g):
        """Bind the group's pieces' state to its runs' if their scalars agree; else False."""
        states = [self._owner.state[piece] for piece in g.pieces]
        keys = list(states[0])
        if any(list(st) != keys for st in states):
            return False
        flat = {k for k in keys if all(_is_flat(st[k], piece) for st, piece in zip(states, g.pieces))}
        if not all(_same([st[k] for st in states]) for k in keys if k not in flat):
            return False
        for run in g.runs:
            merged = {}
            for k in keys:
                if k in flat:
                    merged[k] = torch.cat([self._owner.state[piece][k] for piece, _, _ in run.members])
                else:
                    v = states[0][k]
                    merged[k] = v.clone() if isinstance(v, torch.Tensor) else v
            self.optimizer.state[run.param] = merged
            self._share(run, merged)
        g.bound = True
        return True

    def _share(self, run, merged):
        """Each piece of the run sees the run's state: views of its per-element tensors, its scalars."""
        for piece, lo, hi in run.members:
            st = self._owner.state[piece]
            for k, v in merged.items():
                st[k] = v[lo:hi] if _is_flat(v, run.param) else v
        run.shared = dict(merged)

    def _unbind(self, g):
        """Each piece its own scalars again (its per-element views are its own elements already)."""
        if not g.bound:
            return
        for piece in g.pieces:
            st = self._owner.state[piece]
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    st[k] = v.clone()
        g.bound = False


def _options(group):
    return {k: v for k, v in group.items() if k != "params"}


def _is_flat(v, param):
    """Per-element state of `param` (1-D, one value an element), as torch's element-wise optimizers keep it."""
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == param.numel()


def _same(values):
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and v.dtype == first.dtype and v.shape == first.shape
                   and v.device == first.device and torch.equal(v, first) for v in values[1:])
    return all(type(v) is type(first) and v == first for v in values[1:])
