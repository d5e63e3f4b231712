"""The planner's matrix-optimizer rows (--optimizer muon|adafactor, zerokern/plan/matrix.py): each
rank's state and Newton-Schulz work read off ZeroOptimizer's own layout, checked by hand, against a
real module's params, against the layout a ZeroOptimizer builds, and (fp32 and int8 Muon momentum)
against the state bytes a real ZeroOptimizer holds on one process and on 2 gloo ranks."""

import json
import math
import subprocess
import sys

import pytest
from zerokern.plan import plan
from zerokern.plan.cli import main
from zerokern.plan.matrix import INT8_BLOCK, int8_momentum_bytes, model_shapes, ns_flops, plan_matrices
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
    unit = plan(**TINY, dp=4, optimizer="muon", matrix_layout="unit")
    assert p.matrix_layout == "groups" and unit.matrix_layout == "unit"
    assert p.stages[0].adam_bytes == p.matrix.state_bytes_unsharded == unit.matrix.state_bytes_unsharded
    for s in p.stages[1:3]:
        assert s.adam_bytes == pytest.approx(max(p.matrix.state_bytes))
    for s in unit.stages[1:]:
        assert s.adam_bytes == pytest.approx(max(unit.matrix.state_bytes))
    # stage 3 needs shard(): its column is the unit layout's whatever stages 1-2 run. A shape whose
    # busiest rank differs between the layouts (143,104 bytes in groups, 136,704 in a unit)
    kw = dict(layers=1, hidden=64, heads=2, vocab=96, dp=2, bucket_cap_mb=0.02, optimizer="muon")
    groups, unit = plan(**kw), plan(**kw, matrix_layout="unit")
    assert max(groups.matrix.state_bytes) != max(unit.matrix.state_bytes)
    assert groups.stages[2].adam_bytes == pytest.approx(max(groups.matrix.state_bytes))
    assert groups.stages[3].adam_bytes == unit.stages[3].adam_bytes != groups.stages[2].adam_bytes
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
    assert "per-rank rows in ZeroOptimizer's own layout (its param groups' order, stages 1-2" in out
    assert main(["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "128", "--dp", "2",
                 "--optimizer", "muon", "--matrix-layout", "unit"]) == 0
    assert "per-rank rows in one shard() unit's layout (registration order)" in capsys.readouterr().out
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


# --- the Muon momentum in int8 (--matrix-state-precision int8) ------------------------------------

def test_int8_momentum_bytes_by_hand():
    # [Note: int8 momentum of whole matrices]: m n codes + 2 m ceil(n / 64) (bf16 rho) + 4 n (fp32 c)
    assert int8_momentum_bytes((128, 128)) == 128 * 128 + 2 * 128 * 2 + 4 * 128  # 1.0625 an element
    assert int8_momentum_bytes((9, 300)) == 2_700 + 2 * 9 * 5 + 4 * 300
    # docs/matrix_optimizers.md's loss run: 4 layers of d 128, 16 matrices, 3,145,728 fp32 bytes -> 825,344
    p = plan(layers=4, hidden=128, heads=4, vocab=256, optimizer="muon", matrix_state_precision="int8")
    fp32 = plan(layers=4, hidden=128, heads=4, vocab=256, optimizer="muon")
    assert (p.matrix.matrix_state_bytes, fp32.matrix.matrix_state_bytes) == (825_344, 3_145_728)
    assert p.matrix.state_precision == "int8" and fp32.matrix.state_precision == "fp32"
    # AdamW's share is the same in both; stage 0 holds all of it, stages 1-3 the busiest rank's
    assert p.stages[0].adam_bytes - p.matrix.matrix_state_bytes == fp32.stages[0].adam_bytes - 3_145_728


@pytest.mark.parametrize("shape", [(1, 1), (1, 64), (1, 65), (9, 300), (33, 9), (127, 4097), (0, 5)])
def test_int8_momentum_bytes_are_the_codecs_tensors(shape):
    """The planner (no torch) keeps its own copy of the codec's layout; here it meets the runtime's:
    the block, and the bytes of what encode_rows makes for odd shapes (a short last block, one
    element, a row longer than 64 blocks, no rows)."""
    torch = pytest.importorskip("torch")
    from zerokern.optim import lowbit_momentum

    assert INT8_BLOCK == lowbit_momentum.BLOCK
    m = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    held = lowbit_momentum.encode_rows(m)
    assert sum(t.numel() * t.element_size() for t in held) == int8_momentum_bytes(shape)


def _stepped(cases, world):
    """Each case's state on each rank of a real ZeroOptimizer (plan_matrix_workers.py)."""
    import dist_harness
    import plan_matrix_workers as W

    if world == 1:
        return [[W.state_bytes(precision, **kw)] for precision, kw in cases]
    out = dist_harness.values(dist_harness.run(W.ranks, world, cases, timeout=300))
    return [[r[k] for r in out] for k in range(len(cases))]


def _planned(precision, world, dtype, bucket_cap_mb, layout="unit"):
    import plan_matrix_workers as W

    return plan(**W.SHAPE, dp=world, dtype=dtype, bucket_cap_mb=bucket_cap_mb, optimizer="muon",
                matrix_state_precision=precision, matrix_layout=layout)


def _check(got, planned):
    """Each rank's per-element state is the planned row to the byte; what else it holds is torch's
    0-dim AdamW `step`, one a tensor on every rank (empty pieces too), not planned ([Note: matrix
    optimizers in the plan])."""
    import plan_matrix_workers as W

    m = planned.matrix
    assert [r["per_element"] for r in got] == list(m.state_bytes), ([r["per_element"] for r in got], m.state_bytes,
                                                                    planned.matrix_layout)
    assert max(m.state_bytes) == planned.stages[2].adam_bytes and planned.stages[0].adam_bytes == sum(m.state_bytes)
    shapes, whole = model_shapes("gpt", W.SHAPE["layers"], W.SHAPE["hidden"], W.SHAPE["vocab"])
    for r in got:
        assert r["scalars"] == [("step", 4)] * (len(shapes) - len(whole)), r["scalars"]
    assert sorted(name for r in got for name in r["matrices"]) == sorted(
        f"blocks.{i}.{k}.weight" for i in range(2) for k in ("qkv", "proj", "fc1", "fc2")), "each matrix on one rank"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_process_holds_the_planned_state(dtype):
    """A tiny GPT registered as model_shapes lists it, one step of ZeroOptimizer (Muon + AdamW),
    fp32 and int8 momentum: the state it holds is the plan's, to the byte, and int8 is less."""
    import torch

    cases = [(precision, dict(dtype=getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]),
                              bucket_cap_mb=0.02)) for precision in ("fp32", "int8")]
    got = _stepped(cases, 1)
    for (precision, _), g in zip(cases, got):
        _check(g, _planned(precision, 1, dtype, 0.02))
    assert got[1][0]["per_element"] < got[0][0]["per_element"] / 2


def test_two_ranks_at_stage_2_hold_the_planned_state():
    """2 gloo ranks, stage 2, fp32 and int8 momentum, small buckets (several a layer) and one large
    one (the ranks' shares then differ, so a row given to the other rank would fail), in both
    layouts the planner knows: the model shard()ed as one unit (registration order, matrix_layout
    "unit") and ZeroOptimizer bucketing the params itself, built with the documented two groups
    (matrices, then the rest, each in registration order: matrix_layout "groups"). Each rank's
    state is its planned row of its layout, to the byte."""
    cases = [(precision, dict(bucket_cap_mb=cap, units=units))
             for units in (True, False) for precision in ("fp32", "int8") for cap in (0.02, 25.0)]
    got = _stepped(cases, 2)
    for (precision, kw), g in zip(cases, got):
        _check(g, _planned(precision, 2, "fp32", kw["bucket_cap_mb"], "unit" if kw["units"] else "groups"))
    for layout in ("unit", "groups"):
        large = _planned("int8", 2, "fp32", 25.0, layout).matrix.state_bytes
        assert large[0] != large[1], f"{layout}: the shares differ, so the per-rank check can tell ranks apart"
    # the two layouts give the ranks other shares here, so each layout's row is checked against its own runtime
    assert _planned("int8", 2, "fp32", 25.0, "unit").matrix.state_bytes != \
        _planned("int8", 2, "fp32", 25.0, "groups").matrix.state_bytes


def test_groups_order_is_the_rest_then_the_matrices_in_gradient_order():
    """ZeroOptimizer's loose unit takes [matrices, rest] (each in registration order) and reverses
    it into backward order ([Note: matrix optimizers in the plan])."""
    from zerokern.plan.matrix import groups_order

    assert groups_order(6, [1, 4]) == [0, 2, 3, 5, 1, 4]
    assert groups_order(3, []) == [0, 1, 2] and groups_order(2, [0, 1]) == [0, 1]
    shapes, whole = model_shapes("gpt", TINY["layers"], TINY["hidden"], TINY["vocab"])
    a = plan_matrices("muon", shapes, whole, 2, 10 ** 9, 8.0, layout="groups")
    b = plan_matrices("muon", [shapes[i] for i in groups_order(len(shapes), whole)],
                      list(range(len(shapes) - len(whole), len(shapes))), 2, 10 ** 9, 8.0)
    assert a == b
    with pytest.raises(ValueError, match="layout must be one of groups, unit, got 'registration'"):
        plan_matrices("muon", shapes, whole, 2, 4096, 8.0, layout="registration")
    with pytest.raises(ValueError, match="unknown matrix_layout 'x'; choose one of groups, unit"):
        plan(**TINY, optimizer="muon", matrix_layout="x")


def test_cli_prints_the_int8_row_and_refuses_what_the_runtime_refuses(capsys):
    shape = ["--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "256", "--dp", "2", "--optimizer"]
    assert main(shape + ["muon", "--matrix-state-precision", "int8"]) == 0
    out = capsys.readouterr().out
    assert "Muon on the layers' matrices (int8 momentum), AdamW with fp32 moments on the rest" in out
    assert ("muon: Muon on 16 matrices (7.864e+05 params, an int8 momentum each: uint8 codes, a bf16 scale per 64 "
            "elements of a row and an fp32 one per column, 825,344 bytes in all, 1.049 an element") in out
    assert main(shape + ["muon", "--json", "--matrix-state-precision", "int8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["matrix_state_precision"] == "int8" and d["matrix"]["matrix_state_bytes"] == 825_344
    for bad, message in (
            (["adafactor", "--matrix-state-precision", "int8"],
             "ZeroOptimizer refuses state_precision on a group that is not Muon's"),
            (["adam", "--matrix-state-precision", "int8"], "use optimizer='muon', or state_precision='int8' for"),
            (["muon", "--matrix-state-precision", "int8", "--no-master-weights"],
             "ZeroOptimizer refuses int8 Muon momentum beside bf16 params without masters"),
            (["muon", "--matrix-state-precision", "int4"], "invalid choice: 'int4'")):
        with pytest.raises(SystemExit) as e:
            main(shape + bad)
        assert e.value.code == 2
        assert message in capsys.readouterr().err, bad
    with pytest.raises(ValueError, match="unknown matrix_state_precision 'bf16'"):
        plan(layers=2, hidden=64, heads=2, vocab=128, optimizer="muon", matrix_state_precision="bf16")
