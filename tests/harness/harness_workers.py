"""Rank functions for tests/harness/test_dist_harness.py: ranks that hang, raise, die, crash at exit, or
leave state behind, and one that reports what a rank starts with."""

import atexit
import os
import time

import torch
import torch.distributed as dist


def hang(rank, world):
    time.sleep(3600)


def raise_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 raised on purpose")
    return rank


def die_on_rank_1(rank, world):
    if rank == 1:
        os._exit(3)
    return rank


def abort_at_exit(rank, world):
    """Returns normally; the process aborts in Python's shutdown (atexit runs only there)."""
    atexit.register(os.abort)
    return rank


def leave_state_behind(rank, world):
    """Changes what a process-wide setting can change, and keeps a group and a zerokern optimizer."""
    import zerokern

    # the group first: the optimizer's collectives below wait for every rank to have made it (a rank
    # that returned at once could close the group's connections while its peer still connected)
    dist.new_group([0, 1])
    model = torch.nn.Linear(4, 4)
    leave_state_behind.kept = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3)
    os.environ["ZEROKERN_CHECK_COLLECTIVES"] = "0"
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234 + rank)
    return dict(pid=os.getpid(), dtype=torch.get_default_dtype())


def what_a_rank_starts_with(rank, world):
    fresh_draw = torch.rand(1, generator=torch.Generator().manual_seed(torch.initial_seed())).item()
    return dict(pid=os.getpid(), dtype=torch.get_default_dtype(), env=os.environ.get("ZEROKERN_CHECK_COLLECTIVES"),
                draw=torch.rand(1).item(), fresh_draw=fresh_draw, hash=hash("zerokern"), groups=len(
                    dist.distributed_c10d._world.pg_map), test_env=os.environ.get("HARNESS_TEST_VALUE"),
                cwd=os.getcwd())
