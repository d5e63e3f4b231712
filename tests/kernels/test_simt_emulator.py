"""The SIMT emulator itself (csrc/emu, [Note: the SIMT emulator]): each construct against what the
CUDA programming guide says it does, written here independently of simt.h's PTX-rule code, and the
faults a GPU raises reported as its errors. Kernels: csrc/emu/selftest.cu."""

import ctypes

import pytest
import torch

import simt_emu as emu


@pytest.fixture(scope="module")
def lib():
    return emu.library()


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def expected_shuffle(mode, b, width, tid):
    lane, warp_base = tid % 32, tid - tid % 32
    seg = lane // width * width  # the first lane of this lane's group of `width`
    if mode == "idx":  # srcLane modulo width, within the group
        src = seg + b % width
    elif mode == "up":  # own value where lane - delta leaves the group
        src = lane - b if lane % width >= b else lane
    elif mode == "down":
        src = lane + b if lane % width + b < width else lane
    else:  # xor: a later group's lane gives the own value, an earlier group's is read
        src = lane ^ b if (lane ^ b) // width <= lane // width else lane
    return 1000 + warp_base + src


@pytest.mark.parametrize("mode", ["idx", "up", "down", "xor"])
@pytest.mark.parametrize("b,width", [(0, 32), (1, 32), (5, 32), (16, 32), (31, 32), (3, 8), (7, 8), (9, 8),
                                     (2, 16), (1, 2), (12, 16)])
def test_shuffles_as_the_programming_guide_says(lib, mode, b, width):
    out = torch.zeros(64, dtype=torch.int32)
    code = {"idx": 0, "up": 1, "down": 2, "xor": 3}[mode]
    emu.reset()
    assert lib.zk_emu_selftest_shuffle(code, b, width, ptr(out)) == 0, lib.zk_emu_last_message()
    assert out.tolist() == [expected_shuffle(mode, b, width, t) for t in range(64)]


@pytest.mark.parametrize("k", [0, 5, 64, 100])
def test_votes_and_barrier_reductions(lib, k):
    out = torch.zeros(64 * 4, dtype=torch.int32)
    emu.reset()
    assert lib.zk_emu_selftest_vote(64, k, ptr(out)) == 0, lib.zk_emu_last_message()
    rows = out.view(64, 4).tolist()
    ballot = sum(1 << lane for lane in range(32) if lane % 3 == 0)
    for t, (b, anyall, count, andor) in enumerate(rows):
        assert b & 0xFFFFFFFF == ballot and anyall == 3, t
        assert count == min(k, 64) and andor == int(k >= 64) + 2 * int(k > 0), t


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_shared_memory_barriers_and_atomics(lib, reverse):
    blocks = 5
    x = torch.arange(blocks * 256, dtype=torch.float32)  # integers: every sum exact in any order
    sums, total = torch.zeros(blocks), torch.zeros(1)
    count, maximum = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with emu.emulated(reverse=reverse) as log:
        assert lib.zk_emu_selftest_reduce(blocks, ptr(x), ptr(sums), ptr(total), ptr(count), ptr(maximum)) == 0
    assert log == [("reduce_kernel", (blocks, 1, 1), (256, 1, 1))]
    assert sums.tolist() == x.view(blocks, 256).sum(1).tolist()
    assert total.item() == x.sum().item() and count.item() == blocks * 256 and maximum.item() == blocks * 256 - 1


def test_three_dimensional_grids_and_blocks(lib):
    grid, block = (2, 3, 2), (4, 2, 3)
    n = 12 * 24
    out = torch.full((n * 4,), -1, dtype=torch.int32)
    g, b = (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block)
    emu.reset()
    assert lib.zk_emu_selftest_index(g, b, ptr(out)) == 0, lib.zk_emu_last_message()
    rows = out.view(n, 4).tolist()
    i = 0
    for bz in range(2):
        for by in range(3):
            for bx in range(2):
                for tz in range(3):
                    for ty in range(2):
                        for tx in range(4):
                            assert rows[i] == [i, tx | ty << 8 | tz << 16, bx | by << 8 | bz << 16, 4 | 2 << 8 | 3 << 16]
                            i += 1


@pytest.mark.parametrize("which,threads,code,words", [
    (0, 64, 719, "returned"),  # __syncthreads() that thread 5 left before
    (1, 32, 719, "returned"),  # a full-mask shuffle whose lane 3 returned
    (2, 1, 716, "not 16-byte aligned"),  # a float4 load at 4 bytes past an aligned address
    (3, 64, 719, ""),  # warp 0 at a shuffle, warp 1 at a barrier: never met
])
def test_faults_are_reported_as_a_gpu_would(lib, which, threads, code, words):
    x, out = torch.zeros(16), torch.zeros(64)
    emu.reset()
    rc = lib.zk_emu_selftest_faulty(which, threads, ptr(x), ptr(out))
    message = lib.zk_emu_last_message().decode()
    assert rc == code and words in message, (rc, message)
    emu.reset()
    assert lib.zk_emu_selftest_shuffle(3, 1, 32, ptr(torch.zeros(64, dtype=torch.int32))) == 0  # and runs on


def test_bad_launch_configurations_fail(lib):
    emu.reset()
    assert lib.zk_emu_selftest_vote(2048, 0, ptr(torch.zeros(2048 * 4, dtype=torch.int32))) == 9  # > 1024 threads
    assert "block (2048,1,1)" in lib.zk_emu_last_message().decode()
    emu.reset()
    out = torch.zeros(4 * 48, dtype=torch.int32)  # a partial last warp: the full-mask ballot names lanes it lacks
    assert lib.zk_emu_selftest_vote(48, 0, ptr(out)) == 719
    assert "lacks" in lib.zk_emu_last_message().decode()
