"""Stage 3: the params are sharded too, and gathered unit by unit for the forward and backward
that need them.

[Note: stage-3 params] At stage 3 each rank keeps only its slice of every param bucket
(FlatParams.param_shards: the fp32 master for fp32 params, which the fused update writes in
place, or the fp16/bf16 slice the update writes next to its fp32 master). A unit's full buffers
hold values only while the unit is GATHERED; their storage is freed (resized to 0 bytes, the
tensor objects stay) otherwise. Between gathers a param's .data is an empty tensor of its dtype
and device, as DeepSpeed's stage 3 leaves it: code that reads a param outside its unit's forward
and backward sees an empty tensor and fails on its shape, never reads freed memory (on a CPU a
tensor over freed storage is a segfault), and its full shape is kept in its Member (core/member.py).

The storage is resized in place rather than replaced, so tensors that autograd saved in the
forward (views such as weight.t() share the buffer's storage) read the values gathered again
before the unit's backward. A param's .data swap does not touch its version counter, so the
saved params pass autograd's version check.

When (BucketParams says which phase each bucket is in, UnitParams moves a unit's buckets together,
Stage3Runtime decides when):
- forward: a unit's forward pre-hook gathers it (waiting for a prefetch), then launches the
  gather of the unit the last forward ran next (prefetch, as FSDP2's forward prefetch);
  its post-hook frees it (reshard_after_forward=True), except a root (a unit with units inside)
  that ends the forward, whose backward comes first (FSDP2 keeps its root too), and registers a
  hook on the outputs. The order of one iteration (from the first forward after a backward or
  step() on) is what the next iteration prefetches by;
- backward: the first gradient reaching a unit's outputs gathers it again and launches the
  gather of the unit whose backward comes next (the reverse of the order the units finished
  their forwards); once every trainable param of the unit has its gradient (the grad hooks
  count), the unit is freed; the end of backward frees whatever is left (unused params);
- step() frees every unit before the update (a forward under no_grad with
  reshard_after_forward=False, an interrupted backward) so nothing stale is read after it.
Every rank must run the same units in the same order (as FSDP2 requires): the gathers are
collectives. A forward inside backward (activation checkpointing recomputing a unit) gathers
the unit and leaves it gathered for its backward.
"""

import weakref
from typing import List

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import register_multi_grad_hook

from . import model_state
from .gather import BucketParams, param_wire
from ..core.states import ParamState


# [Note: hooks under torch.compile] The hooks that gather and free units are opaque to dynamo
# (torch.compiler.disable, as FSDP2 skips its hooks by default): traced, the collectives' names
# ("all_gather[blocks.2:float32:0]"), bucket indices and unit states became guards of the frames
# dynamo compiled inside the hooks, one per unit, so a compiled model recompiled for every unit
# until dynamo's recompile limit and then ran those frames eagerly (issue 39). Opaque, each hook is
# one graph break at the module call, the same for every unit; the module's own forward is still
# compiled, once for every unit of one shape (tests/zero/params/test_stage3_patterns.py counts the frames).
_opaque = torch.compiler.disable


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _hook_state_dicts(module, up) -> None:
    """model.state_dict() and load_state_dict() of `module`'s own params that are `up`'s: this
    rank's slices ([Note: stage-3 model state dicts] in params/model_state.py)."""
    attrs = [a for a, p in module._parameters.items() if p is not None and up.unit.locate(p) is not None]
    if not attrs:
        return
    popped = []  # keys the load pre-hook took; its post-hook takes them off missing_keys

    def save(mod, state_dict, prefix, local_metadata):
        up.handed.check(up.name)  # a dict from before, written into and never loaded: these would be stale too
        for a in attrs:
            key = prefix + a
            where = up.unit.locate(mod._parameters.get(a))
            if key in state_dict and where is not None:
                f, i = where
                start, n, b, off = f.my_slice(i)
                t = model_state.to_boxes(f.param_shards[b][off:off + n], start, f.members[i].shape)
                up.handed.add(t, key)
                model_state.note_source(t, f.members[i].param)
                state_dict[key] = t

    def load(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if local_metadata.get("assign_to_params_buffers"):
            error_msgs.append(f"zerokern: load_state_dict(assign=True) would replace the stage-3 params of unit "
                              f"'{up.name}' (each rank keeps its slice of them); load without assign=True")
            return
        up.reshard()  # the slices are the truth; the next forward gathers the loaded values
        for a in attrs:
            key = prefix + a
            where = up.unit.locate(mod._parameters.get(a))
            if key not in state_dict or where is None:
                continue
            value = state_dict.pop(key)
            popped.append(key)
            err = model_state.load_param(where[0], where[1], value, key)
            if err is not None:
                error_msgs.append(err)
            elif isinstance(value, torch.Tensor):
                up.handed.taken(value)

    def after_load(mod, incompatible_keys):
        for key in popped:
            if key in incompatible_keys.missing_keys:
                incompatible_keys.missing_keys.remove(key)
        popped.clear()

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)
    module.register_load_state_dict_post_hook(after_load)


class UnitParams:
    """One stage-3 unit's params: its buckets' BucketParams (params/gather.py), moved together, and
    the params' data bound to the full buffers while they are gathered, to empty tensors otherwise."""

    def __init__(self, unit, comm, runtime):
        self.unit, self.comm = unit, comm
        self.runtime = runtime  # the Stage3Runtime of the unit's model; it counts the gathered bytes
        self.foreign = set()  # id() of the modules outside the unit that hold one of its params (hooked)
        self.flats = list(unit.flat)  # a stage-3 unit: every dtype group keeps slices (params/policy.py)
        self.trainable = sum(len(f.members) for f in self.flats)
        self.buckets: List[BucketParams] = []  # shard() makes them
        self.got = 0  # params of the unit whose grad arrived since it was last gathered for backward
        self.active = 0  # forwards of the unit's module running now (outside backward)
        self.is_root = False  # the unit's module holds other units (Stage3Runtime.add)
        self.reshard_after_forward = unit.config.reshard_after_forward
        self._empty = {}
        self.handed = model_state.HandedOut()  # state_dict() copies, for a dcp.load never loaded

    @property
    def name(self) -> str:
        return self.unit.name  # the module path once the root is sharded (ShardUnit.name_from)

    @property
    def state(self) -> ParamState:
        """The unit's buckets move together, so the first one's state is the unit's (a unit with no
        trainable params is always GATHERED: it has nothing to gather)."""
        return self.buckets[0].state if self.buckets else ParamState.GATHERED

    def shard(self) -> None:
        """At zerokern.shard(): every rank takes rank 0's values (as DDP's construction does), keeps
        its slices and frees the rest (the forward gathers them)."""
        works = []
        for f in self.flats:
            for b, buf in enumerate(f.param_bufs.buffers):
                if buf.storage_offset() != 0 or buf.untyped_storage().nbytes() != buf.numel() * buf.element_size():
                    buf = f.param_bufs.buffers[b] = buf.clone()  # a buffer that owns its storage, to free it whole
                works.append(self.comm.broadcast(buf, name="broadcast_params"))
        for w in works:
            self.comm.wait(w)
        for f in self.flats:
            f.shard_params()
            precision = self.unit.config.gather_precision
            self.buckets += [BucketParams(f, b, self.comm, frees=True, counter=self.runtime,
                                          wire=param_wire(precision, self.comm, f, b, adds=False))
                             for b in range(len(f.param_bufs.buffers))]
        self.reshard()

    def launch(self) -> None:
        """SHARDED -> GATHERING."""
        if self.state is not ParamState.SHARDED:
            return
        self.handed.check(self.name)
        for bp in self.buckets:
            bp.launch()

    def prefetch(self) -> None:
        """Its slices on disk start coming into memory (a gather of it follows soon; [Note: stage-3
        params on disk] in state/nvme_store.py). Nothing for slices in memory."""
        if self.state is ParamState.SHARDED:
            for f in self.flats:
                for io in (f.shard_io or {}).values():
                    io.prefetch_param()

    def wait(self) -> None:
        """GATHERING -> GATHERED: the params view the full buffers."""
        if self.state is not ParamState.GATHERING:
            return
        for bp in self.buckets:
            bp.wait()
        for f in self.flats:
            f.bind_full()

    def unshard(self) -> None:
        self.launch()
        self.wait()

    def reshard(self) -> None:
        """-> SHARDED: the params' data becomes empty and the full buffers' storage is freed."""
        self.wait()  # a gather in flight writes the buffers; every rank launched it, so it completes
        self.got = 0
        if self.state is not ParamState.GATHERED or not self.buckets:
            return
        for f in self.flats:
            key = (f.dtype, f.device)
            if key not in self._empty:
                self._empty[key] = torch.empty(0, dtype=f.dtype, device=f.device)
            f.bind_empty(self._empty[key])
        for bp in self.buckets:
            bp.release()

    def updated(self) -> None:
        """The update wrote the slices: the next gathers round with a new key ([Note: quantized
        param gathers]; the gathers of one step give the same bytes)."""
        for bp in self.buckets:
            if bp.wire is not None:
                bp.wire.count += 1

    def nbytes(self) -> int:
        """Bytes of param memory this rank holds now: its slices (unless on disk) and any full buffer."""
        return sum(t.numel() * t.element_size() for f in self.flats if f.shard_io is None for t in f.param_shards) + sum(
            buf.untyped_storage().nbytes() for f in self.flats for buf in f.param_bufs.buffers)


class _Order(list):
    """Units in an order, as weak references (an order must not keep a dropped model's units
    alive), with each unit's index (`at`), so a hook finds the next one without a scan."""

    def __init__(self, units):
        super().__init__(map(weakref.ref, units))
        self.at = {id(u): k for k, u in enumerate(units)}


def joined(units, comm) -> "Stage3Runtime":
    """[Note: one runtime per model] The runtime of `units`: theirs, merged into one where they
    have several, or a new one where none has one. zerokern.shard() gives a new unit the runtime of
    the units inside its module (sharded before it: the blocks before the root), so one model's
    units share one forward order and prefetch chain; the optimizer joins the runtimes of the units
    it owns (blocks sharded without a root), and then owns that runtime (opt.stage3). Two models on
    one process group keep two runtimes: neither's forward order is the other's. No registry keyed
    by the group is needed: a runtime is found through its units (ShardUnit.gathers)."""
    found = []
    for u in units:
        up = u.gathers
        if up is not None and all(up.runtime is not r for r in found):
            found.append(up.runtime)
    if not found:
        return Stage3Runtime(comm)
    for other in found[1:]:
        found[0].absorb(other)
    return found[0]


def _after_grad(unit) -> None:
    """ShardUnit.after_grad at stage 3: one of the unit's params has its grad."""
    up = unit.gathers
    if up is not None:
        up.runtime.after_grad(up)


def add_foreign_use(holder: torch.nn.Module, up: "UnitParams") -> None:
    """`holder` (outside the unit's module) holds one of the unit's params, as a head tied to an
    embedding of another unit: its forward gathers the unit (left gathered: the unit's own hooks
    and grads free it), and so does the first gradient reaching its outputs."""
    if id(holder) in up.foreign:
        return
    up.foreign.add(id(holder))
    _hook_state_dicts(holder, up)

    def pre(module, args):
        if up.state is not ParamState.GATHERED:
            up.unshard()

    def post(module, args, output):
        if _in_backward() or up.active > 0:
            return  # inside the unit's own forward: its hooks do the rest
        if torch.is_grad_enabled():
            tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, _opaque(lambda _grads: up.runtime.gather_for_backward(up)),
                                         mode="any")
        if up.active == 0 and (up.reshard_after_forward or not torch.is_grad_enabled()):
            up.reshard()  # as after the unit's own forward
    holder.register_forward_pre_hook(_opaque(pre))
    holder.register_forward_hook(_opaque(post), always_call=True)


class Stage3Runtime:
    """The hooks that gather and free the stage-3 units of one model, and their order. The module
    hooks reach it through each unit's UnitParams (up.runtime), so runtimes can merge (joined())."""

    def __init__(self, comm):
        self.comm, self.group = comm, comm.group
        # Weak: a unit's UnitParams lives as long as its module's hooks (which hold it); a model
        # that is dropped takes its units along, and no later forward prefetches them.
        self._units: List[weakref.ref] = []
        self._of = weakref.WeakValueDictionary()  # id(ShardUnit) -> UnitParams
        # weak references: an order must not keep a dropped model's units alive
        self.order = _Order([])  # pre-forward order of the last forward
        self.backward_order = _Order([])  # the reverse of the last forward's post-forward order
        self._pre: List[UnitParams] = []  # the running forward's orders, recorded as it goes
        self._post: List[UnitParams] = []
        self._seen, self._post_seen = set(), set()  # id() of the units in _pre / _post (no scan per hook)
        self._depth = 0  # unit forwards running (nested)
        self._new_forward = True  # the next unit forward begins an iteration (after backward or step())
        self._end_queued = False
        # A backward with create_graph=True (a gradient penalty) saved the gathered params in the
        # graph it built, which a later backward runs: nothing is freed until a backward without
        # create_graph ends ([Note: double backward]).
        self._keep_for_graph = False
        self.prefetch = True  # launch the next unit's gather with this one's (bench/overlap.py turns it off)
        self.gathered_bytes = 0  # bytes of full param buffers allocated now (BucketParams counts)
        self.peak_bytes = 0  # their peak since reset_peak(): the gathered working set

    @property
    @torch._dynamo.disable  # run eagerly: dynamo, tracing a hook, put the units themselves back into the weak list
    def units(self) -> List[UnitParams]:
        live = [r() for r in self._units]
        if None in live:  # a unit was dropped: its reference goes too
            self._units = [r for r, up in zip(self._units, live) if up is not None]
            live = [up for up in live if up is not None]
        return live

    def reset_peak(self) -> None:
        self.peak_bytes = self.gathered_bytes

    def add(self, unit) -> UnitParams:
        """zerokern.shard(..., stage=3): shard the new unit now and hook its module."""
        up = UnitParams(unit, self.comm, self)
        up.shard()
        module = unit.module()
        up.is_root = any(any(m is x.unit.module() for m in module.modules()) for x in self.units)
        self._units.append(weakref.ref(up))
        self._of[id(unit)] = up
        unit.gathers, unit.after_grad = up, _after_grad
        module.register_forward_pre_hook(_opaque(lambda m, args: up.runtime.pre_forward(up)))
        module.register_forward_hook(_opaque(lambda m, args, output: up.runtime.post_forward(up, output)),
                                     always_call=True)
        _hook_state_dicts(module, up)
        for owner in {id(m): m for m in [m for m, _ in unit.param_owners] if m is not module}.values():
            add_foreign_use(owner, up)  # called from outside the unit's forward (another unit's), it gathers
        return up

    def absorb(self, other: "Stage3Runtime") -> None:
        """[Note: one runtime per model] other's units join this runtime; the next forward shows
        the merged order."""
        if other is self:
            return
        for up in other.units:
            up.runtime = self
            for bp in up.buckets:
                bp.counter = self
            self._units.append(weakref.ref(up))
            self._of[id(up.unit)] = up
        self.gathered_bytes += other.gathered_bytes
        self.peak_bytes = max(self.peak_bytes, self.gathered_bytes)
        self.prefetch = self.prefetch and other.prefetch
        self.order, self.backward_order = _Order([]), _Order([])
        self._iteration_ends()

    def _note_create_graph(self) -> None:
        """Called from autograd's hooks, where grad mode is the backward's create_graph (not from a
        checkpoint's recompute, which turns grad mode on itself): [Note: double backward]."""
        if torch.is_grad_enabled():
            self._keep_for_graph = True

    def gather_for_backward(self, up) -> None:
        self._note_create_graph()
        self._queue_end_of_backward()
        up.unshard()

    def of(self, unit) -> UnitParams:
        return self._of[id(unit)]

    def expect_order(self, units) -> None:
        """The forward order the optimizer expects (from the params' order), until a forward shows one."""
        ups = [self._of[id(u)] for u in units]
        self.order, self.backward_order = _Order(ups), _Order(ups[::-1])

    def _iteration_ends(self) -> None:
        """A backward began or step() ran: the next unit forward starts a new order (the last
        one's lists go, so they keep no dropped model's units alive)."""
        self._new_forward = True
        self._pre, self._post, self._seen, self._post_seen = [], [], set(), set()

    def reshard_all(self, units=None) -> None:
        self._iteration_ends()
        self._keep_for_graph = False  # step() ends a penalty's graph too (a Hessian-vector product, no backward after)
        for up in (self.units if units is None else [self._of[id(u)] for u in units]):
            up.reshard()

    @staticmethod
    def _next(order, up):
        """The live unit after `up` in `order` (a list of weak references, each with the index of
        its unit under order.at), or None."""
        k = order.at.get(id(up))
        if k is None or order[k]() is not up:  # not in it (an id can be reused by a new unit)
            return None
        for r in order[k + 1:]:
            x = r()
            if x is not None:
                return x
        return None

    def _read_ahead(self, order, launched) -> None:
        """The unit after the one just launched: its slices on disk start coming in, behind this
        unit's compute and the next one's gather ([Note: stage-3 params on disk])."""
        after = self._next(order, launched)
        if after is not None:
            after.prefetch()

    # --- forward ---------------------------------------------------------------

    def pre_forward(self, up) -> None:
        if _in_backward():  # activation checkpointing recomputes the unit inside backward
            self._queue_end_of_backward()
            up.unshard()
            return
        if self._new_forward:  # the first unit forward since the last backward or step()
            self._new_forward = False
            self._pre, self._post, self._seen, self._post_seen, self._depth = [], [], set(), set(), 0
            self._end_queued = False  # a backward that raised never ran its callback
            for x in self.units:
                x.active = 0  # a forward that raised never ran its post-hooks
                x.got = 0  # a backward that raised left its count
        self._depth += 1
        up.active += 1
        if id(up) not in self._seen:
            self._seen.add(id(up))
            self._pre.append(up)
        up.unshard()
        nxt = self._next(self.order, up) if self.prefetch else None
        if nxt is not None:
            nxt.launch()
            self._read_ahead(self.order, nxt)

    def post_forward(self, up, output) -> None:
        if _in_backward():
            return  # gathered for its backward, which follows
        self._depth -= 1
        up.active -= 1
        if id(up) not in self._post_seen:
            self._post_seen.add(id(up))
            self._post.append(up)
        grad = torch.is_grad_enabled()
        tensors = []
        if grad:
            tensors = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, _opaque(lambda _grads: up.runtime.pre_backward(up)), mode="any")
        outermost = self._depth == 0
        if outermost:  # the orders this iteration has shown so far, for the next one's prefetches
            self.order, self.backward_order = _Order(self._pre), _Order(self._post[::-1])
        # A root (a unit with units inside) that ends the forward stays gathered: its backward
        # comes first, as FSDP2 keeps its root. Without backward (no_grad) everything goes.
        # So does a unit whose backward no output announces (gradients reach it another way).
        keep = grad and ((outermost and up.is_root) or not tensors)
        if not keep and (up.reshard_after_forward or not grad):
            up.reshard()
        if outermost and up.is_root:
            for x in self.units:  # a prefetch no unit used; everything when no backward follows
                if not grad or id(x) not in self._seen:
                    x.reshard()
            nxt = self._next(self.backward_order, up) if grad and self.prefetch else None
            if nxt is not None:
                nxt.launch()  # the first unit backward reaches after the root: behind the loss
                self._read_ahead(self.backward_order, nxt)

    # --- backward --------------------------------------------------------------

    def _queue_end_of_backward(self) -> None:
        self._iteration_ends()
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_opaque(self._end_of_backward))

    def pre_backward(self, up) -> None:
        self._note_create_graph()
        self._queue_end_of_backward()
        up.unshard()
        nxt = self._next(self.backward_order, up)
        if nxt is not None:
            nxt.launch()
            self._read_ahead(self.backward_order, nxt)

    def after_grad(self, up) -> None:
        if up.state is ParamState.SHARDED:
            return
        up.got += 1
        if up.got >= up.trainable and not self._keep_for_graph:
            up.reshard()  # every param of the unit has its grad: nothing in backward reads them again

    def _end_of_backward(self) -> None:
        """[Note: double backward] torch.autograd.grad(..., create_graph=True) builds a graph of the
        backward itself, and its nodes saved the gathered params (views of the full buffers) that
        the final backward reads: freeing them there gave "setStorage: ... out of bounds for
        storage of size 0". So a create_graph backward frees nothing, and neither do the grads of
        the backward after it (a node of the penalty's graph may read a param after the param's
        grad arrived); the end of the first backward without create_graph frees every unit. The
        cost: the units a penalty's graph reaches stay gathered from that backward to the end of
        the next one."""
        self._end_queued = False
        if torch.is_grad_enabled():
            return
        self.reshard_all()
