"""Checkpoints of stage-3 models (issue 15): sharded with torch.distributed.checkpoint and
consolidated, model and optimizer, saved at one world size and resumed at another.

A resumed run must continue as the uninterrupted one: bit for bit at the same world size, within
fp32 reduction-order noise at another (bf16: one bf16 ulp, the half- vs whole-batch grads round
differently), and within fp32 noise of torch.optim.AdamW on one process over the whole batch.
Multi-rank runs have a timeout: a hang fails."""

import copy
import math
import shutil

import pytest
import torch
from torch.distributed.checkpoint.protocol import _validate_checkpointable_tensor_metadata

import dist_harness
import stage3_ckpt_workers as W
from zerokern.zero.params import model_state


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def save_runs(tmp_path_factory):
    """The save runs of this module, by (world, dtype, via): each run once (several tests resume
    the same checkpoint, at different world sizes or by other means)."""
    runs = {}

    def save(world, dtype, via):
        if (world, dtype, via) not in runs:
            path = str(tmp_path_factory.mktemp(f"save{world}-{dtype}-{via}"))
            saved = dist_harness.values(dist_harness.run(W.save, world, path, dtype, via, timeout=300))
            assert all(s["unchanged"] for s in saved), "taking the state dicts changed the model"
            assert saved[0]["shapes_between"] == [(0,)], "a stage-3 param held values between steps"
            runs[world, dtype, via] = path, saved[0]
        return runs[world, dtype, via]
    return save


@pytest.fixture
def save(save_runs, tmp_path):
    """save(world, dtype, via) -> (a copy of that save's directory, owned by this test; what rank 0
    returned), so no test reads what another one changed."""
    def copied(world, dtype="float32", via="own"):
        path, saved = save_runs(world, dtype, via)
        shutil.copytree(path, tmp_path, dirs_exist_ok=True)
        return str(tmp_path), copy.deepcopy(saved)
    return copied


@pytest.mark.parametrize("via", ["own", "helpers", "full"])
@pytest.mark.parametrize("save_world,load_world", [(4, 2), (2, 2), (2, 1)])
def test_resume_at_any_world_size(save, via, save_world, load_world):
    """own: dcp.save/load of model.state_dict() and opt.state_dict(); helpers: torch's
    get/set_model_state_dict and get/set_optimizer_state_dict; full: zerokern.full_state_dict and
    opt.full_state_dict through torch.save, loaded (mmap) into the fresh sharded model."""
    path, saved = save(save_world, via="helpers" if via == "helpers" else "own")
    resumed = dist_harness.values(dist_harness.run(W.resume, load_world, path, "float32", via, timeout=300))
    ref = W.reference()
    for rank, r in enumerate(resumed):
        assert r["steps"] == [W.BEFORE], (rank, r["steps"])
        assert _max_diff(r["loaded"], saved["at_save"]) == 0, rank
        diff = _max_diff(r["final"], saved["final"])
        assert diff == 0 if save_world == load_world else diff < 1e-5, (rank, diff)
        assert _max_diff(r["final"], ref) < 2e-5, rank


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 4)])
def test_bf16_resume_keeps_the_fp32_masters(save, save_world, load_world):
    """The bf16 weights and their fp32 masters load in either order without the masters being
    re-read from the bf16 weights: the same world size resumes bit for bit."""
    path, saved = save(save_world, "bfloat16", "helpers")
    resumed = dist_harness.values(dist_harness.run(W.resume, load_world, path, "bfloat16", "helpers", timeout=300))
    for rank, r in enumerate(resumed):
        assert _max_diff(r["loaded"], saved["at_save"]) == 0, rank
        diff = _max_diff(r["final"], saved["final"])
        assert diff == 0 if save_world == load_world else diff <= 2.0 ** -8, (rank, diff)


def test_checkpoints_load_without_zerokern(save):
    """The consolidated file loads into the plain model and torch.optim.AdamW, which train on as
    the sharded run did; the DCP checkpoint's model loads into the plain model too."""
    path, saved = save(4)
    assert _max_diff(W.resume_unsharded_torch(path), saved["final"]) < 1e-5
    assert _max_diff(W.dcp_into_plain_model(path), saved["at_save"]) == 0


def test_mistakes_are_errors_naming_the_param_and_the_fix(tmp_path):
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.mistakes, 2, str(tmp_path), timeout=240))):
        assert r["dcp load never loaded"] and "never loaded into the model" in r["dcp load never loaded"] \
            and "model.load_state_dict(sd)" in r["dcp load never loaded"], (rank, r)
        assert r["consolidating it"] and "never loaded into the model" in r["consolidating it"], (rank, r)
        assert r["after loading it"] is None, (rank, r["after loading it"])
        assert r["other rank's slice"] and "'blocks.0.fc1.weight'" in r["other rank's slice"] \
            and "another part of the param than this rank's" in r["other rank's slice"], (rank, r)
        assert r["wrong shape"] and "size mismatch for 'blocks.0.fc1.weight'" in r["wrong shape"], (rank, r)
        assert r["assign"] and "assign=True" in r["assign"], (rank, r)
        assert r["torch full into plain"] and "size mismatch" in r["torch full into plain"], (rank, r)
        assert r["missing"] == [], (rank, r["missing"])


@pytest.mark.parametrize("shape", [(), (7,), (4, 8), (3, 4, 5), (2, 3, 1, 4)])
def test_flat_slices_as_boxes(shape):
    """Every flat slice of every shape: the boxes tile it exactly once, the marked tensor passes
    DCP's own checks, gives the values back, never has the param's shape unless it is whole, and is
    about the slice's size (its bounding box: at most a row of the trailing dims more at each end,
    plus the padding of the last dimension)."""
    n = math.prod(shape)
    values = torch.arange(n, dtype=torch.float32)
    for start in range(n + 1):
        for end in range(start, n + 1):
            cover = torch.zeros(n, dtype=torch.int64)
            for offsets, sizes in model_state.flat_boxes(start, end, shape):
                view = cover.view(shape)[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
                view += 1
            assert torch.equal(cover, (torch.arange(n) >= start) & (torch.arange(n) < end)), (start, end)
            t = model_state.to_boxes(values[start:end], start, shape)
            _validate_checkpointable_tensor_metadata(t)
            assert torch.equal(model_state.from_boxes(t), values[start:end]), (start, end)
            assert tuple(t.shape) != shape or (shape == () and end > start), (start, end, t.shape)
            if shape:
                padding = 2 * t.numel() // t.shape[-1]
                assert t.numel() <= (end - start) + 2 * math.prod(shape[1:]) + padding, (start, end, t.shape)
