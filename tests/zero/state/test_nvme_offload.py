"""OffloadPolicy(device="nvme"): the optimizer state (and the fp32 masters of bf16 params) in one
scratch file per rank, streamed in chunks ([Note: NVMe swap] in zerokern/zero/state/swap.py): the
same numbers as in memory, DCP checkpoints, bad paths and I/O errors raising on every rank."""

import os

import pytest
import torch

import dist_harness
import nvme_workers as W
import zerokern
from zerokern import FusedZeroAdam, OffloadPolicy
from zerokern.zero.state import swap
from zero_workers import make_model


@pytest.mark.parametrize("world,stage", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_on_disk_trains_bit_for_bit_as_in_memory(tmp_path, world, stage, dtype):
    for r in dist_harness.values(dist_harness.run(W.matches_in_memory, world, stage, dtype, str(tmp_path))):
        assert r["streams"] and r["chunks"] >= 2, r  # on disk, in several chunks
        assert r["params"] and r["state"] and r["n_state"] >= 10, r
        assert r["report"]["adam_state"] == 0 and r["report"]["master_params"] == 0, r["report"]
        assert r["report"]["on_disk"] > 0 and r["report"]["nvme_buffers"] > 0, r["report"]
        assert r["files_left"] == [], r  # the scratch file is unlinked at creation


# int8 state without fp32 masters (bf16 params), the one that saves the most ([Note: low-bit chunks on disk])
INT8 = dict(W.LOWBIT, state_precision="int8", master_weights=False)


@pytest.mark.parametrize("stage,state", [(1, INT8), (2, INT8), (2, dict(INT8, master_weights=True)),
                                         (2, dict(INT8, state_precision="bf16"))],
                         ids=["int8-stage1", "int8-stage2", "int8-masters-stage2", "bf16-stage2"])
def test_lowbit_state_on_disk_trains_bit_for_bit_as_in_memory(tmp_path, stage, state):
    """int8 codes, their block scales (and the fp32 masters where asked) on disk, or bf16 moments: the
    in-memory run's params and state (codes and scales) bit for bit, each shard in 2 chunks. The other
    low-bit states are run at stage 2 only: the store does not know the stage."""
    for r in dist_harness.values(dist_harness.run(W.matches_in_memory, 2, stage, torch.bfloat16, str(tmp_path),
                                                  state)):
        assert r["streams"] and r["chunks"] >= 2, r
        assert r["params"] and r["state"] and r["n_state"] >= 10, r
        assert r["report"]["adam_state"] == 0 and r["report"]["master_params"] == 0, r["report"]
        assert r["report"]["on_disk"] > 0 and r["report"]["nvme_buffers"] > 0, r["report"]
        assert r["files_left"] == [], r


def test_lowbit_stage3_state_on_disk_trains_bit_for_bit_as_in_memory(tmp_path):
    for r in dist_harness.values(dist_harness.run(W.stage3_matches_in_memory, 2, torch.bfloat16, str(tmp_path),
                                                  INT8)):
        assert r["streams"] and r["chunks"] >= 2 and r["params"] and r["state"] and r["n_state"] >= 6, r


@pytest.mark.parametrize("state,inner", [({}, None), (INT8, None), ({}, "AdamW"), ({}, "SGD")],
                         ids=["fp32", "int8", "ZeroOptimizer-AdamW", "ZeroOptimizer-SGD"])
def test_a_dcp_checkpoint_resumes_on_disk_and_in_memory(tmp_path, state, inner):
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = dist_harness.values(dist_harness.run(W.dcp_save, 2, str(tmp_path / "a"), ckpt, state, inner))
    for offload in (True, False):
        got = dist_harness.values(dist_harness.run(W.dcp_resume, 2, str(tmp_path / "b"), ckpt, offload, state, inner))
        for w, g in zip(want, got):
            assert all(torch.equal(a, b) for a, b in zip(w, g)), offload


# int8: 4 arrays a chunk (codes and scales of 2 moments), 2 chunks; the 6th call is in chunk 1, after
# chunk 0 was read, updated and (for writes) written to the other slot
@pytest.mark.parametrize("state", [{}, dict(INT8, dtype=torch.bfloat16, fail_at=6)], ids=["fp32", "int8"])
@pytest.mark.parametrize("op", ["_pread", "_pwrite"])
def test_an_io_error_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path, op, state):
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.io_error, 2, str(tmp_path), 1, op, state))):
        assert r["error"] and "rank 1:" in r["error"] and "Input/output error" in r["error"], (rank, r)
        assert "not applied on any rank" in r["error"], r
        assert r["unchanged"] and r["then_same"], (rank, r)


def test_a_bad_path_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    missing = str(tmp_path / "missing")
    for msg in dist_harness.values(dist_harness.run(W.bad_path, 2, [str(tmp_path), missing])):
        assert msg and "NvmeOffloadError" in msg and f"rank 1: {missing} does not exist" in msg, msg


def test_paths_that_cannot_hold_the_state_are_named_with_the_bytes(tmp_path):
    assert swap.check_path(tmp_path, 4096) is None
    assert "does not exist" in swap.check_path(tmp_path / "nope", 1)
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in swap.check_path(tmp_path / "file", 1)
    need = 10**18
    msg = swap.check_path(tmp_path, need)
    assert msg and f"this rank's state needs {need:,}" in msg and "bytes free" in msg, msg
    if os.path.isdir("/dev/shm") and swap._filesystem("/dev/shm") == "tmpfs":
        assert "is on tmpfs, which is memory" in swap.check_path("/dev/shm", 1)


def test_what_nvme_offload_does_not_offer_is_refused(tmp_path):
    model = make_model(torch.bfloat16)
    nv = OffloadPolicy(device="nvme", path=str(tmp_path))
    with pytest.raises(ValueError, match=r"OffloadPolicy\(device='cpu'\) with state_precision='bf16'/'int8'"):
        FusedZeroAdam(model.parameters(), offload=OffloadPolicy(), state_precision="int8")
    # ZeroOptimizer is offered: its inner optimizer's per-element state streams from disk
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.AdamW, offload=nv, zero_stage=2)
    assert all(s.streams and s.state_keys == ("exp_avg", "exp_avg_sq") for s in opt.stores)
    with pytest.raises(ValueError, match="needs path="):
        OffloadPolicy(device="nvme")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stage3_state_on_disk_trains_bit_for_bit_as_in_memory(tmp_path, dtype):
    for r in dist_harness.values(dist_harness.run(W.stage3_matches_in_memory, 2, dtype, str(tmp_path))):
        assert r["streams"] and r["params"] and r["outputs"] and r["state"] and r["n_state"] >= 6, r
        assert not r["shards_in_file"] and r["released"] == r["prefetched"] == 0, r  # params=False: in memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stage3_params_on_disk_train_bit_for_bit_as_in_memory(tmp_path, dtype):
    """OffloadPolicy(params=True): the param slices live in the swap file, read for each gather and
    written by the update; the same params, outputs and state as in memory, and memory_report no
    longer counts the slices (on_disk does)."""
    for r in dist_harness.values(dist_harness.run(W.stage3_matches_in_memory, 2, dtype, str(tmp_path), None, 4, True)):
        assert r["streams"] and r["params"] and r["outputs"] and r["state"] and r["n_state"] >= 6, r
        assert r["shards_in_file"], r
        # each step: 3 units gathered for forward and again for backward, each slice dropped after its
        # gather (the no_grad forward at the end: 3 more); the units after the first read ahead
        assert r["released"] >= 4 * 6 + 3 and r["prefetched"] >= 4 * 2, r
        rep, ref = r["report"], r["ref_report"]
        slices = ref["params"]  # in memory: only the slices (every unit is resharded after step())
        assert slices > 0 and rep["params"] == 0, (rep, ref)
        size = torch.finfo(dtype).bits // 8
        state = ref["adam_state"] + ref["master_params"]
        assert rep["on_disk"] >= state + slices and rep["on_disk"] - state - slices < 3 * 4096 * size, (rep, ref)


def test_stage3_params_on_disk_resume_from_dcp(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for d in "abc":
        (tmp_path / d).mkdir()
    want = dist_harness.values(dist_harness.run(W.stage3_dcp_save, 2, str(tmp_path / "a"), ckpt))
    for on_disk, d in ((True, "b"), (False, "c")):
        got = dist_harness.values(dist_harness.run(W.stage3_dcp_resume, 2, str(tmp_path / d), ckpt, on_disk))
        for w, g in zip(want, got):
            assert len(w) == len(g) and all(torch.equal(a, b) for a, b in zip(w, g)), on_disk


def test_params_on_disk_is_for_stage_3_on_several_ranks(tmp_path):
    with pytest.raises(ValueError, match=r"params=True.*needs device='nvme'"):
        OffloadPolicy(params=True)
    nv = OffloadPolicy(device="nvme", path=str(tmp_path), params=True)
    with pytest.raises(ValueError, match=r"params=True.*at stage 2 every rank holds the whole params"):
        FusedZeroAdam(make_model(torch.float32).parameters(), zero_stage=2, offload=nv)


@pytest.fixture
def small_filesystem(tmp_path):
    """An 8 MB ext4 filesystem, loop-mounted (root, mkfs.ext4 and mount needed; else skipped)."""
    import shutil
    import subprocess
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not shutil.which("mount"):
        pytest.skip("needs root, mkfs.ext4 and mount for a loop-mounted filesystem")
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "8M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    done = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"loop mount refused here: {done.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_raises_on_every_rank_with_the_bytes(small_filesystem):
    for msg in dist_harness.values(dist_harness.run(W.full_disk, 2, small_filesystem)):
        assert msg and "NvmeOffloadError" in msg, msg
        for rank in (0, 1):  # both ranks' state (about 17 MB each) is more than the 8 MB filesystem has
            assert f"rank {rank}: {small_filesystem} has " in msg and "bytes free, and this rank's state needs" in msg, msg
    assert os.listdir(small_filesystem) == ["lost+found"]  # nothing left behind


def test_state_tensors_held_across_steps_stay_live_and_edits_reach_the_disk(tmp_path):
    """opt.state[p]'s tensors are the same objects after step() (a kept reference sees the new values,
    as with torch.optim, though each step writes the other slot), and an edit through them (here:
    exp_avg zeroed) is what the next step reads: the in-memory run's numbers, bit for bit."""
    runs = []
    for offload in (None, OffloadPolicy(device="nvme", path=str(tmp_path), chunk_mb=4096 / 2**20)):
        torch.manual_seed(0)
        lin = torch.nn.Linear(40, 30)
        opt = FusedZeroAdam(lin.parameters(), lr=1e-2, offload=offload)
        held, seen = None, []
        for k in range(4):
            opt.zero_grad()
            lin(torch.randn(3, 40, generator=torch.Generator().manual_seed(k))).square().sum().backward()
            opt.step()
            held = opt.state[lin.weight]["exp_avg"] if held is None else held
            assert held is opt.state[lin.weight]["exp_avg"]
            seen.append(held.clone())
            if k == 1:
                held.zero_()  # a user's edit of the state between steps
        runs.append((seen, [p.detach().clone() for p in lin.parameters()]))
    (seen0, params0), (seen1, params1) = runs
    assert all(torch.equal(a, b) for a, b in zip(seen0, seen1))
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def test_a_long_first_fill_says_how_far_it_got(tmp_path, monkeypatch, capsys):
    """The first step writes bf16 params' fp32 masters into the file; one that takes longer than
    PROGRESS_EVERY seconds (here: 0) prints its progress and its end on stderr."""
    monkeypatch.setattr(swap, "PROGRESS_EVERY", 0.0)
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    opt = FusedZeroAdam(lin.parameters(), lr=1e-2, offload=OffloadPolicy(device="nvme", path=str(tmp_path),
                                                                      chunk_mb=4096 / 2**20))
    assert "writing the first values" not in capsys.readouterr().err  # nothing written yet
    lin(torch.randn(3, 256, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    err = capsys.readouterr().err
    assert "zerokern: rank 0: writing the first values of " in err and " GB so far" in err, err
    assert "zerokern: rank 0: wrote 0.00 GB into " in err, err
    lin(torch.randn(3, 256, dtype=torch.bfloat16)).float().square().sum().backward()
    opt.step()
    assert "writing the first values" not in capsys.readouterr().err  # the second step fills nothing


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inner", ["AdamW", "SGD"])
def test_zero_optimizer_state_on_disk_trains_bit_for_bit_as_in_memory(tmp_path, stage, dtype, inner):
    """ZeroOptimizer's inner optimizer stepped chunk by chunk over state streamed from disk
    ([Note: inner state on disk]): the in-memory numbers, state dicts that view the file, and a
    loaded state dict trains on alike."""
    for r in dist_harness.values(dist_harness.run(W.zero_optimizer_matches_in_memory, 2, stage, dtype, str(tmp_path),
                                                  inner)):
        assert r["streams"] and r["chunks"] >= 2, r
        assert r["keys"] == {"AdamW": ("exp_avg", "exp_avg_sq"), "SGD": ("momentum_buffer",)}[inner], r
        assert r["params"] and r["state"] and r["n_state"] >= 6, r
        assert r["views_of_file"] and r["loaded"], r
        assert r["report"]["master_params"] == 0 and r["report"]["on_disk"] > 0, r["report"]
        assert r["report"]["adam_state"] <= 4 * 6, r["report"]  # in memory: the step counts only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_optimizer_with_stage3_params_on_disk_trains_bit_for_bit_as_in_memory(tmp_path, dtype):
    """OffloadPolicy(params=True): the param shards move at commit, and the inner optimizer's pieces
    follow them (inner_stream re-points every piece at its store's master)."""
    for r in dist_harness.values(dist_harness.run(W.zero_optimizer_matches_in_memory, 2, 3, dtype, str(tmp_path),
                                                  "AdamW", 4, True)):
        assert r["shards_in_file"] and r["streams"] and r["chunks"] >= 2, r
        assert r["params"] and r["state"] and r["views_of_file"] and r["loaded"], r


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_optimizer_io_error_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path, stage):
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.zero_optimizer_io_error, 2, str(tmp_path), 1,
                                                                  "_pwrite", stage))):
        assert r["error"] and "rank 1:" in r["error"] and "Input/output error" in r["error"], (rank, r)
        assert "not applied on any rank" in r["error"], r
        assert r["unchanged"] and r["then_same"], (rank, r)


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    (torch.optim.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1)),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)), (torch.optim.Rprop, dict(lr=1e-2)),
    (torch.optim.ASGD, dict(lr=1e-2)), (torch.optim.NAdam, dict(lr=1e-2)), (torch.optim.RAdam, dict(lr=1e-2)),
    (torch.optim.Adamax, dict(lr=1e-2)), (torch.optim.Adadelta, dict(lr=1.0)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True))], ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_zero_optimizer_any_elementwise_inner_optimizer_on_disk_matches_in_memory(tmp_path, cls, kw, dtype):
    """One process: each torch.optim elementwise optimizer's per-element state (max_exp_avg_sq, Adagrad's
    sum from a non-zero start, Rprop's step_size, ASGD's ax, ...) streamed in several chunks, with its
    per-param scalars (ASGD's eta and mu) stepped once per step: the in-memory numbers, bit for bit."""
    runs = []
    for offload in (None, OffloadPolicy(device="nvme", path=str(tmp_path), chunk_mb=4096 / 2**20, buffer_count=2)):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.Tanh(), torch.nn.Linear(96, 7)).to(dtype)
        opt = zerokern.ZeroOptimizer(m.parameters(), cls, offload=offload, zero_stage=2, bucket_cap_mb=0.01, **kw)
        for k in range(4):
            opt.zero_grad()
            x = torch.randn(5, 40, generator=torch.Generator().manual_seed(k)).to(dtype)
            m(x).float().square().sum().backward()
            if k == 0:
                m[0].bias.grad = None  # no step for it: its state stays
            opt.step()
        runs.append(([p.detach().clone() for p in m.parameters()],
                     [v.clone() for st in opt.state.values() for _, v in sorted(st.items())
                      if isinstance(v, torch.Tensor)]))
    if offload is not None:
        assert all(s.streams for s in opt.stores) and max(-(-s.n // s.swap.chunk) for s in opt.stores) >= 2
    (pa, sa), (pb, sb) = runs
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb))
