"""zerokern.ZeroOptimizer(params, torch.optim.X, ...): any elementwise torch optimizer over the
ZeRO engine (issue 25), 2 gloo ranks against the same optimizer on one process."""

import pytest
import torch

import dist_harness
import zero_optimizer_workers as W
import zerokern


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
    model = W.Net()
    for cls in [getattr(torch.optim, "Adafactor", None), torch.optim.LBFGS]:
        if cls is None:
            continue
        with pytest.raises(ValueError, match=f"{cls.__name__} is not known to update each element"):
            zerokern.ZeroOptimizer(model.parameters(), cls)
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer class"):
        zerokern.ZeroOptimizer(model.parameters(), "SGD")


def test_one_process_sgd_with_grad_scaler_and_clipping():
    """One process, stage 0: GradScaler (its grad_scale reaches the engine) and max_grad_norm as torch."""
    torch.manual_seed(0)
    model, ref = W.Net(), W.Net()
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
