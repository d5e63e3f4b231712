"""ShardUnit: the parameters of one module (or one param list), flattened into
buckets per dtype, with the gradient hooks that feed those buckets.

A unit owns, for each dtype among its trainable params, one FlatParams: the
bucket plan (FlatLayout), the param buffers whose views the params' .data
become, and its grad path (grads/path.py), which holds one GradBucket per bucket
and what each param's .grad is. It owns its hooks, which hand each grad to the
grad path ([Note: a short grad walk] in grads/members.py), and removes them. It
does not decide when a bucket is reduced: that is the ReduceSchedule's job
(one per optimizer, over all of its units), which the unit reports grads to.

[Note: ownership] A unit owns where its params' data and grads live: .data
and .grad are views of its buckets. Anything that moves them (model.to() that
copies, to_empty(), assigning .data, .grad assigned by hand or set to None)
is found before the next step (a pointer compare per param, in the loop that
step() already makes) and adopted: the values are copied into the bucket and
the view restored, so training goes on with what the model holds. A move to
another device or dtype cannot be adopted and raises, naming the param.

[Note: bucket order] Backward produces grads in about the reverse of the
order modules register their params. A unit lays out its params in that
reverse order, and starts a new bucket wherever another unit's params lie
between two of its own (`breaks`): a root unit holding both the embedding
(whose grad comes last) and the final norm (whose grad comes first) then has
them in different buckets, and the final norm's bucket can be reduced early.
"""

import weakref
from typing import List, Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .params import empty as empty_param
from .grads.bucket import GradBucket
from .core.flat_plan import plan_flat
from .core.member import Member
from .grads.placeholder import ShardedGrad
from .core.stage import ShardConfig, Strategy
from .params.storage import FlatBuffers


class FlatParams:
    """One dtype's trainable params of a unit (in backward order): a Member each, their buffers, and
    their grad path (its grad buckets and the members' .grad)."""

    def __init__(self, params, names, breaks, comm, config: ShardConfig, strategy: Strategy, unit_name: str, grads,
                 params_policy):
        """grads: the grad path's mode (grads/path.py: grad_path), which makes this group's grad
        path; params_policy: where the params live between steps (params/policy.py: param_policy)."""
        self.params_policy = params_policy
        self.members = [Member(p, i, n) for i, (p, n) in enumerate(zip(params, names))]
        self.params = tuple(params)  # members' params, for code that wants the tensors (fixed for good)
        self.unit_name = unit_name
        self.dtype, self.device = params[0].dtype, params[0].device
        self.rank = comm.rank if strategy.shards_state else 0
        cap = max(1, int(config.bucket_cap_mb * 2**20 // params[0].element_size()))
        self.layout = plan_flat(params, names, strategy.layout_world, cap, config.align, breaks, config.matrices)
        self.param_bufs = FlatBuffers.from_tensors(params, self.layout)
        self.param_bufs.bind_params(params)
        for m in self.members:  # where each param's data must stay now ([Note: ownership]), its version there
            m.ptr, m.version = m.param.data_ptr(), m.param._version
        # this rank's slice of each param bucket: views of the full buffers, until shard_params() gives
        # them storage of their own ([Note: stage-3 params]: the full buffers then hold values only
        # while the unit is gathered)
        self.param_shards: List[torch.Tensor] = [self.param_bufs.shard(self.rank, b)
                                                 for b in range(len(self.layout.buckets))]
        # the group's grad path: its GradBuckets and each member's .grad (grads/members.py)
        self.grads = grads.group(self, comm, strategy, config.reduce_precision)
        self.buckets = self.grads.buckets
        # stage 3 with OffloadPolicy(params=True): bucket -> the NvmeStore whose file holds the slice
        # ([Note: stage-3 params on disk] in state/nvme_store.py); None: the slices are in memory
        self.shard_io = None
        self.changed = set()  # params adopted with new values since the stores last looked
        for i, m in enumerate(self.members):
            if m.param.grad is None:
                continue  # as in torch, None until a backward reaches it (no full grad buffer until then)
            self.grads.took(i, False)  # a grad from before sharding counts, as torch.optim would use it

    @property
    def names(self) -> List[str]:
        return [m.name for m in self.members]

    def param_shard(self, b: int) -> torch.Tensor:
        """This rank's slice of param bucket b: a view of the full buffer, or at stage 3 (once
        shard_params() ran) a tensor of its own that outlives the full buffer's storage."""
        return self.param_shards[b]

    def my_slice(self, i: int):
        """(start, n, bucket, shard offset): this rank holds elements [start, start + n) of
        params[i] flattened, at [shard offset, shard offset + n) of its shard of the bucket."""
        pc = self.layout.rank_piece(self.rank, i)
        if pc is None:
            return 0, 0, self.layout.slots[i].bucket, 0
        return pc.tensor_start, pc.numel, pc.bucket, pc.shard_offset

    # --- stage 3 ([Note: stage-3 params] in params/per_unit.py) --------------------------------

    def shard_params(self) -> None:
        """Keep a copy of this rank's slice of every param bucket (the full buffers still hold
        the whole params; UnitParams frees them)."""
        self.param_shards = [self.param_bufs.shard(self.rank, b).clone() for b in range(len(self.layout.buckets))]

    def bind_full(self) -> None:
        """The unit was gathered: each param's data is its view of the full buffer again."""
        with torch.no_grad():
            for i, m in enumerate(self.members):
                p = m.param
                empty_param.mark_full(p)  # first: the checks' reads then skip its __torch_function__
                if m.empty_version is not None and p._version != m.empty_version:  # the checks' own tests,
                    m.check_untouched(self.unit_name)  # inline: they run per param and gather
                if p.device != self.device or p.dtype != self.dtype:  # model.to(dtype) between gathers cast only
                    m.check_moved(self.dtype, self.device)  # the placeholder
                m.empty_version = None
                p.data = self.param_bufs.view(i, m.shape)
                m.ptr = p.data_ptr()

    def bind_empty(self, placeholder: torch.Tensor) -> None:
        """The unit is being sharded: each param's data becomes `placeholder` (no elements),
        so a read outside the unit's forward and backward sees an empty tensor, never freed memory."""
        with torch.no_grad():
            for i, m in enumerate(self.members):
                p = m.param
                p.data = placeholder
                m.ptr = p.data_ptr()
                m.empty_version = p._version
                empty_param.mark_empty(p, self, i)  # [Note: reads between gathers]

    def forget_empty_write(self, i: int) -> None:
        """A write to params[i] while sharded that is known to mean nothing (a root's init of
        params its own unit initialised the same way: params/materialize.py) is not an error later."""
        m = self.members[i]
        if m.empty_version is not None:
            m.empty_version = m.param._version

    def adopt(self, i: int) -> None:
        """[Note: ownership] params[i] no longer views its bucket (model.to() copied it, to_empty(),
        .data assigned): copy its values into the bucket and make it a view again."""
        m = self.members[i]
        m.check_moved(self.dtype, self.device)
        p = m.param
        self.params_policy.check_replaceable(self, i, "data")
        view = self.param_bufs.view(i, p.shape)
        with torch.no_grad():
            if not torch.equal(view, p.data):
                self.changed.add(i)  # new values: a separate fp32 master must be read again
            view.copy_(p.data)
        p.data = view
        m.ptr = p.data_ptr()
        if p.grad is not None and not isinstance(p.grad, ShardedGrad):  # model.to() moved the grad along
            self.grads.bind(i)


class ShardUnit:
    """The trainable params of one module (not those of units inside it), flattened per dtype."""

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], runs: Sequence[int], comm,
                 config: ShardConfig, name: str, grads, params_policy):
        """params/names/runs in registration order; runs[k] numbers the stretch of the
        module's params (between other units' params) that params[k] belongs to. grads: the grad
        path's mode of the unit's stage (a GradPath, grads/path.py: grad_path), params_policy its param policy
        (params/policy.py: param_policy)."""
        self.comm, self.config, self.name = comm, config, name
        self.strategy = config.strategy(comm.world_size)  # what the stage means here (core/stage.py)
        self.schedule = None  # the ReduceSchedule of the optimizer that owns this unit, once one does
        self.module_slots = []  # (module, attribute, param): set by zerokern.shard to follow the module
        self.param_owners = []  # (module, param) for every module holding a param, tied ones each time
        self.module = lambda: None  # zerokern.shard: a weak reference to the unit's module
        self.sync = True  # False: backward accumulates locally (no_sync / set_requires_gradient_sync(False))
        self.after_grad = None  # stage 3: called (unit) after each of its params' grads (params/per_unit.py)
        self.gathers = None  # stage 3: the UnitParams that gather and free its params (params/per_unit.py)
        self.flat: List[FlatParams] = []
        trainable = [k for k, p in enumerate(params) if p.requires_grad]
        for dtype in sorted({params[k].dtype for k in trainable}, key=str):
            ks = [k for k in trainable if params[k].dtype == dtype][::-1]  # backward order
            breaks = [j for j in range(1, len(ks)) if runs[ks[j]] != runs[ks[j - 1]]]
            self.flat.append(FlatParams([params[k] for k in ks], [names[k] for k in ks], breaks, comm, config,
                                         self.strategy, name, grads, params_policy))
        self._where = {}
        for f in self.flat:
            for i, p in enumerate(f.params):
                self._where[p] = (f, i)
        # The hooks find the unit through a weak reference: torch keeps tensor hooks in C++, where
        # the garbage collector does not look, so a hook holding the unit (which holds the params)
        # would keep a dropped model's buckets alive for good. The unit lives as long as its module
        # (module._zerokern_unit) or its optimizer (opt.units) holds it.
        me = weakref.ref(self)
        for k, f in enumerate(self.flat):
            for i, p in enumerate(f.params):
                p.register_hook(_pre_hook(me, k, i))
                p.register_post_accumulate_grad_hook(_hook(me, k, i))

    @property
    def params(self) -> List[torch.Tensor]:
        return [p for f in self.flat for p in f.params]

    def name_from(self, path: str) -> None:
        """The unit's module is at `path` in a module sharded around it: errors name params and the
        unit from there, and its buckets' collectives too (two units' gathers of one size must not
        pass for each other: [Note: announced collectives])."""
        self.name = path
        for f in self.flat:
            for m in f.members:
                m.name = f"{path}.{m.local_name}"
            f.unit_name = path
            for b in f.buckets:
                b.name = f"{path}:{b.name.split(':', 1)[1]}"

    def locate(self, p):
        """(FlatParams, local index) of a trainable param of this unit, or None."""
        return self._where.get(p)

    @property
    def buckets(self) -> List[GradBucket]:
        return [b for f in self.flat for b in f.buckets]

    def sync_from_model(self) -> None:
        """Before step(): what the model did to params and grads since backward.
        - a param whose data left its bucket view is adopted ([Note: ownership]);
        - a param written in place (its version counter moved) has its fp32 master re-read where
          the new weights are not the master's rounding;
        - a grad assigned by hand (no backward, so no hook) moves into its bucket;
        - a grad set to None (torch's way to skip a param this step) no longer counts.
        A .grad that is still the view bound last is passed on identity and a pointer.

        [Note: in-place weights] fp16/bf16 params (and offloaded ones) are trained through a
        separate fp32 master, and step() writes the params from it. A write into a param between
        steps (model.load_state_dict, nn.init, clamp_ under no_grad) would be overwritten by
        the next step, silently, unless the master follows: the param's version counter says it
        was written (the optimizer's own writes go through the flat buffers, not the param), and
        ShardStore.refresh_params re-reads the master there. A write through p.data has a
        version counter of its own and is not seen."""
        for f in self.flat:
            for i, m in enumerate(f.members):
                p = m.param
                if m.empty_version is not None:  # stage 3 only: elsewhere nothing is recorded
                    m.check_untouched(f.unit_name)
                if p.data_ptr() != m.ptr:
                    f.adopt(i)
                if p._version != m.version:  # [Note: in-place weights]
                    m.version = p._version
                    f.changed.add(i)
            f.grads.sync()

    def adopt_replacement(self, owner, attr, p, q) -> None:
        """owner.<attr> was replaced by another tensor q (load_state_dict(assign=True)): p takes
        q's values and its place back, so the optimizer keeps training what the model uses."""
        where = self.locate(p)
        name = where[0].members[where[1]].name if where else attr
        if where:
            where[0].params_policy.check_replaceable(where[0], where[1], "assign")
        if not isinstance(q, torch.Tensor) or q.shape != p.shape:
            raise RuntimeError(f"zerokern: {name} was replaced by {type(q).__name__} "
                               f"{list(q.shape) if isinstance(q, torch.Tensor) else ''}; a sharded param can "
                               f"only take new values of shape {list(p.shape)}")
        if q.device != p.device or q.dtype != p.dtype:
            raise RuntimeError(f"zerokern: {name} was replaced by a {q.dtype} tensor on {q.device}, but it was "
                               f"sharded as {p.dtype} on {p.device}; build the optimizer after loading")
        with torch.no_grad():
            p.copy_(q)
        if where:
            where[0].changed.add(where[1])
        owner._parameters[attr] = p

    def __deepcopy__(self, memo):
        raise TypeError(
            f"zerokern: a module sharded with zerokern.shard (unit '{self.name}') or an optimizer over it "
            "cannot be deep-copied (its params are views of shared buckets with hooks). Copy the model "
            "before sharding it, or copy its state_dict() into a fresh model")


# param -> a weak reference to the unit that owns it. Weak both ways: a param that dies (or a
# deepcopy's new param) is not in it, and the unit (which holds its params strongly) lives as long
# as its module (module._zerokern_unit) or its optimizer holds it; a strong value here would keep
# every sharded model alive for good.
_OWNER = WeakIdKeyDictionary()


def unit_of(param: torch.Tensor) -> Optional[ShardUnit]:
    ref = _OWNER.get(param)
    return ref() if ref is not None else None


def make_unit(params, names, runs, comm, config: ShardConfig, name: str, grads, params_policy) -> ShardUnit:
    """A ShardUnit over params no unit owns yet (with its grad path and param policy), registered
    as their owner."""
    for p, n in zip(params, names):
        owner = unit_of(p)
        if owner is not None:
            raise ValueError(f"zerokern: {n} is already sharded by unit '{owner.name}'")
    unit = ShardUnit(params, names, runs, comm, config, name, grads, params_policy)
    for p in unit.params:
        _OWNER[p] = weakref.ref(unit)
    return unit


def forward_order(units, index):
    """zerokern.shard units in the order a forward runs their pre-hooks: a unit before the units
    inside its module, siblings in the order their params were registered."""
    def key(u):
        module = u.module()
        inside = [index[p] for p in module.parameters() if p in index] if module is not None else []
        inside = inside or [index[p] for p in u.params]
        return min(inside), -len(inside)
    return sorted(units, key=key)


def owner_of(params):
    """The one optimizer (FusedZeroAdam, ZeroOptimizer) whose engine trains every tensor in `params`,
    else None (none given, one not owned, or owners that differ). Integrations ask this before
    changing what they do."""
    owner = None
    for p in params:
        u = unit_of(p)
        engine = u.schedule.owner() if u is not None and u.schedule is not None and u.schedule.owner else None
        opt = engine.optimizer() if engine is not None else None
        if opt is None or (owner is not None and opt is not owner):
            return None
        owner = opt
    return owner


def check_free(owned, index):
    """The units zerokern.shard() made are this optimizer's to take: not another live one's (an
    optimizer that was dropped releases its units: a new one may be built, as with torch.optim),
    none of their params frozen since, all of them given."""
    for u in owned:
        if u.schedule is not None and u.schedule.owner is not None and u.schedule.owner() is not None:
            raise ValueError(f"zerokern: unit '{u.name}' already belongs to another optimizer that is still alive; "
                             "build one optimizer over all of a model's params, or drop the other one first "
                             "(del opt, and any reference to it, e.g. a scheduler's; then gc.collect())")
        frozen = [m.name for f in u.flat for m in f.members if not m.param.requires_grad]
        if frozen:
            raise ValueError(f"zerokern: {frozen[0]} (unit '{u.name}') was trainable when zerokern.shard() made the "
                             "unit and is frozen now (requires_grad=False): freeze it before shard(), or keep it "
                             "trainable and give it lr=0 in a param group of its own")
        missing = [m.name for f in u.flat for m in f.members if m.param not in index]
        if missing:
            raise ValueError(f"zerokern: {missing[0]} (unit '{u.name}') is trainable but not in this "
                             "optimizer's params: pass all of the unit's params, or freeze it before shard()")


def _pre_hook(unit_ref, k: int, i: int):
    def pre_hook(grad):
        unit = unit_ref()
        if unit is None:
            return None  # the unit was dropped: the param trains on without zerokern
        f = unit.flat[k]
        m = f.members[i]
        p = m.param
        if p.device != f.device or p.dtype != f.dtype:  # before autograd fails on a grad of another dtype or device
            m.check_moved(f.dtype, f.device)
        if grad.layout is not torch.strided:
            raise RuntimeError(f"zerokern: {m.name} got a sparse gradient (nn.Embedding(..., sparse=True) or "
                               "EmbeddingBag(..., sparse=True)?), but zerokern's buckets hold dense gradients that "
                               "are reduced and sharded as one buffer; build the module with sparse=False (torch's "
                               "AdamW refuses sparse gradients too)")
        # Runs before autograd adds `grad` into the bucket ([Note: a short grad walk] in grads/members.py).
        f.grads.before_accumulate(i)
    return torch.compiler.disable(pre_hook)  # [Note: hooks under torch.compile] (params/per_unit.py)


def _hook(unit_ref, k: int, i: int):
    def hook(p):
        unit = unit_ref()
        if unit is None:
            return
        bucket = unit.flat[k].grads.took(i, unit.sync)
        if unit.schedule is not None and unit.sync:
            unit.schedule.on_grad(bucket)
        if unit.after_grad is not None:
            unit.after_grad(unit)
    return torch.compiler.disable(hook)  # [Note: hooks under torch.compile] (params/per_unit.py)
