"""zerokern.ZeroOptimizer(params, torch.optim.X, ...): any elementwise torch optimizer over the
ZeRO engine (issue 25), 2 gloo ranks against the same optimizer on one process."""

import pytest
import torch

import dist_harness
import zero_optimizer_workers as W
import zerokern
from numerics import abs_diff


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adamw"])
def test_torch_optimizer_over_shards_matches_one_process(name, stage):
    for r in dist_harness.values(dist_harness.run(W.train, 2, name, stage, timeout=120)):
        # fp32: the ranks' grads are averaged in another order than one process's batch mean
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-7), r
        assert r["eval"] == pytest.approx(r["ref_eval"], rel=1e-5, abs=1e-7), r
        assert r["diff"] < 1e-5, r["diff"]
        assert r["lr"] == [W.OPTIMIZERS[name][1]["lr"], 0.02], "param groups keep their keys"
        assert r["state_keys"], "the inner optimizer's state is in state_dict()"


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_and_torch_state_load(stage):
    for r in dist_harness.values(dist_harness.run(W.resume, 2, stage, timeout=120)):
        assert r["same"], "resumed from this rank's state dict: bitwise the uninterrupted run"
        assert r["from_torch"] < 1e-5, r


def test_whole_tensor_optimizers_are_refused():
    model = W.ThreeLayers()
    for cls in [torch.optim.LBFGS]:  # Muon and Adafactor run, each param whole on one rank (test_zero_adafactor.py)
        with pytest.raises(ValueError, match=f"ZeroOptimizer: {cls.__name__} .* cannot run on each rank's shards"):
            zerokern.ZeroOptimizer(model.parameters(), cls)
    with pytest.raises(ValueError, match="_FloatStateSGD is not known to update each element"):  # unknown: vouch
        zerokern.ZeroOptimizer(model.parameters(), _FloatStateSGD, lr=0.1)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer class"):
        zerokern.ZeroOptimizer(model.parameters(), "SGD")


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")
def test_muon_is_refused_with_its_own_reason_even_when_vouched_for():
    """Muon orthogonalises each 2-D update as a whole: the refusal says so (it cited Adafactor and
    LAMB), and elementwise=True, which cannot make slices work for it, gets zerokern's error too (it
    failed inside torch on zerokern's 1-element probe, issue 50)."""
    model = W.ThreeLayers()
    for vouched in (None, True):
        with pytest.raises(ValueError) as e:
            zerokern.ZeroOptimizer(model.parameters(), torch.optim.Muon, lr=0.02, elementwise=vouched)
        text = str(e.value)
        assert text.startswith("ZeroOptimizer: Muon ") and "orthogonalises" in text, text
        assert "Adafactor" not in text and "torch.Size([1])" not in text, text


def test_a_vouched_optimizer_that_refuses_slices_gets_zerokerns_error():
    """An optimizer vouched for with elementwise=True that rejects a flat 1-D slice (it wants a
    param's shape) fails with zerokern's error naming it and why slices cannot work, not inside torch."""
    class MatrixOnly(torch.optim.SGD):
        def __init__(self, params, **kw):
            params = list(params)
            for g in params if isinstance(params[0], dict) else [{"params": params}]:
                for p in g["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"MatrixOnly wants 2-D params, got {tuple(p.shape)}")
            super().__init__(params, **kw)

    with pytest.raises(ValueError) as e:
        zerokern.ZeroOptimizer(W.ThreeLayers().parameters(), MatrixOnly, lr=0.1, elementwise=True)
    text = str(e.value)
    assert text.startswith("ZeroOptimizer: MatrixOnly (elementwise=True) refused") and "flat 1-D" in text, text
    assert "MatrixOnly wants 2-D params" in text, text  # its own words, after zerokern's


def test_one_process_sgd_with_grad_scaler_and_clipping():
    """One process, stage 0: GradScaler (its grad_scale reaches the engine) and max_grad_norm as torch."""
    torch.manual_seed(0)
    model, ref = W.ThreeLayers(), W.ThreeLayers()
    opt = zerokern.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9, max_grad_norm=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for _ in range(3):
        x = torch.randn(8, 6)
        opt.zero_grad()
        ref_opt.zero_grad()
        scaler.scale(model(x)).backward()
        ref(x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
    assert max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())) < 1e-6


@pytest.mark.parametrize("via", ["dcp", "helpers"])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_dcp_checkpoint_resumes_bit_for_bit(tmp_path, name, stage, via):
    """Issue 39: a fresh ZeroOptimizer's state_dict() had no state entries, so dcp.load filled
    nothing and the run resumed with empty momentum / Adam state (params 1e-2..1e-1 off)."""
    path = str(tmp_path / "ck")
    for rank, r in enumerate(dist_harness.values(
            dist_harness.run(W.checkpoint_resume, 2, name, stage, via, path, 2, timeout=180))):
        assert r["same"], (rank, r["diff"])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_torch_helpers_round_trip_changes_nothing(name, world):
    """Issue 39: set_optimizer_state_dict hands the state keyed by param name; it was looked up by
    index, so the inner optimizer lost its state (1 process) or torch raised "Missing optimizer
    state" (2 ranks: a param with no element on a rank had no entry there)."""
    for rank, r in enumerate(dist_harness.values(
            dist_harness.run(W.checkpoint_resume, world, name, 2, "round_trip", None, 2, timeout=180))):
        assert r["inner_after"] == r["inner_before"] > 0, (rank, r)
        assert r["same"], (rank, r["diff"])


@pytest.mark.parametrize("name", ["sgd", "adam", "rmsprop"])
def test_dcp_checkpoint_resumes_at_another_world_size(tmp_path, name):
    """Saved at 2 ranks (stage 2), resumed at 1: the same state, re-sharded by DCP."""
    path = str(tmp_path / "ck")
    saved = dist_harness.values(dist_harness.run(W.checkpoint_resume, 2, name, 2, "dcp", path, 2, timeout=180))
    resumed = dist_harness.values(dist_harness.run(W.resume_elsewhere, 1, name, 2, path, 2, timeout=180))[0]
    want = saved[0]["weights"]
    # fp32: one process averages the full batch's grads in another order than two ranks' reduction
    assert resumed.keys() == want.keys()
    assert max(abs_diff(resumed[n], want[n]) for n in want) < 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_before_the_first_step(tmp_path, stage):
    """Saved before any step, the state is 'none yet': SGD with dampening makes its momentum buffer
    from the first grad (a zero buffer would give (1 - dampening) x grad), so it must stay unmade."""
    path = str(tmp_path / "ck")
    for rank, r in enumerate(dist_harness.values(
            dist_harness.run(W.checkpoint_resume, 2, "sgd_dampening", stage, "dcp", path, 0, timeout=180))):
        assert r["same"], (rank, r["diff"])


class _FloatStateSGD(torch.optim.SGD):
    """SGD that also keeps a Python float in a param's state from its first step (as a custom
    optimizer might): elementwise, so ZeroOptimizer trains it."""

    def step(self, closure=None):
        out = super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.state[p]["seen"] = self.state[p].get("seen", 0.0) + 1.0
        return out


def test_state_dict_before_first_step_refuses_state_without_a_placeholder():
    """A Python value made at the first step cannot be given a placeholder for dcp.load to fill:
    state_dict() before that step raises, naming the optimizer, the key and the param; training
    and a state dict after the first step work as before."""
    model = W.ThreeLayers()
    opt = zerokern.ZeroOptimizer(model.named_parameters(), _FloatStateSGD, lr=0.1, elementwise=True)
    with pytest.raises(ValueError, match=r"_FloatStateSGD makes its state 'seen' \(a float.*a\.weight has had none"):
        opt.state_dict()
    opt.zero_grad()
    model(torch.randn(4, 6)).backward()
    opt.step()
    sd = opt.state_dict()
    assert {st["seen"] for st in sd["state"].values()} == {1.0}
    assert all(not st["zerokern_fresh"] for st in sd["state"].values())
