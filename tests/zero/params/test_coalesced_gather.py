"""[Note: coalesced param gathers]: at stages 1/2 small param buckets are gathered as one
collective a group after the update, with the per-bucket gathers' bits."""

import pytest
import torch

import coalesced_workers as W
import dist_harness
from zerokern.zero.params.coalesced import plan_groups

F32, BF16, CPU = (torch.float32, "cpu"), (torch.bfloat16, "cpu"), None


def test_plan_groups_consecutive_equal_keys_within_the_limit():
    assert plan_groups([10, 10, 10, 10], [F32] * 4, limit=25) == [[0, 1], [2, 3]]
    assert plan_groups([10, 10, 10], [F32] * 3, limit=30) == [[0, 1, 2]]
    # another dtype, or a bucket that never coalesces (None), breaks a group
    assert plan_groups([1, 1, 1, 1, 1], [F32, BF16, F32, None, F32], limit=100) == [[0], [1], [2], [3], [4]]
    assert plan_groups([1, 1, 1, 1], [F32, F32, None, None], limit=100) == [[0, 1], [2], [3]]
    # a bucket at or over the limit alone; the limit 0 coalesces nothing
    assert plan_groups([5, 40, 5, 5], [F32] * 4, limit=20) == [[0], [1], [2, 3]]
    assert plan_groups([5, 5], [F32] * 2, limit=0) == [[0], [1]]
    assert plan_groups([], [], limit=10) == []
    with pytest.raises(ValueError, match="2 bucket sizes for 1 keys"):
        plan_groups([1, 2], [F32])


# (world, optimizer, stage, dtype): FusedZeroAdam and ZeroOptimizer's matrix-whole layout (Muon + AdamW)
CASES = [(2, "adam", 1, torch.float32), (2, "muon", 2, torch.bfloat16), (4, "adam", 2, torch.float32),
         (4, "muon", 1, torch.float32), (4, "muon", 2, torch.float32)]


@pytest.mark.parametrize("world,kind,stage,dtype", CASES)
def test_same_bits_as_a_gather_a_bucket_with_fewer_collectives(world, kind, stage, dtype):
    out = dist_harness.values(dist_harness.run(W.same_bits, world, kind, stage, dtype, 1 << 20, timeout=240))
    for r in out:
        assert all(r["equal"]), r["equal"]
        assert r["buckets"] >= 2 and r["groups"] == [r["buckets"]], r  # every bucket in one group
        # one bucket: one broadcast a rank; coalesced: one broadcast a rank for them all
        assert r["launched"]["alone"] == [world * r["buckets"]] * 4, r["launched"]
        assert r["launched"]["coalesced"] == [world] * 4, r["launched"]
    for p, q in zip(out[0]["params"], out[1]["params"]):  # every rank holds the same params
        assert torch.equal(p, q)


def test_the_limit_splits_the_groups():
    out = dist_harness.values(dist_harness.run(W.same_bits, 2, "adam", 2, torch.float32, 2500, timeout=240))
    for r in out:
        assert all(r["equal"]), r["equal"]
        assert len(r["groups"]) > 1 and sum(r["groups"]) == r["buckets"], r
        assert r["launched"]["coalesced"][0] == 2 * len(r["groups"]), r
