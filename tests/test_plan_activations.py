"""The planner's activation memory against numbers by hand."""

import pytest

from zerokern.plan import plan
from zerokern.plan.activations import activation_memory, layer_bytes_per_token
from zerokern.plan.cli import main

def test_llama_7b_by_hand():
    # per layer, bf16 (B = 2), h = 4096, f = 11008, 32 heads, kv = h:
    #   2 RMSNorms 2*((4 + 2B)h + 4) = 65,544; attention B(2h + 2kv) = 32,768; MLP 4Bf = 88,064;
    #   SDPA's logsumexp 4a = 128 -> 186,504 bytes per token
    assert layer_bytes_per_token("llama", 4096, 32, 11008, dtype="bf16") == 186_504
    a = activation_memory(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000, seq=4096)
    # + final norm (4 + 2B)h + 4 = 32,772 and the token ids 8; loss 12V = 384,000
    assert a.peak_bytes_per_token == 32 * 186_504 + 32_780 + 384_000
    full = activation_memory(arch="llama", layers=32, hidden=4096, heads=32, ffn_hidden=11008, vocab=32000,
                             seq=4096, checkpointing="full")
    assert full.peak_bytes_per_token == 32 * 2 * 4096 + 32_780 + 384_000  # the loss outweighs a recomputed layer
    # GPT-style (f = 4h) in fp16: B(8h + 2f) + 4B + 4a = 16hB + 8 + 4a
    assert layer_bytes_per_token("gpt", 1024, 16, dtype="fp16") == 16 * 1024 * 2 + 8 + 64


def test_7b_llama_on_8_x_24gb_int8_needs_checkpointing():
    kw = dict(arch="llama", layers=32, hidden=4096, heads=32, vocab=32000, ffn_hidden=11008, dp=8,
              gpu_memory="24GB", state_precision="int8", seq=4096)
    p = plan(**kw)
    assert p.smallest_fitting_stage is None  # 26 GB of activations alone, without checkpointing
    assert all(s.total_bytes == plan(**dict(kw, seq=None)).stages[s.stage].total_bytes + s.activations_bytes
               for s in p.stages)
    assert p.largest_micro_batch == {"none": [0, 0, 0, 0], "full": [0, 0, 1, 5]}
    assert plan(**kw, checkpointing="full").smallest_fitting_stage == 2
    assert plan(**dict(kw, seq=2048)).smallest_fitting_stage == 3  # or half the sequence at stage 3


def test_cli_activations(capsys):
    args = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000",
            "--ffn-hidden", "11008", "--dp", "8", "--gpu-memory", "24GB", "--state-precision", "int8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "activ" not in out.split("\n\n")[1] and "give --seq-len" in out  # not counted: no column
    assert main(args + ["--seq-len", "4096", "--checkpointing", "full"]) == 0
    out = capsys.readouterr().out
    row2 = next(line.split() for line in out.splitlines() if line.startswith("2 "))
    assert row2[7] == "2.78" and "smallest stage that fits" in out  # activ column: 678,924 B/token x 4096
    assert "largest micro-batch of 4096-token sequences" in out
    with pytest.raises(SystemExit) as e:
        main(["--params", "7B", "--seq-len", "4096"])
    assert e.value.code == 2
    capsys.readouterr()
