"""Shared benchmark harness: interleaved timing, machine facts, tables, JSON, plots.

Every benchmark in bench/ times its implementations interleaved (A B C A B C
...) so that machine noise (these machines are shared) hits all of them alike,
and reports medians with the spread (25th-75th percentile) next to them.
"""

import datetime
import glob
import json
import os
import platform
import socket
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


def interleaved(fns, device, rounds, warmup=1, progress=None, time_limit_s=None, min_rounds=1, fn_limit_s=None):
    """{name: [seconds per call]}: `rounds` rounds, each calling every fn once;
    the order rotates per round so no implementation always runs first.
    time_limit_s: start no new round after this many seconds once min_rounds are done.
    fn_limit_s: call no more an fn whose calls alone took this long (it keeps the samples it
    has). With both, a loaded machine gets fewer rounds instead of a run that never ends."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    sync(device)
    times = {name: [] for name in names}
    t0 = time.perf_counter()
    for r in range(rounds):
        if time_limit_s is not None and r >= min_rounds and time.perf_counter() - t0 > time_limit_s:
            break
        if fn_limit_s is not None:
            names = [n for n in names if sum(times[n]) <= fn_limit_s]
            if not names:
                break
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_one(fns[name], device))
        if progress is not None:
            progress.update(1)
    return times


def free_port():
    """A TCP port free on this machine now, for a multi-process benchmark's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(seconds):
    """Median and 25th/75th percentiles in milliseconds."""
    ms = sorted(s * 1e3 for s in seconds)
    # "exclusive" (the default) extrapolates past the samples when there are only two.
    if len(ms) == 1:
        q = [ms[0]] * 3
    else:
        q = statistics.quantiles(ms, n=4, method="exclusive" if len(ms) > 2 else "inclusive")
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


class OtherLoad:
    """CPU time that other processes used, and the hypervisor stole, while a block of this process
    ran: the machine noise a benchmark's spread alone may not show (a stall that hits every round
    alike). From /proc/stat and this process's own times; cpus() is None where /proc is absent.

        load = OtherLoad(); ...; others, steal = load.cpus()   # each in CPUs (2.0 = two cores)
    """

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        own = os.times()
        busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq (guest time is in user)
        return time.perf_counter(), busy, v[7] if len(v) > 7 else 0, own.user + own.system

    def cpus(self):
        end = self._read()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None, None
        tick, dt = os.sysconf("SC_CLK_TCK"), end[0] - self.start[0]
        others = (end[1] - self.start[1]) / tick - (end[3] - self.start[3])
        return max(0.0, others / dt), (end[2] - self.start[2]) / tick / dt


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
    caches = cpu_caches()
    if caches:
        info["cpu_caches"] = caches
    try:
        info["zerokern_cpu_capability"] = torch.ops.zerokern.cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    return info


def cpu_caches():
    """{"L1d": bytes, "L2": bytes, "L3": bytes} of CPU 0 (per instance; the L3 is usually shared by
    all cores), from Linux sysfs; {} elsewhere."""
    def read(path):
        with open(path) as f:
            return f.read().strip()

    out = {}
    for d in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level, kind, size = (read(os.path.join(d, f)) for f in ("level", "type", "size"))
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        out[f"L{level}{'d' if kind == 'Data' else ''}"] = int(size.rstrip("KMG")) * mult
    return out


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


class StreamTable:
    """A table printed a row at a time, as results arrive (print_table needs every row first).
    columns: [(key, header, format, width)]; a row may hold a preformatted string under a key."""

    def __init__(self, columns):
        self.columns = columns
        self.widths = [max(w, len(h)) for _, h, _, w in columns]

    def header(self):
        self._line([h for _, h, _, _ in self.columns])
        self._line(["-" * w for w in self.widths])

    def row(self, row):
        self._line([("" if row.get(k) is None else fmt.format(row[k])) for k, _, fmt, _ in self.columns])

    def _line(self, cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, self.widths))).rstrip(),
              flush=True)


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


def write_json(path, info, rows, extra=None):
    """{"machine": info, "results": rows, **extra}; extra adds top-level keys (settings, notes)."""
    with open(path, "w") as f:
        json.dump({"machine": info, "results": rows, **(extra or {})}, f, indent=1)
    print(f"wrote {path}")


def plot(path, rows, x, y, series, panels, xlabel, ylabel, title, ncols=3, styles=None, panel_order=None,
         yerr=None, hollow=None):
    """One panel per value of `panels` in a grid of at most `ncols` columns, one line per value
    of `series`, each series the same colour in every panel and one legend for the figure.
    styles: {series: matplotlib line kwargs} (colour, linestyle, ...) for chosen series; the rest
    take the default colour cycle in sorted order. panel_order: the panels' order (default sorted).
    yerr: (low key, high key) of each point's error bar. hollow: a key; points whose value there is
    truthy get an open marker (a flagged measurement). Series are ordered as in styles, then sorted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = {r[panels] for r in rows}
    keys = [k for k in panel_order if k in present] if panel_order else sorted(present)
    ncols = max(1, min(ncols, len(keys)))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows + 0.9), squeeze=False)
    present_series = {r[series] for r in rows}
    names = [n for n in (styles or {}) if n in present_series] + sorted(present_series - set(styles or {}))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    taken = {matplotlib.colors.to_hex(st["color"]) for st in (styles or {}).values() if "color" in st}
    free = iter([c for c in cycle if matplotlib.colors.to_hex(c) not in taken] * 3)
    style = {n: dict((styles or {}).get(n) or {"color": next(free)}) for n in names}
    for ax, key in zip(axes.flat, keys):
        sub = [r for r in rows if r[panels] == key]
        for name in names:
            pts = sorted(((r[x], r[y], r) for r in sub if r[series] == name and r.get(y) is not None),
                         key=lambda p: p[0])
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            kw = {"marker": "o", "markersize": 4, "linewidth": 1.5, **style[name]}
            if yerr:
                err = [[max(0.0, p[1] - p[2][yerr[0]]) for p in pts], [max(0.0, p[2][yerr[1]] - p[1]) for p in pts]]
                ax.errorbar(xs, ys, yerr=err, capsize=2, label=name, **kw)
            else:
                ax.plot(xs, ys, label=name, **kw)
            marked = [(p[0], p[1]) for p in pts if hollow and p[2].get(hollow)]
            if marked:
                ax.scatter([m[0] for m in marked], [m[1] for m in marked], s=40, facecolors="white",
                           edgecolors=kw["color"], linewidths=1.5, zorder=3)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(str(key), fontsize=10)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    order = [n for n in names if n in handles]
    fig.legend([handles[n] for n in order], order, loc="lower center", ncol=min(len(order), 7), fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=11)
    legend_rows = -(-len(order) // 7)
    height, title_lines = fig.get_figheight(), title.count("\n") + 1
    fig.tight_layout(rect=(0, (0.25 + 0.2 * legend_rows) / height, 1, 1 - (0.05 + 0.18 * title_lines) / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
