"""The planner's reduce_precision and gather_precision ([Note: bytes on the wire] and [Note: error
feedback memory] in zerokern/plan/traffic.py): bytes within and across hosts and the error
feedback's memory, against numbers worked out by hand and against a quantized gloo run."""

import json

import pytest

from zerokern.plan import plan
from zerokern.plan import traffic
from zerokern.plan.cli import main

# P = 4096 bf16 params (8,192 bytes) on dp = 4 ranks, 2 hosts of 2 (s = 2). Blocks of 64: a quarter
# shard is 1,024 elements: int8 q = 4 * 16 scales + 1,024 = 1,088 bytes, int4 64 + 512 = 576; a half
# shard (hybrid, 2,048): int8 128 + 2,048 = 2,176, int4 128 + 1,024 = 1,152; the whole 4,096: int8
# 256 + 4,096 = 4,352.
# Rows: (stage, reduce, gather) -> (flat per rank, flat across, flat within, hybrid across, hybrid within)
BY_HAND = {
    # no quantization: ring reduce-scatter/all-gather 3/4 x 8,192 = 6,144 per rank, 2 of 4 ring edges
    # cross hosts; hybrid all-reduces the whole 8,192 (stage 0) or the half shard 4,096 over 2 hosts:
    # 4 ranks x 2 x 1/2 x that, and inside a host 4 x 1/2 x 8,192 = 16,384 per collective
    (0, None, None): (12_288, 24_576, 24_576, 32_768, 32_768),
    (2, None, None): (12_288, 24_576, 24_576, 16_384, 32_768),
    (3, None, None): (18_432, 36_864, 36_864, 16_384, 49_152),
    # int8, flat stage 0 (> 2 ranks): an all-to-all of 1,088-byte chunks (3 sent per rank, 2 of them
    # to the other host: across 4 x 2 x 1,088 = 8,704, within 4,352), then a ring all-gather of the
    # summed chunks (3 x 1,088 per rank; across 2 x 3,264, within 2 x 3,264). Hybrid: 4 x 4,352.
    (0, "int8", None): (6_528, 15_232, 10_880, 17_408, 32_768),
    # from stage 1 the reduce-scatter is that all-to-all alone; the bf16 gather after step as above.
    # Hybrid: 4 ranks x 2,176 (the 2-host all-reduce is one all-gather of the whole quantized shard)
    (1, "int8", None): (3_264 + 6_144, 8_704 + 12_288, 4_352 + 12_288, 8_704, 32_768),
    (3, "int8", None): (3_264 + 12_288, 8_704 + 24_576, 4_352 + 24_576, 8_704, 49_152),
    (2, "int4", None): (3 * 576 + 6_144, 4 * 2 * 576 + 12_288, 4 * 576 + 12_288, 4 * 1_152, 32_768),
    # gather_precision int8: stage 3's two all-gathers of 1,088-byte chunks (3 per rank each); flat only
    (3, None, "int8"): (6_144 + 6_528, 12_288 + 13_056, 12_288 + 13_056, 16_384, 49_152),
    # casts: fp32 doubles the grads' bytes, bf16 of bf16 grads changes nothing
    (2, "fp32", None): (12_288 + 6_144, 2 * 12_288 + 12_288, 2 * 12_288 + 12_288, 32_768, 32_768),
    (2, "bf16", None): (12_288, 24_576, 24_576, 16_384, 32_768),
}


@pytest.mark.parametrize("stage, reduce, gather", list(BY_HAND))
def test_bytes_within_and_across_hosts_by_hand(stage, reduce, gather):
    s = plan(params=4096, dp=4, hosts=2, dtype="bf16", reduce_precision=reduce, gather_precision=gather).stages[stage]
    got = (s.comm_bytes, s.inter_host_bytes, s.intra_host_bytes, s.hybrid_inter_host_bytes, s.hybrid_intra_host_bytes)
    assert got == BY_HAND[stage, reduce, gather]


def test_error_feedback_in_the_totals_by_hand():
    # bf16 residuals, committed + pending, of what is quantized: flat the whole 4,096 (+ the 1,024
    # chunk of the sum at stage 0 on 4 ranks), hybrid the whole bucket at stage 0, then the half shard
    plain = plan(params=4096, dp=4, hosts=2, dtype="bf16")
    for precision in ("int8", "int4"):
        p = plan(params=4096, dp=4, hosts=2, dtype="bf16", reduce_precision=precision)
        assert [s.error_feedback_bytes for s in p.stages] == [4 * 5_120, 4 * 4_096, 4 * 4_096, 4 * 4_096]
        assert [s.hybrid_error_feedback_bytes for s in p.stages] == [4 * 4_096, 4 * 2_048, 4 * 2_048, 4 * 2_048]
        for s, q in zip(plain.stages, p.stages):
            assert q.total_bytes == s.total_bytes + q.error_feedback_bytes
            assert q.headroom_bytes == s.headroom_bytes - q.error_feedback_bytes
            assert q.hybrid_total_bytes == s.hybrid_total_bytes + q.hybrid_error_feedback_bytes
    # casts keep none; one rank sends nothing and keeps none
    assert all(s.error_feedback_bytes == 0 for s in plan(params=4096, dp=4, reduce_precision="fp32").stages)
    one = plan(params=4096, dp=1, reduce_precision="int8")
    assert all(s.error_feedback_bytes == 0 and s.comm_bytes == 0 for s in one.stages)
    # "fits" counts it: stage 2, fp32, 2 ranks: params 4,000 + grads 2,000 + buckets 4,000 + Adam 4,000
    # = 14,000 bytes; int8's residuals 4 x 1,000 more
    assert plan(params=1000, dp=2, dtype="fp32", gpu_memory=16_000).stages[2].fits
    assert not plan(params=1000, dp=2, dtype="fp32", gpu_memory=16_000, reduce_precision="int8").stages[2].fits


def test_three_hosts_by_hand():
    # 3,600 fp32 params, mesh (3, 2), stage 0: each rank all-reduces its whole bucket over 3 hosts,
    # the all-to-all and all-gather of 1,200-element chunks: 2 x 2 x (4 x 19 + 1,200) = 5,104 bytes per
    # rank, 6 ranks; its residuals: the bucket and its 1,200 chunk of the sum, 4 bytes each at the
    # peak. (A gloo run of that mesh, in blocks of 256, counted 4,880 per rank, as the planner then
    # did, and 19,200 bytes of residuals.)
    s = plan(params=3600, dp=6, hosts=3, dtype="fp32", reduce_precision="int8").stages[0]
    assert s.hybrid_inter_host_bytes == 6 * 5_104
    assert s.hybrid_error_feedback_bytes == 4 * (3_600 + 1_200)


def test_unknown_precisions_name_the_choices(capsys):
    with pytest.raises(ValueError, match=r"unknown reduce_precision 'int2'; choose one of \(None, 'fp32', 'bf16', "
                                         r"'int8', 'int4'\)"):
        plan(1e9, reduce_precision="int2")
    with pytest.raises(ValueError, match=r"unknown gather_precision 'int4'; choose one of \(None, 'int8'\)"):
        plan(1e9, gather_precision="int4")
    for flag, bad in (("--reduce-precision", "int2"), ("--gather-precision", "int4")):
        with pytest.raises(SystemExit) as e:
            main(["--params", "1e9", flag, bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"invalid choice: '{bad}'" in err and "'none'" in err and "'int8'" in err, err


def test_choices_match_the_runtime():
    """The planner repeats the runtime's tuples (it must not import torch): the same choices, and
    the runtime refuses what the planner refuses."""
    from zerokern.zero.comm import wire
    from zerokern.zero.core import precision

    assert traffic.REDUCE_PRECISIONS == precision.REDUCE_PRECISIONS
    assert traffic.GATHER_PRECISIONS == precision.GATHER_PRECISIONS
    from zerokern.kernels import wire as kernel_wire
    assert traffic.BLOCK == kernel_wire.BLOCK
    for n in (0, 1, 255, 256, 257, 4097):
        for bits, name in ((8, "int8"), (4, "int4")):
            assert traffic.wire_bytes(n, name, 4) == wire.stride(n, bits), (n, name)
    for bad in (("int2", None), (None, "int4"), ("INT8", None)):
        for check in (traffic.check_precisions, precision.check_precisions):
            with pytest.raises(ValueError, match="choose one of"):
                check(*bad)


def test_cli_prints_the_columns_and_json(capsys):
    argv = ["--params", "4096", "--dp", "4", "--hosts", "2", "--reduce-precision", "int8", "--gather-precision",
            "int8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "    ef  total" in out and "hybrid MB across" in out and "of which ef" in out
    assert "grads in int8, params gathered in int8" in out
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["reduce_precision"], d["gather_precision"]) == ("int8", "int8")
    assert d["stages"][0]["error_feedback_bytes"] == 4 * 5_120
    assert main(["--params", "4096", "--dp", "4"]) == 0
    assert "    ef" not in capsys.readouterr().out  # no quantized reduction, no column


def test_planner_matches_the_counted_bytes_and_residuals():
    """A 2 x 2 gloo mesh counts (HybridComm.inter_host_bytes) what each rank sends across hosts; the
    planner, given the layout's padded bucket as its params, says the same to the byte, and the
    residuals memory_report() holds at the peak and between steps."""
    import dist_harness
    import plan_wire_workers as W

    cases = [(0, "int8", (2, 2)), (2, "int4", (2, 2)), (2, "int8", None)]
    results = dist_harness.values(dist_harness.run(W.counted, 4, cases, timeout=300))
    for stage, precision, mesh in cases:
        runs = [r[stage, precision, mesh] for r in results]
        p = plan(params=runs[0]["padded"], dp=4, hosts=2, dtype="fp32", reduce_precision=precision).stages[stage]
        hybrid = mesh is not None
        if hybrid:
            assert sum(r["sent"] for r in runs) == p.hybrid_inter_host_bytes, (stage, precision, runs)
        ef = p.hybrid_error_feedback_bytes if hybrid else p.error_feedback_bytes
        between = traffic.error_feedback_bytes(stage, runs[0]["padded"], 4, 2, precision, hybrid, between_steps=True)
        for r in runs:
            assert (r["peak"], r["between"]) == (ef, between), (stage, precision, mesh, r, ef)
