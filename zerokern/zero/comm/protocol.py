"""What the runtime asks of a Comm, written down: Comm (base.py), GlooComm (gloo.py), HybridComm
(hybrid.py) and any stand-in (bench/overlap.py's simulated link) satisfy it, and
tests/zero/comm/test_comm_protocol.py checks each against it, so a new member cannot be added to one
and forgotten in another.

Every collective is asynchronous: it returns a work object (`wait()`, `is_completed()`) that
only `Comm.wait` waits for (it times the wait). Sums are divided by `dp_size` by the caller."""

from typing import Any, List, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class CommProtocol(Protocol):
    group: Any  # the process group the layout shards over (None: one process)
    rank: int  # this rank in `group`
    world_size: int  # ranks in `group`
    check: Any  # the collective check of [Note: announced collectives] (comm/check.py), or None
    # [Note: the collective for the backend] (grads/released.py): what the backend does fastest
    exchange_reduce: bool
    prefers_all_reduce: bool
    broadcast_gather: bool

    @property
    def distributed(self) -> bool:
        """More than one rank: collectives run."""

    @property
    def dp_size(self) -> int:
        """How many ranks' grads a reduced grad averages."""

    @property
    def leads(self) -> bool:
        """The one rank that gets what is handed to one rank (a full state dict)."""

    @property
    def shards(self) -> "CommProtocol":
        """The group the state is sharded over (itself, or a hybrid mesh's shard group)."""

    @property
    def wait_seconds(self) -> float:
        """Host time spent waiting on collectives."""

    # wire: a bucket's codec when its grads (GradWire) or params (ParamWire) travel in another
    # precision ([Note: one codec] in comm/wire.py)
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, name: str = ...,
                       wire: Any = None) -> Any: ...

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, name: str = ...,
                   across: Optional[torch.Tensor] = None, wire: Any = None) -> Any: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, name: str = ..., wire: Any = None) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0, name: str = ...) -> Any: ...

    def broadcast_from_first(self, tensors: Sequence[torch.Tensor], name: str = ...) -> None: ...

    def differing(self, mine: Any, what: str) -> Optional[List[Any]]: ...

    def gather_objects(self, obj: Any, name: str = ...) -> List[Any]: ...

    def wait(self, work: Any) -> None: ...
