"""Per-rank bodies of test_agreement_patterns.py: ranks that leave the common path (a unit one
rank skips, an exception one rank catches, a collective on rank 0 only) must all raise, never
hang, abort or train on ([Note: announced collectives] in zerokern/zero/comm/check.py)."""

import os
import time

import torch
import torch.distributed as dist

import zerokern
from zerokern import FusedZeroAdam
from zerokern.zero.comm.check import CollectiveMismatch
import dist_harness
from models import FlakyStack


def _build(stage, timeout="30"):
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = timeout  # a rank that waits elsewhere: an error well within the test's
    model = FlakyStack()
    if stage == 3:
        for m in [*model.blocks, model.head]:
            zerokern.shard(m, stage=3)
        zerokern.shard(model, stage=3)
        return model, FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    return model, FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.0, zero_stage=stage, bucket_cap_mb=1e-4)


def _batches(rank, n=4):
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def _outcome(fn):
    """What a rank ended with: its error (kind and text) or None, and how long it took."""
    t0 = time.time()
    try:
        fn()
        return {"error": None, "seconds": time.time() - t0}
    except CollectiveMismatch as e:
        return {"error": str(e), "kind": "mismatch", "seconds": time.time() - t0}
    except Exception as e:  # noqa: BLE001  the test reports it
        return {"error": f"{type(e).__name__}: {e}", "kind": "other", "seconds": time.time() - t0}


def layer_drop_on_one_rank(rank, world, stage):
    """Rank 1 drops block 2 at the second step (LayerDrop decided per rank). Below stage 3 the
    params are whole and every bucket is reduced, as DDP(find_unused_parameters=True) does: the
    same numbers as DDP + AdamW."""
    model, opt = _build(stage)

    def train(model, opt):
        for s, x in enumerate(_batches(rank)):
            model(x, skip=(2,) if rank == 1 and s == 1 else ()).backward()
            opt.step()
            opt.zero_grad()
    out = _outcome(lambda: train(model, opt))
    if stage < 3:
        ddp = torch.nn.parallel.DistributedDataParallel(FlakyStack(), find_unused_parameters=True)
        train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0))
        out["diff"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ddp.module.parameters()))
    return out


def exception_on_one_rank(rank, world, stage, where):
    """Rank 1 raises in block 1's forward or backward at the second step; its loop skips the
    batch and goes on (a skip-the-batch-on-OOM loop)."""
    model, opt = _build(stage)
    skipped = []

    def train():
        for s, x in enumerate(_batches(rank)):
            model.blocks[1].fail = where if rank == 1 and s == 1 else None
            try:
                model(x).backward()
            except RuntimeError as e:
                if "simulated" not in str(e):
                    raise
                skipped.append(s)
                opt.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
    out = _outcome(train)
    out["skipped"] = skipped
    return out


def full_state_dict_on_rank0_only(rank, world):
    """`if rank == 0: full_state_dict(model)` between two steps (a save on rank 0 only): no rank
    may get a dict of stale bytes or train on with params that disagree."""
    model, opt = _build(3)
    batches = _batches(rank)
    got = {}

    def shards():
        return [t.clone() for u in opt.units for f in u.flat for t in f.param_shards]

    def train():
        for s, x in enumerate(batches):
            model(x).backward()
            opt.step()
            opt.zero_grad()
            if s == 1:
                got["after step 1"] = shards()
                if rank == 0:
                    got["dict"] = zerokern.full_state_dict(model)
    out = _outcome(train)
    out["got_dict"] = "dict" in got
    out["untouched"] = all(a.equal(b) for a, b in zip(got["after step 1"], shards()))
    return out


def subgroup_then_world_group(rank, world):
    """Ranks 0 and 1 train zerokern on a group of their own, ranks 2 and 3 a DDP model on theirs;
    then every rank makes a group of all four and all-reduces on it (issue 39: the collective
    check's groups for the sub-group, made by its members only, used to leave torch's group
    counter ahead on them, and the world group then hung)."""
    import torch.distributed as dist
    torch.manual_seed(0)
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    model = FlakyStack()
    if rank < 2:
        opt = FusedZeroAdam(model.parameters(), lr=1e-2, process_group=g01, zero_stage=2, bucket_cap_mb=1e-4)
        for x in _batches(rank, 2):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=g23)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for x in _batches(rank, 2):
            opt.zero_grad()
            ddp(x).backward()
            opt.step()
    everyone = dist.new_group([0, 1, 2, 3])
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=everyone)
    return t.item()


def _held_queue(rank, names, pace=0.0):
    """Queue one all-reduce per name through zerokern's Comm while the check's thread is held in
    the launch of a first collective (so they are all queued when it comes back), then let it go
    and wait for them. Returns each result (rank 0's + rank 1's: 1 + 2 * k for the k-th), the
    announcement all-reduces counted on the control group, and the error if one was raised."""
    import threading

    import torch.distributed as dist

    from zerokern.zero.comm.factory import make_comm
    comm = make_comm()
    control = comm.check.control
    counted = [0]
    all_reduce = dist.all_reduce

    def counting(tensor, *a, group=None, **kw):
        counted[0] += group is control
        return all_reduce(tensor, *a, group=group, **kw)
    dist.all_reduce = counting
    try:
        go = threading.Event()
        first = torch.ones(1)

        def held(group):
            go.wait()
            return dist.all_reduce(first, group=group, async_op=True)
        works = [comm._launch("held", first, held)]
        tensors = [torch.full((1 + k % 3,), float(rank + 1 + k * (rank + 1))) for k in range(len(names))]
        for t, name in zip(tensors, names):
            if pace:
                time.sleep(pace)
            works.append(comm.all_reduce(t, name=name))
        go.set()
        out = {"error": None}
        try:
            for w in works:
                w.wait()
        except CollectiveMismatch as e:
            out.update(error=str(e), kind="mismatch")
        out["values"] = [t[0].item() for t in tensors]
        out["rounds"] = counted[0]
        return out
    finally:
        dist.all_reduce = all_reduce


def queued_collectives(rank, world):
    """Sixteen collectives queued while the check's thread was busy: announced together."""
    return _held_queue(rank, [f"all_reduce[{k}]" for k in range(16)])


def queued_at_different_paces(rank, world):
    """Rank 1 queues its collectives slowly, rank 0 all at once: the rounds launch what every rank
    announced and keep the rest for later; nothing raises, every result is right."""
    return _held_queue(rank, [f"all_reduce[{k}]" for k in range(8)], pace=0.05 if rank == 1 else 0.0)


def mismatch_inside_a_round(rank, world):
    """The ranks' fourth queued collective differs (rank 1 went another way): it and every later
    one raise on both ranks; the three before it completed."""
    names = [f"all_reduce[{k}]" for k in range(6)]
    if rank == 1:
        names[3] = "all_reduce[elsewhere]"
    return _held_queue(rank, names)


def uneven_eval(rank, world):
    """[Note: the cause, on every rank] An eval loop over shards of different lengths at stage 3:
    rank 0 runs 3 batches, rank 1 runs 2 and goes on to the all_reduce of its eval loss (the user's
    own collective). Rank 0 gives up waiting (the timeout) and raises; rank 1's all_reduce then
    fails with gloo's connection error, which zerokern cannot wrap: its excepthook names rank 0's
    error after the traceback, and explain() gives that line."""
    import contextlib
    import io
    import sys
    from zerokern.zero.comm import check
    model, opt = _build(3, timeout="4")  # rank 0 waits that long for rank 1's gather
    total = torch.zeros(())
    try:
        with torch.no_grad():
            for x in _batches(rank, n=3 - rank):
                total += model(x)
        dist.all_reduce(total)
        return {"error": None}
    except Exception as e:  # noqa: BLE001  what each rank sees is the result
        out = {"error": f"{type(e).__name__}: {e}", "explained": check.explain(e),
               "hooked": getattr(sys.excepthook, "zerokern", False)}
        if out["hooked"]:
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                sys.excepthook(type(e), e, e.__traceback__)  # as Python would, for an uncaught error
            out["printed"] = err.getvalue()
        return out


def _planned_loop(rank, last):
    """[Note: planned collectives] Six passes over the same four all-reduces (so the ranks agree on
    a plan for the next ones), then a seventh whose names `last(rank)` gives. Returns the results
    (rank 0's + rank 1's), the rounds of each pass, how many collectives were launched from a
    plan, and the error if one was raised."""
    from zerokern.zero.comm.factory import make_comm
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "30"  # a hang would be an error well within the test's
    comm = make_comm()
    check = comm.check
    passes = [[f"all_reduce[{k}]" for k in range(4)]] * 6 + [last(rank)]
    out = {"error": None, "values": [], "rounds": []}
    t0 = time.time()
    try:
        for names in passes:
            before = check.rounds
            tensors = [torch.full((2,), float(rank + 1)) for _ in names]
            for w in [comm.all_reduce(t, name=n) for t, n in zip(tensors, names)]:
                comm.wait(w)
            out["values"].append([t[0].item() for t in tensors])
            out["rounds"].append(check.rounds - before)
    except CollectiveMismatch as e:
        out.update(error=str(e), kind="mismatch")
    out["planned"], out["seconds"] = check.planned, time.time() - t0
    return out


def planned_loop_deviating_alike(rank, world):
    """Every rank leaves the plan the same way (a batch skipped on every rank): no error."""
    return _planned_loop(rank, lambda r: ["all_reduce[0]", "all_reduce[elsewhere]", "all_reduce[2]"])


def planned_loop_deviating_on_one_rank(rank, world):
    """Rank 1 leaves the plan (its second collective of the last pass is another one) while rank 0
    follows it and waits on the planned collective: both raise, naming both."""
    return _planned_loop(rank, lambda r: ["all_reduce[0]", "all_reduce[elsewhere]" if r == 1 else "all_reduce[1]"])


def _until_mismatch(rank, body):
    """body(comm) on a fresh zerokern Comm (a 30 s timeout: a hang is an error well within the
    test's); returns the error if one was raised, and the seconds it took."""
    from zerokern.zero.comm.factory import make_comm
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "30"
    comm = make_comm()
    out = {"error": None}
    t0 = time.time()
    try:
        body(comm)
    except CollectiveMismatch as e:
        out.update(error=str(e), kind="mismatch")
    out["seconds"] = time.time() - t0
    return out


def queued_on_one_rank_planned_on_the_other(rank, world):
    """[Note: planned collectives] A loop runs on a plan, then rank 0 queues a long burst of it
    at once while rank 1 sleeps, then makes it one at a time: rank 0's rounds announce the
    collectives past the plan as queued ones, while rank 1 agrees to them as a forecast (planned).
    Rank 1 then leaves the plan at one of them (rank 0 launched it; it never completes): both
    raise, naming both, within seconds."""
    def body(comm):
        for _ in range(6):
            for w in [comm.all_reduce(torch.ones(2), name=f"all_reduce[{k}]") for k in range(4)]:
                comm.wait(w)
        names = [f"all_reduce[{i % 4}]" for i in range(130)]
        if rank == 1:  # past the stretch planned when rank 0 queued: rank 0 announced it as queued
            names[125] = "all_reduce[elsewhere]"
        if rank == 0:
            works = [comm.all_reduce(torch.ones(2), name=n) for n in names]
            dist_harness.tell_ranks("rank 0 queued all 130")  # its thread waits in a round for rank 1
            for w in works:
                comm.wait(w)
        else:  # one at a time: its rounds ask for the next stretch, with no collective queued
            dist_harness.wait_for("rank 0 queued all 130")
            for n in names:
                comm.wait(comm.all_reduce(torch.ones(2), name=n))
    return _until_mismatch(rank, body)


def planned_object_gather_left_on_one_rank(rank, world):
    """An object gather in a loop (its launch blocks until every rank made it): where rank 1 makes
    another collective instead, rank 0 must not sit in the gather; both raise, within seconds."""
    def body(comm):
        for p in range(8):
            comm.wait(comm.all_reduce(torch.ones(2), name="all_reduce[0]"))
            if rank == 1 and p == 7:
                comm.wait(comm.all_reduce(torch.ones(2), name="all_reduce[elsewhere]"))
            else:
                comm.gather_objects(p, name="gather_objects[1]")
    return _until_mismatch(rank, body)


# bench/check_stress.py --seed 11 --only-program 2: an all-reduce and an object gather in turn, then
# every rank switches alike to a loop of 33 (0, 2: all-reduces of two shapes; 1: an object gather)
_SWITCH = ("21" * 24 + "1212121212121212121212121212020202011021220220122201221002021202010221221010102200100102011"
           "212020202011021020220122201221002021202010212122101010220100102011212121")


def short_plans_left_alike(rank, world, programs=3):
    """[Note: planned collectives] Plans of a few collectives each (an object gather is never
    planned), so each round asks for the next stretch at once, and the ranks leave the plan alike
    many times (the forecast is wrong there on every rank): every rank must make the same rounds
    whatever the timing (a rank that made one more raised a mismatch). Each program queues every
    collective, with a rank's own short sleeps, on a group of its own; nothing may raise."""
    import random

    from zerokern.zero.comm.factory import make_comm
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = "30"
    out = {"error": None, "values": []}
    for p in range(programs):
        comm = make_comm(dist.new_group([0, 1]))
        rng = random.Random(f"{p}/{rank}")
        works, tensors = [], []
        try:
            for k, op in enumerate(_SWITCH):
                if rng.random() < 0.05:
                    time.sleep(rng.choice([0.001, 0.01, 0.05]))
                if op == "1":
                    comm.gather_objects(k, name="gather_objects[1]")
                    continue
                t = torch.full((8 if op == "0" else 5,), float(rank + 1))
                works.append(comm.all_reduce(t, name=f"all_reduce[{op}]"))
                tensors.append(t)
            for w in works:
                comm.wait(w)
        except CollectiveMismatch as e:
            out.update(error=str(e), kind="mismatch")
            return out
        out["values"].append(sorted({t[0].item() for t in tensors}))
    return out
