"""Every collective zerokern launches is first announced to the other ranks, so ranks that
reached different ones raise alike instead of hanging, aborting or mixing buffers.

[Note: announced collectives] Collectives pair by order: the k-th collective one rank launches
on a group meets the k-th of every other rank. A rank that skips one (a unit one rank's forward
did not run: LayerDrop, MoE experts; an exception one rank caught and went on from; a
full_state_dict or generate on rank 0 only) pairs everything after it with the wrong partner:
gloo aborts the process ("Received data size doesn't match expected size", SIGABRT, no Python
exception), NCCL hangs, and two buffers of the same size silently add up unrelated grads. So
before each collective every rank all-reduces (MAX) one small ticket, [v, -v] for v = (its
sequence number, a checksum of the collective's name, shape and dtype), over a gloo group of
its own: every rank's v is equal exactly when max(v) == -max(-v). Only then does the real
collective launch, so a data collective always meets its partner. On a mismatch every rank
gathers what each was at and raises the same error. As torch's TORCH_DISTRIBUTED_DEBUG=DETAIL
(ProcessGroupWrapper) checks collectives, but with one all-reduce of 16 bytes and the unit or
bucket named, on by default.

The group is gloo on the CPU, its own: it never queues behind the data collectives in flight
(gloo runs one group's work on a few threads, in order) and never waits for the GPU (an NCCL
check would cost a device sync per collective). Its timeout bounds the wait for a rank that
reaches no collective at all (stuck in its own code, or gone): ZEROKERN_COLLECTIVE_TIMEOUT
seconds (600 by default, NCCL's); a rank that exits makes the others' wait fail at once.
ZEROKERN_CHECK_COLLECTIVES=0 turns the check off (one host round trip per collective saved; a
mismatch is then a hang or an abort again).
"""

import os
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveMismatch(RuntimeError):
    """The ranks reached different collectives (raised alike on every rank)."""


def _timeout() -> float:
    raw = os.environ.get("ZEROKERN_COLLECTIVE_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"zerokern: ZEROKERN_COLLECTIVE_TIMEOUT={raw!r} is not a positive number of seconds")
    return value


_HINT = ("Every rank must make the same zerokern calls and run the same units, in the same order: run every unit "
         "on every rank (LayerDrop, MoE experts: give a skipped unit a zero-weight input instead), skip a failed "
         "batch on every rank or stop, call full_state_dict/save_model on every rank (rank0_only=True keeps the "
         "result on rank 0), and pass synced_gpus=True to generate().")


class CollectiveCheck:
    """The announcements of one process group: its own gloo group and the sequence number."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = _timeout()
        ranks = dist.get_process_group_ranks(group)
        # Local synchronization: only the group's members create it (a sub-group's other ranks
        # never make a zerokern Comm for it). WORLD's check is made by everyone anyway.
        self.control = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=self.timeout),
                                      use_local_synchronization=group is not dist.group.WORLD)
        self.seq = 0

    def announce(self, name: str, tensor=None) -> None:
        """Wait until every rank announced this collective; raise alike on every rank if one
        announced another."""
        self.seq += 1
        what = name if tensor is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
        v = ((self.seq % (1 << 30)) << 32) | zlib.crc32(what.encode())
        ticket = torch.tensor([v, -v], dtype=torch.int64)
        self._run(lambda: dist.all_reduce(ticket, op=dist.ReduceOp.MAX, group=self.control), what)
        if int(ticket[0]) == -int(ticket[1]):
            return
        everyone = [None] * self.world_size
        self._run(lambda: dist.all_gather_object(everyone, (self.seq, what), group=self.control), what)
        raise CollectiveMismatch(
            "zerokern: the ranks reached different collectives, which cannot pair: "
            + "; ".join(f"rank {r} at #{s} {w}" for r, (s, w) in enumerate(everyone)) + ". " + _HINT)

    def _run(self, op, what) -> None:
        try:
            op()
        except RuntimeError as e:
            raise CollectiveMismatch(
                f"zerokern (rank {self.rank}): waiting for the other ranks to reach #{self.seq} {what} failed "
                f"({str(e).splitlines()[0][:160]}): a rank stopped, raised, or waits elsewhere (timeout "
                f"{self.timeout:g} s, ZEROKERN_COLLECTIVE_TIMEOUT). " + _HINT) from None


# One check per process group (the groups' Comm objects share its sequence numbers: the group's
# collectives pair in one order, whichever Comm launched them).
_CHECKS = {}


def for_group(group):
    """The group's CollectiveCheck, made on first use (a collective: every member makes its
    first Comm for the group at the same call), or None where checks are off."""
    if os.environ.get("ZEROKERN_CHECK_COLLECTIVES", "1") == "0":
        return None
    entry = _CHECKS.get(id(group))
    if entry is None or entry.group is not group:
        entry = _CHECKS[id(group)] = CollectiveCheck(group)
    return entry
