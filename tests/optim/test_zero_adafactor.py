"""zerokern.ZeroOptimizer(params, torch.optim.Adafactor) on one process ([Note: whole matrices on
their owners] in zerokern/optim/whole_state.py): every param whole, the inner Adafactor steps it
in its own shape, bit for bit torch.optim.Adafactor's numbers, 1-D params too (an unfactored
variance); its state dict is torch's layout (step, row_var, col_var, variance) both ways; an
Adafactor group beside an AdamW one; and what it refuses, naming the group."""

import copy

import pytest
import torch
import torch.nn as nn

import matrix_helpers as H
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is torch 2.5+")

STEPS = 5
# torch's defaults, and every option changed: the inner optimizer's own code reads them
OPTIONS = [dict(),
           dict(lr=0.05, beta2_decay=-0.5, eps=(1e-30, 1e-2), d=2.0, weight_decay=0.01, foreach=True, maximize=True)]


def _model():
    torch.manual_seed(3)
    # odd, rectangular both ways, with biases (1-D: Adafactor keeps their variance unfactored) and a norm
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.LayerNorm(5), nn.Linear(5, 5, bias=False))


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("options", OPTIONS)
def test_adafactor_on_one_process_is_torch_adafactor_bit_for_bit(stage, options):
    ref = _model()
    ref_opt = torch.optim.Adafactor(ref.parameters(), **options)
    model = copy.deepcopy(ref)
    opt = H.one_process(model, torch.optim.Adafactor, stage, **options)
    batches = H.batches(STEPS)
    H.train(ref, ref_opt, batches)
    H.train(model, opt, batches)
    assert opt.matrices_stepped == STEPS * len(list(ref.parameters())), "every param whole, once a step"
    held_out = torch.randn(8, 7, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(held_out), ref(held_out)), "the trained params, as the forward sees them"
    if stage != 3:  # stage 3's params are empty between gathers
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item()}"
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for k, st in ref_sd["state"].items():
        assert set(sd["state"][k]) == set(st), f"state[{k}]: torch's keys"
        for key, v in st.items():
            got = sd["state"][k][key]
            assert got.shape == v.shape and got.dtype == v.dtype, f"state[{k}][{key!r}]: torch's layout"
            assert torch.equal(got, v), f"state[{k}][{key!r}]"


def test_state_dicts_cross_between_torch_adafactor_and_zero_optimizer():
    """torch.optim.Adafactor loads ZeroOptimizer's state dict and ZeroOptimizer loads torch's: both
    then take the same next steps as the run that was not interrupted."""
    batches = H.batches(STEPS)
    ref = _model()
    ref_opt = torch.optim.Adafactor(ref.parameters(), lr=0.02)
    H.train(ref, ref_opt, batches[:3])
    model = copy.deepcopy(ref)
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Adafactor, zero_stage=2, lr=0.02)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    back = copy.deepcopy(ref)
    back_opt = torch.optim.Adafactor(back.parameters(), lr=0.02)
    back_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((ref, ref_opt), (model, opt), (back, back_opt)):
        H.train(m, o, batches[3:])
    for p, q, r in zip(model.parameters(), ref.parameters(), back.parameters()):
        assert torch.equal(p, q) and torch.equal(r, q)


def test_a_state_of_another_shape_is_refused():
    model = _model()
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.Adafactor, zero_stage=1)
    sd = opt.state_dict()
    sd["state"][0]["row_var"] = sd["state"][0]["col_var"].clone()
    with pytest.raises(ValueError, match=r"state\[0\]\['row_var'\] has shape \[1, 7\], param 0 has \[33, 7\] "
                                         r"\(and Adafactor keeps its row_var as \[33, 1\]\)"):
        opt.load_state_dict(sd)


def test_adafactor_and_adamw_groups_are_one_process_adafactor_and_adamw():
    torch.manual_seed(5)
    ref = _model()
    model = copy.deepcopy(ref)

    def groups(m, cls):
        hidden = [p for p in m.parameters() if p.dim() == 2]
        rest = [p for p in m.parameters() if p.dim() != 2]
        return [{"params": hidden, "optimizer": cls, "lr": 0.03}, {"params": rest, "lr": 3e-3}]

    ref_groups = groups(ref, None)
    ref_opts = [torch.optim.Adafactor(ref_groups[0]["params"], lr=0.03),
                torch.optim.AdamW(ref_groups[1]["params"], lr=3e-3, weight_decay=0.05)]
    opt = zerokern.ZeroOptimizer(groups(model, torch.optim.Adafactor), torch.optim.AdamW, weight_decay=0.05,
                                 zero_stage=2, bucket_cap_mb=1e-4)
    for x in H.batches(STEPS):
        H.step_both(ref, ref_opts, model, opt, x)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item()}"
    assert opt.matrices_stepped == STEPS * 3, "the three matrices, once a step"
    assert opt.state_dict()["param_groups"][0]["optimizer"] is torch.optim.Adafactor


@pytest.mark.parametrize("which, message", [
    ("empty", r"param group 0 \(Adafactor\) has no params; give it its params, or leave the group out"),
    ("frozen", r"the Adafactor param group has no trainable params \(each has requires_grad False\)"),
    ("1-D in muon", r"Muon orthogonalises .* takes 2-D params only: params\[1\] has shape \[33\]")])
def test_a_bad_adafactor_group_is_refused_by_name(which, message):
    model = _model()
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    if which == "empty":
        groups = [{"params": [], "optimizer": torch.optim.Adafactor}, {"params": list(model.parameters())}]
    elif which == "frozen":
        for p in matrices:
            p.requires_grad_(False)
        groups = [{"params": matrices, "optimizer": torch.optim.Adafactor}, {"params": rest}]
    else:
        if not hasattr(torch.optim, "Muon"):
            pytest.skip("torch.optim.Muon is torch 2.9+")
        # a Muon group beside an Adafactor one runs (test_zero_mixed_matrix.py); its 1-D param does not
        groups = [{"params": matrices[:1] + rest[:1], "optimizer": torch.optim.Muon},
                  {"params": matrices[1:], "optimizer": torch.optim.Adafactor}, {"params": rest[1:]}]
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        zerokern.ZeroOptimizer(groups, torch.optim.AdamW, zero_stage=2)
    assert before == [p.data_ptr() for p in model.parameters()], "refused before the engine took the params"
