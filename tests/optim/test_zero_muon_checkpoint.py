"""A Muon + AdamW ZeroOptimizer at stage 2 saved with torch.distributed.checkpoint on 4 ranks
resumes on 2 ranks and on one process (torch.optim.Muon + torch.optim.AdamW loading the
checkpoint consolidated by torch's dcp_to_torch_save) with the uninterrupted run's next steps,
bit for bit (issue 51 item 6; docs/checkpoints.md, "Muon and other matrix optimizers").

Why bit for bit: every rank trains on the same batch, so each run's averaged gradient is that
batch's one-process gradient exactly (fp32 sums of 2 or 4 equal terms, in any order, are 2x and
4x exactly, then a power-of-two division), and the state loads as copies. With a batch split
over the ranks the sums would differ by rounding, which Muon's bf16 Newton-Schulz can turn into
differences of about 1e-3 of an update."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_harness
import muon_checkpoint_workers as W

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")


def test_four_ranks_saved_resume_on_two_and_on_one_process(tmp_path):
    path = str(tmp_path / "ck")
    saved = dist_harness.values(dist_harness.run(W.save, 4, path, timeout=240))
    resumed = dist_harness.values(dist_harness.run(W.resume, 2, path, timeout=240))
    plain = W.resume_plain(path, str(tmp_path / "full.pt"))
    model = W.Net()
    hidden, _ = W.split(model)
    want = saved[0][0]
    for rank, (w, held, _) in enumerate(saved):
        assert all(torch.equal(a, b) for a, b in zip(w, want)), f"saving rank {rank} differs from rank 0"
        # [Note: whole state in checkpoints]: the momentum gathered whole on every rank
        assert held == [p.numel() for p in hidden], (rank, held)
    assert sum(s for _, _, s in saved) == len(hidden) * W.STEPS, "Newton-Schulz once per matrix and step"
    assert sum(s for _, s in resumed) == len(hidden) * (W.STEPS - W.SAVE_AT)
    for name, got in [*((f"2 ranks, rank {r}", w) for r, (w, _) in enumerate(resumed)), ("one process", plain)]:
        diff = max((a - b).abs().max().item() for a, b in zip(got, want))
        assert diff == 0.0, f"{name}: params {diff} from the uninterrupted 4-rank run"
    # the checkpoint holds each momentum as one tensor of the matrix's shape (written by one rank:
    # DCP deduplicates the save plans of a tensor every rank holds whole)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for k, p in enumerate(hidden):
        entry = meta[f"optim.state.{k}.momentum_buffer"]
        assert list(entry.size) == list(p.shape) and [list(c.sizes) for c in entry.chunks] == [list(p.shape)], k
