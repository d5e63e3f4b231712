"""Stage-3 patterns that reach past one unit's forward and backward (issue 29, items 3, 4, 11,
12): torch's numbers, or zerokern's error naming the param and the fix."""

import pytest

import dist_harness
import stage3_patterns_workers as W


def test_gradient_penalty_double_backward_matches_adamw():
    """Before: "setStorage: sizes [16, 8] ... out of bounds for storage of size 0" in backward
    (the penalty's graph read params freed at the end of the create_graph backward)."""
    for r in dist_harness.values(dist_harness.run(W.gradient_penalty, 2, timeout=120)):
        for raf in (True, False):
            assert r[raf]["diff"] < 1e-6, (raf, r[raf])
            assert r[raf]["gathered_after"] == 0, "step() frees every unit after a penalty's backward"


def test_hf_style_init_from_the_root_initialises_every_unit():
    """Before: the first forward raised "blocks.0.weight ... was changed in place while its unit
    was sharded ... load them: model.load_state_dict" (neither the cause nor the fix)."""
    for r in dist_harness.values(dist_harness.run(W.hf_style_init_at_root, 2, timeout=120)):
        assert r["biases_zero"] and all(0.01 < s < 0.03 for s in r["weight_stds"]), r
        assert r["diff"] < 1e-6, r["diff"]
        assert r["refused"] and "wrote to blocks.0." in r["refused"] and "reset_parameters()" in r["refused"], r
        assert "Pass the same init to every shard() call" in r["refused"] and r["left_on_meta"]


def test_hf_generate_at_stage3_syncs_ranks_that_finish_at_different_lengths():
    """Before: rank 0 left generate() early, the gathers desynchronised and the next training
    step aborted. transformers turns synced_gpus on only for DeepSpeed ZeRO-3 and FSDP; zerokern's
    stage-3 model now does the same; an explicit synced_gpus=False raises on every rank."""
    pytest.importorskip("transformers")
    synced = dist_harness.values(dist_harness.run(W.hf_generate_at_stage3, 2, None, timeout=180))
    assert [r["error"] for r in synced] == [None, None], synced
    assert [r["new_tokens"] for r in synced] == [2, 5]
    assert synced[0]["checksum"] == synced[1]["checksum"], "the ranks agree after the step"
    unsynced = dist_harness.values(dist_harness.run(W.hf_generate_at_stage3, 2, False, timeout=180))
    for r in unsynced:
        assert r["error"] and "synced_gpus=True" in r["error"], r


def test_params_read_outside_a_forward_name_zerokern_the_param_and_the_fix():
    """Before: torch's "mat1 and mat2 shapes cannot be multiplied (4x8 and 0)" and "PowBackward0
    returned an invalid gradient ... got [0]" (after the L2 forward had silently added 0)."""
    for r in dist_harness.values(dist_harness.run(W.params_read_outside_forward, 2, timeout=120)):
        for what, param in (("hidden", "body.weight"), ("head weight", "head.weight"), ("head mT", "head.weight"),
                            ("l2", "body.weight")):
            assert r[what] and r[what].startswith(f"zerokern: {param} was used"), (what, r[what])
            assert "call the module" in r[what] and "full_state_dict" in r[what], r[what]
        # the full shapes to Python ([Note: shapes between gathers]), an empty tensor held
        assert r["shapes"] == [(16, 8), (16,), (4, 16), (4,)] and r["held"] == [(0,)] * 4, r
        assert r["keys"] == ["body.bias", "body.weight", "head.bias", "head.weight"]
        assert "head.weight sharded by zerokern" in r["repr"] and "shape=[4, 16]" in r["repr"], r["repr"]
        assert r["trained"]


def test_torch_compile_at_stage3_gives_eager_losses():
    for r in dist_harness.values(dist_harness.run(W.compiled_matches_eager, 2, timeout=300)):
        assert r[True] == r[False], r


def test_a_compiled_model_at_stage3_compiles_a_bounded_number_of_frames():
    """[Note: hooks under torch.compile]: the hooks were traced, and the collectives' names
    (all_gather[blocks.2:float32:0]) became guards, so each unit recompiled (10 frames for 4
    blocks, dynamo's recompile limit hit). Now the count does not grow with the blocks."""
    frames = {}
    for n in (4, 8):
        for r in dist_harness.values(dist_harness.run(W.compiled_frames, 2, n, timeout=300)):
            assert r["losses"][True] == r["losses"][False], r
            frames.setdefault(n, set()).add(r["frames"])
    assert frames[4] == frames[8] and max(frames[4]) <= 4, frames


def test_a_compiled_training_step_at_stage3_trains_as_eager():
    """forward, backward() and step() under one torch.compile: dynamo traced the grad hooks and
    the end-of-backward callback, faked a param emptied to [0] with its full-size grad and died
    ("attempting to assign a gradient of size [s49] to a tensor of size [0]"). Now they run
    eagerly (graph breaks, as step() already was one) and it trains as the eager steps do."""
    for r in dist_harness.values(dist_harness.run(W.compiled_training_step, 2, timeout=300)):
        assert r["keys"] == 10, r
        assert r["max_diff"] < 1e-6, r  # the same ops in the same order: eager backend, same kernels
        assert r["losses"] == pytest.approx(r["eager_losses"], abs=1e-6), r

def test_a_forward_reading_a_sharded_param_shape_compiles_and_gives_eager_losses():
    """Before: the forward (head.weight's shape read before the head's unit gathers) divided by
    the empty tensor's numel() 0; eager and compiled now read the full shape, as one process does.
    The compiled run also needs the runtime's unit list kept out of dynamo's tracing: pruning the
    dropped eager model's units there stored the units themselves in the weak list ("'UnitParams'
    object is not callable" in backward)."""
    for r in dist_harness.values(dist_harness.run(W.compiled_reads_shapes, 2, timeout=300)):
        assert r[True] == r[False], r
        assert r[False][0] == pytest.approx(r["ref"][0], rel=1e-6), r  # the first step: the same weights


def test_nanogpt_decay_groups_by_dim_match_adamw():
    """nanoGPT's configure_optimizers after shard(stage=3): decay groups by p.dim() >= 2 and the
    param count it prints are those of the unsharded model, so ZeroOptimizer(AdamW) with two
    groups trains as one-process AdamW. Before: every param had dim() 1 and numel() 0 between
    gathers, so no matrix decayed, the count was 0 and the weights drifted from AdamW's."""
    for r in dist_harness.values(dist_harness.run(W.nanogpt_decay_groups, 2, timeout=300)):
        assert r["after"] == r["before"] == r["ref"], r
        assert r["after"]["count"] > r["after"]["decay_numel"] > 0, r["after"]
        assert r["shapes"] == r["ref_shapes"] == r["shapes_after"] and r["held"] == [(0,)], r
        assert r["wd"] == [0.5, 0.0], r["wd"]
        assert r["diff"] < 1e-5, r["diff"]  # fp32: the ranks' grads are averaged in another order
        assert r["load"] == "<All keys matched successfully>" and r["resumed_equal"], r
