"""zerokern's fused Adam against its peers, on whatever this machine has.

    python bench/adam_throughput.py                      # the demo: about a minute on a 2-core CPU
    python bench/adam_throughput.py --full               # the long sweep: up to 1e8 params on CPU, with DeepSpeed
    python bench/adam_throughput.py --deepspeed          # also DeepSpeed's CPUAdam / FusedAdam (JIT-built C++)
    python bench/adam_throughput.py --json out.json --plot out.png
    python bench/adam_throughput.py --quick              # seconds: a smoke test

For each precision (fp32 AdamW; mixed = fp32 master weights, bf16 grads, bf16
model params written back), layout (one flat tensor; a GPT-style list of layer
tensors; 200 equal tensors, which shows the per-tensor cost) and size, it checks
every usable zerokern backend and installed peer against zerokern's plain-torch
reference (the tests' oracle; one step, on a 1% sample of every tensor's elements),
then times them interleaved and prints one table
row per implementation as each case finishes: median ms/step, the 25th-75th
percentile range and its spread (p75/p25), GB/s and % of the roof.

Bytes per parameter, the traffic an ideal single pass moves:
  fp32:  read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B)                 = 28 B
  mixed: read+write fp32 p, m, v (24 B) + read bf16 g (2 B) + write bf16 p (2 B) = 28 B
Peers that need more passes (torch's step + casting copies) are charged the
same 28 B, so their GB/s is "effective" and comparable.

Roofs, timed in the same interleaved rounds as the implementations: on CPUs,
`roof` is a kernel moving exactly those streams with no Adam arithmetic (a plain
copy underestimates what seven streams reach there); on GPUs, a device-to-device
copy of the same bytes. `copy` (a plain copy of the same bytes) is reported
beside it on both.

Notes on a row: "noisy" when p75/p25 > 1.3 (NOISY_SPREAD), "over roof" when
%roof > 100, "busy" when other processes used > 0.25 CPUs during the case
(BUSY_CPUS), "few rounds" when it was timed fewer than 5 times (an
implementation whose calls alone take 2x --budget is left out of later rounds);
the run ends with a footnote on what each means.

JSON (--json): {"machine", "results": [one object per implementation and case],
"settings", "notes"}. Result keys as before (precision, layout, params, tensors,
impl, median_ms, p25_ms, p75_ms, min_ms, n, params_per_s, gb_per_s,
roof_gb_per_s, pct_of_roof, copy_gb_per_s, pct_of_copy, speedup_vs_torch_fused),
plus spread (p75/p25), flags (list of the notes above), validation_err (max
|param - reference| over the reference's update size after one step, on the
sample; null for roof), rounds_s (seconds the case's timing took), others_cpus and steal_cpus
(CPUs other processes used, and the hypervisor stole, meanwhile), gb_per_s_p25
and gb_per_s_p75 (GB/s at the p75 and p25 times: the plot's error bars).
"""

import argparse
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern import ops  # noqa: E402
from zerokern.kernels.backends.registry import PREFERENCE  # noqa: E402

BYTES_PER_PARAM = 28
MANY = 200  # the "many" layout: the same params split into this many equal tensors
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PRECISIONS, LAYOUTS = ("fp32", "mixed"), ("flat", "layers", "many")

# p75/p25 above this marks a row "noisy": the middle half of its rounds spans more than 30%, so
# its median (and every ratio built on it) is uncertain by about that much. In the long sweep of
# bench/results/adam_throughput_cpu_2core_2026-11-30 (a quiet CI machine) the median row had 1.07
# and 9 rows in 10 stayed under 1.22; on a loaded machine rows reach 2 to 50.
NOISY_SPREAD = 1.3
# Rounds per case: as many as fit in --budget seconds, within these (see run_case). A row with
# fewer than MIN_ROUNDS is marked "few rounds".
MIN_ROUNDS, MAX_ROUNDS = 5, 30
# Other processes (plus hypervisor steal) using more than this many CPUs while a case is timed
# mark its rows "busy": a stall that hits every round alike slows a row without widening its spread.
BUSY_CPUS = 0.25
# Validation: after one step from the same params, grads and zero state, every implementation's
# params must match the reference's within this fraction of the reference's update
# (|p - p_ref| <= VALIDATE_TOL * max|p_ref - p0|, on Reference's sample). The update is lr-sized
# (1e-4), the params up to 0.04: one ulp of the largest is 4e-5 of the update; implementations differ
# by an ulp or two (operation order). A wrong lr, bias correction, missing state or a skipped
# tensor is off by 1e-1 to 1. Weight decay at these settings moves a param by 1e-6 of itself,
# under 1e-3 of the update: tests/kernels/test_adam.py checks it, this does not.
VALIDATE_TOL = 1e-3
# How long a first (uncached) JIT build of DeepSpeed's C++ Adam took on the 2-core CI machine;
# a loaded machine has taken ~7 minutes. A cached build loads in ~2 s (ninja: no work to do).
DEEPSPEED_BUILD_NOTE = {"cpu": "about 40 s on an idle 2-core CPU, several minutes on a loaded one",
                        "cuda": "several minutes of nvcc"}

# One colour per implementation in every panel of the plot.
STYLES = {
    "zerokern-cpu": {"color": "tab:blue"}, "zerokern-cuda": {"color": "tab:blue"},
    "zerokern-triton": {"color": "tab:cyan"}, "zerokern-torch": {"color": "tab:olive"},
    "torch-forloop": {"color": "tab:red"}, "torch-foreach": {"color": "tab:orange"},
    "torch-fused": {"color": "tab:green"}, "deepspeed-cpu-adam": {"color": "tab:purple"},
    "deepspeed-fused-adam": {"color": "tab:purple"}, "apex-fused-adam": {"color": "tab:brown"},
    "roof": {"color": "black", "linestyle": "--"}, "copy": {"color": "gray", "linestyle": ":"},
}


class Case:
    """The tensors of one (precision, layout, size) case, shared by all implementations."""

    def __init__(self, precision, layout, n, device):
        shapes = {"flat": lambda: [(n,)], "layers": lambda: H.transformer_shapes(n),
                  "many": lambda: [(n // MANY,)] * MANY}[layout]()
        self.precision, self.layout, self.device = precision, layout, device
        self.numel = sum(torch.Size(s).numel() for s in shapes)
        # Uniform, not normal: one cheap pass each (randn of 1e7 takes seconds on a busy machine).
        self.params = [torch.empty(s, device=device).uniform_(-0.04, 0.04) for s in shapes]
        gdtype = torch.float32 if precision == "fp32" else torch.bfloat16
        self.grads = [torch.empty(s, device=device, dtype=gdtype).uniform_(-2e-3, 2e-3) for s in shapes]
        self.model = [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes] if precision == "mixed" else None
        self.step = 0

    def zeros(self):
        return [torch.zeros_like(p) for p in self.params]


def zerokern_impl(case, backend):
    m, v = case.zeros(), case.zeros()
    state = {"step": 0}

    def step():
        state["step"] += 1
        ops.fused_adam_(case.params, case.grads, m, v, lr=HYPER["lr"], beta1=HYPER["betas"][0],
                        beta2=HYPER["betas"][1], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                        step=state["step"], model_params=case.model, backend=backend)
    return step


def torch_optimizer_impl(case, make_optimizer):
    """A torch.optim-style optimizer on fp32 params. In mixed precision it needs
    the bf16 grads upcast into fp32 .grad and the result cast back: both copies
    are part of its step (that is what a mixed-precision loop around it pays)."""
    params = [p.detach().requires_grad_() for p in case.params]  # shares storage with case.params
    if case.precision == "fp32":
        for p, g in zip(params, case.grads):
            p.grad = g
        return make_optimizer(params).step
    for p in params:
        p.grad = torch.empty_like(p)
    opt = make_optimizer(params)
    grads32 = [p.grad for p in params]
    masters = [p.detach() for p in params]

    def step():
        torch._foreach_copy_(grads32, case.grads)
        opt.step()
        torch._foreach_copy_(case.model, masters)
    return step


def load_deepspeed(device):
    """Build or load DeepSpeed's Adam op before any case runs, saying which and how long it took.
    Returns (the optimizer class or None, a note for the JSON)."""
    try:
        import deepspeed  # noqa: F401
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder
    except ImportError as e:
        print(f"DeepSpeed: not timed (cannot import it: {e})", flush=True)
        return None, f"not importable: {e}"
    builder = CPUAdamBuilder() if device == "cpu" else FusedAdamBuilder()
    label = "CPUAdam" if device == "cpu" else "FusedAdam"
    if installed_ops.get(builder.name):
        print(f"DeepSpeed {label}: prebuilt at install (DS_BUILD_OPS), loading it ...", flush=True)
    else:
        from torch.utils.cpp_extension import get_default_build_root

        # torch.utils.cpp_extension builds in $TORCH_EXTENSIONS_DIR/<op>, else in
        # ~/.cache/torch_extensions/py<ver>_<cuda or cpu>/<op>.
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        pattern = os.path.join(root, "") if root else os.path.join(get_default_build_root(), "*")
        root = root or get_default_build_root()
        cached = sorted(glob.glob(os.path.join(pattern, f"{builder.name}*", f"{builder.name}*.so")))
        if cached:
            print(f"DeepSpeed {label}: loading its cached JIT build {cached[-1]} (ninja checks it is up to "
                  f"date and rebuilds only if DeepSpeed, torch or the flags changed) ...", flush=True)
        else:
            print(f"building DeepSpeed's {label} (JIT C++ build, {DEEPSPEED_BUILD_NOTE[device]}; cached "
                  f"afterwards under {root}); --no-deepspeed to skip ...", flush=True)
    t0 = time.perf_counter()
    try:
        builder.load()
    except Exception as e:  # not fatal: the peer is reported as skipped
        print(f"DeepSpeed {label}: not timed ({type(e).__name__}: {str(e).splitlines()[0][:160]})", flush=True)
        return None, f"load failed: {type(e).__name__}"
    took = time.perf_counter() - t0
    print(f"DeepSpeed {label}: ready in {took:.0f} s", flush=True)
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return (DeepSpeedCPUAdam if device == "cpu" else FusedAdam), f"timed; op ready in {took:.1f} s"


def peers(case, device, deepspeed_cls=None):
    """name -> factory of a step function, for every peer installed here."""
    out = {}
    for name, kw in (("torch-forloop", dict(foreach=False)), ("torch-foreach", dict(foreach=True)),
                     ("torch-fused", dict(fused=True))):
        out[name] = lambda kw=kw: torch_optimizer_impl(case, lambda ps: torch.optim.AdamW(ps, **HYPER, **kw))
    if deepspeed_cls is not None and device == "cpu":
        out["deepspeed-cpu-adam"] = lambda: torch_optimizer_impl(
            case, lambda ps: deepspeed_cls(ps, **HYPER, adamw_mode=True))
    elif deepspeed_cls is not None:
        out["deepspeed-fused-adam"] = lambda: torch_optimizer_impl(
            case, lambda ps: deepspeed_cls(ps, **HYPER, adam_w_mode=True))
    return out


def apex_peer(case, device):
    if device != "cuda":
        return {}
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return {}
    return {"apex-fused-adam": lambda: torch_optimizer_impl(case, lambda ps: FusedAdam(ps, **HYPER, adam_w_mode=True))}


def roof_impl(case):
    m, v = case.zeros(), case.zeros()
    return lambda: torch.ops.zerokern.stream_roof_(case.params, case.grads, m, v, case.model or [])


def copy_impl(case, device):
    """A plain copy moving the case's 28 B/param (half read, half written)."""
    src = torch.ones(max(1, BYTES_PER_PARAM * case.numel // 8), device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def implementations(case, device, with_reference, deepspeed_cls=None):
    impls = {}
    backends = [b for b, ok in ops.available_backends().items()
                if ok and b in PREFERENCE.get(device, ()) and (with_reference or b != "torch")]
    for b in backends:
        impls[f"zerokern-{b}"] = lambda b=b: zerokern_impl(case, b)
    impls.update(peers(case, device, deepspeed_cls))
    impls.update(apex_peer(case, device))
    if device == "cpu" and ops.available_backends()["cpu"]:
        impls["roof"] = lambda: roof_impl(case)
    return impls


class Reference:
    """What one step of zerokern's plain-torch backend (the oracle tests/kernels/test_adam.py checks every
    backend against) makes of the case's params, on a sample: every 97th element of each tensor
    and its first and last 64 (vector tails, list ends). Adam is elementwise, so the sample's
    update is the full one's; the reference then costs ~1% of a step, not several torch passes.
    Also the params before the step, to give every implementation the same start."""

    STRIDE, ENDS = 97, 64

    def __init__(self, case):
        self.p0 = [t.clone() for t in case.params]
        self.index = [self._index(t.numel(), case.device) for t in case.params]
        before, grads = self._gather(case.params), self._gather(case.grads)
        p, m, v = before.clone(), torch.zeros_like(before), torch.zeros_like(before)
        ops.fused_adam_([p], [grads], [m], [v], lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], step=1, backend="torch")
        self.expected, self.update = p, (p - before).abs().max().item()

    @classmethod
    def _index(cls, numel, device):
        ends = torch.cat([torch.arange(min(numel, cls.ENDS)), torch.arange(max(0, numel - cls.ENDS), numel)])
        return torch.cat([ends, torch.arange(min(cls.ENDS, numel), numel, cls.STRIDE)]).unique().to(device)

    def _gather(self, tensors):
        return torch.cat([t.reshape(-1)[i] for t, i in zip(tensors, self.index)])

    def restore(self, case):
        for t, t0 in zip(case.params, self.p0):
            t.copy_(t0)
        for t in case.model or []:
            t.fill_(float("nan"))

    def error(self, case):
        """(max |param - reference| over the reference's largest update, None), or (inf, why) when
        the bf16 model params are not the round-to-nearest of this implementation's own fp32
        params (at most half a bf16 ulp off, 2^-8 relative; NaN, the fill, fails). Not against
        the reference's bf16: where an update cancels a param to near zero, an ulp of difference
        in fp32 is many bf16 ulps of the result."""
        params = self._gather(case.params)
        err = (params - self.expected).abs().max().item() / self.update if self.update > 0 else float("inf")
        if err != err:  # NaN
            return float("inf"), "NaN in params"
        if err > VALIDATE_TOL or not case.model:
            return err, None
        if not torch.allclose(self._gather(case.model).float(), params, rtol=2 ** -8, atol=0):
            return float("inf"), "its bf16 model params are not its fp32 params rounded"
        return err, None


def validate_and_build(case, impls):
    """{name: step fn} for every implementation that builds and matches the reference after its
    first step (which also allocates its optimizer state); the others go to `problems`."""
    ref = Reference(case)
    fns, errs, problems = {}, {}, []
    for name, factory in impls.items():
        ref.restore(case)
        try:
            fn = factory()
            fn()
            H.sync(case.device)
        except Exception as e:  # a peer that cannot run here is reported, not fatal
            problems.append(f"{name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        if name != "roof":  # the roof moves the bytes without Adam's arithmetic: nothing to check
            errs[name], why = ref.error(case)
            if not errs[name] <= VALIDATE_TOL:
                problems.append(f"{name}: FAILED validation against the reference, not timed ("
                                + (why or f"params off by {errs[name]:.3g} of the update, tolerance {VALIDATE_TOL:g}")
                                + ")")
                continue
        fns[name] = fn
    del ref
    return fns, errs, problems


def run_case(precision, layout, n, device, budget_s, rounds, with_reference, deepspeed_cls, table):
    load, case_t0 = H.OtherLoad(), time.perf_counter()  # the whole case: validation's stalls count too
    case = Case(precision, layout, n, device)
    fns, errs, problems = validate_and_build(case, implementations(case, device, with_reference, deepspeed_cls))
    fns["copy"] = copy_impl(case, device)
    fns["copy"]()
    # Validation ran every implementation once, allocating its state: that was the warm-up. Then
    # rounds until budget_s has passed (5 to 30 of them); an implementation whose calls alone
    # take 2 x budget_s (a busy machine) is left out of later rounds rather than let the case
    # run on.
    t0 = time.perf_counter()
    if rounds:
        times = H.interleaved(fns, device, rounds, warmup=0)
    else:
        times = H.interleaved(fns, device, MAX_ROUNDS, warmup=0, time_limit_s=budget_s, min_rounds=MIN_ROUNDS,
                              fn_limit_s=2 * budget_s)
    nrounds = rounds or MIN_ROUNDS
    took = time.perf_counter() - t0
    others, steal = load.cpus()
    # /proc/stat counts in 10 ms ticks: too coarse to judge a window much under 0.2 s (--quick).
    busy = others is not None and others + steal > BUSY_CPUS and time.perf_counter() - case_t0 > 0.2
    nbytes = BYTES_PER_PARAM * case.numel
    stats = {name: H.summary(t) for name, t in times.items()}
    copy_gbs = nbytes / stats.pop("copy")["median_ms"] / 1e6
    roof_gbs = nbytes / stats["roof"]["median_ms"] / 1e6 if "roof" in stats else copy_gbs
    baseline = stats.get("torch-fused")
    ntensors = f"{len(case.params)} tensor{'s' * (len(case.params) != 1)}"
    machine = "" if others is None else (f"; other processes {others:.2f} CPUs, steal {steal:.2f}"
                                         f"{' (BUSY: see notes)' if busy else ''}")
    print(f"-- {precision} {layout}, {case.numel:.2e} params in {ntensors}: {len(times['copy'])} rounds "
          f"in {took:.1f} s; roof {roof_gbs:.1f} GB/s, copy {copy_gbs:.1f} GB/s{machine}", flush=True)
    for line in problems:
        print(f"   {line}", flush=True)
    rows = []
    for name, s in stats.items():
        gbs = nbytes / s["median_ms"] / 1e6
        spread = s["p75_ms"] / s["p25_ms"] if s["p25_ms"] > 0 else float("inf")
        pct_roof = 100 * gbs / roof_gbs
        flags = ((["noisy"] if spread > NOISY_SPREAD else []) + (["over roof"] if pct_roof > 100.5 else [])
                 + (["busy"] if busy else []) + (["few rounds"] if s["n"] < min(MIN_ROUNDS, nrounds) else []))
        row = {
            "precision": precision, "layout": layout, "params": case.numel, "tensors": len(case.params),
            "impl": name, **s, "params_per_s": case.numel / s["median_ms"] * 1e3, "gb_per_s": gbs,
            "roof_gb_per_s": roof_gbs, "pct_of_roof": pct_roof,
            "copy_gb_per_s": copy_gbs, "pct_of_copy": 100 * gbs / copy_gbs,
            "speedup_vs_torch_fused": baseline["median_ms"] / s["median_ms"] if baseline else None,
            "spread": spread, "flags": flags, "validation_err": errs.get(name), "rounds_s": took,
            "others_cpus": others, "steal_cpus": steal,
            "gb_per_s_p25": nbytes / s["p75_ms"] / 1e6, "gb_per_s_p75": nbytes / s["p25_ms"] / 1e6,
        }
        rows.append(row)
        table.row({**row, "range": f"{s['p25_ms']:.3f}-{s['p75_ms']:.3f}", "note": ", ".join(flags)})
    del case, fns
    return rows, problems, copy_gbs


TABLE = [
    ("precision", "dtype", "{}", 5), ("layout", "layout", "{}", 6), ("params", "params", "{:.1e}", 7),
    ("impl", "impl", "{}", 18), ("median_ms", "ms", "{:.3f}", 8), ("range", "p25-p75 ms", "{}", 17),
    ("spread", "spread", "{:.2f}x", 6), ("gb_per_s", "GB/s", "{:.1f}", 5), ("pct_of_roof", "%roof", "{:.0f}", 5),
    ("speedup_vs_torch_fused", "vs torch-fused", "{:.2f}x", 14), ("note", "note", "{}", 4),
]

FOOTNOTES = {
    "noisy": (f"noisy: p75/p25 > {NOISY_SPREAD} (the middle half of this row's rounds spans more than "
              f"{NOISY_SPREAD - 1:.0%}); its median and ratios are uncertain by about that much. Usually "
              "another process competing for the cores or memory bus (a shared or loaded machine); rerun on "
              "an idle machine, or with --budget larger for more rounds. A noisy roof row makes every %roof "
              "of its case uncertain."),
    "over roof": ("over roof: %roof > 100, this row moved its 28 B/param faster than the roof kernel (the same "
                  "streams, no arithmetic) did in the same rounds. The roof is not a law: on a noisy machine "
                  "the roof's rounds can be the ones slowed (check both rows' spread); and while the working "
                  "set (28 B x params) fits in the caches, both run at cache rather than DRAM speed, where "
                  "small differences in access pattern or thread split can put a kernel above it. Trust "
                  "%roof only for rows without a note, at sizes well above the last-level cache. With many "
                  "small tensors the roof op also pays a host cost per call that fused_adam_ does not (it "
                  "validates every tensor each call; fused_adam_ caches that)."),
    "few rounds": (f"few rounds: timed fewer than {MIN_ROUNDS} times, because this implementation's calls "
                   "alone took longer than the case's cap (2x --budget); its median and spread rest on too few "
                   "samples to mean much. It happens on a busy machine (see busy)."),
    "busy": (f"busy: while this case was timed, other processes used (or the hypervisor stole) more than "
             f"{BUSY_CPUS} CPUs (the case's line says how much). Its rows compete for the cores and memory "
             "bus: times are slower, and implementations that use every thread (torch's, above ~32k elements "
             "per op) suffer most, even when all rounds are slowed alike and the spread stays small. "
             "Rerun when the machine is idle, or with --threads 1 (other processes then stall a "
             "one-thread op less than a two-thread one, which waits for its descheduled thread)."),
}


def many_vs_flat(rows):
    """Per-tensor cost: time for the params split into 200 tensors over time for one tensor."""
    key = {(r["precision"], r["layout"], r["params"] // MANY * MANY, r["impl"]): r for r in rows}
    impls = list(dict.fromkeys(r["impl"] for r in rows))

    def ratio(many, flat):
        return f"{many['median_ms'] / flat['median_ms']:.2f}x{'?' if many['flags'] or flat['flags'] else ''}"

    lines = []
    for prec, n in sorted({(p, n) for p, layout, n, _ in key if layout == "many"}):
        cells = [ratio(key[(prec, "many", n, i)], key[(prec, "flat", n, i)])
                 if (prec, "many", n, i) in key and (prec, "flat", n, i) in key else "" for i in impls]
        lines.append([prec, f"{n:.0e}"] + cells)
    if any(any(c for c in line[2:]) for line in lines):
        print(f"\n{MANY} tensors vs one tensor of the same total size (time ratio; 1.00x = no per-tensor cost; "
              f"?: either row has a note):")
        H.print_table([dict(zip(["dtype", "params"] + impls, line)) for line in lines],
                      [(k, k, "{}") for k in ["dtype", "params"] + impls])


def parse_sizes(text):
    return [int(float(x)) for x in text.split(",")]


def default_sizes(device, quick, full):
    if quick:
        return [10_000, 100_000]
    if device == "cpu":
        return [1_000_000, 10_000_000, 100_000_000] if full else [1_000_000, 10_000_000]
    # A GPU does the whole sweep in about a minute (bench/device_check.sh relies on it): --full or not.
    return [1_000_000, 10_000_000, 100_000_000, 256_000_000, 1_000_000_000]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--sizes", type=parse_sizes, help="params per case, e.g. 1e6,1e7,1e8 "
                    "(default: 1e6,1e7 on CPU, 1e6,1e7,1e8 with --full; 1e6,1e7,1e8,2.56e8,1e9 on GPU)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--budget", type=float, default=2.0,
                    help="seconds of timing per case: rounds until it has passed, 5 to 30 of them")
    ap.add_argument("--rounds", type=int, help="fixed number of interleaved rounds instead of --budget")
    ap.add_argument("--with-reference", action="store_true", help="also time zerokern's plain-torch backend")
    ap.add_argument("--full", action="store_true",
                    help="the long sweep on CPU: sizes up to 1e8, DeepSpeed included unless --no-deepspeed "
                         "(a few minutes on an idle 2-core CPU, ~10 on a busy one)")
    ap.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=None,
                    help="time DeepSpeed's CPUAdam (FusedAdam on GPU), whose first use JIT-builds C++ "
                         "(default: only with --full)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, no DeepSpeed: a smoke test")
    ap.add_argument("--json", help="write results (with machine facts) to this path")
    ap.add_argument("--plot", help="write a PNG of GB/s against size, a panel per precision and layout")
    ap.add_argument("--jsonl", help="append each case's rows to this path as it finishes (JSON lines)")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or default_sizes(device, args.quick, args.full)
    rounds = 3 if args.quick and not args.rounds else args.rounds
    with_deepspeed = args.deepspeed if args.deepspeed is not None else (args.full and not args.quick)
    precisions, layouts = args.precisions.split(","), args.layouts.split(",")
    info = H.machine_info(device)
    cases = [(p, l, n) for p in precisions for l in layouts for n in sizes]
    print_header(info, device, cases, precisions, layouts, sizes,
                 f"{rounds} rounds" if rounds else f"~{args.budget:g} s of timing",
                 "" if args.full or args.quick else " (--full: the long sweep)")
    deepspeed_cls, deepspeed_note = None, "not timed (--deepspeed to include)"
    if with_deepspeed:
        deepspeed_cls, deepspeed_note = load_deepspeed(device)
    else:
        print(f"DeepSpeed's {'CPUAdam' if device == 'cpu' else 'FusedAdam'}: not timed (--deepspeed to include it; "
              f"its first use JIT-builds C++, {DEEPSPEED_BUILD_NOTE[device]})", flush=True)
    print(f"Each implementation is checked against zerokern's plain-torch reference (one step) before it is "
          f"timed. GB/s counts {BYTES_PER_PARAM} B/param; %roof is against `roof`, timed in the same rounds; "
          f"dtype mixed = fp32 master, bf16 grads and model copy.\n", flush=True)

    table = H.StreamTable(TABLE)
    table.header()
    rows, problems, log = [], [], H.CaseLog(args.jsonl, info)
    t_start = time.perf_counter()
    for precision, layout, n in cases:
        case_rows, case_problems, _ = run_case(precision, layout, n, device, args.budget, rounds,
                                               args.with_reference, deepspeed_cls, table)
        log.add(case_rows)
        rows += case_rows
        problems += [f"{precision} {layout} {n:.0e}: {p}" for p in case_problems]
    print(f"\n{len(cases)} case{'s' * (len(cases) != 1)} in {time.perf_counter() - t_start:.0f} s.")

    print_notes(rows)
    many_vs_flat(rows)
    failed = [p for p in problems if "FAILED validation" in p]
    if args.json:
        H.write_json(args.json, info, rows, extra={
            "settings": {"argv": sys.argv[1:] if argv is None else list(argv), "device": device, "sizes": sizes,
                         "precisions": precisions, "layouts": layouts, "budget_s": args.budget, "rounds": rounds,
                         "bytes_per_param": BYTES_PER_PARAM, "noisy_spread": NOISY_SPREAD, "busy_cpus": BUSY_CPUS,
                         "validate_tol": VALIDATE_TOL, "hyper": HYPER},
            "notes": {"deepspeed": deepspeed_note, "problems": problems}})
    if args.plot:
        plot(args.plot, rows, info)
    if failed:
        print(f"\n{len(failed)} implementation(s) FAILED validation:\n  " + "\n  ".join(failed))
        sys.exit(1)


def print_header(info, device, cases, precisions, layouts, sizes, per_case, more):
    """The machine (name, threads, caches, what else is running now) and the plan of the run."""
    print(f"zerokern fused Adam on {info.get('gpu') or info['cpu']} ({device}, {info['cpu_count']} CPUs, "
          f"{info['torch_threads']} threads"
          f"{', kernels ' + info['zerokern_cpu_capability'] if 'zerokern_cpu_capability' in info else ''}), "
          f"torch {info['torch']}; backends: {ops.available_backends()}")
    caches = info.get("cpu_caches") or {}
    if device == "cpu" and caches:
        print("caches: " + ", ".join(f"{k} {v >> 20} MiB" if v >= 1 << 20 else f"{k} {v >> 10} KiB"
                                     for k, v in caches.items())
              + (f" (the L3 holds the {BYTES_PER_PARAM} B/param of {caches['L3'] / BYTES_PER_PARAM:.1e} params)"
                 if "L3" in caches else ""))
    load = H.OtherLoad()
    time.sleep(0.5)
    others, steal = load.cpus()
    if others is not None and others + steal > BUSY_CPUS:
        print(f"note: other processes are using {others:.1f} CPUs (steal {steal:.1f}) of {info['cpu_count']} right "
              f"now: expect slow, noisy results (rows marked busy); rerun when the machine is idle, or with "
              f"--threads 1 to avoid the worst of it")
    print(f"{len(cases)} case{'s' * (len(cases) != 1)}: {','.join(precisions)} x {','.join(layouts)} x "
          f"{','.join(f'{n:.0e}' for n in sizes)} params; {per_case} per case{more}", flush=True)


def print_notes(rows):
    """A footnote for each kind of note the table used, with how many rows carry it."""
    seen = {f for r in rows for f in r["flags"]}
    if seen:
        print("\nNotes:")
    for flag in ("noisy", "over roof", "busy", "few rounds"):
        if flag in seen:
            count = sum(flag in r["flags"] for r in rows)
            print(f"  {count} row{'s' * (count != 1)} {FOOTNOTES[flag]}")


def plot(path, rows, info):
    """A panel per (precision, layout): rows fp32 and mixed, columns the layouts; the copy roof
    drawn from each case's copy_gb_per_s; error bars are the p25-p75 range."""
    pts = [dict(r) for r in rows]
    cases = {(r["precision"], r["layout"], r["params"]): r["copy_gb_per_s"] for r in rows}
    for (precision, layout, n), gbs in cases.items():
        pts.append({"precision": precision, "layout": layout, "params": n, "impl": "copy", "gb_per_s": gbs,
                    "gb_per_s_p25": gbs, "gb_per_s_p75": gbs})
    names = {"flat": "1 tensor", "layers": "GPT-style layer tensors", "many": f"{MANY} equal tensors"}
    for r in pts:
        r["panel"] = f"{r['precision']}, {names.get(r['layout'], r['layout'])}"
    order = [f"{p}, {names[l]}" for p in PRECISIONS for l in LAYOUTS]
    H.plot(path, pts, "params", "gb_per_s", "impl", "panel", "parameters", f"GB/s ({BYTES_PER_PARAM} B/param)",
           f"fused Adam step on {info.get('gpu') or info['cpu']} ({info['torch_threads']} threads, "
           f"torch {info['torch']}, "
           f"{info['date'][:10]})\nbars: p25-p75 range; open markers: rows with a note (noisy, over roof, busy)",
           ncols=3, styles=STYLES, panel_order=order, yerr=("gb_per_s_p25", "gb_per_s_p75"), hollow="flags")


if __name__ == "__main__":
    main()
