"""The planner's matrix-optimizer rows (--optimizer muon|adafactor, zerokern/plan/matrix.py): each
rank's state and Newton-Schulz work read off ZeroOptimizer's own layout, checked by hand, against a
real module's params, and against the layout a ZeroOptimizer builds."""

import json
import math
import subprocess
import sys

import pytest
from zerokern.plan import plan
from zerokern.plan.cli import main
from zerokern.plan.matrix import model_shapes, ns_flops, plan_matrices
from zerokern.zero.core.matrix_layout import plan_matrix_layout

TINY = dict(layers=2, hidden=64, heads=2, vocab=128)


def test_ns_flops_by_hand():
    # 5 steps of X X^T (2 m^2 n), A A (2 m^3), B X (2 m^2 n) on the short side first
    assert ns_flops((64, 64)) == 5 * (4 * 64 ** 3 + 2 * 64 ** 3)
    assert ns_flops((256, 64)) == ns_flops((64, 256)) == 5 * (4 * 64 * 64 * 256 + 2 * 64 ** 3)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_shapes_are_the_formulas_params_and_the_layers_matrices(arch):
    kw = dict(TINY, ffn_hidden=None if arch == "gpt" else 176, kv_heads=None if arch == "gpt" else 1)
    shapes, whole = model_shapes(arch, kw["layers"], kw["hidden"], kw["vocab"], kw["ffn_hidden"], kw["heads"],
                                 kw["kv_heads"])
    total = plan(**TINY, ffn_hidden=kw["ffn_hidden"], kv_heads=kw["kv_heads"], arch=arch).params_total
    assert sum(math.prod(s) for s in shapes) == total
    per_layer = 4 if arch == "gpt" else 7
    assert len(whole) == per_layer * TINY["layers"] and all(len(shapes[i]) == 2 for i in whole)
    assert not any(shapes[i][0] == TINY["vocab"] for i in whole)  # embeddings and head stay with AdamW


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_each_element_and_matrix_counted_once(optimizer, dp):
    shapes, whole = model_shapes("gpt", TINY["layers"], TINY["hidden"], TINY["vocab"])
    m = plan_matrices(optimizer, shapes, whole, dp, 4096, 8.0)
    numels = [math.prod(s) for s in shapes]
    matrix_state = sum(4 * numels[i] if optimizer == "muon" else 4 * sum(shapes[i]) for i in whole)
    assert m.state_bytes_unsharded == matrix_state + 8.0 * (sum(numels) - sum(numels[i] for i in whole))
    assert sum(m.state_bytes) == m.state_bytes_unsharded  # every element on one rank, every matrix on one
    expect_work = sum(ns_flops(shapes[i]) if optimizer == "muon" else numels[i] for i in whole)
    assert sum(m.work) == expect_work and len(m.work) == dp


def test_the_adam_column_is_the_busiest_ranks_state():
    p = plan(**TINY, dp=4, optimizer="muon")
    assert p.stages[0].adam_bytes == p.matrix.state_bytes_unsharded
    for s in p.stages[1:]:
        assert s.adam_bytes == pytest.approx(max(p.matrix.state_bytes))
    adam = plan(**TINY, dp=4)
    assert p.stages[1].adam_bytes < adam.stages[1].adam_bytes  # one fp32 buffer for the matrices, not two


@pytest.mark.parametrize("optimizer", ["muon", "adafactor"])
def test_without_masters_the_state_is_bf16_and_there_is_no_master(optimizer):
    """ZeroOptimizer(master_weights=False) on bf16 params: torch's optimizers keep their state in
    bf16, 2 bytes a value (Muon's momentum 4 -> 2, Adafactor's statistics 4 -> 2, AdamW's two
    moments 8 -> 4: measured in bench/no_master_memory.py), so each rank's state is half."""
    a = plan(**TINY, dp=4, optimizer=optimizer)
    b = plan(**TINY, dp=4, optimizer=optimizer, master_weights=False)
    assert b.matrix.state_bytes == tuple(x / 2 for x in a.matrix.state_bytes)
    assert b.matrix.state_bytes_unsharded == a.matrix.state_bytes_unsharded / 2
    assert all(s.master_bytes == 0 for s in b.stages) and all(s.master_bytes > 0 for s in a.stages)
    with pytest.raises(ValueError, match=r"master_weights=False keeps torch's optimizers' state in bf16.*"
                                         r"state_precision='int8' has no meaning there"):
        plan(**TINY, optimizer=optimizer, master_weights=False, state_precision="int8")


def test_the_plan_is_the_layout_zero_optimizer_builds():
    """The planner's per-rank work follows the owners of plan_matrix_layout, which the runtime's
    plan_flat calls for a unit's matrix group (here: the whole model as one bf16 unit, no breaks)."""
    shapes, whole = model_shapes("gpt", 12, 768, 50257)
    cap = int(25 * 2**20 // 2)
    ml = plan_matrix_layout(shapes, whole, 4, cap, cost="muon")
    m = plan_matrices("muon", shapes, whole, 4, cap, 8.0)
    assert m.work == tuple(float(sum(ns_flops(shapes[i]) for i in ml.owned(r))) for r in range(4))
    assert m.balance <= 1.15  # issue 51's bound on a 12-layer GPT over 4 ranks


def test_cli_rows_and_refusals(capsys):
    assert main(["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "128", "--dp", "2",
                 "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "Muon on the layers' matrices, AdamW with fp32 moments on the rest" in out
    assert "muon: Muon on 8 matrices" in out and "balance" in out
    for bad in (["--params", "7e9", "--optimizer", "muon"],
                ["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "128", "--optimizer", "adafactor",
                 "--offload-optimizer", "cpu"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2
        assert "is planned from the model's shape" in capsys.readouterr().err


def test_json_has_the_matrix_rows():
    proc = subprocess.run([sys.executable, "-m", "zerokern.plan", "--layers", "2", "--hidden", "64", "--heads", "2",
                           "--vocab", "128", "--dp", "2", "--optimizer", "adafactor", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["optimizer"] == "adafactor" and d["matrix"]["matrices"] == 8 and d["matrix"]["balance"] >= 1.0
