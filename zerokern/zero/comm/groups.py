"""The process groups the collective check makes for a group ([Note: announced collectives] in
comm/check.py): a gloo group for the announcements and one for zerokern's own collectives, made
off torch's books where only some ranks make them, and the timeout that bounds their waits."""

import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from .context import PROCESS

_RESTART_HINT = ("If torchrun restarted the workers (--max-restarts) with --rdzv-backend c10d, the store it shares "
                 "with them still holds the last attempt's addresses (pytorch/pytorch#135712): set "
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or launch without --rdzv-backend c10d.")


# [Note: groups only some ranks make] torch names a group made with use_local_synchronization
# from its ranks and a salt, the counter _world.group_count, and every group made on a rank
# advances that counter, on the members alone for a local group. So the check's two groups for a
# sub-group (made by its members only: the other ranks never make a zerokern Comm for it) would
# leave the members' counters ahead of the others', and the next group made by every rank (a
# dist.new_group over the world) would get another name, and so another store prefix, on the
# members than on the rest: every rank waits in its barrier for good (issue 39). So the check
# makes its local groups off the books: salted by a counter of its own per set of ranks (the
# members make the check's groups for a set of ranks in the same order), from a range torch's
# counter never reaches, and torch's counter is put back afterwards.
# (tests/zero/comm/test_agreement_patterns.py: a sub-group trained on, then a world group.)
_OFF_THE_BOOKS = 1 << 48


@contextmanager
def _off_the_books(ranks):
    world = dist.distributed_c10d._world
    kept = world.group_count
    salt = PROCESS.salt(ranks)  # the check groups made for these ranks so far
    world.group_count = _OFF_THE_BOOKS + 16 * salt
    try:
        yield
    finally:
        world.group_count = kept


def _new_group(ranks, **kw):
    """dist.new_group, naming the known cause when it fails on a restarted worker."""
    try:
        return dist.new_group(ranks, **kw)
    except RuntimeError as e:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            raise RuntimeError(f"zerokern: creating its process groups failed on a restarted worker "
                               f"({str(e).splitlines()[0][:160]}). " + _RESTART_HINT) from e
        raise


def _timeout() -> float:
    raw = os.environ.get("ZEROKERN_COLLECTIVE_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"zerokern: ZEROKERN_COLLECTIVE_TIMEOUT={raw!r} is not a positive number of seconds")
    return value



class CheckGroups(NamedTuple):
    """A group's check groups: the announcements' (gloo) and the data collectives' (the group's backend)."""
    control: Any
    data: Any
    timeout: float  # seconds: ZEROKERN_COLLECTIVE_TIMEOUT


def check_groups(group) -> CheckGroups:
    timeout = _timeout()
    ranks = dist.get_process_group_ranks(group)
    # Local synchronization: only the group's members create them (a sub-group's other ranks
    # never make a zerokern Comm for it). WORLD's are made by everyone anyway.
    local = group is not dist.group.WORLD
    with _off_the_books(ranks) if local else nullcontext():
        control = _new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout), use_local_synchronization=local)
        data = _new_group(ranks, backend=dist.get_backend(group), use_local_synchronization=local)
    return CheckGroups(control, data, timeout)
