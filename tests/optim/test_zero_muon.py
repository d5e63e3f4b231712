"""zerokern.ZeroOptimizer(params, torch.optim.Muon) on one process ([Note: whole matrices on their
owners] in zerokern/optim/whole_state.py): every param whole, the inner Muon steps it in its
own shape, bit for bit torch.optim.Muon's numbers; its state dict is torch's layout both ways; and
what it refuses (a non-2-D param, shard() units without matrices= on several processes), naming
the culprit, on every rank."""

import copy
import re

import pytest
import torch
import torch.nn as nn

import dist_harness
import matrix_helpers as H
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

STEPS = 5
# nesterov off and a non-default adjust_lr_fn too: the inner optimizer's own options apply
OPTIONS = [dict(lr=0.02, weight_decay=0.01),
           dict(lr=0.05, momentum=0.9, nesterov=False, ns_steps=3, adjust_lr_fn="match_rms_adamw")]


def _model():
    torch.manual_seed(3)
    # odd, rectangular both ways (NS transposes tall matrices), no biases: Muon takes 2-D only
    return nn.Sequential(nn.Linear(7, 33, bias=False), nn.Tanh(), nn.Linear(33, 5, bias=False), nn.Tanh(),
                         nn.Linear(5, 5, bias=False))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("options", OPTIONS)
def test_muon_on_one_process_is_torch_muon_bit_for_bit(stage, options):
    ref = _model()
    ref_opt = torch.optim.Muon(ref.parameters(), **options)
    model = copy.deepcopy(ref)
    opt = H.one_process(model, torch.optim.Muon, stage, **options)
    batches = H.batches(STEPS)
    H.train(ref, ref_opt, batches)
    H.train(model, opt, batches)
    held_out = torch.randn(8, 7, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(held_out), ref(held_out)), "the trained params, as the forward sees them"
    if stage != 3:  # stage 3's params are empty between gathers
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item()}"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, st in ref_sd["state"].items():
        got = sd["state"][k]["momentum_buffer"]
        assert got.shape == st["momentum_buffer"].shape, "torch's layout: the param's shape"
        assert torch.equal(got, st["momentum_buffer"])


def test_state_dicts_cross_between_torch_muon_and_zero_optimizer():
    """torch.optim.Muon loads ZeroOptimizer's state dict and ZeroOptimizer loads torch's: both
    then take the same next steps as the run that was not interrupted."""
    batches = H.batches(STEPS)
    ref = _model()
    ref_opt = torch.optim.Muon(ref.parameters(), lr=0.02)
    H.train(ref, ref_opt, batches[:3])
    model = copy.deepcopy(ref)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, zero_stage=1, lr=0.02)
    opt.load_state_dict(ref_opt.state_dict())  # torch's into zerokern's
    back = copy.deepcopy(ref)
    back_opt = torch.optim.Muon(back.parameters(), lr=0.02)
    # and zerokern's into torch's (a copy: torch keeps the tensors it is given, as between two torch optimizers)
    back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((ref, ref_opt), (model, opt), (back, back_opt)):
        H.train(m, o, batches[3:])
    for p, q, r in zip(model.parameters(), ref.parameters(), back.parameters()):
        assert torch.equal(p, q) and torch.equal(r, q)


def test_a_state_of_another_shape_is_refused():
    model = _model()
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, zero_stage=1, lr=0.02)
    sd = opt.state_dict()
    sd["state"][0]["momentum_buffer"] = sd["state"][0]["momentum_buffer"].t().contiguous()
    with pytest.raises(ValueError, match=r"state\[0\]\['momentum_buffer'\] has shape \[7, 33\], param 0 has "
                                         r"\[33, 7\]"):
        opt.load_state_dict(sd)


def test_a_param_that_is_not_2d_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, bias=False))
    params = [{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}]
    with pytest.raises(ValueError, match=r"ZeroOptimizer: Muon orthogonalises .* takes 2-D params only: "
                                         r"params\[1\] \('0.bias'\) has shape \[4\]"):
        zerokern.ZeroOptimizer(params, torch.optim.Muon, lr=0.02)


def _two_ranks(rank, world):
    """On 2 processes Muon's params must lie whole in one rank's shard; a unit zerokern.shard()
    laid out without matrices= did not lay them out so, and is refused, naming the param and the
    fix, on every rank alike (with matrices=: tests/optim/test_zero_muon_units.py)."""
    model = _model()
    zerokern.shard(model, stage=2)
    try:
        zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, lr=0.02)
    except ValueError as e:
        return str(e)
    return None


def test_shard_units_without_matrices_are_refused_on_every_rank():
    for text in dist_harness.values(dist_harness.run(_two_ranks, 2, timeout=120)):
        assert text is not None and re.search(r"steps \d\.weight as a whole matrix, so on 2 ranks it must lie "
                                              r"whole in one rank's shard, but unit 'Sequential' was laid out by "
                                              r"zerokern.shard\(\) without it. Pass matrices= to every "
                                              r"zerokern.shard\(\) call", text), text


def test_state_on_disk_is_refused(tmp_path):
    """OffloadPolicy(device="nvme") steps the inner optimizer over chunks of the pieces, which are
    not whole matrices: refused before anything is built."""
    model = _model()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"Muon .* OffloadPolicy\(device='nvme'\) steps chunks"):
        zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, zero_stage=2, lr=0.02,
                               offload=zerokern.OffloadPolicy(device="nvme", path=str(tmp_path)))
    assert before == [p.data_ptr() for p in model.parameters()]
