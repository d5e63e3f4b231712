"""The harness's promises (tests/dist_harness.py), on both of its ways to start ranks: a hang fails
within its timeout, a rank that raises is reported, a rank that dies or crashes in Python's shutdown
fails the run, and after each of these the next run works and starts from fresh processes that
nothing an earlier run did reaches."""

import os
import time

import pytest
import torch

import dist_harness
import harness_workers as W


def _next_run_works(before=(), **kw):
    """A run after `before` (runs' results): its ranks are new processes, with the parent's
    environment and directory, and none of the state a rank can leave in a process."""
    pids = {r["pid"] for results in before for r in results}
    os.environ["HARNESS_TEST_VALUE"] = "seen"  # set after any zygote started: it must still arrive
    try:
        now = dist_harness.values(dist_harness.run(W.what_a_rank_starts_with, 2, timeout=60, **kw))
    finally:
        del os.environ["HARNESS_TEST_VALUE"]
    for r in now:
        assert r["pid"] not in pids and r["pid"] != os.getpid(), r
        assert r["dtype"] == torch.float32 and r["env"] is None, r
        assert r["draw"] == r["fresh_draw"], r  # torch's generator as a new process has it
        assert r["groups"] == 1, r  # the default group, nothing else
        assert r["test_env"] == "seen" and r["cwd"] == os.getcwd(), r
    assert now[0]["pid"] != now[1]["pid"]
    if "PYTHONHASHSEED" not in os.environ:  # each rank's interpreter its own hash seed, as on two hosts
        assert now[0]["hash"] != now[1]["hash"], now
    return now


@pytest.mark.parametrize("fresh", [False, True])
def test_a_hang_fails_within_the_timeout(fresh):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3 s"):
        dist_harness.run(W.hang, 2, timeout=3, fresh=fresh)
    # the spawned way joins rank by rank (up to 2 x 3 s); either way the ranks are killed at once
    assert time.monotonic() - start < 2 * 3 + 30
    _next_run_works()


def test_a_raised_exception_is_reported():
    results = dist_harness.run(W.raise_on_rank_1, 2)
    assert results[0] == ("ok", 0)
    assert results[1][0] == "error" and "ValueError: rank 1 raised on purpose" in results[1][1], results
    assert "Traceback" in results[1][1]  # where it was raised
    with pytest.raises(AssertionError, match="rank 1 failed"):
        dist_harness.values(results)
    _next_run_works()


def test_a_rank_that_dies_fails_the_run():
    with pytest.raises(AssertionError, match=r"exited abnormally .*\{1: 3\}"):
        dist_harness.run(W.die_on_rank_1, 2)
    _next_run_works()


@pytest.mark.parametrize("fresh", [False, True])
def test_a_crash_in_python_shutdown_fails_the_run(fresh):
    """The ranks end through Python's full shutdown, where the exit drain ([Note: exit drain]) and
    the crashes it prevents happen: here an atexit callback aborts."""
    with pytest.raises(AssertionError, match=r"exited abnormally .*\{0: -6, 1: -6\}"):
        dist_harness.run(W.abort_at_exit, 2, fresh=fresh)
    _next_run_works()


def test_state_a_run_leaves_behind_does_not_reach_the_next():
    first = _next_run_works()
    left = dist_harness.values(dist_harness.run(W.leave_state_behind, 2, timeout=60))
    assert [r["dtype"] for r in left] == [torch.float64] * 2  # it did change them
    second = _next_run_works([first, left])
    _next_run_works([first, second], fresh=True)
