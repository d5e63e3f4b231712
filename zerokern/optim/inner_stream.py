"""ZeroOptimizer's inner torch optimizer over state on disk (OffloadPolicy(device="nvme")).

[Note: inner state on disk] The inner optimizer's per-element fp32 state (the keys whose tensors
have the param's shape: Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer, ...; found before
the engine is built, inner_state.element_keys) is kept as NvmeStore arrays ([Note: NVMe swap] in
zero/state/swap.py), and streamed through the store's ring of aligned buffers. A step:
- per chunk [lo, hi) of a store's shard, the inner optimizer steps once over temporary views: for
  each piece with a grad that overlaps the chunk, a param that is its part of the chunk's master
  (the ring buffer of a fp16/bf16 param's fp32 master, or the store's staging copy of a fp32
  param shard), that part of the grad (copied, divided as ZeroOptimizer._update divides it), and
  a state dict whose per-element entries are its parts of the chunk's state buffers. An
  elementwise optimizer gives each element the numbers it gives on the whole piece, so the
  result is bit for bit the in-memory one (tests/zero/state/test_nvme_offload.py). Per-element state the
  optimizer makes at a piece's first step (momentum_buffer) is copied into the buffers;
- the other entries (Adam's step, ASGD's eta and mu) are per piece, not per element: each chunk
  steps clones of them, and the piece takes the values of its first chunk (every chunk gives the
  same), at commit, so a piece in three chunks counts one step, not three. Pieces with no element
  on this rank step once on their own, as in memory;
- the store writes the buffers to its other slot; once every rank's I/O succeeded
  (gather_objects) the stores commit and the state goes live: self.inner.state[piece]'s
  per-element tensors (and a fp16/bf16 param's piece of the master, the inner optimizer's param)
  are re-pointed in place at the slot just written, as FusedZeroAdam._repoint_state does, so
  state_dict(), load_state_dict and DCP see the state through the swap file's mmap; else every
  rank raises NvmeOffloadError with nothing changed.
"""

import weakref
from collections import defaultdict

import torch

from ..zero.state.swap import NvmeOffloadError
from . import inner_state


class InnerStream:
    """The inner optimizer's per-element state in a ZeroOptimizer's NvmeStores, and the streamed step
    over it (see the Note). Owned by the ZeroOptimizer; keys: the per-element keys on disk."""

    def __init__(self, optimizer, keys):
        self._opt = weakref.ref(optimizer)  # its owner: no cycle
        self.keys = tuple(keys)

    def _view(self, store, key, off, n):
        base = store.state[key]  # the current slot
        return base[off:off + n]

    def to_disk(self, ts):
        """The per-element state of these pieces (trainable indices) moves into the current slot: the
        values are copied there and the entries become views of the file."""
        opt = self._opt()
        stores = opt.engine.stores
        for t in ts:
            s, off, n, _ = opt._where[t]
            st = opt.inner.state[opt._piece[t]]
            for key in self.keys:
                if key not in st:
                    continue
                view = self._view(stores[s], key, off, n)
                old = st[key]
                if old.data_ptr() != view.data_ptr() or old.numel() != n or old.dtype != view.dtype:
                    view.copy_(old.reshape(-1))
                    st[key] = view

    @torch.no_grad()
    def init_state(self):
        """The inner state as its first step would make it (inner_state.make_initial_state), a piece
        at a time, each moved to disk at once: never the whole state in memory."""
        opt = self._opt()
        for t, piece in opt._piece.items():
            inner_state.make_initial_state(opt.inner, [piece])
            self.to_disk([t])
        opt.engine.stores[0].swap.flush()

    @torch.no_grad()
    def step(self, had, divisor):
        """One inner step over every store, streamed; committed only if every rank's I/O succeeded."""
        opt = self._opt()
        stores = opt.engine.stores
        stores[0].swap.flush()  # what went through the mapping (a loaded state dict) reaches the file
        divisor = None if divisor is None else divisor.to("cpu")
        group_of = {t: k for k, ts in enumerate(opt._inner_ts) for t in ts}
        by_store = defaultdict(list)
        for t, (s, off, n, _) in enumerate(opt._where):
            if had[t] and n:
                by_store[s].append((t, off, n))
        new, made = {}, defaultdict(set)  # per piece: its entries that are not per element; keys it made

        def grad_of(g):
            g = g.to(torch.float32, copy=True)
            return g if divisor is None else g.div_(divisor)

        problem, streamed = None, []
        for s, store in enumerate(stores):
            if not store.master_valid:
                store.refresh_master()
                store.swap.flush()
            if not by_store[s]:  # nothing to update: no stream, no commit (its slot stays current)
                continue

            def run(lo, hi, master, grad, *state, s=s):
                chunks, model = dict(zip(self.keys, state[:-1])), state[-1]
                entries = []
                for t, off, n in by_store[s]:
                    a, z = max(off, lo) - lo, min(off + n, hi) - lo
                    if a < z:
                        entries.append((t, master[a:z], grad_of(grad[a:z]), {k: c[a:z] for k, c in chunks.items()}))
                self._step(entries, group_of, new, made)
                if model is not None:  # fp16/bf16 params: round the new masters to nearest, as in memory
                    model.copy_(master)

            problem = store.stream(run)
            if problem is not None:
                break
            streamed.append(store)
        if problem is None:  # the pieces with no element here: their per-piece entries step as in memory
            empty = [(t, torch.zeros(0), torch.zeros(0), {k: torch.zeros(0) for k in self.keys})
                     for t, (_, _, n, _) in enumerate(opt._where) if had[t] and not n]
            self._step(empty, group_of, new, made)
        failed = [p for p in opt.engine.comm.gather_objects(problem, name="nvme_step") if p]
        if failed:
            raise NvmeOffloadError("zerokern: the optimizer step could not read or write its state on disk, so it was "
                                   "not applied on any rank (the params and the optimizer state are those of the "
                                   "last step): " + "; ".join(failed))
        for store in streamed:
            store.commit()
        self._commit(new, made)

    def _step(self, entries, group_of, new, made):
        """The inner optimizer's step over (trainable index, param view, grad, per-element state views)."""
        if not entries:
            return
        opt = self._opt()
        inner = opt.inner
        groups, state = inner.param_groups, inner.state
        tmp, params = defaultdict(dict), defaultdict(list)
        for t, q, g, views in entries:
            q.grad = g
            st = state[opt._piece[t]]
            tmp[q] = {k: views[k] if k in self.keys else (v.clone() if isinstance(v, torch.Tensor) else v)
                      for k, v in st.items()}
            params[group_of[t]].append(q)
        saved = {k: groups[k]["params"] for k in params}
        try:
            for k, ps in params.items():
                groups[k]["params"] = ps
            inner.param_groups = [groups[k] for k in sorted(params)]
            inner.state = tmp
            inner.step()
        finally:
            for k, ps in saved.items():
                groups[k]["params"] = ps
            inner.param_groups, inner.state = groups, state
        for t, q, _, views in entries:
            q.grad = None
            st = tmp[q]
            for k in self.keys:
                if k in st and st[k] is not views[k]:  # made in this step (a late key), or replaced
                    views[k].copy_(st[k])
                    made[t].add(k)
            if t not in new:
                new[t] = {k: v for k, v in st.items() if k not in self.keys}

    def _commit(self, new, made):
        """The step goes live: per-piece entries, and every view re-pointed at the slot just written."""
        opt = self._opt()
        stores = opt.engine.stores
        for t, entries in new.items():
            st = opt.inner.state[opt._piece[t]]
            for k, v in entries.items():
                old = st.get(k)
                if (isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape
                        and old.dtype == v.dtype):
                    old.copy_(v)  # the same tensor: a reference kept across step() stays live
                else:
                    st[k] = v
        for t, (s, off, n, _) in enumerate(opt._where):
            store, piece = stores[s], opt._piece[t]
            # the inner optimizer's param: its piece of the master, which a store may move at commit (a
            # fp16/bf16 param's master to the slot just written); where it stays, this changes nothing
            _repoint(piece, store.master, off, n)
            st = opt.inner.state[piece]
            for key in self.keys:
                if key in st:
                    _repoint(st[key], store.state[key], off, n)
                elif key in made.get(t, ()):
                    st[key] = self._view(store, key, off, n)


def _repoint(tensor, base, off, n):
    """tensor, the same object, now over base[off:off + n] (set_ moves a tensor to other memory in place)."""
    tensor.set_(base.untyped_storage(), base.storage_offset() + off, (n,), (1,))
