"""GradBufferPool ([Note: what the pool keeps] in zerokern/zero/grads/pool.py), on its own."""

import torch

from zerokern.zero.grads.pool import GradBufferPool

F32, CPU = torch.float32, torch.device("cpu")


def test_buckets_up_to_the_unit_share_one_size_and_are_reused():
    pool = GradBufferPool(keep=5, unit={F32: 100})
    a = pool.acquire(50, F32, CPU)
    assert a.numel() == 100 and torch.count_nonzero(a[:50]) == 0
    pool.release(a)
    b = pool.acquire(80, F32, CPU, zero=False)
    assert b is a and pool.allocations == 1


def test_a_larger_bucket_gets_its_own_size_and_the_smallest_free_buffer_that_fits():
    pool = GradBufferPool(keep=5, unit={F32: 100})
    big, huge = pool.acquire(300, F32, CPU), pool.acquire(500, F32, CPU)
    assert (big.numel(), huge.numel()) == (300, 500)
    pool.release(huge)
    pool.release(big)
    assert pool.acquire(200, F32, CPU) is big  # no new allocation for a size between
    assert pool.acquire(100, F32, CPU) is huge  # nothing smaller free: a larger one, not a new one
    assert pool.allocations == 2


def test_at_most_keep_free_buffers_stay_the_least_recently_released_dropped_first():
    pool = GradBufferPool(keep=2, unit={F32: 10})
    bufs = [pool.acquire(10, F32, CPU) for _ in range(5)]  # a no_sync accumulation: all in use at once
    assert pool.held_bytes == pool.peak_bytes == 5 * 40
    for b in bufs:
        pool.release(b)
    assert pool.held_bytes == 2 * 40 and pool.free_bytes() == 2 * 40 and pool.in_use_bytes == 0
    got = [pool.acquire(10, F32, CPU), pool.acquire(10, F32, CPU)]
    assert {id(g) for g in got} == {id(b) for b in bufs[3:]}, "the kept buffers are the last two released"
    assert pool.allocations == 5


def test_dtypes_and_devices_do_not_mix():
    pool = GradBufferPool(keep=5, unit={F32: 10, torch.bfloat16: 20})
    a = pool.acquire(10, F32, CPU)
    pool.release(a)
    b = pool.acquire(10, torch.bfloat16, CPU)
    assert b is not a and b.dtype == torch.bfloat16 and b.numel() == 20
