"""overlap_param_gather: step() leaves the all-gather of updated params running and each module
waits for its own in the next forward ([Note: gather behind forward]); every API that reads or
writes params waits first. Multi-rank runs have a timeout: a hang fails."""

import pytest
import torch

import dist_harness
import param_gather_workers as W
import zerokern


@pytest.mark.parametrize("world,stage,cap_mb", [(2, 1, 0.002), (2, 2, 0.002), (4, 2, 0.001), (2, 2, 25.0)])
def test_same_bits_as_waiting_in_step_and_adamw_numbers(world, stage, cap_mb):
    for r in dist_harness.values(dist_harness.run(W.against_waiting_and_adamw, world, stage, cap_mb, timeout=240)):
        assert r["losses"]["wait"] == r["losses"]["overlap"], r
        assert r["final_equal"] and all(r["reads_equal"]), r
        assert r["max_diff_ref"] < 2e-5, r
        assert all(r["pending_after_step"]), r  # step() returned with the gathers running
        # block 0 runs before the last block's gathers were waited for (step 2 follows a read of
        # block 1 only; the other reads waited for everything)
        seen = r["last_block_at_first"]
        assert seen[2] and set(seen[2]) == {"GATHERING"}, seen
        assert all(set(s) == {"GATHERED"} for k, s in enumerate(seen) if k != 2), seen


@pytest.mark.parametrize("stage", [1, 2])
def test_unused_block_and_replaced_param(stage):
    for r in dist_harness.values(dist_harness.run(W.unused_block_and_replaced_param, 2, stage, timeout=240)):
        assert r["losses_equal"] and r["final_equal"], r


def test_needs_shard_units():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"params\[0\] is not sharded with zerokern.shard"):
        zerokern.FusedZeroAdam(model.parameters(), overlap_param_gather=True)
    with pytest.raises(TypeError, match="overlap_param_gather must be True or False"):
        zerokern.shard(torch.nn.Linear(4, 4), overlap_param_gather="yes")
    sharded = zerokern.shard(torch.nn.Linear(4, 4), overlap_param_gather=True)
    with pytest.raises(ValueError, match="overlap_param_gather=False"):
        zerokern.FusedZeroAdam(sharded.parameters(), overlap_param_gather=False)


def test_one_process_trains_as_without_it():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    b.load_state_dict(a.state_dict())
    for blk in b:
        zerokern.shard(blk, overlap_param_gather=True)
    zerokern.shard(b, overlap_param_gather=True)
    opts = [zerokern.FusedZeroAdam(a.parameters(), lr=0.1), zerokern.FusedZeroAdam(b.parameters(), lr=0.1)]
    x = torch.randn(5, 4)
    for _ in range(3):
        for m, o in zip((a, b), opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_units_gather_in_the_order_the_forward_reaches_them():
    """The root first (its pre-hook runs first, also where its own params come last), then the
    blocks in order."""
    from zerokern.zero.unit import forward_order, unit_of

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for blk in list(model)[1::-1]:  # shard the blocks in reverse, to show the order is not the calls'
        zerokern.shard(blk)
    zerokern.shard(model)  # the root holds the head, registered last
    params = list(model.parameters())
    index = {p: k for k, p in enumerate(params)}
    units = [unit_of(model[2].weight), unit_of(model[1].weight), unit_of(model[0].weight)]
    assert forward_order(units, index) == [units[0], units[2], units[1]]
