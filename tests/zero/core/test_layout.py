"""FlatLayout properties over many random shapes and world sizes, and flat
storage whose views autograd accumulates into."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zerokern.zero.params.storage import FlatBuffers
from zerokern.zero.core.layout import plan_layout

numels = st.lists(st.integers(min_value=0, max_value=3000), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(numels=numels, world=st.integers(1, 8), cap=st.integers(1, 5000), align=st.sampled_from([1, 4, 16, 64]))
def test_plan_properties(numels, world, cap, align):
    layout = plan_layout(numels, world, cap, align)
    assert [s.index for s in layout.slots] == list(range(len(numels)))
    assert [s.numel for s in layout.slots] == numels
    seen_order = [i for b in layout.buckets for i in b.tensors]
    assert seen_order == list(range(len(numels))), "buckets keep the given order"
    for b in layout.buckets:
        assert b.padded_numel % (world * align) == 0 and b.padded_numel >= b.numel
        assert b.shard_numel * world == b.padded_numel and b.shard_numel % align == 0
        ranges = sorted((layout.slots[i].offset, layout.slots[i].offset + layout.slots[i].numel) for i in b.tensors)
        for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
            assert e0 <= s1, "tensors in a bucket do not overlap"
        for i in b.tensors:
            assert layout.slots[i].offset % align == 0, "every tensor starts aligned"
            assert layout.slots[i].bucket == b.index
        if len(b.tensors) > 1:
            assert b.numel <= cap, "only a lone tensor may exceed the cap"
        # the gaps and the tensors tile the bucket exactly (GradBucket.zero clears the gaps)
        held = [0] * b.padded_numel
        assert all(lo < hi for lo, hi in layout.gaps(b.index)), "no empty gap"
        for lo, hi in list(layout.gaps(b.index)) + ranges:
            for k in range(lo, hi):
                held[k] += 1
        assert held == [1] * b.padded_numel
    # Every element of every tensor is owned by exactly one rank.
    owned = {i: [0] * n for i, n in enumerate(numels)}
    for b in layout.buckets:
        for r in range(world):
            start, end = layout.rank_range(r, b.index)
            assert start % align == 0
            for p in layout.rank_pieces(r, b.index):
                assert 0 <= p.shard_offset and p.shard_offset + p.numel <= end - start
                assert layout.slots[p.index].offset + p.tensor_start == start + p.shard_offset
                for k in range(p.tensor_start, p.tensor_start + p.numel):
                    owned[p.index][k] += 1
    assert all(c == 1 for counts in owned.values() for c in counts)


def test_small_example_by_hand():
    # 10 and 5 elements, align 4, world 2, cap 100: offsets 0 and 12, end 17, padded to 24.
    layout = plan_layout([10, 5], world_size=2, bucket_cap=100, align=4)
    assert [(s.bucket, s.offset) for s in layout.slots] == [(0, 0), (0, 12)]
    (b,) = layout.buckets
    assert (b.numel, b.padded_numel, b.shard_numel) == (17, 24, 12)
    assert layout.rank_range(1, 0) == (12, 24)
    assert [(p.index, p.tensor_start, p.shard_offset, p.numel) for p in layout.rank_pieces(0, 0)] == [(0, 0, 0, 10)]
    assert [(p.index, p.tensor_start, p.shard_offset, p.numel) for p in layout.rank_pieces(1, 0)] == [(1, 0, 0, 5)]


def test_cap_splits_buckets_and_big_tensors_stand_alone():
    layout = plan_layout([30, 30, 100, 5], world_size=1, bucket_cap=64, align=1)
    assert [b.tensors for b in layout.buckets] == [(0, 1), (2,), (3,)]


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(bucket_cap=0), dict(align=0)])
def test_bad_arguments(bad):
    args = dict(numels=[3], world_size=2, bucket_cap=10, align=4)
    args.update(bad)
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_layout(**args)
    with pytest.raises(ValueError, match=r"numels\[1\] is negative"):
        plan_layout([1, -2], 1, 10)


def test_gradients_accumulate_into_the_buckets():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3))
    ref.load_state_dict(model.state_dict())
    params = list(model.parameters())[::-1]  # backward order
    layout = plan_layout([p.numel() for p in params], world_size=2, bucket_cap=64, align=16)
    assert len(layout.buckets) > 1
    pbuf = FlatBuffers.from_tensors(params, layout)
    pbuf.bind_params(params)
    gbuf = FlatBuffers.zeros(layout, torch.float32, "cpu")
    gbuf.bind_grads(params)
    x = torch.randn(5, 7)
    for _ in range(2):  # two backward passes accumulate
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    for i, (p, r) in enumerate(zip(params, list(ref.parameters())[::-1])):
        assert torch.equal(p, r), f"param {i} value survived the rebinding"
        assert torch.equal(gbuf.view(i, p.shape), r.grad), f"grad {i} landed in the bucket"
        assert p.grad.data_ptr() == gbuf.view(i, p.shape).data_ptr(), "the grad is still the bucket view"
    # padding stays zero, and a shard is a contiguous slice of the bucket
    for b in layout.buckets:
        used = torch.zeros(b.padded_numel, dtype=torch.bool)
        for i in b.tensors:
            s = layout.slots[i]
            used[s.offset:s.offset + s.numel] = True
        assert torch.all(gbuf.buffers[b.index][~used] == 0)
        assert torch.equal(torch.cat([gbuf.shard(r, b.index) for r in range(2)]), gbuf.buffers[b.index])


def test_storage_rejects_mismatches():
    layout = plan_layout([4, 4], 1, 100)
    with pytest.raises(ValueError, match="1 tensors for a layout of 2"):
        FlatBuffers.from_tensors([torch.ones(4)], layout)
    bf = FlatBuffers.zeros(layout, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match=r"params\[0\] is torch.float32, the buffer is torch.bfloat16"):
        bf.bind_params([torch.ones(4), torch.ones(4)])
