"""ZeroOptimizer: any elementwise torch.optim optimizer over this rank's ZeRO shards.

    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9,
                                 zero_stage=2)

The signature is torch's ZeroRedundancyOptimizer's (params, optimizer_class, **defaults), plus
zerokern's sharding options. The engine (zero/engine.py) does everything ZeRO: reduction,
GradScaler agreement, clipping (max_grad_norm, clip_grad_norm_), gathers, stage-3 units. The
inner torch optimizer sees one fp32 tensor per param and rank, a view of this rank's slice of the
param's fp32 master in its shard store ("a piece"), with the reduced, unscaled and clipped
gradient of that slice as .grad, and updates it in place. For an elementwise optimizer (each
element's update depends on that element's grad and state only: SGD, Adam, AdamW, Adagrad,
RMSprop, ...) the pieces together give exactly the numbers of the same optimizer on whole
params. One that reads whole tensors (Adafactor's row and column statistics, LAMB's trust ratio,
LBFGS, Muon's orthogonalised matrices) would not, and is refused, with the reason for the ones
torch ships (_WHOLE_TENSOR), also when vouched for with elementwise=True; but Muon and Adafactor
run, each of their params laid out whole on one rank that steps it ([Note: whole matrices on
their owners] in optim/whole_state.py).

State: the inner optimizer's, per piece (every trainable param has a piece on every rank, an
empty one where the rank holds none of its elements), made at construction as the first step
would make it ([Note: inner state before the first step] in optim/inner_state.py), so a fresh
optimizer's state_dict() has every entry dcp.load must fill. state_dict() gives it keyed by the
outer param index, each piece-sized tensor marked with where it lies in the flattened param (as
FusedZeroAdam's: [Note: sharded state in checkpoints] in optim/state_dict.py), so dcp.save /
dcp.load re-shard it; load_state_dict takes such a dict (keyed by index, or by name as torch's
set_optimizer_state_dict gives it), or whole (unsharded) tensors, e.g. the same torch optimizer's
state dict on one process.

With offload=OffloadPolicy(device="nvme", path=...) (or zerokern.shard units with it) the inner
optimizer's per-element fp32 state lives in the swap file and each step streams it chunk by chunk,
stepping the inner optimizer over each chunk's slices of the pieces: the same numbers, and the
state in self.state[p] as views of the file ([Note: inner state on disk] in optim/inner_stream.py).
"""

import torch

from . import inner_set, inner_state, lowbit_momentum, no_master, whole_state, wire_checkpoint
from .flat_runs import FlatRuns
from .inner_set import InnerSet
from .inner_stream import InnerStream
from . import state_dict as checkpoint
from ..zero.engine import ZeroEngine
from ..zero.core.whole_matrices import WholeMatrices
from .engine_optimizer import EngineOptimizer
from .zero_setup import validated_groups

# torch.optim classes whose update is elementwise (so per-slice updates equal whole-tensor ones)
_ELEMENTWISE = {getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                                                   "RAdam", "Adadelta", "ASGD", "Rprop") if hasattr(torch.optim, n)}
# torch.optim classes known to read whole tensors, and why no slice of a param can stand in for it:
# refused even with elementwise=True (vouching cannot make them elementwise)
_WHOLE_TENSOR = {
    "Muon": "orthogonalises each 2-D update as a whole (Newton-Schulz iterations on the param's matrix), which no "
            "rank's flat slice of it can do",
    "Adafactor": "factors the second moment into a 2-D param's row and column statistics, which need the whole "
                 "param",
    "LBFGS": "takes its steps along directions built from every param's whole gradient (and re-evaluates the "
             "loss)",
}
# Of the whole-tensor classes, Muon and Adafactor run where every param is whole on the rank that
# steps it: one rank's piece is the whole param, in its shape, and its own code (Muon's momentum,
# Newton-Schulz, adjust_lr_fn; Adafactor's factored variance, relative step, clipping; weight
# decay) gives torch's numbers ([Note: whole matrices on their owners] in optim/whole_state.py).
# The value: the per-param cost its owners are balanced by (matrix_layout.matrix_cost).
_WHOLE_MATRIX = {"Muon": "muon", "Adafactor": "adafactor"}
# [Note: mixed groups] Muon is for 2-D hidden weights, AdamW for the rest; users write it as torch's
# param groups with the class per group under "optimizer", the positional class the default:
#     ZeroOptimizer([{"params": hidden, "optimizer": torch.optim.Muon, "lr": 0.02}, {"params": rest}],
#                   torch.optim.AdamW, lr=3e-4, zero_stage=2)
# One optimizer to LR schedulers, GradScaler, clip_grad_norm_ and checkpoints, one engine. **defaults
# are the default class's; a group with its own class takes its own keys and that class's defaults
# (checked by a throwaway instance, as the default class's are). Each class runs as its own torch
# optimizer over its groups (InnerSet, optim/inner_set.py). "optimizer" stays in the group, and in
# state dicts; load_state_dict refuses a group saved with another class.
# [Note: element-wise pieces as runs]: False steps every piece one by one (the same numbers, slower)
FLAT_RUNS = True
_SHARDING = ("zero_stage", "process_group", "bucket_cap_mb", "overlap_comm", "offload", "overlap_param_gather",
             "mesh", "reduce_precision", "gather_precision")


class ZeroOptimizer(EngineOptimizer):
    """ZeroOptimizer(params, optimizer_class, *, zero_stage=None, process_group=None, bucket_cap_mb=None,
    overlap_comm=None, offload=None, overlap_param_gather=None, mesh=None, reduce_precision=None,
    gather_precision=None, max_grad_norm=None, elementwise=None,
    **defaults)

    Trains params with optimizer_class(**defaults) on this rank's fp32 shards (see the module
    docstring); a param group may name its own class under "optimizer" ([Note: mixed groups]). The sharding options and the .grad rules are FusedZeroAdam's. elementwise=True
    vouches for an optimizer class not known here to update each element on its own. A Muon
    group with "state_precision": "int8" (or state_precision="int8" where Muon is the default
    class) keeps its momentum in int8 blocks ([Note: int8 momentum of whole matrices] in
    optim/lowbit_momentum.py). master_weights=False: bf16 params keep no fp32 master, the inner
    optimizer steps them (and keeps its state) in bf16 as torch does on one process ([Note: bf16
    params without masters] in optim/no_master.py)."""

    def __init__(self, params, optimizer_class, *, max_grad_norm=None, elementwise=None, **kwargs):
        if max_grad_norm is not None and not 0 < float(max_grad_norm) < float("inf"):
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        sharding = {k: kwargs.pop(k) for k in _SHARDING if k in kwargs}
        self.optimizer_class, self.max_grad_norm = optimizer_class, max_grad_norm
        self._why = {}  # class -> why it reads whole tensors (None: elementwise)
        precision = kwargs.pop(lowbit_momentum.OPTION, None)  # [Note: int8 momentum of whole matrices]
        self.master_weights = no_master.popped(kwargs)  # [Note: bf16 params without masters]
        defaults = self._checked_class(optimizer_class, elementwise, kwargs)
        groups = validated_groups(params)
        for gi, g in enumerate(groups):  # [Note: mixed groups]: a group's own class, and its defaults
            cls = g.get("optimizer", optimizer_class)
            if cls is not optimizer_class:
                groups[gi] = {**self._checked_class(cls, elementwise, _keys(g), f"param group {gi}"), **g}
        lowbit_momentum.checked_precisions(groups, [g.get("optimizer", optimizer_class) for g in groups],
                                           optimizer_class, precision)
        self._constructing = True
        super().__init__(groups, defaults)
        self._constructing = False
        self._classes = [g.get("optimizer", optimizer_class) for g in self.param_groups]  # per param group
        names = {p: n for g in self.param_groups for p, n in zip(g["params"], g.get("param_names", ()))}
        matrices = self._matrices(names, sharding)  # the params stepped whole, where the layout must keep them so
        self.matrices_stepped = 0  # matrices this rank ran the inner optimizer on, all steps together
        # the inner optimizer's per-element state: what OffloadPolicy(device="nvme") keeps on disk
        plain = [g for g, c in zip(self.param_groups, self._classes) if c is optimizer_class]
        elements = inner_state.element_keys(optimizer_class, kwargs, plain, _probe(self._why.get(optimizer_class)))
        if len(set(self._classes)) > 1 and getattr(sharding.get("offload"), "device", None) == "nvme":
            raise ValueError("ZeroOptimizer: OffloadPolicy(device='nvme') streams one inner optimizer's state, and "
                             f"the param groups name {len(set(self._classes))} classes; use "
                             "OffloadPolicy(device='cpu') or none")
        options = (optimizer_class.__name__, [c.__name__ for c in self._classes], kwargs, self._members(names),
                   [g.get(lowbit_momentum.OPTION) for g in self.param_groups], self.master_weights)
        self.engine = ZeroEngine(self, [g["params"] for g in self.param_groups], names, state_keys=(),
                                 what="ZeroOptimizer", options=repr(options),
                                 disk_state_keys=[k for k, dt in elements.items() if dt == torch.float32],
                                 matrices=matrices, master_weights=self.master_weights, **sharding)
        if not self.master_weights:
            no_master.check(self.engine, names, self.param_groups)
        trainable = self.engine.trainable
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        # [Note: whole matrices on their owners]: the trainable params a matrix class steps whole
        self._group_t = [group_of[id(p)] for p in trainable]  # per trainable param, its param group
        self._whole = {t for t in range(len(trainable)) if self._why.get(self._class_of(t))}
        # per trainable param: (store index, shard offset, numel, start in the flattened param). Every
        # trainable param has a piece on every rank, an empty one where this rank holds none of its
        # elements: the inner optimizer keeps its per-param scalars (Adam's step, ...) there too, so
        # every rank's state dict has every param, as torch's checkpoint helpers want, and the ranks
        # agree on those scalars.
        self._where = [None] * len(trainable)
        self._at = [None] * len(trainable)  # its position among its store's pieces (engine.param_of)
        for s, pieces in enumerate(self.engine.pieces):
            for k, (t, off, n, start) in enumerate(pieces):
                self._where[t], self._at[t] = (s, off, n, start), k
        stores = self.engine.stores
        # a leaf view: the inner optimizer's param; 1-D, or the param's shape where it is whole. Of the
        # fp32 master, or without one of the bf16 param shard ([Note: bf16 params without masters])
        self._piece = {t: stores[w[0]].master[w[1]:w[1] + w[2]].view(self._piece_shape(t))
                       for t, w in enumerate(self._where)}
        ts_of = [[] for _ in self.param_groups]  # per param group, its pieces' trainable indices
        for t, p in enumerate(trainable):
            ts_of[group_of[id(p)]].append(t)
        self._inner_groups = [gi for gi, ts in enumerate(ts_of) if ts]  # groups with a trainable param
        self._inner_ts = [ts_of[gi] for gi in self._inner_groups]
        self._inner_index = {t: k for k, t in enumerate(t for ts in self._inner_ts for t in ts)}
        kept = [{**_keys(self.param_groups[gi]), "params": [self._piece[t] for t in ts]}
                for gi, ts in zip(self._inner_groups, self._inner_ts)]
        if not kept:  # no trainable param
            kept = [{**_keys(self.param_groups[0]), "params": [torch.zeros(0)]}]
        inner_classes = [self._classes[gi] for gi in self._inner_groups] or [optimizer_class]
        args = {c: kwargs if c is optimizer_class else {} for c in inner_classes}  # **defaults: the default class's
        if len(set(inner_classes)) == 1:
            self.inner = inner_classes[0](kept, **args[inner_classes[0]])
        else:  # [Note: mixed groups]
            self.inner = InnerSet([(c, args[c], g) for c, g in zip(inner_classes, kept)])
        slots = inner_set.slots(self.inner)  # [Note: int8 momentum of whole matrices]: the matrices this rank owns
        self._momentum = lowbit_momentum.Int8Momentum(
            (*slots[k], self._piece[t]) for k, (gi, ts) in enumerate(zip(self._inner_groups, self._inner_ts))
            if self.param_groups[gi].get(lowbit_momentum.OPTION) == "int8" for t in ts if self._where[t][2])
        # [Note: inner state before the first step] in optim/inner_state.py
        device = stores[0].master.device if stores else torch.device("cpu")
        late = [inner_state.late_keys(c, args[c], g, device, _probe(self._why.get(c)))
                for c, g in zip(inner_classes, self.inner.param_groups)]
        self._late = {t: late[k] for k, ts in enumerate(self._inner_ts) for t in ts}
        self._disk = None  # [Note: inner state on disk] in optim/inner_stream.py
        if stores and getattr(stores[0], "streams", False):
            other = [k for k, dt in elements.items() if dt != torch.float32]
            if other:
                raise ValueError(f"zerokern: OffloadPolicy(device='nvme') keeps fp32 state on disk, and "
                                 f"{optimizer_class.__name__}'s {other} is {elements[other[0]]}; use "
                                 "OffloadPolicy(device='cpu')")
            self._disk = InnerStream(self, stores[0].state_keys)
            self._disk.init_state()  # a piece at a time, each moved to disk at once
        else:
            self._momentum.settle()  # codes, never an fp32 buffer
            inner_set.make_initial_state(self.inner, self._stepped(), inner_state.make_initial_state)
        # [Note: element-wise pieces as runs] in optim/flat_runs.py: torch's element-wise classes' groups
        runs = {} if self._disk is not None or not FLAT_RUNS else {c: [] for c in inner_classes if c in _ELEMENTWISE}
        for k, (gi, ts) in enumerate(zip(self._inner_groups, self._inner_ts)):
            if self._classes[gi] in runs:
                runs[self._classes[gi]].append((k, [
                    (t, self._piece[t], self._where[t][0], stores[self._where[t][0]].master, *self._where[t][1:3])
                    for t in ts]))
        self._runs = [FlatRuns(c, args[c], groups, self.inner) for c, groups in runs.items() if groups]
        in_runs = {t for k, gi in enumerate(self._inner_groups) if self._classes[gi] in runs for t in self._inner_ts[k]}
        # the pieces stepped one by one every step: the rest but for the empty ones of matrices owned elsewhere
        self._one_by_one = [t for t in self._piece if t not in in_runs and not (t in self._whole and
                                                                                self._where[t][2] == 0)]
        self._sync_state()

    def _checked_class(self, cls, elementwise, options, where=None):
        """cls's defaults with these options (its own checks of them, by a throwaway instance on a
        piece as the inner optimizer will see it), after refusing a class that cannot run on
        shards, naming why. Records in self._why whether it steps whole matrices."""
        at = f" ({where})" if where else ""
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"ZeroOptimizer: optimizer_class{at} must be a torch.optim.Optimizer class, got {cls!r}")
        why = _WHOLE_TENSOR.get(cls.__name__) if cls.__module__.startswith("torch.") else None
        whole = why is not None and cls.__name__ in _WHOLE_MATRIX  # [Note: whole matrices on their owners]
        if why is not None and not whole:
            raise ValueError(
                f"ZeroOptimizer: {cls.__name__}{at} {why}, so it cannot run on each rank's shards, whatever "
                "elementwise= says. Train it without ZeroOptimizer (plain DDP), or use an elementwise optimizer "
                "(SGD, Adam, AdamW, Adagrad, RMSprop, ...)")
        if not (elementwise or cls in _ELEMENTWISE or whole):
            raise ValueError(
                f"ZeroOptimizer: {cls.__name__}{at} is not known to update each element on its own "
                "(Adafactor and LAMB-style optimizers read whole tensors: row/column statistics, trust ratios), so "
                "running it on each rank's slice of a param would give other numbers than on the whole param. "
                "Use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...), or pass elementwise=True "
                "if this one is")
        self._why[cls] = why if whole else None
        try:  # a 2-D piece for Muon, which takes no other; else flat, 1-D, fp32
            return cls([torch.zeros((1, 1) if whole else (1,), requires_grad=True)], **options).defaults
        except (ValueError, RuntimeError, TypeError) as e:
            if cls in _ELEMENTWISE or whole:
                raise  # its own check of the options (lr=-1, ...): torch's message says it
            raise ValueError(
                f"ZeroOptimizer: {cls.__name__}{at} (elementwise=True) refused a flat 1-D fp32 tensor of 1 "
                f"element ({type(e).__name__}: {e}). ZeroOptimizer hands the inner optimizer each rank's slice of "
                "every param, flattened to 1-D, so an optimizer that needs a param's shape (2-D matrices, as "
                "Muon's orthogonalised updates) cannot run on them: it is not elementwise. Train it without "
                "ZeroOptimizer, or check the options passed to it") from e

    def _matrices(self, names, sharding):
        """The WholeMatrices the layout must keep whole (None: none), after
        checking every matrix class's param group ([Note: whole matrices on their owners])."""
        index = {p: k for k, p in enumerate(p for g in self.param_groups for p in g["params"])}
        found, costs = [], []  # each param with its class's cost ([Note: a cost per param])
        for gi, (g, cls) in enumerate(zip(self.param_groups, self._classes)):
            why = self._why.get(cls)
            if why is None:
                continue
            if not g["params"]:
                what = "the 2-D hidden weights" if cls.__name__ == "Muon" else "its params"
                raise ValueError(f"ZeroOptimizer: param group {gi} ({cls.__name__}) has no params; give it {what}, "
                                 "or leave the group out")
            mine = [(index[p], p) for p in g["params"] if p.requires_grad]
            whole_state.check_whole_matrices(cls.__name__, why, mine, names, sharding, cls.__name__ == "Muon")
            found += [p for _, p in mine]
            costs += [_WHOLE_MATRIX[cls.__name__]] * len(mine)
        return WholeMatrices.of(costs, found, [names.get(p, f"params[{index[p]}]") for p in found]) if found else None

    def _members(self, names):
        """Per whole-tensor param group, its params by name (or index) and shape: in the options the
        ranks compare, so a group that differs across ranks is named in the error on every rank."""
        index = {p: k for k, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {f"param group {gi} ({cls.__name__})": [f"{names.get(p, f'params[{index[p]}]')} {list(p.shape)}"
                                                        for p in g["params"]]
                for gi, (g, cls) in enumerate(zip(self.param_groups, self._classes)) if self._why.get(cls)}

    def _stepped(self):
        """The pieces the inner optimizer may step: all but the empty ones of params stepped whole
        elsewhere, which keep no state ([Note: whole matrices on their owners])."""
        return [piece for t, piece in self._piece.items() if not (t in self._whole and self._where[t][2] == 0)]

    def _update(self, had, divisor):
        for gi, inner in zip(self._inner_groups, self.inner.param_groups):  # lr schedulers change the outer ones
            inner.update(_keys(self.param_groups[gi]))
        if self._disk is not None:
            self._disk.step(had, divisor)
            return
        stores = self.engine.stores
        grads, models = [], []
        for store in stores:
            if not store.master_valid:
                store.refresh_master()
            _, grad, model = store.operands()  # once: an offloaded store copies the grad to the CPU here
            models.append(model)
            # [Note: the grad of a piece] a copy: the reduced grad can be what .grad shows (stage 0) and
            # must not change under it. In the master's dtype: fp32, or bf16 without masters, unscaled
            # and clipped in fp32 and then rounded once ([Note: bf16 params without masters])
            g = grad.to(torch.float32 if divisor is not None else store.master.dtype, copy=True)
            if divisor is not None:
                g = g.div_(divisor.to(g.device)).to(store.master.dtype)
            grads.append(g)
        one_by_one = self._one_by_one + [t for runs in self._runs for t in runs.set_grads(had, grads)]
        for t in one_by_one:
            s, off, n, _ = self._where[t]
            piece = self._piece[t]
            piece.grad = grads[s][off:off + n].view(piece.shape) if had[t] else None
            self.matrices_stepped += t in self._whole and had[t]
        for runs in self._runs:
            runs.step()
        self._momentum.step(self.inner)  # self.inner.step(), int8 momenta decoded a matrix at a time
        for t in one_by_one:
            self._piece[t].grad = None
        for store, model in zip(stores, models):
            if model is not None:  # fp16/bf16 params (or an offloaded copy): round the new masters to nearest
                model.copy_(store.master)

    # --- state dicts ----------------------------------------------------------

    def _sync_state(self):
        """self.state[p] is the inner optimizer's state of p's piece (the same dict), for every
        trainable p ({} where the inner optimizer keeps none)."""
        self.state.clear()
        for t, p in enumerate(self.engine.trainable):
            self.state[p] = self.inner.state[self._piece[t]]

    def state_dict(self):
        """This rank's pieces' state, keyed by param index as torch.optim's, an entry for every
        trainable param (made before the first step: [Note: inner state before the first step]);
        piece-sized tensors are marked as slices of the flattened param where the state is
        sharded (DCP re-shards them). With reduce_precision="int8"/"int4" on several ranks it
        adds "error_feedback", a collective ([Note: error feedback in checkpoints])."""
        self.engine.finish_param_gather()
        sd = torch.optim.Optimizer.state_dict(self)
        index = {p: k for k, p in enumerate(p for g in self.param_groups for p in g["params"])}
        for t, p in enumerate(self.engine.trainable):
            piece = self._piece[t]
            st = inner_state.with_placeholders(self.inner.state[piece], self._late[t], piece, self._class_of(t),
                                               self._member(t)[1] or f"params[{index[p]}]")
            st = lowbit_momentum.in_torch_layout(st)  # int8 momentum: torch's fp32 momentum_buffer
            # scalars copied: a run's pieces share theirs ([Note: element-wise pieces as runs]), and dcp.load
            # writes each entry in place
            sd["state"][index[p]] = {k: v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
                                     for k, v in st.items()}
            st = sd["state"][index[p]]
            if not self.strategy.shards_state or t in self._whole:
                continue
            _, _, n, start = self._where[t]
            numel = self._numel(t)
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n:
                    checkpoint.mark_slice(v, start, n, numel)
        if self._whole and self.strategy.shards_state:  # [Note: whole state in checkpoints]: a collective
            whole_state.gather_from_owners(self.engine.comm, [(sd["state"][index[p]], self._where[t][2] > 0,
                                                               self._state_layout(t))
                                                              for t, p in enumerate(self.engine.trainable)
                                                              if t in self._whole],
                                           self.engine.stores[0].master.device)
        checkpoint.add_error_feedback(self, sd["state"])  # quantized reductions: a collective
        return sd

    def _member(self, t):
        """(param, name, full shape) of trainable param t (at stage 3 p.shape is empty between gathers)."""
        return self.engine.param_of(self.engine.stores[self._where[t][0]], self._at[t])

    def _state_layout(self, t):
        """whole_state.state_layout of trainable param t (stepped whole): torch's state of it."""
        gi = self._group_t[t]
        return whole_state.state_layout(self._classes[gi], _keys(self.param_groups[gi]), tuple(self._shape(t)),
                                        self._piece[t].dtype)  # bf16 without masters, as torch keeps it

    def _class_of(self, t):
        """The optimizer class that steps trainable param t ([Note: mixed groups])."""
        return self._classes[self._group_t[t]]

    def _shape(self, t):
        return self._member(t)[2]

    def _piece_shape(self, t):
        """The inner optimizer's view of trainable param t's piece: the param's shape where a
        whole-matrix optimizer runs, an empty (0, n) one on the ranks that do not own it ([Note:
        whole matrices on their owners]), else 1-D."""
        _, _, n, start = self._where[t]
        if t not in self._whole:
            return (n,)
        if n == 0:  # (0, columns) for a matrix (Muon takes 2-D params only), (0,) for a 1-D param
            return (0, *self._shape(t)[1:])
        if start != 0 or n != self._numel(t):  # the matrix layout keeps every matrix whole
            raise RuntimeError(f"ZeroOptimizer: {self._member(t)[1] or f'param {t}'} is split across ranks "
                               f"([{start}, {start + n}) of {self._numel(t)} here), which "
                               f"{self._class_of(t).__name__} cannot run on")
        return tuple(self._shape(t))

    def _numel(self, t):
        return self._shape(t).numel()

    def load_state_dict(self, state_dict):
        """A dict from state_dict() (this rank's, or re-sharded by DCP; keyed by param index, or by
        name as torch's set_optimizer_state_dict hands it), or one with whole tensors (the same
        torch optimizer on one process): each piece takes its slice. As torch.optim, a param with
        no state in the dict starts afresh."""
        self.engine.finish_param_gather()
        checkpoint.check_groups(self, state_dict["param_groups"])
        saved = checkpoint.by_position(state_dict, state_dict["state"])
        params = [p for g in self.param_groups for p in g["params"]]
        index = {p: k for k, p in enumerate(params)}
        inner_state_dict = {}
        for t, p in enumerate(self.engine.trainable):
            st = saved.get(index[p])
            if st is None:
                continue
            _, _, n, start = self._where[t]
            if t in self._whole and n == 0:  # its owner takes it ([Note: whole state in checkpoints])
                continue
            numel, out = self._numel(t), {}
            layout = self._state_layout(t) if t in self._whole else {}
            for key, v in inner_state.without_placeholders(st, self._late[t]).items():
                if key in wire_checkpoint.KEYS:  # FusedZeroAdam's error feedback: not the inner optimizer's
                    continue
                if key in layout and isinstance(v, torch.Tensor):  # torch's layout: the whole param's state
                    if tuple(v.shape) != layout[key][0]:
                        raise ValueError(f"ZeroOptimizer: state[{index[p]}]['{key}'] has shape {list(v.shape)}, "
                                         f"param {index[p]} has {list(self._shape(t))} (and "
                                         f"{self._class_of(t).__name__} keeps its {key} as {list(layout[key][0])})")
                    out[key] = v.clone()
                    continue
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    where = checkpoint.slice_of(v)
                    if where is not None and where != (start, n, numel):
                        raise ValueError(f"ZeroOptimizer: state[{index[p]}]['{key}'] is the slice {where[:2]} of "
                                         f"{where[2]} elements, but this rank holds [{start}, {start + n}) of "
                                         f"{numel}; load a dict saved at this world size, or re-shard with DCP")
                    if where is None and v.numel() == numel and v.numel() != n:
                        if tuple(v.shape) != tuple(self._shape(t)):
                            raise ValueError(f"ZeroOptimizer: state[{index[p]}]['{key}'] has shape "
                                             f"{list(v.shape)}, param {index[p]} has {list(self._shape(t))}")
                        v = v.reshape(-1)[start:start + n]
                    elif v.numel() != n:
                        raise ValueError(f"ZeroOptimizer: state[{index[p]}]['{key}'] has {v.numel()} elements; "
                                         f"param {index[p]} has {numel} and this rank's slice {n}")
                    elif t in self._whole and v.dim() > 1 and tuple(v.shape) != tuple(self._shape(t)):
                        raise ValueError(f"ZeroOptimizer: state[{index[p]}]['{key}'] has shape {list(v.shape)}, "
                                         f"param {index[p]} has {list(self._shape(t))}")
                    v = v.reshape(self._piece[t].shape)
                # a copy: the inner optimizer updates its state in place, and must not write into the
                # caller's dict (or share a step counter with the optimizer it came from)
                out[key] = v.clone() if isinstance(v, torch.Tensor) else v
            inner_state_dict[self._inner_index[t]] = out
        groups = [{**_keys(state_dict["param_groups"][gi]), "params": [self._inner_index[t] for t in ts]}
                  for gi, ts in zip(self._inner_groups, self._inner_ts)]
        if not groups:
            groups = [{**self.inner.param_groups[0], "params": [0]}]
        shapes = {p: self._shape(t) for t, p in enumerate(self.engine.trainable)}
        carried, counts = checkpoint.saved_error_feedback(self, saved, shapes, mine_too=False)  # checks first
        for gi, group in enumerate(state_dict["param_groups"]):
            theirs = group.get("optimizer", self._classes[gi])  # [Note: mixed groups]
            if theirs is not self._classes[gi] and theirs != _qualname(self._classes[gi]):
                raise ValueError(f"ZeroOptimizer: param group {gi} of the state dict was stepped by {theirs!r}, this "
                                 f"optimizer steps it with {_qualname(self._classes[gi])}")
        for gi, group in enumerate(state_dict["param_groups"]):
            self.param_groups[gi].update(_keys(group))
        self.inner.load_state_dict({"state": inner_state_dict, "param_groups": groups})
        wire_checkpoint.restore(self, carried, counts)
        self._momentum.settle()  # loaded int8 momenta encoded
        # the params the dict had none of
        inner_set.make_initial_state(self.inner, self._stepped(), inner_state.make_initial_state)
        for runs in self._runs:  # the pieces' state is new: bound to the runs again at the next step
            runs.unbind_all()
        if self._disk is not None:
            self._disk.to_disk(range(len(self._where)))  # the loaded values into the current slot
        self._sync_state()

    def memory_report(self):
        rep = self.engine.memory_report()
        on_disk = self._disk.keys if self._disk is not None else ()  # counted in rep["on_disk"]
        inner = sum(v.numel() * v.element_size() for st in self.inner.state.values() for k, v in st.items()
                    if isinstance(v, torch.Tensor) and k not in on_disk)
        rep["adam_state"] += inner  # the inner optimizer's state
        rep["total"] += inner
        return rep


def _keys(group):
    """A param group's options, as its inner optimizer takes them ([Note: mixed groups]: not its class,
    nor how zerokern keeps its state)."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names", "optimizer", lowbit_momentum.OPTION)}


def _probe(why):
    """inner_state's throwaway instances' param: 2-D for a matrix class (Muon takes no other)."""
    return (2, 2) if why else (2,)


def _qualname(cls):
    return f"{cls.__module__}.{cls.__qualname__}"
