"""zerokern.shard(module): mark a module as a unit of ZeRO sharding, FSDP2's
`fully_shard` shape.

    for block in model.blocks:
        zerokern.shard(block, stage=2)
    zerokern.shard(model, stage=2)           # the rest: embeddings, final norm, head
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=3e-4)

Each call flattens the module's trainable params that no unit inside it owns
yet into buckets (their .data become views, values unchanged) and installs
the gradient hooks; the module's class gains ZeroModule's methods
(set_requires_gradient_sync, as FSDP2's, which Accelerate drives). The
optimizer built over the params finds the units and reduces, updates and
gathers them. Without shard(), FusedZeroAdam(params) makes one unit of the
params itself.
"""

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .grads import ddp_guard
from .params import model_state
from .comm.factory import comm_for
from .state.lowbit_store import StatePolicy
from .params.materialize import materialize
from .core.stage import OffloadPolicy, ShardConfig
from .core.whole_matrices import COSTS, WholeMatrices
from .grads.path import grad_path
from .params.policy import param_policy
from .unit import ShardUnit, make_unit, unit_of

class ZeroModule:
    """Methods a sharded module gains (its class becomes a subclass of this and of its own)."""

    def zero_units(self) -> List[ShardUnit]:
        """The units in this module (its own and those inside it), outermost first."""
        return [m._zerokern_unit for m in self.modules() if isinstance(m, ZeroModule)]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward passes accumulate grads locally with no communication (gradient
        accumulation); the next synced backward or step() reduces them. As FSDP2's."""
        units = self.zero_units() if recurse else [self._zerokern_unit]
        for u in units:
            u.sync = bool(requires_gradient_sync)


def _forward_pre_hook(module, args):
    unit = module._zerokern_unit
    ddp_guard.check_forward(unit)  # [Note: DDP wrap] in grads/ddp_guard.py
    # [Note: interrupted backward] in grads/schedule.py: a new forward ends a backward that never finished.
    if unit.schedule is not None:
        unit.schedule.reset()
    # [Note: ownership] in unit.py: load_state_dict(assign=True) put new Parameter objects in the
    # module; the unit's own params (the ones the optimizer holds) take their values and places back.
    for owner, attr, p in unit.module_slots:
        q = owner._parameters.get(attr)
        if q is not p:
            engine = unit.schedule.owner() if unit.schedule is not None and unit.schedule.owner is not None else None
            if engine is not None:
                engine.finish_param_gather()  # p is written next ([Note: gather behind forward])
            unit.adopt_replacement(owner, attr, p, q)


def shard(module: torch.nn.Module, *, stage: int = 2, process_group=None, bucket_cap_mb: float = 25.0,
          overlap_comm: bool = True, offload: Optional[OffloadPolicy] = None,
          overlap_param_gather: bool = False, reshard_after_forward: bool = True, device=None,
          init: Optional[Callable[[torch.nn.Module], None]] = None, state_precision: str = "fp32",
          mesh=None, reduce_precision: Optional[str] = None,
          gather_precision: Optional[str] = None, matrices=None) -> torch.nn.Module:
    """Make `module` a unit: its trainable params not owned by a unit inside it are
    flattened into buckets that one FusedZeroAdam (built later over the params)
    reduces, updates and gathers. Call it on each block, then on the root. Returns
    `module` (the same object). overlap_param_gather: step() returns before the updated params
    are gathered; each unit waits for its own in its next forward, a module holding a param in
    its state_dict() too (code that reads params directly in between calls
    opt.finish_param_gather() first; [Note: gather behind forward] in zero/params/gather.py).
    stage=3 shards the params too: once the optimizer is built, each rank keeps its slice and a
    unit's params are gathered for its forward and backward only (reshard_after_forward=False
    keeps them from forward to backward); [Note: stage-3 params] in zero/params/per_unit.py. At stage 3
    the module may be on the meta device: its own params are then materialised on `device` (None:
    the current CUDA device if there is one, else the CPU), initialised by reset_parameters() or
    init(module), and sharded before shard() returns ([Note: meta init] in zero/params/materialize.py).
    state_precision: what the optimizer will keep Adam's moments in; "int8" lays the buckets out in
    blocks of 256 elements ([Note: int8 shards in blocks] in zero/state/lowbit_store.py), so pass the
    same value to FusedZeroAdam. mesh: hybrid sharding, sharded within each host and replicated across
    hosts: a 2-D DeviceMesh with dims ("replicate", "shard") as FSDP2's HSDP takes, or a (replicate,
    shard) pair of sizes (the same on every shard() call; [Note: hybrid sharding] in zero/comm/hybrid.py).
    reduce_precision (None, "fp32", "bf16", "int8", "int4"): what the grads travel in when they are
    reduced; int8/int4 are blockwise codes summed after decoding, with error feedback ([Note: quantized
    reductions] in zero/comm/wire.py). With a mesh only the hop between hosts is quantized.
    gather_precision (None, "int8"): what gathered params travel in: int8 codes with an fp32 scale per
    256 elements (3.94x fewer bytes than fp32 params). At stage 3 the weights are quantized for each
    forward and backward, the shards stay exact; at stages 1/2 each step gathers the update (master minus
    the params every rank holds), so the params are bit-identical on every rank and within one int8 step
    of the fp32 masters, which the optimizer then keeps apart from fp32 params too ([Note: quantized param
    gathers] in zero/params/gather.py). With a mesh the param gathers stay inside a host and full
    precision. The same on every shard() call.
    matrices: the params a matrix optimizer (ZeroOptimizer's torch.optim.Muon and
    torch.optim.Adafactor groups) will step whole, so on several ranks each is laid out whole in
    one rank's shard, owners balanced by each one's optimizer's cost ([Note: whole matrices in
    units], [Note: a cost per param] in zero/core/whole_matrices.py): an iterable of params (Muon's;
    any superset, e.g. the whole Muon group on every call), {param: "muon" | "adafactor"} (or the
    torch.optim class), or fn(name, param) -> "muon" | "adafactor" | None over the unit's own
    params (True means "muon"; names as in this module; a meta module's params are new once
    materialised, so name them this way)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, ZeroModule):
        raise ValueError(f"{type(module).__name__} is already sharded (zerokern.shard was called on it)")
    align = StatePolicy(state_precision).align  # validates it
    config = ShardConfig(stage, bucket_cap_mb, overlap_comm, offload, overlap_param_gather=overlap_param_gather,
                         reshard_after_forward=reshard_after_forward, reduce_precision=reduce_precision,
                         gather_precision=gather_precision, **({} if align is None else {"align": align}))
    if init is not None and not callable(init):
        raise TypeError(f"init must be a callable taking the module, got {type(init).__name__}")
    comm = comm_for(process_group, mesh, _device_type(module, device))
    strategy = config.strategy(comm.world_size)
    if strategy.materializes_meta:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        materialize(module, torch.device(device), init, lambda m: isinstance(m, ZeroModule), _inner_params(module))
    params, names, runs, run, last_owned = [], [], [], 0, False
    seen: Dict[int, bool] = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen[id(p)] = True
        if unit_of(p) is not None:
            last_owned = True
            continue
        if last_owned:
            run += 1
            last_owned = False
        params.append(p)
        names.append(name)
        runs.append(run)
    sparse = [n for n, m in module.named_modules() if getattr(m, "sparse", False) is True
              and isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    if sparse:
        raise ValueError(f"zerokern.shard: {sparse[0] or type(module).__name__} makes sparse gradients (sparse=True), "
                         "but zerokern's buckets hold dense gradients that are reduced and sharded as one buffer; "
                         "build it with sparse=False (torch's AdamW refuses sparse gradients too)")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"zerokern.shard: the params of {type(module).__name__} are on {sorted(map(str, devices))}; "
                         "move the module to one device first")
    for p, n in zip(params, names):
        if p.device.type == "meta":
            raise ValueError(f"zerokern.shard: {n} is on the meta device; materialise the module first "
                             "(module.to_empty(device=...) and initialise it), or shard it with stage=3, which "
                             "materialises one unit at a time")
    if matrices is not None:  # [Note: whole matrices in units]
        config = dataclasses.replace(config, matrices=_matrices_of(matrices, params, names))
    policy = param_policy(strategy)
    policy.before_unit(comm, module, config, params, names)  # stage 3: shard() runs collectives from here on
    unit = make_unit(params, names, runs, comm, config, type(module).__name__, grad_path(strategy), policy)
    unit.init = init  # how its params were initialised, if materialised here (a root's init is checked against it)
    unit.module_slots = []
    for p, n in zip(params, names):
        if p.requires_grad:
            prefix, _, attr = n.rpartition(".")
            unit.module_slots.append((module.get_submodule(prefix), attr, p))
    unit.param_owners = [(module.get_submodule(n.rpartition(".")[0]), p)
                         for n, p in module.named_parameters(remove_duplicate=False) if unit.locate(p) is not None]
    unit.module = weakref.ref(module)  # the module holds the unit; not the other way round
    for path, m in module.named_modules():  # errors name the params of units inside from here ("blocks.0.fc1.weight")
        if path and isinstance(m, ZeroModule):
            m._zerokern_unit.name_from(path)
    module._zerokern_unit = unit
    module.register_forward_pre_hook(_forward_pre_hook)
    policy.after_unit(comm, module, unit, lambda m: isinstance(m, ZeroModule), unit_of)
    cls = module.__class__
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Zero{cls.__name__}", (ZeroModule, cls), {})
    module.__class__ = _CLASSES[cls]
    return module


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, *, rank0_only: bool = True, device="cpu") -> dict:
    """The whole state dict of a model sharded at stage 3 (any stage works), as model.state_dict()
    of the same model unsharded would give it: every param whole, on `device`. A collective: every
    rank calls it. rank0_only: the other ranks get {} (as torch's full state dicts), so only one
    rank holds the whole model; the gather itself goes one bucket at a time. A snapshot: its
    tensors are copies.
    torch.save it, and load it with model.load_state_dict into any model, sharded or not."""
    with model_state.collecting_sources() as sources:  # id(slice) -> its param
        sd = model.state_dict()
    comm, whole = None, {}  # id(param) -> its full values (on the ranks that keep them)
    for p in model.parameters():
        unit = unit_of(p)
        comm = comm or (unit.comm if unit is not None else None)
        where = unit.locate(p) if unit is not None else None
        if where is not None and id(p) not in whole:
            where[0].params_policy.gather_whole(where[0], comm, not rank0_only or comm.leads, device, whole)
    leads = comm.leads if comm is not None else (dist.get_rank() == 0 if dist.is_initialized() else True)
    if rank0_only and not leads:
        return {}
    out = {}
    for k, v in sd.items():  # copies throughout (a snapshot, as the gathered ones are)
        source = sources.get(id(v))
        if source is not None and id(source) in whole:
            out[k] = whole[id(source)]
        elif model_state.is_marked(v):  # a slice whose param was not found: never hand it out as whole
            raise RuntimeError(f"zerokern.full_state_dict: entry '{k}' is this rank's slice of a stage-3 param "
                               "that the gather did not reach; please report this with the model's wrappers")
        else:
            out[k] = v.to(device, copy=True) if isinstance(v, torch.Tensor) else v
    return out


def _matrices_of(matrices, params, names) -> WholeMatrices:
    """shard(matrices=...): the WholeMatrices of the unit's own trainable params it names, each
    with its cost kind ([Note: a cost per param] in core/whole_matrices.py): an iterable of params
    (Muon's), {param: kind}, or fn(name, param) -> kind, a kind being "muon", "adafactor", the
    class torch.optim.Muon or torch.optim.Adafactor, True ("muon"), or False/None (not whole).
    A "muon" param must be 2-D (torch's Muon takes no other), named otherwise."""
    def kind(value, name):
        if value is True or (isinstance(value, str) and value in COSTS):
            return "muon" if value is True else value
        if isinstance(value, type) and value.__module__.startswith("torch.") and value.__name__.lower() in COSTS:
            return value.__name__.lower()
        if value is False or value is None:
            return None
        raise ValueError(f"zerokern.shard(matrices=...): {name} is given {value!r}; a param's entry is \"muon\" or "
                         "\"adafactor\" (or torch.optim.Muon, torch.optim.Adafactor; True for Muon), the optimizer "
                         "whose param group steps it whole, or False/None for a param stepped element-wise")

    wanted = "an iterable of params, {param: \"muon\" | \"adafactor\"} or fn(name, param) -> \"muon\" | \"adafactor\""
    trainable = [(p, n) for p, n in zip(params, names) if p.requires_grad]
    if callable(matrices):
        chosen = [(p, n, kind(matrices(n, p), n)) for p, n in trainable]
    elif isinstance(matrices, torch.Tensor):
        raise TypeError(f"zerokern.shard(matrices=...) takes {wanted}, got one tensor; wrap it in a list")
    elif isinstance(matrices, Mapping):
        given = {id(p): v for p, v in matrices.items()}
        chosen = [(p, n, kind(given[id(p)], n)) for p, n in trainable if id(p) in given]
    else:
        try:
            given = {id(p) for p in matrices}
        except TypeError:
            raise TypeError(f"zerokern.shard(matrices=...) takes {wanted}, got {type(matrices).__name__}") from None
        chosen = [(p, n, "muon") for p, n in trainable if id(p) in given]
    chosen = [(p, n, k) for p, n, k in chosen if k is not None]
    for p, n, k in chosen:
        if k == "muon" and p.dim() != 2:
            raise ValueError(f"zerokern.shard(matrices=...): {n} has shape {list(p.shape)}; a matrix optimizer "
                             "(torch.optim.Muon) steps 2-D params only. Name the 2-D hidden weights only, and give "
                             "the other params (embeddings, norms, biases) another optimizer, or mark a param that "
                             "torch.optim.Adafactor steps \"adafactor\"")
    return WholeMatrices.of([k for _, _, k in chosen], [p for p, _, _ in chosen], [n for _, n, _ in chosen])


def _device_type(module, device) -> str:
    """Where the module's params are, or will be materialised (a meta module at stage 3): the
    device type a mesh is built for."""
    if device is not None:
        return torch.device(device).type
    types = {p.device.type for p in module.parameters()}
    if "cuda" in types or ("meta" in types and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def _inner_params(module):
    """(name, param, its unit's init, forget) of the stage-3 params of units inside `module`, for
    materialize to check what the root's init writes to them."""
    out = []
    for path, m in module.named_modules():
        if not path or not isinstance(m, ZeroModule):
            continue
        unit = m._zerokern_unit
        for f in unit.flat:
            for i in f.params_policy.empty_between_gathers(f):
                out.append((f"{path}.{f.members[i].local_name}", f.params[i], getattr(unit, "init", None),
                            lambda f=f, i=i: f.forget_empty_write(i)))
    return out


_CLASSES: Dict[type, type] = {}  # module class -> its ZeroModule subclass (one each, as FSDP2)
