"""Which Comm a group gets: make_comm picks the class for the group's backend, comm_for adds the
hybrid (mesh) case. Apart from the Comm classes so that none of them names another."""

import os
import socket
from typing import Optional, Tuple

import torch.distributed as dist

from . import check as collective_check
from . import exit_drain
from .base import Comm
from .context import PROCESS
from .gloo import GlooComm
from .hybrid import HybridComm, describe, resolve_mesh


def make_comm(process_group=None) -> Comm:
    """The Comm for `process_group` (None: the default group if there is one, else one process),
    with the collectives its backend does fastest."""
    probe = Comm(process_group)  # resolves the default group and the world size
    if not probe.distributed:
        return probe
    exit_drain.register()  # [Note: exit drain]
    check = collective_check.for_group(probe.group)
    if dist.get_backend(probe.group) != "gloo":
        return Comm(probe.group, check=check)
    comm = GlooComm(probe.group, check=check)
    if comm.world_size > 2:  # 2 ranks move the fewest bytes on one host or two ([Note: collectives across hosts])
        comm.place(_hosts(comm))
    return comm


# [Note: what a host is] Ranks share a host when they have the same hostname and reach the
# rendezvous store from the same local address (the source address the kernel picks for the
# store's host:port; connect() on a UDP socket sends nothing). The hostname alone is not enough:
# network namespaces share one (bench/netbed.py's hosts), yet each has its own address and link.
# Torchrun's GROUP_RANK (the node's rank) would be right under torchrun only. Where no store
# address is known (a file:// init) the hostname alone decides. Gathered once per group (one
# gather_objects, announced as any collective), so every rank picks the same collectives.
def _store_address() -> Optional[Tuple[str, int]]:
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  a torch without it: the environment's address, if any
        store = None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT", "").isdigit():
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return None


def this_host() -> Tuple[str, Optional[str]]:
    """What tells this rank's host from another's ([Note: what a host is])."""
    address, where = None, _store_address()
    if where is not None:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(*where, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                address = s.getsockname()[0]
        except OSError:  # no route: only the hostname tells
            address = None
    return socket.gethostname(), address


def _hosts(comm):
    """Every rank's this_host() in `comm`'s group, gathered once per group."""
    ctx = PROCESS.of(comm.group)
    if ctx.hosts is None:
        ctx.hosts = comm.gather_objects(this_host(), name="hosts")
    return ctx.hosts


def mesh_comm(mesh, process_group, device_type: str):
    """A HybridComm for `mesh` (see resolve_mesh), after every rank agreed on the mesh (one
    collective over the world: a rank with another mesh, or none, makes every rank raise), or
    the shard group's plain Comm where the mesh has one replica."""
    world = make_comm(None)
    mine = ("mesh", tuple(mesh)) if isinstance(mesh, (tuple, list)) else None
    if mine is not None:  # sizes only: agree before building groups for them
        _agree(world, mine)
    mesh = resolve_mesh(mesh, process_group, device_type)
    description = describe(mesh)
    if mine is None:
        _agree(world, description)
    shard_group, replica_group = mesh.get_group("shard"), mesh.get_group("replicate")
    if dist.get_world_size(shard_group) < 2:
        raise ValueError(f"zerokern: the mesh {tuple(mesh.mesh.shape)} has a shard dim of size 1, so nothing would "
                         "be sharded; that is data parallelism (zero_stage=0 over the world, or DDP)")
    key = (id(shard_group), id(replica_group))
    # every shard() call and the optimizer share one HybridComm, so its byte count covers every unit
    cached = PROCESS.hybrids.get(key)
    if cached is not None and cached.shards.group is shard_group and cached.replicas.group is replica_group:
        return cached
    shards = make_comm(shard_group)
    if dist.get_world_size(replica_group) == 1:
        return shards
    PROCESS.hybrids[key] = comm = HybridComm(world, shards, make_comm(replica_group), description)
    return comm


def _agree(world, mine) -> None:
    everyone = world.differing(mine, "zerokern mesh")
    if everyone is not None:
        raise ValueError("zerokern: the ranks passed different meshes, so their groups would not pair: "
                         + "; ".join(f"rank {r}: {m}" for r, m in enumerate(everyone)))


def comm_for(process_group=None, mesh=None, device_type: Optional[str] = None):
    """The Comm sharding uses: over `mesh` where one is given, else over `process_group`."""
    if mesh is None:
        return make_comm(process_group)
    return mesh_comm(mesh, process_group, device_type or "cpu")
