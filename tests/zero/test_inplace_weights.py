"""Weights written into fp16/bf16 params between steps (model.load_state_dict, nn.init, a
WGAN-style clamp_) are what the next step trains from, at stages 0, 1 and 2: the fp32 masters
follow them. Before this, the next step wrote the old masters back: the new weights were lost
without a word. Multi-rank runs have a timeout: a hang fails."""

import pytest

import dist_harness
import inplace_workers as W


@pytest.mark.parametrize("how", ["load_state_dict", "init", "clamp", "one_row"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_process(dtype, how):
    r = W.write_between_steps(0, 1, dtype, 0, how)
    assert r["written"] and r["masters_kept"], r


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_state(stage):
    for rank, r in enumerate(dist_harness.values(dist_harness.run(W.write_between_steps, 2, "bfloat16", stage,
                                                                  "load_state_dict", timeout=120))):
        assert r["written"] and r["masters_kept"], (rank, r)
