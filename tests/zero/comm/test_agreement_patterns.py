"""Ranks that leave the common path all raise, naming what each was at: never a hang, an abort
(gloo's SIGABRT on a size mismatch) or training on with mixed buffers (issue 29, items 1, 2, 5).
Each ran on 2 gloo ranks before the collective check: LayerDrop and the exceptions aborted or
hung (the harness's timeout), full_state_dict on rank 0 only gave a dict of stale bytes."""

import pytest

import agreement_patterns_workers as W
import dist_harness


def _both_raise_a_mismatch(results, *names):
    outs = dist_harness.values(results)
    for r, out in enumerate(outs):
        assert out["error"] and out.get("kind") == "mismatch", (r, out)
        assert "rank 0 at" in out["error"] and "rank 1 at" in out["error"], out["error"]
        for n in names:
            assert n in out["error"], (n, out["error"])
    assert outs[0]["error"] == outs[1]["error"], "every rank raises the same error"
    return outs


def test_a_unit_skipped_on_one_rank_raises_on_every_rank_at_stage_3():
    outs = _both_raise_a_mismatch(dist_harness.run(W.layer_drop_on_one_rank, 2, 3, timeout=120),
                                  "run every unit on every rank")
    # the units by their paths: gathers of blocks of one size are told apart
    assert "blocks.2" in outs[0]["error"] or "blocks.3" in outs[0]["error"], outs[0]["error"]


def test_a_module_skipped_on_one_rank_trains_as_ddp_at_stage_2():
    """Whole params: every bucket is reduced, a skipped module's grads count as zero (DDP's
    find_unused_parameters=True)."""
    for out in dist_harness.values(dist_harness.run(W.layer_drop_on_one_rank, 2, 2, timeout=120)):
        assert out["error"] is None, out["error"]
        assert out["diff"] < 1e-6, out["diff"]


@pytest.mark.parametrize("stage,where", [(3, "forward"), (2, "backward"), (3, "backward")])
def test_an_exception_on_one_rank_raises_on_every_rank(stage, where):
    outs = _both_raise_a_mismatch(dist_harness.run(W.exception_on_one_rank, 2, stage, where, timeout=120),
                                  "skip a failed batch on every rank")
    assert outs[1]["skipped"] == [1] and outs[0]["skipped"] == []


def test_full_state_dict_on_rank0_only_is_refused_and_corrupts_nothing():
    outs = _both_raise_a_mismatch(dist_harness.run(W.full_state_dict_on_rank0_only, 2, timeout=120),
                                  "full_state_dict[", "call full_state_dict/save_model on every rank")
    assert not outs[0]["got_dict"], "no dict of stale bytes is handed out"
    for r, out in enumerate(outs):
        assert out["untouched"], f"rank {r}'s params changed after the refused call"


def test_the_collective_timeout_is_validated(monkeypatch):
    from zerokern.zero.comm import check as collective_check
    for bad in ("abc", "0", "-5"):
        monkeypatch.setenv("ZEROKERN_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="ZEROKERN_COLLECTIVE_TIMEOUT"):
            collective_check._timeout()
    monkeypatch.setenv("ZEROKERN_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_check._timeout() == 2.5


def test_a_subgroup_trained_on_then_a_world_group_does_not_hang():
    """zerokern never makes a group that ranks outside it would have to join (or that moves their
    group names apart): a world group made after it works on every rank."""
    assert dist_harness.values(dist_harness.run(W.subgroup_then_world_group, 4, timeout=120)) == [10.0] * 4


def test_queued_collectives_are_announced_together():
    """[Note: announcing in rounds]: 16 collectives queued while the check's thread was busy take
    one announcement round trip between them, not one each (it was 17 for the 17)."""
    for out in dist_harness.values(dist_harness.run(W.queued_collectives, 2, timeout=120)):
        assert out["error"] is None, out["error"]
        assert out["values"] == [3.0 + 3 * k for k in range(16)], out["values"]
        assert out["rounds"] <= 3, out["rounds"]


def test_ranks_queueing_at_different_paces_agree():
    for out in dist_harness.values(dist_harness.run(W.queued_at_different_paces, 2, timeout=120)):
        assert out["error"] is None, out["error"]
        assert out["values"] == [3.0 + 3 * k for k in range(8)], out["values"]


def test_a_mismatch_inside_a_round_raises_on_every_rank():
    outs = _both_raise_a_mismatch(dist_harness.run(W.mismatch_inside_a_round, 2, timeout=120),
                                  "all_reduce[3]", "all_reduce[elsewhere]")
    for out in outs:
        assert out["values"][:3] == [3.0, 6.0, 9.0], out["values"]  # agreed before the mismatch: launched


def test_an_uneven_eval_loop_names_the_cause_on_every_rank():
    """Issue 39 item 7: rank 0 ran 3 eval batches, rank 1 ran 2 and waits in its own all_reduce.
    Rank 0 raises zerokern's error after the timeout; rank 1's all_reduce then fails with gloo's
    bare connection error, and the line zerokern prints with it (its excepthook) quotes rank 0's
    error, so both logs name the same cause."""
    first, second = dist_harness.values(dist_harness.run(W.uneven_eval, 2, timeout=120))
    assert first["error"].startswith("CollectiveMismatch") and "all_gather[" in first["error"], first
    assert "run as many batches on every rank" in first["error"], first["error"]
    cause = first["error"].split(": ", 1)[1]
    assert "Connection closed by peer" in second["error"] or "Connection reset" in second["error"], second
    assert second["explained"] is not None and cause in second["explained"], second
    assert second["hooked"] and second["explained"] in second["printed"], second


def test_a_repeated_loop_runs_on_a_plan_and_every_rank_leaving_it_alike_goes_on():
    """[Note: planned collectives]: once the ranks have agreed on a plan, the same four
    collectives per pass launch with no round trip each (each pass took a round per collective,
    or one for those queued together, before plans); the results are the same. Then every rank
    leaves the plan the same way (a batch skipped on every rank): they agree on that and go on."""
    for out in dist_harness.values(dist_harness.run(W.planned_loop_deviating_alike, 2, timeout=120)):
        assert out["error"] is None, out["error"]
        assert out["values"] == [[3.0] * 4] * 6 + [[3.0] * 3], out["values"]
        assert sum(out["rounds"][2:6]) <= 2, out["rounds"]  # a stretch of the plan is agreed ahead, in the background
        assert out["planned"] >= 12, out["planned"]


def test_one_rank_leaving_the_plan_raises_on_every_rank():
    """Rank 0 launched the planned collective and waits on it; rank 1 made another one. Rank 1
    posts where it left the plan, rank 0 answers with what it made there, and both raise the same
    error, within seconds, not at the timeout."""
    outs = _both_raise_a_mismatch(dist_harness.run(W.planned_loop_deviating_on_one_rank, 2, timeout=120),
                                  "all_reduce[1]", "all_reduce[elsewhere]")
    for out in outs:
        assert out["values"] == [[3.0] * 4] * 6, out["values"]  # every pass before it completed
        assert out["seconds"] < 20, out["seconds"]


def test_one_rank_leaving_a_plan_the_other_announced_raises_on_every_rank():
    """The collective rank 1 leaves the plan at was queued on rank 0 before the round that agreed
    it (rank 1 had it as a forecast): rank 0 answers too, so both raise, within seconds (it waited
    for the timeout, then raised a timeout on each rank)."""
    outs = _both_raise_a_mismatch(dist_harness.run(W.queued_on_one_rank_planned_on_the_other, 2, timeout=120),
                                  "all_reduce[1]", "all_reduce[elsewhere]")
    for out in outs:
        assert out["seconds"] < 20, out["seconds"]


def test_one_rank_leaving_the_plan_at_an_object_gather_raises_on_every_rank():
    """An object gather is never launched from a plan (its launch blocks: rank 0 sat in it until
    rank 1 gave up at the timeout and exited)."""
    outs = _both_raise_a_mismatch(dist_harness.run(W.planned_object_gather_left_on_one_rank, 2, timeout=120),
                                  "gather_objects[1]", "all_reduce[elsewhere]")
    for out in outs:
        assert out["seconds"] < 20, out["seconds"]


def test_short_plans_left_alike_many_times_never_raise():
    for out in dist_harness.values(dist_harness.run(W.short_plans_left_alike, 2, timeout=120)):
        assert out["error"] is None, out["error"]
        assert out["values"] == [[3.0]] * 3, out["values"]
