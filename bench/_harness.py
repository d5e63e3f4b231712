"""Shared benchmark harness: interleaved timing, machine facts, tables, JSON, plots.

Every benchmark in bench/ times its implementations interleaved (A B C A B C
...) so that machine noise (these machines are shared) hits all of them alike,
and reports medians with the spread (25th-75th percentile) next to them.
"""

import datetime
import json
import os
import platform
import statistics
import time

import torch


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_one(fn, device):
    """Seconds for one call of fn, measured on the device's own clock."""
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(fns, device, rounds, warmup=1, progress=None):
    """{name: [seconds per call]}: `rounds` rounds, each calling every fn once;
    the order rotates per round so no implementation always runs first."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    sync(device)
    times = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_one(fns[name], device))
        if progress is not None:
            progress.update(1)
    return times


def summary(seconds):
    """Median and 25th/75th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2], "min_ms": ms[0], "n": len(ms)}


def rounds_for(fns, device, budget_s, lo=3, hi=30):
    """How many interleaved rounds fit in budget_s, from one timed call of each fn."""
    per_round = sum(time_one(fn, device) for fn in fns.values())
    return max(lo, min(hi, int(budget_s / max(per_round, 1e-6))))


def copy_bandwidth(nbytes, device, rounds=5):
    """GB/s of a plain device copy moving nbytes in total (read + write)."""
    src = torch.empty(max(1, nbytes // 8), dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, device, rounds)["copy"]
    return 2 * src.numel() * 4 / statistics.median(t) / 1e9


def transformer_shapes(total):
    """Parameter shapes of a GPT-style decoder with about `total` parameters:
    per layer qkv, attention out, two MLP matrices (4x), their biases and two
    LayerNorms; the rest goes to a token embedding."""
    hidden = 256
    for h in (512, 768, 1024, 1600, 2048, 4096):
        if 4 * (12 * h * h) <= total:
            hidden = h
    h = hidden
    layer = [(3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    layers = max(1, total // per_layer) if total >= per_layer else 0
    shapes = layer * layers
    rest = total - per_layer * layers
    if rest > 0:
        shapes = [(rest // h, h)] * (rest >= h) + [(rest % h,)] * (rest % h > 0) + shapes
    return shapes


def machine_info(device):
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        info["zerokern_cpu_capability"] = torch.ops.zerokern.cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    return info


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_table(rows, columns):
    """rows: list of dicts; columns: [(key, header, format)]."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("" if row.get(k) is None else fmt.format(row[k])) for k, _, fmt in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for j, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


class CaseLog:
    """--jsonl PATH: the machine facts, then each finished case's rows, one JSON object per line,
    appended and flushed as the case ends, so a run stopped at its time limit (bench/device_check.sh)
    keeps every case it finished. No path: does nothing."""

    def __init__(self, path, info):
        self.path = path
        if path:
            with open(path, "w") as f:
                f.write(json.dumps({"machine": info}) + "\n")

    def add(self, rows):
        if self.path:
            with open(self.path, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")


def write_json(path, info, rows):
    with open(path, "w") as f:
        json.dump({"machine": info, "results": rows}, f, indent=1)
    print(f"wrote {path}")


def plot(path, rows, x, y, series, panels, xlabel, ylabel, title):
    """One panel per value of `panels`, one line per value of `series`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({r[panels] for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        sub = [r for r in rows if r[panels] == key]
        for name in sorted({r[series] for r in sub}):
            pts = sorted((r[x], r[y]) for r in sub if r[series] == name and r.get(y) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {key}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
