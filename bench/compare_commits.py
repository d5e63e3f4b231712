"""One benchmark, two source trees, interleaved: is the change slower?

    git worktree add /tmp/old <commit> && (cd /tmp/old && python setup.py build_ext --inplace)
    python bench/compare_commits.py --old /tmp/old --repeats 5 zero_step --sizes 1e6,1e7 --rounds 10
    python bench/compare_commits.py --old /tmp/old --repeats 5 overlap --layers 12 --steps 8
    python bench/compare_commits.py --old /tmp/old --repeats 3 train_step --variants zerokern-s2,zerokern-s3
    python bench/compare_commits.py --old /tmp/old --repeats 3 host_overhead --counts 1,200

Runs bench/<name>.py from each tree in its own process (PYTHONPATH = that
tree), alternating old/new and new/old so drift hits both alike, collects the
JSON each run writes, and prints per measured quantity the median over runs of
each tree, the spread (min-max of the per-run values) and new/old. Extra
arguments go to the benchmark unchanged. --json writes every per-run value.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = os.path.dirname(HERE)


def _zero_step(doc):
    return {f"step ms, {r['params']:.0e} params, {r['impl']}": r["median_ms"] for r in doc["results"]}


def _overlap(doc):
    r0 = doc["ranks"][0]
    out = {"backward compute alone ms": r0["compute_backward_s"] * 1e3}
    for mode in ("overlap", "no_overlap"):
        for k in ("backward_s", "step_s", "grad_exposed_s", "param_exposed_s"):
            out[f"{mode} {k[:-2]} ms"] = r0[mode][k] * 1e3
    return out


def _train_step(doc):
    return {f"{r['variant']} {r['dtype']} step ms": r["median_ms"] for r in doc["results"]["steps"]
            if r["variant"].startswith("zerokern")}


def _host_overhead(doc):
    return {f"{r['path']}, {r['params']} params, us": r["median_us"] for r in doc["results"]}


EXTRACT = {"zero_step": _zero_step, "overlap": _overlap, "train_step": _train_step, "host_overhead": _host_overhead}


def run_once(tree, name, extra, tmp, tag):
    out = os.path.join(tmp, f"{tag}.json")
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.join(tree, "bench", f"{name}.py"), *extra, "--json", out]
    subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return EXTRACT[name](json.load(f))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the other source tree (extension built in place)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("bench", choices=sorted(EXTRACT))
    args, extra = ap.parse_known_args(argv)
    trees = {"old": os.path.abspath(args.old), "new": NEW}
    runs = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            order = ["old", "new"] if k % 2 == 0 else ["new", "old"]
            for which in order:
                runs[which].append(run_once(trees[which], args.bench, extra, tmp, f"{which}{k}"))
                print(f"run {k + 1}/{args.repeats} {which} done", file=sys.stderr, flush=True)
    keys = list(runs["new"][0])
    print(f"bench/{args.bench}.py {' '.join(extra)}: {args.repeats} runs per tree, interleaved")
    print(f"{'quantity':52s} {'old median':>11s} {'(min-max)':>17s} {'new median':>11s} {'(min-max)':>17s} "
          f"{'new/old':>8s}")
    summary = []
    for key in keys:
        old = [r[key] for r in runs["old"]]
        new = [r[key] for r in runs["new"]]
        mo, mn = statistics.median(old), statistics.median(new)
        summary.append({"quantity": key, "old": old, "new": new, "old_median": mo, "new_median": mn,
                        "ratio": mn / mo if mo else None})
        ratio = f"{mn / mo:7.2f}x" if mo else "      -"
        print(f"{key:52s} {mo:11.3f} {f'({min(old):.3f}-{max(old):.3f})':>17s} {mn:11.3f} "
              f"{f'({min(new):.3f}-{max(new):.3f})':>17s} {ratio}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": args.bench, "args": extra, "old": trees["old"], "rows": summary}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
