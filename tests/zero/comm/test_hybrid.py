"""Hybrid sharding (issue 28): sharded within a shard group, replicated across groups, over a
(replicate, shard) mesh, on 4 (2 x 2) and 6 (3 x 2) gloo ranks against AdamW on one process."""

import os

import pytest

import dist_harness
import hybrid_workers as W


def _check(results, cases, shard_world, dp_size):
    for r in dist_harness.values(results):
        for case in cases:
            got = r[case]
            # fp32: the ranks' grads are summed in another order than one process's batch mean
            assert got["losses"] == pytest.approx(got["ref_losses"], rel=1e-5, abs=1e-7), (case, got)
            assert got["diff"] < 1e-5, (case, got["diff"])
            assert (got["shard_world"], got["dp_size"]) == (shard_world, dp_size), got
            if case[1] == "fused":  # exp_avg and exp_avg_sq of a 1/shard_world slice (plus the buckets' padding)
                assert 8 * got["numel"] <= got["adam_state"] * shard_world <= 8 * (got["numel"] + 32 * 16), got


def test_2x2_mesh_every_stage():
    cases = [(1, "fused"), (2, "fused"), (3, "fused"), (2, "sgd")]
    _check(dist_harness.run(W.train, 4, (2, 2), cases, timeout=300), cases, 2, 4)


def test_3x2_mesh_device_mesh():
    cases = [(2, "fused"), (3, "fused")]
    _check(dist_harness.run(W.train, 6, "device_mesh", cases, timeout=300), cases, 2, 6)


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_saved_at_one_mesh_loads_at_another(tmp_path, stage):
    path = str(tmp_path / "ckpt")
    for r in dist_harness.values(dist_harness.run(W.checkpoint, 4, path, stage, (2, 2), (1, 4), timeout=300)):
        assert r["shard_world"] == 4
        assert r["resumed"] == pytest.approx(r["after"], rel=1e-5, abs=1e-7), r
    # one copy: every saved tensor's chunks cover it once (the replicas' equal slices are not written twice)
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(path).read_metadata()
    for fqn, m in meta.state_dict_metadata.items():
        chunks = getattr(m, "chunks", None)
        if chunks:
            covered = sum(c.sizes.numel() for c in chunks)
            assert covered == m.size.numel(), (fqn, covered, m.size)
    # and as many bytes as the same state saved from the (1, 4) mesh, whose ranks all hold other slices
    written = [sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".distcp"))
               for d in (path, path + "-again")]
    assert written[0] <= 1.05 * written[1], written


@pytest.mark.parametrize("case, expect", [
    ("not_dividing", "mesh=(3, 2) (replicate, shard) has 6 ranks, but the world has 4"),
    ("no_names", "hybrid sharding needs a 2-D mesh with dims named ('replicate', 'shard')"),
    ("other_names", "hybrid sharding needs a 2-D mesh with dims named ('replicate', 'shard')"),
    ("differs", "the ranks passed different meshes"),
    ("one_flat", "with the same mesh="),
])
def test_bad_mesh_raises_on_every_rank(case, expect):
    errors = dist_harness.values(dist_harness.run(W.bad_mesh, 4, case, timeout=120))
    for rank, e in enumerate(errors):
        assert e is not None and expect in e, (rank, e)


def test_a_rank_that_raises_makes_every_rank_raise():
    """Every survivor raises RankLost, also one whose replica all-reduce was already launched when
    the peer went (that one used to get gloo's bare "Connection closed by peer")."""
    results = dist_harness.run(W.one_rank_raises, 4, (2, 2), timeout=120)
    assert all(status == "error" for status, _ in results), results
    assert "used (sum) outside its unit's forward" in results[1][1]
    for rank in (0, 2, 3):
        assert results[rank][1].startswith("RankLost:") and "another rank is gone" in results[rank][1], \
            (rank, results[rank][1][:300])
