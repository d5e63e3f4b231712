"""A flat group that spans hosts reduce-scatters and gathers host by host ([Note: collectives
across hosts] in zerokern/zero/comm/gloo.py): the plan's messages (pure), the collectives on 4
gloo ranks told they are on 2 or 3 hosts, and stage-2 training on them against torch. What the
links carry is measured on the namespaced hosts (tests/zero/comm/test_netbed.py, slow)."""

import itertools
import threading

import pytest

import across_hosts_workers as W
import dist_harness
import stage2_workers as S
from zerokern.zero.comm.gloo import HostPlan

LAYOUTS = [(0, 0, 1, 1), (0, 0, 0, 1), (0, 1, 0, 1), (0, 0, 1, 2), (0, 1, 2, 3), (0, 0, 0, 0, 0, 1, 1, 1)]


def _simulate(plan, messages, reduce):
    """What each rank holds of each chunk after the messages, step by step: for a reduce-scatter
    the set of ranks whose part it has summed (each at most once); for an all-gather whether it
    has the chunk."""
    n = len(plan.host_of)
    held = {(r, c): ({r} if reduce else r == c) for r in range(n) for c in range(n)}
    for step in (0, 1):
        arriving = [(src, dst, c) for s, src, dst, c in messages if s == step]
        snapshot = dict(held)  # a step's messages leave with what their sender held before it
        for src, dst, c in arriving:
            if reduce:
                assert not (snapshot[(src, c)] & held[(dst, c)]), (src, dst, c)  # no part summed twice
                held[(dst, c)] = held[(dst, c)] | snapshot[(src, c)]
            else:
                assert snapshot[(src, c)], (src, dst, c)  # a rank forwards only what it has
                held[(dst, c)] = True
    return held


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plan_sums_every_part_once_and_crosses_hosts_least(layout):
    plan = HostPlan(layout)
    n, hosts = len(layout), len(set(layout))
    rs, ag = plan.reduce_scatter_messages(), plan.all_gather_messages()
    held = _simulate(plan, rs, reduce=True)
    assert all(held[(c, c)] == set(range(n)) for c in range(n))
    held = _simulate(plan, ag, reduce=False)
    assert all(held.values())
    for messages in (rs, ag):
        assert len(set(messages)) == len(messages)
        # one chunk per (pair, chunk): the tags (base + chunk) pair each message with its receive
        assert len({(src, dst, c) for _, src, dst, c in messages}) == len(messages)
        across = [m for m in messages if plan.host_of[m[1]] != plan.host_of[m[2]]]
        assert len(across) == (hosts - 1) * n  # (H - 1) buffers; a ring all-reduce: 2 (n - 1) / n x H
        if len({layout.count(h) for h in layout}) == 1:  # equal hosts: each rank sends (n - 1) / n, as a ring
            for r in range(n):
                assert sum(1 for m in messages if m[1] == r) == n - 1, (r, messages)


def test_the_plan_names_hosts_by_first_rank():
    plan = HostPlan(["b", "a", "b", "a"])
    assert plan.host_of == (0, 1, 0, 1) and plan.members == ((0, 2), (1, 3)) and plan.local == (0, 0, 1, 1)
    assert not HostPlan(["x"] * 3).spans
    assert [plan.relay(h, c) for h, c in itertools.product(range(2), range(4))] == [0, 0, 2, 2, 1, 1, 3, 3]


def test_relay_threads_finish_their_queue_and_return_at_exit():
    """[Note: the relay thread]: one per group, running its collectives in order; at exit each is
    told to return after what was queued before (none left inside gloo while Python finalizes)."""
    from zerokern.zero.comm import gloo
    ran, gate = [], threading.Event()
    works = [gloo._relayed(key, lambda k=key, i=i: (gate.wait(5), ran.append((k, i))))
             for i in range(2) for key in ("group a", "group b")]
    threads = [thread for _, thread in gloo._RELAYS.values()]
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    threading.Timer(0.2, gate.set).start()  # the queued ones finish while _stop_relays waits
    gloo._stop_relays()
    assert all(w.is_completed() for w in works) and not any(t.is_alive() for t in threads)
    assert [i for k, i in ran if k == "group a"] == [0, 1] and len(ran) == 4 and not gloo._RELAYS


@pytest.mark.parametrize("check", [True, False])
def test_collectives_across_hosts_sum_in_a_fixed_order_and_copy_exactly(check):
    layouts = [(0, 0, 1, 1), (0, 0, 0, 1), (0, 1, 2, 0)] if check else [(0, 0, 1, 1)]
    for r in dist_harness.values(dist_harness.run(W.collectives_bits, 4, layouts, [1, 127, 4097], check,
                                                  timeout=180)):
        assert r["spans_by_default"] is False and r["relayed"], r  # one machine, a file:// store: one host
        for case in r["cases"]:
            assert case["fixed_order"] and case["second_fixed_order"], case
            assert case["input_kept"] and case["gather"] and case["gather_separate"], case
            # 4 terms: at most 3 roundings of the sum of magnitudes, as torch's own order
            bound = 3 * (2 ** -24 if case["dtype"] == "torch.float32" else 2 ** -8)
            assert case["err"] <= bound and case["torch_err"] <= bound, case


def test_stage2_across_hosts_trains_as_torch():
    """Stage 2 on 4 ranks told they are 2 hosts x 2: reduce-scatters and gathers host by host."""
    for r in dist_harness.values(dist_harness.run(S.random_accumulation, 4, 2, 6, 6, None, "across_hosts",
                                                  timeout=300)):
        assert r["relayed"], r
        assert r["worst"]["torch.float32"] < 5e-5 and r["worst"]["torch.bfloat16"] < 1e-2, r


def test_stage3_across_hosts_matches_stage2_and_adamw():
    """Stage 3 and stage 2 on 4 ranks that the factory takes for 2 hosts x 2 (this_host faked):
    the same bits as each other (the same reductions), AdamW's numbers within stage 3's fp32 bound."""
    for r in dist_harness.values(dist_harness.run(W.stage3_on_two_hosts, 4, timeout=300)):
        assert r["relayed"], r
        assert r["losses_equal"] and r["equal_to_stage2"], r["losses"]
        assert r["max_diff_ref"] < 2e-5, r["max_diff_ref"]  # tests/zero/params/test_stage3.py's fp32 bound
