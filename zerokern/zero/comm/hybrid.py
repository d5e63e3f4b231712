"""HybridComm: sharding inside a group of ranks (a node), replicated across such groups.

[Note: hybrid sharding] With mesh=(replicate, shard), a 2-D DeviceMesh as FSDP2's HSDP takes, the
layout, the shards, the param gathers and the grad-norm sum live in the mesh's shard group (its
`shards` Comm: rank and world_size are that group's), which is meant to be one host's ranks. A
bucket's grads are reduce-scattered there, then each rank's reduced shard is all-reduced across
the replicas (the ranks that hold the same shard on the other hosts), so the slow link carries
1/shard-size of a bucket, as DeepSpeed ZeRO++'s hpZ and FSDP2's HSDP do; the sum is divided by
the whole mesh's size. Replicas then hold identical shards and do identical updates, so the
param gathers never cross hosts (so gather_precision leaves them full precision: [Note: quantized
param gathers] in params/wire_gather.py). Agreements (flags, overflow, setup broadcasts, the checks that
every rank passed the same model) go over the whole mesh, so every rank still raises alike.

With the collective check on, the replica all-reduce of a shard is queued at once and launched
by the replica group's check thread as soon as the shard's reduce-scatter is done ([Note:
announced collectives]), so it overlaps the rest of the backward; with the check off it is
launched when the bucket is waited for.
"""

import time
from typing import Tuple

import torch.distributed as dist

from . import wire as wire_comm


NAMES = ("replicate", "shard")
# the DeviceMesh zerokern made for a (replicate, shard) pair, per default group (a new
# init_process_group makes new ones): every shard() call and the optimizer share one
_MESHES = {}


class _Then:
    """A collective launched only when the one before it is waited for (collective check off)."""

    def __init__(self, first, second):
        self.first, self.second, self.work = first, second, None

    def wait(self):
        if self.work is None:
            self.first.wait()
            self.work = self.second()
        return self.work.wait()

    def is_completed(self):
        return self.work is not None and self.work.is_completed()


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
        if key not in _MESHES:
            from torch.distributed.device_mesh import init_device_mesh
            _MESHES[key] = init_device_mesh(device_type, (r, s), mesh_dim_names=NAMES)
        return _MESHES[key]
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

    def _across(self, first, part, name, w=None):
        """`first` (a shard-group collective whose result is `part`), then `part` summed across the
        replicas; w: its GradWire, if the grads cross hosts in another precision (only this hop is
        quantized: [Note: quantized reductions] in comm/wire.py)."""
        r, name = self.replicas, f"{name}/replicas"
        h = r.world_size
        self.inter_host_bytes += wire_comm.all_reduce_bytes(part, h, w)
        if r.check is not None:
            if w is not None and w.bits is not None:
                return r._launch(name, part, lambda g: (first.wait(), wire_comm.all_reduce(part, g, r.rank, h, w))[1],
                                 blocks=h > 2)
            if w is None:
                return r._launch(name, part,
                                 lambda g: (first.wait(), dist.all_reduce(part, group=g, async_op=True))[1])
        return _Then(first, lambda: r.all_reduce(part, name=name, wire=w))

    def reduce_scatter(self, output, input, name="reduce_scatter", wire=None):
        return self._across(self.shards.reduce_scatter(output, input, name), output, name, wire)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, name="all_reduce", across=None, wire=None):
        """Over the whole mesh. across: grads, of which only this part is needed after (this
        rank's range of a bucket): summed in the shard group, then that part across replicas."""
        if across is None:
            return self.world.all_reduce(tensor, op=op, name=name)
        return self._across(self.shards.all_reduce(tensor, op=op, name=name), across, name, wire)

    def all_gather(self, output, input, name="all_gather"):
        return self.shards.all_gather(output, input, name)

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
