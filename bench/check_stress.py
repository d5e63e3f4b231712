"""Adversarial stress of the collective check's plans ([Note: planned collectives] in
zerokern/zero/comm/check.py): random programs of collectives through make_comm()'s Comm on 2 or
4 gloo ranks. A tool, not a CI test.

    python bench/check_stress.py --world 2 --seed 1 --programs 20 [--deviate] [--no-gather-objects]
        [--check-off] [--digest out.json] [--timeout 15] [--only-program N]

Every program runs on a process group of its own (dist.new_group: a check of its own), so a
mismatch in one leaves the next one clean. The program (its collectives, the loop structure, the
waits, the alike switches, which rank deviates and where) comes from an RNG seeded by (seed,
program) and is the same on every rank; the sleeps come from an RNG seeded per rank, so the ranks'
timings differ. Outcomes per program:
  ok            no error, every value right (no deviation)
  false_error   an error where the ranks made the same collectives (or before the deviation)
  wrong_value   a result that is not the expected one
  raised        a deviation, and every rank raised CollectiveMismatch (naming each rank's collective)
                within --fast seconds of the deviation
  slow_raise    a deviation: every rank raised, some later than --fast seconds (or not a mismatch)
  missed        a deviation and some rank finished without an error
  hang          the run did not finish in time (the parent killed it)
Each rank also reports its exit code (-6: SIGABRT).
"""

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# ---------------------------------------------------------------- programs (the same on every rank)

def make_program(seed, index, world, deviate, gather_objects):
    rng = random.Random(f"{seed}/{index}")
    kinds = ["all_reduce"] * 4 + ["all_gather_own", "all_gather", "reduce_scatter", "broadcast"]
    if gather_objects:
        kinds.append("gather_objects")
    nvocab = rng.choice([1, 2, 3, 6, 10, 20])
    vocab = []
    for j in range(nvocab):
        kind = rng.choice(kinds)
        vocab.append(dict(kind=kind, name=f"{kind}[{j}]", n=rng.choice([1, 2, 3, 5, 8]),
                          src=rng.randrange(world)))
    # a few names of one shape (told apart by name only) and one name of two shapes
    period_choices = [1, 2, 3, 4, 5, 7, 12, 33, 63, 64, 65, 70, 100, 130]
    shape = rng.choice(["loop", "loop", "alternate", "switch", "bursty"])

    def seq(period):
        return [rng.randrange(nvocab) for _ in range(period)]
    period = rng.choice(period_choices)
    a = seq(period)
    b = seq(rng.choice(period_choices))
    budget = rng.choice([150, 250, 400])
    passes = []  # list of lists of vocab indices
    if shape == "alternate":
        while sum(map(len, passes)) < budget:
            passes.append(a if len(passes) % 2 == 0 else b)
    elif shape == "switch":
        n1 = max(2, budget // 2 // len(a))
        passes = [a] * n1
        while sum(map(len, passes)) < budget:
            passes.append(b)
        if rng.random() < 0.5:
            passes += [a] * 3
    else:
        passes = [a] * max(3, budget // len(a))
    ops = [i for p in passes for i in p]
    # alike changes: every rank does them (must never error)
    for _ in range(rng.choice([0, 0, 1, 2, 4])):
        where = rng.randrange(len(ops))
        what = rng.random()
        if what < 0.4:
            ops[where] = rng.randrange(nvocab)  # another one of the vocabulary, alike
        elif what < 0.7:
            ops.insert(where, rng.randrange(nvocab))
        elif len(ops) > 2:
            del ops[where]
    # waits: per stretch, wait each at once, or queue k then wait them
    waits = []  # per op: wait for everything queued after it (True) or go on
    i = 0
    while i < len(ops):
        mode = rng.random()
        k = 1 if mode < 0.4 else rng.choice([2, 3, 8, 20, 40, 70, 100, 200])
        k = min(k, len(ops) - i)
        waits += [False] * (k - 1) + [True]
        i += k
    waits[-1] = True
    dev = None
    if deviate:
        # one rank makes something else at one point (after a plan formed, mostly) and goes on
        rank = rng.randrange(world)
        lo = min(len(ops) - 1, rng.choice([0, 3 * len(a), 10, len(ops) // 2]))
        at = rng.randrange(lo, len(ops))
        kind = rng.choice([k for k in kinds])
        dev = dict(rank=rank, at=at, spec=dict(kind=kind, name=f"deviant-{kind}", n=rng.choice([1, 2, 3, 5, 8]),
                                               src=rng.randrange(world)))
    return dict(vocab=vocab, ops=ops, waits=waits, dev=dev, shape=shape, period=period,
                sleepy=rng.choice([0.0, 0.02, 0.05, 0.1]))


# ---------------------------------------------------------------- values

def _value(k, r, n, world):
    """Rank r's input for op k: integer-valued floats plus a fraction (exact sums on 2 ranks)."""
    g = torch.Generator().manual_seed(k * 131 + r * 7 + 1)
    return (torch.randint(-50, 50, (n,), generator=g).float() + torch.rand(n, generator=g)).float()


def start_op(comm, spec, k, rank, world):
    """Launch op k; returns (work or None, check(): error string or None, digestable tensor)."""
    n, kind, name = spec["n"], spec["kind"], spec["name"]
    if kind == "all_reduce":
        t = _value(k, rank, n, world)
        w = comm.all_reduce(t, name=name)
        exp = sum(_value(k, r, n, world).double() for r in range(world))
        return w, lambda: None if torch.allclose(t.double(), exp, atol=1e-4) else f"{name}: {t} != {exp}", t
    if kind in ("all_gather_own", "all_gather"):
        out = torch.zeros(n * world)
        if kind == "all_gather_own":
            inp = out[rank * n:(rank + 1) * n]
            inp.copy_(_value(k, rank, n, world))
        else:
            inp = _value(k, rank, n, world)
        w = comm.all_gather(out, inp, name=name)
        exp = torch.cat([_value(k, r, n, world) for r in range(world)])
        return w, lambda: None if torch.equal(out, exp) else f"{name}: {out} != {exp}", out
    if kind == "reduce_scatter":
        inp = _value(k, rank, n * world, world)
        out = torch.zeros(n)
        w = comm.reduce_scatter(out, inp, name=name)
        exp = sum(_value(k, r, n * world, world).double() for r in range(world))[rank * n:(rank + 1) * n]
        return w, lambda: None if torch.allclose(out.double(), exp, atol=1e-4) else f"{name}: {out} != {exp}", out
    if kind == "broadcast":
        t = _value(k, rank, n, world)
        w = comm.broadcast(t, src_rank=spec["src"], name=name)
        exp = _value(k, spec["src"], n, world)
        return w, lambda: None if torch.equal(t, exp) else f"{name}: {t} != {exp}", t
    if kind == "gather_objects":
        got = comm.gather_objects((k, rank), name=name)
        exp = [(k, r) for r in range(world)]
        return None, lambda: None if got == exp else f"{name}: {got} != {exp}", torch.tensor([float(k)])
    raise ValueError(kind)


# ---------------------------------------------------------------- one rank

def run_program(comm, prog, rank, world, trng, digest):
    from zerokern.zero.comm.check import CollectiveMismatch
    ops, waits, dev = prog["ops"], prog["waits"], prog["dev"]
    out = dict(error=None, kind=None, at=None, wrong=[], t_dev=None, t_err=None)
    queued = []
    k = -1
    try:
        for k, idx in enumerate(ops):
            spec = prog["vocab"][idx]
            if dev is not None and dev["rank"] == rank and dev["at"] == k:
                spec = dev["spec"]
                out["t_dev"] = time.time()
            if prog["sleepy"] and trng.random() < prog["sleepy"]:
                time.sleep(trng.choice([0.01, 0.05, 0.2, 0.4, 1.0]))
            queued.append(start_op(comm, spec, k, rank, world))
            if waits[k]:
                if prog["sleepy"] and trng.random() < prog["sleepy"] * 2:
                    time.sleep(trng.choice([0.01, 0.1, 0.3, 0.6]))
                for w, chk, t in queued:
                    if w is not None:
                        comm.wait(w)
                    bad = chk()
                    if bad is not None:
                        out["wrong"].append((k, bad))
                    digest.update(t.numpy().tobytes())
                queued = []
    except CollectiveMismatch as e:
        out.update(error=str(e)[:600], kind="mismatch", at=k, t_err=time.time())
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}"[:600], kind=type(e).__name__, at=k, t_err=time.time())
    return out


def install_trace(path):
    """--trace: each check's rounds and submits, to a log per rank (what paired with what)."""
    import sys as _sys
    from zerokern.zero.comm import check as C
    log = open(path, "a", buffering=1)
    ex, sub, take = C.CollectiveCheck._exchange, C.CollectiveCheck.submit, C.CollectiveCheck._take

    def _exchange(self, start, slots):
        caller = _sys._getframe(1).f_code.co_name
        real = sum(1 for s in slots if s[3])
        desc = " ".join(f"{s[0]}:{s[1].split(' ')[0] or hex(s[2])[-4:]}{'' if s[3] else '?'}" for s in slots[:6])
        log.write(f"{time.time():.3f} g{id(self) % 10000} EX by={caller} start={start} real={real} "
                  f"fc={len(slots) - real} end={self.forecast.end} [{desc}]\n")
        try:
            r = ex(self, start, slots)
        except BaseException as e:
            log.write(f"{time.time():.3f} g{id(self) % 10000}    -> raised {str(e)[:200]}\n")
            raise
        log.write(f"{time.time():.3f} g{id(self) % 10000}    -> {r if isinstance(r, int) else r[0]} "
                  f"end={self.forecast.end}\n")
        return r

    def submit(self, name, tensor, launch):
        before = self.planned
        w = sub(self, name, tensor, launch)
        log.write(f"{time.time():.3f} g{id(self) % 10000} SUB #{self.seq} {name} "
                  f"{'planned' if self.planned > before else 'queued'}\n")
        return w

    def _take(self, item, pending):
        r = take(self, item, pending)
        if isinstance(item, tuple):
            log.write(f"{time.time():.3f} g{id(self) % 10000} TAKE #{item[0]} pending={len(pending)}\n")
        else:
            log.write(f"{time.time():.3f} g{id(self) % 10000} TAKE {'REFILL' if r else 'STOP'}\n")
        return r
    C.CollectiveCheck._exchange, C.CollectiveCheck.submit, C.CollectiveCheck._take = _exchange, submit, _take


def rank_main(rank, world, tmp, args):
    os.environ["ZEROKERN_COLLECTIVE_TIMEOUT"] = str(args.timeout)
    if args.check_off:
        os.environ["ZEROKERN_CHECK_COLLECTIVES"] = "0"
    if args.plans_off:
        os.environ["ZEROKERN_PLAN_COLLECTIVES"] = "0"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    dist.barrier()
    from zerokern.zero.comm.factory import make_comm
    if args.trace:
        install_trace(os.path.join(args.trace, f"trace{rank}.log"))
    results = []
    path = os.path.join(tmp, f"rank{rank}.jsonl")
    programs = [args.only_program] if args.only_program is not None else range(args.first, args.first + args.programs)
    for p in programs:
        prog = make_program(args.seed, p, world, args.deviate, not args.no_gather_objects)
        group = dist.new_group(list(range(world)))
        comm = make_comm(group)
        trng = random.Random(f"{args.seed}/{p}/rank{rank}")
        digest = hashlib.sha1()
        t0 = time.time()
        out = run_program(comm, prog, rank, world, trng, digest)
        out.update(program=p, rank=rank, seconds=time.time() - t0, digest=digest.hexdigest(),
                   nops=len(prog["ops"]), shape=prog["shape"], period=prog["period"], dev=prog["dev"],
                   rounds=getattr(comm.check, "rounds", None), planned=getattr(comm.check, "planned", None))
        with open(path, "a") as f:
            f.write(json.dumps(out) + "\n")
        dist.barrier()  # torch's own, on the default group: the next program starts together
    if args.destroy:
        dist.destroy_process_group()


def _entry(rank, world, tmp, args):
    try:
        rank_main(rank, world, tmp, args)
    except BaseException:  # noqa: BLE001
        with open(os.path.join(tmp, f"crash{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


# ---------------------------------------------------------------- parent

def classify(prog_results, world, fast):
    """prog_results: the ranks' dicts for one program."""
    dev = prog_results[0]["dev"]
    wrong = [r["wrong"] for r in prog_results if r["wrong"]]
    if dev is None:
        if any(r["error"] for r in prog_results):
            return "false_error"
        return "wrong_value" if wrong else "ok"
    # an error on the deviating rank before it deviated: false
    d = prog_results[dev["rank"]]
    if d["error"] and d["at"] is not None and d["at"] < dev["at"]:
        return "false_error"
    if wrong:
        return "wrong_value"
    if not all(r["error"] for r in prog_results):
        return "missed"
    t_dev = d["t_dev"]
    slow = [r for r in prog_results if r["kind"] != "mismatch" or r["t_err"] - t_dev > fast]
    return "slow_raise" if slow else "raised"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--programs", type=int, default=10)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--only-program", type=int, default=None)
    ap.add_argument("--deviate", action="store_true")
    ap.add_argument("--no-gather-objects", action="store_true")
    ap.add_argument("--check-off", action="store_true")
    ap.add_argument("--plans-off", action="store_true")
    ap.add_argument("--destroy", action="store_true")
    ap.add_argument("--timeout", type=float, default=15.0, help="ZEROKERN_COLLECTIVE_TIMEOUT")
    ap.add_argument("--fast", type=float, default=5.0, help="seconds a deviation may take to raise everywhere")
    ap.add_argument("--run-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--trace", default=None, help="a folder: each rank logs its rounds and submits there")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="check_stress_")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(r, args.world, tmp, args)) for r in range(args.world)]
    t0 = time.time()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(1.0, args.run_timeout - (time.time() - t0)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    per_rank = []
    for r in range(args.world):
        path = os.path.join(tmp, f"rank{r}.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        per_rank.append({row["program"]: row for row in rows})
    programs = [args.only_program] if args.only_program is not None else list(range(args.first, args.first + args.programs))
    counts, details = {}, []
    for p in programs:
        rows = [per_rank[r].get(p) for r in range(args.world)]
        if any(row is None for row in rows):
            outcome = "hang" if hung else "incomplete"
        else:
            outcome = classify(rows, args.world, args.fast)
        counts[outcome] = counts.get(outcome, 0) + 1
        details.append(dict(program=p, outcome=outcome, rows=rows))
        if outcome not in ("ok", "raised") or args.verbose:
            print(f"program {p}: {outcome}")
            for r, row in enumerate(rows):
                if row is None:
                    print(f"  rank {r}: no result")
                    continue
                dt = (row["t_err"] - rows[row["dev"]["rank"]]["t_dev"]
                      if row["dev"] and row["t_err"] and rows[row["dev"]["rank"]] and rows[row["dev"]["rank"]]["t_dev"]
                      else None)
                print(f"  rank {r}: shape={row['shape']} period={row['period']} nops={row['nops']} dev={row['dev']} "
                      f"at={row['at']} kind={row['kind']} raise_after_dev={dt} seconds={row['seconds']:.1f} "
                      f"rounds={row['rounds']} planned={row['planned']} wrong={row['wrong'][:2]} "
                      f"error={(row['error'] or '')[:300]}")
            if hung:
                break
        if outcome == "hang":
            break
    for r in range(args.world):
        crash = os.path.join(tmp, f"crash{r}.txt")
        if os.path.exists(crash):
            print(f"rank {r} crashed:\n{open(crash).read()[-2000:]}")
    print(json.dumps(dict(world=args.world, seed=args.seed, deviate=args.deviate, counts=counts, exit_codes=codes,
                          hung=hung, seconds=round(time.time() - t0, 1))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), counts=counts, exit_codes=codes, hung=hung,
                           digests={d["program"]: [row and row["digest"] for row in d["rows"]] for d in details},
                           details=details), f)


if __name__ == "__main__":
    main()
