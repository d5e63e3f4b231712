"""HybridComm: sharding inside a group of ranks (a node), replicated across such groups.

[Note: hybrid sharding] With mesh=(replicate, shard), a 2-D DeviceMesh as FSDP2's HSDP takes, the
layout, the shards, the param gathers and the grad-norm sum live in the mesh's shard group (its
`shards` Comm: rank and world_size are that group's), which is meant to be one host's ranks. A
bucket's grads are reduce-scattered there, then each rank's reduced shard is all-reduced across
the replicas (the ranks that hold the same shard on the other hosts), so the slow link carries
1/shard-size of a bucket, as DeepSpeed ZeRO++'s hpZ and FSDP2's HSDP do; the sum is divided by
the whole mesh's size. Replicas then hold identical shards and do identical updates, so the
param gathers never cross hosts (so gather_precision leaves them full precision: [Note: quantized
param gathers] in params/gather.py). Agreements (flags, overflow, setup broadcasts, the checks that
every rank passed the same model) go over the whole mesh, so every rank still raises alike.

[Note: the replica hop's thread] With the collective check on, the replica all-reduce of a
shard is handed to a thread of the HybridComm's own (the relay), which waits for the shard's
reduce-scatter and then queues the all-reduce ([Note: announced collectives]), hops in the order
they were handed over, so every rank queues them alike. The caller goes on with the backward.
Launched from the caller's thread (as it was when the check's plan had it), the wait for the
reduce-scatter blocked the backward at every bucket: 0.4-0.7 s of a 1.5-2.0 s int4 step on the
2 x 2 test bed (bench/multihost.py). The wait is not left to the check's own thread either: that
thread must stay free for the rounds the other hosts' threads announce in, and one blocked on a
reduce-scatter (which waits for its host peer's backward, which may wait for a buffer: below)
closes a cycle through the other host and hangs. With the check off the all-reduce is launched
on the caller's thread when the bucket is waited for or its input released (a user's collective
on the same group could otherwise interleave differently on two ranks).

[Note: reading the input] Only the first hop reads the bucket's full buffer; the replica hop
reads and writes the reduced shard alone. So the Work of the two carries `read`, a Work done once
the first hop is (the relay has queued the second), and the grad path gives the full buffer back
to the pool then, not when the replicas have summed ([Note: stage-2 memory] in
grads/released.py): a backward keeps IN_FLIGHT_BUCKETS buffers in flight either way, but no
longer waits for the slow link to free one. Where the second hop reads the input (`part` views
it: an all-reduce whose result is read in place), `read` is None and the whole reduction is
waited for.
"""

import time
from typing import Tuple

import torch.distributed as dist

from . import wire as wire_comm
from .context import PROCESS
from .worker import OrderedWorker
from .works import Pending, Then


NAMES = ("replicate", "shard")


def _Then(first, launch, frees_input) -> Then:
    """A collective launched only when the one before it is waited for (collective check off),
    or its input released ([Note: reading the input])."""
    return Then(first, launch, launches=True, reads=frees_input)


def _Hop(first, launch, frees_input) -> Pending:
    """A replica hop for the relay ([Note: the replica hop's thread]): launch() once `first` is
    done; `read` is done once it launched ([Note: reading the input])."""
    def job():
        first.wait()
        return launch()
    return Pending(job=job, reads=frees_input)


def _Relay() -> OrderedWorker:
    """The thread that launches a HybridComm's replica hops, in order; started with the first hop."""
    return OrderedWorker("zerokern-relay")


def describe(mesh) -> Tuple:
    return ("mesh", tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ()), mesh.mesh.flatten().tolist())


def resolve_mesh(mesh, process_group, device_type: str):
    """The DeviceMesh for `mesh` (a 2-D DeviceMesh, or a (replicate, shard) pair of sizes that
    zerokern builds the mesh for), validated on this rank alone: an error here is raised on
    every rank that passed the same thing, without a collective."""
    if process_group is not None:
        raise ValueError("zerokern: pass either mesh= or process_group=, not both (the mesh's shard group is the "
                         "process group)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("zerokern: mesh= needs torch.distributed: call init_process_group() first")
    world = dist.get_world_size()
    if isinstance(mesh, (tuple, list)) and len(mesh) == 2 and all(isinstance(n, int) for n in mesh):
        r, s = mesh
        if r < 1 or s < 1 or r * s != world:
            raise ValueError(f"zerokern: mesh=({r}, {s}) (replicate, shard) has {r * s} ranks, but the world has "
                             f"{world}: the sizes must multiply to the world size (hosts x ranks per host)")
        key = (device_type, r, s, id(dist.distributed_c10d._get_default_group()))
        # one per (replicate, shard) pair and default group (a new init_process_group makes new
        # ones): every shard() call and the optimizer share it
        meshes = PROCESS.meshes
        if key not in meshes:
            from torch.distributed.device_mesh import init_device_mesh
            meshes[key] = init_device_mesh(device_type, (r, s), mesh_dim_names=NAMES)
        return meshes[key]
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"zerokern: mesh must be a 2-D DeviceMesh with dims named {NAMES} or a (replicate, shard) "
                        f"pair of ints, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or not set(NAMES) <= set(names):
        raise ValueError(f"zerokern: the mesh has dims {names or 'without names'} (shape {tuple(mesh.mesh.shape)}); "
                         f"hybrid sharding needs a 2-D mesh with dims named {NAMES}: init_device_mesh(device, "
                         f"(hosts, ranks_per_host), mesh_dim_names={NAMES})")
    if mesh.size() != world:
        raise ValueError(f"zerokern: the mesh covers {mesh.size()} ranks (shape {tuple(mesh.mesh.shape)}) but the "
                         f"world has {world}: build it over every rank")
    return mesh


class HybridComm:
    """The Comm of one rank of a (replicate x shard) mesh ([Note: hybrid sharding]). It answers
    as its shard group's Comm (rank, world_size, group, the backend's choices) except where
    the replicas take part: grad reductions, agreements and broadcasts."""

    def __init__(self, world, shards, replicas, description):
        self.world, self.shards, self.replicas, self.description = world, shards, replicas, description
        self.group, self.rank, self.world_size = shards.group, shards.rank, shards.world_size
        self.check = shards.check
        self.exchange_reduce = shards.exchange_reduce
        self.prefers_all_reduce = shards.prefers_all_reduce
        self.broadcast_gather = shards.broadcast_gather
        # what this rank sent to the other hosts for the replica all-reduces (a ring over one rank
        # per host sends 2 (h - 1) / h of the tensor): the counter bench/multihost.py checks
        # against the links' own counters and the planner's count
        self.inter_host_bytes = 0
        self._relay = _Relay()

    distributed = True

    @property
    def dp_size(self) -> int:
        """How many ranks' grads a reduced grad averages: the whole mesh's."""
        return self.world.world_size

    @property
    def wire_rank(self) -> int:
        """Only the replica all-reduce is quantized: its ranks differ by host. The ranks of one host
        round alike, so at stage 0, where each sends the same whole bucket, every rank ends alike."""
        return self.replicas.rank

    @property
    def leads(self) -> bool:
        return self.world.rank == 0

    @property
    def wait_seconds(self) -> float:
        return self.shards.wait_seconds  # wait() below adds every wait there

    def _across(self, first, input, part, name, w=None):
        """`first` (a shard-group collective of `input` whose result is `part`), then `part` summed
        across the replicas; w: its GradWire, if the grads cross hosts in another precision (only
        this hop is quantized: [Note: quantized reductions] in comm/wire.py)."""
        r, name = self.replicas, f"{name}/replicas"
        h = r.world_size
        # [Note: reading the input]: free after the first hop unless the second reads it (part views it)
        frees = part.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
        self.inter_host_bytes += wire_comm.all_reduce_bytes(part, h, w)
        launch = lambda: r.all_reduce(part, name=name, wire=w)  # noqa: E731
        if r.check is not None:  # [Note: the replica hop's thread]
            return self._relay.hand(_Hop(first, launch, frees))
        return _Then(first, launch, frees)

    def reduce_scatter(self, output, input, name="reduce_scatter", wire=None):
        return self._across(self.shards.reduce_scatter(output, input, name), input, output, name, wire)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, name="all_reduce", across=None, wire=None):
        """Over the whole mesh. across: grads, of which only this part is needed after (this
        rank's range of a bucket): summed in the shard group, then that part across replicas."""
        if across is None:
            return self.world.all_reduce(tensor, op=op, name=name)
        return self._across(self.shards.all_reduce(tensor, op=op, name=name), tensor, across, name, wire)

    def all_gather(self, output, input, name="all_gather", wire=None):
        return self.shards.all_gather(output, input, name, wire)

    def broadcast(self, tensor, src_rank=0, name="broadcast"):
        return self.world.broadcast(tensor, src_rank, name)

    def broadcast_from_first(self, tensors, name="broadcast_params"):
        self.world.broadcast_from_first(tensors, name)

    def differing(self, mine, what):
        return self.world.differing(mine, what)

    def gather_objects(self, obj, name="gather_objects"):
        return self.world.gather_objects(obj, name)

    def wait(self, work):
        t0 = time.perf_counter()
        work.wait()
        self.shards.wait_seconds += time.perf_counter() - t0
