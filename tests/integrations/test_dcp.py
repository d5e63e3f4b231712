"""torch.distributed.checkpoint (DCP) with FusedZeroAdam: every rank's slice of the sharded
state is saved once, and loading at another world size re-shards it (issue 13). A resumed run
must continue as the uninterrupted one: bit for bit at the same world size, within fp32
reduction-order noise at another (bf16 params: their fp32 masters travel in the checkpoint,
so no bf16 rounding enters)."""

import copy
import shutil

import pytest
import torch

import dcp_workers as W
import dist_harness
from numerics import abs_diff


@pytest.fixture(scope="module")
def save_runs(tmp_path_factory):
    """The save runs of test_dcp_resume_at_any_world_size, by (world, dtype): each run once (two
    tests resume each 2-rank checkpoint, at 2 ranks and at 1)."""
    runs = {}

    def save(world, dtype):
        if (world, dtype) not in runs:
            path = str(tmp_path_factory.mktemp(f"save{world}") / "ck")
            saved = dist_harness.values(dist_harness.run(W.save, world, path, dtype, "helpers", timeout=180))
            assert all(s["unchanged"] for s in saved), "get_optimizer_state_dict changed the optimizer"
            runs[world, dtype] = path, saved
        return runs[world, dtype]
    return save


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_dcp_resume_at_any_world_size(save_runs, tmp_path, dtype, save_world, load_world):
    shared, saved = save_runs(save_world, dtype)
    path = str(tmp_path / "ck")
    shutil.copytree(shared, path)  # this test's own copy: no test reads what another one changed
    saved = copy.deepcopy(saved)
    resumed = dist_harness.values(dist_harness.run(W.resume, load_world, path, dtype, "helpers", timeout=180))
    _same_full_state(resumed[0]["full"], saved[0]["full"])
    for rank, r in enumerate(resumed):
        assert r["steps"] == [W.STEPS_BEFORE], (rank, r["steps"])
        diff = max(abs_diff(a, b) for a, b in zip(r["params"], saved[0]["params"]))
        if save_world == load_world:
            assert diff == 0, (rank, diff)
        else:  # the same state; the grads differ by reduction order (fp32) or by bf16 rounding of
            # half-batch vs full-batch grads (one bf16 ulp at these weights' size, 2**-9)
            assert diff < (1e-5 if dtype == torch.float32 else 2.0 ** -9 + 1e-6), (rank, diff)


def _same_full_state(a, b):
    """Two full_state_dict()s hold the same state (Adam moments, steps, fp32 masters), exactly."""
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][key], b["state"][k][key]), (k, key)
    assert a.get("zerokern_master", {}).keys() == b.get("zerokern_master", {}).keys()
    for k, m in a.get("zerokern_master", {}).items():
        assert torch.equal(m, b["zerokern_master"][k]), (k, "master")


def test_dcp_of_the_optimizers_own_state_dict(tmp_path):
    """dcp.save({"optim": opt.state_dict()}) as well: no rank's slice is lost."""
    path = str(tmp_path / "ck")
    saved = dist_harness.values(dist_harness.run(W.save, 2, path, torch.bfloat16, "state_dict", timeout=180))
    resumed = dist_harness.values(dist_harness.run(W.resume, 2, path, torch.bfloat16, "state_dict", timeout=180))
    for rank, r in enumerate(resumed):
        assert all(torch.equal(a, b) for a, b in zip(r["params"], saved[0]["params"])), rank


def test_dcp_without_the_protocol_is_a_clear_error(tmp_path):
    errors = dist_harness.values(dist_harness.run(W.save_without_protocol, 2, str(tmp_path / "ck"), timeout=120))
    for rank, err in enumerate(errors):
        assert err is not None and "no torch.distributed.checkpoint.protocol" in err, (rank, err)
