"""Stage-3 patterns that reach past one unit's forward and backward (issue 29, items 3, 4, 11,
12): torch's numbers, or zerokern's error naming the param and the fix."""

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
