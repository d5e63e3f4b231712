"""One ZeroOptimizer with a torch.optim.Muon group (the blocks' 2-D weights), a
torch.optim.Adafactor group (their biases and norms, and the head's weight) and an AdamW group (the
embedding, the head's bias): each param whole on one owner, balanced by its own class's cost
([Note: a cost per param] in zerokern/zero/core/whole_matrices.py). On 2 ranks at stage 2 (laid
out by the optimizer, or by shard() units) and stage 3, every rank on the same batch: after 20
steps the params equal one-process torch.optim.Muon + Adafactor + AdamW bit for bit, on every rank
alike, and each whole param was stepped once a step. Bodies in matrix_kinds_workers.py."""

import re

import pytest
import torch

import dist_harness
import matrix_helpers as H
import matrix_kinds_workers as K
import mixed_checkpoint_workers as C
import zerokern

pytestmark = pytest.mark.skipif(not (hasattr(torch.optim, "Muon") and hasattr(torch.optim, "Adafactor")),
                                reason="torch.optim.Muon is torch 2.9+")


@pytest.mark.parametrize("stage, how, dtype", [(2, "optimizer", torch.float32), (2, "dict", torch.float32),
                                               (3, "dict", torch.float32), (3, "predicate", torch.bfloat16)])
def test_muon_adafactor_and_adamw_on_two_ranks_are_one_process_torch(stage, how, dtype):
    cases = [(stage, None, dtype, how)]
    out = dist_harness.values(dist_harness.run(K.same_batch, 2, "mixed", cases, timeout=300))
    H.check_ranks(out, cases, 2, 2, K.U.STEPS, H.same_bits)


def test_a_2x2_mesh_is_one_process_torch_muon_adafactor_and_adamw():
    """Stage 2 (the optimizer's layout) and stage 3 (units, {param: kind}) in one 4-rank run: each
    shard group of 2 steps each whole param once a step."""
    cases = [(2, (2, 2), torch.float32, "optimizer"), (3, (2, 2), torch.float32, "dict")]
    out = dist_harness.values(dist_harness.run(K.same_batch, 4, "mixed", cases, timeout=500))
    H.check_ranks(out, cases, 4, 2, K.U.STEPS, H.same_bits)


def test_state_dict_on_two_ranks_is_torch_layout_both_ways(tmp_path):
    """The mixed optimizer's state_dict() at stage 2 on 2 ranks, saved with DCP after 3 steps: its
    Muon and Adafactor state whole on every rank, in torch's shapes; one-process torch.optim.Muon,
    Adafactor and AdamW load it (consolidated by dcp_to_torch_save) and take the uninterrupted
    run's next 2 steps bit for bit; a fresh 2-rank ZeroOptimizer loads the dict those three give
    (torch's layout, merged) and takes the same steps too."""
    path, again = str(tmp_path / "ck"), str(tmp_path / "again.pt")
    saved = dist_harness.values(dist_harness.run(C.save, 2, path, timeout=240))
    plain = C.resume_plain(path, str(tmp_path / "full.pt"), again)
    resumed = dist_harness.values(dist_harness.run(C.resume_from_torch, 2, again, timeout=240))
    model = K.U._net(torch.float32)
    torch_state = {}
    for o in C.torch_optimizers(model):  # torch's own state shapes, made by one step on zero grads
        for g in o.param_groups:
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        o.step()
        torch_state.update({len(torch_state) + k: {key: list(v.shape) for key, v in st.items()}
                            for k, st in o.state_dict()["state"].items()})
    kinds = [K.kind("mixed", n, p) for n, p in model.named_parameters()]
    whole = sum(k is not None for k in kinds)
    for rank, (_, shapes, classes) in enumerate(saved):
        assert classes == [torch.optim.Muon, torch.optim.Adafactor, None], (rank, classes)
        # groups Muon's, Adafactor's, AdamW's: the first `whole` indices are stepped whole
        for k in range(whole):
            assert shapes[k] == torch_state[k], f"rank {rank}: state[{k}] {shapes[k]}, torch's {torch_state[k]}"
    want = saved[0][0]
    for name, got in [*((f"rank {r}, uninterrupted", w) for r, (w, _, _) in enumerate(saved)),
                      ("one-process torch", plain), *((f"rank {r}, from torch's", w) for r, w in enumerate(resumed))]:
        diff = max((a - b).abs().max().item() for a, b in zip(got, want))
        assert diff == 0.0, f"{name}: params {diff} from rank 0's uninterrupted run"


@pytest.mark.parametrize("stage, how", [(2, "optimizer"), (3, "dict")])
def test_one_process_is_torch_muon_adafactor_and_adamw(stage, how):
    """On one shard every param is whole in any layout; the three classes still run as their own
    torch optimizers (InnerSet), each param stepped by its own."""
    model, opt = K._built("mixed", stage, None, torch.float32, how)
    diff, state, _, whole = K.against_reference("mixed", model, opt, torch.float32)
    assert diff == 0.0 and state == 0.0, f"params {diff}, state {state} from one-process torch"
    assert opt.matrices_stepped == K.U.STEPS * whole


def test_units_that_lay_a_param_out_by_the_other_class_are_refused_on_every_rank():
    """Rank 1 lays blocks.0.up.weight (Muon's) out as Adafactor's: every rank raises, listing each
    rank's param kinds, before any collective could pair with another size."""
    for rank, text in enumerate(dist_harness.values(dist_harness.run(K.refused, 2, "mixed", "differ",
                                                                      timeout=120))):
        assert text is not None and re.search(r"the ranks shard different params or options.*"
                                              r"\('up\.weight \[21, 9\]', 'muon'\).*rank 1: .*"
                                              r"\('up\.weight \[21, 9\]', 'adafactor'\)", text, re.S), text


def test_a_1d_param_in_the_muon_group_is_refused_by_name():
    """Beside an Adafactor group, which takes it; before the engine takes any param."""
    model = K.U._net(torch.float32)
    groups = K._groups("mixed", model)
    bias = model.blocks[1].up.bias
    groups[0]["params"].append(bias)
    groups[1]["params"] = [p for p in groups[1]["params"] if p is not bias]
    named = [{**g, "params": [(n, p) for n, p in model.named_parameters() if any(p is q for q in g["params"])]}
             for g in groups]
    with pytest.raises(ValueError, match=r"Muon orthogonalises .* takes 2-D params only: params\[\d+\] "
                                         r"\('blocks\.1\.up\.bias'\) has shape \[13\]"):
        zerokern.ZeroOptimizer(named, torch.optim.AdamW, zero_stage=2)
