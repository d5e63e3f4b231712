"""`python -m zerokern.plan`: the planner on the command line. Bad input exits
with code 2 and a one-line reason (argparse's convention), never a traceback."""

import argparse
import json
import math
import re
import sys

from . import disk
from .activations import ACT_BYTES, CHECKPOINTING
from .matrix import LAYOUTS, OPTIMIZERS
from .model import DTYPE_BYTES, MATRIX_STATE_PRECISIONS, STATE_BYTES, plan
from .traffic import GATHER_PRECISIONS, REDUCE_PRECISIONS, quantized
from .units import parse_size


def parse_bytes(text, per_second=False):
    """units.parse_size as an argparse type (argparse puts the flag in front of the reason)."""
    try:
        return parse_size(text, per_second)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_COUNT_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def param_count(text):
    """'7.5e9', '7.5B', '125M', '1.3T' -> a whole, finite, positive number of parameters."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a parameter count (e.g. 7.5e9, 7.5B, 125M)")
    value = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if not 0 < value < float("inf") or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters (7.5e9 or 7.5B for 7.5 "
                                         "billion)")
    return int(value)


def count(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a number") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def _precision_flag(choices):
    """The command line's names of a precision tuple: None is 'none'."""
    return [c or "none" for c in choices]


def parser():
    ap = argparse.ArgumentParser(prog="python -m zerokern.plan",
                                 description="Per-GPU memory and communication of mixed-precision Adam training "
                                             "for ZeRO stages 0-3: model states, and activations with --seq-len.")
    model = ap.add_argument_group("model (either --params or the shape)")
    model.add_argument("--params", type=param_count, help="number of parameters, e.g. 7.5e9 or 7.5B")
    model.add_argument("--arch", choices=["gpt", "llama"], default="gpt",
                       help="gpt: biases, LayerNorm, a 4h MLP by default, tied embeddings; llama: no biases, "
                            "RMSNorm, a gated MLP (needs --ffn-hidden), grouped-query attention (--kv-heads), "
                            "untied embeddings. The formulas are in zerokern/plan/model.py")
    model.add_argument("--layers", type=count)
    model.add_argument("--hidden", type=count)
    model.add_argument("--heads", type=count)
    model.add_argument("--kv-heads", type=count, help="key/value heads (llama; default: --heads)")
    model.add_argument("--vocab", type=count)
    model.add_argument("--ffn-hidden", type=count, help="MLP width (gpt default 4 * hidden; llama: required)")
    model.add_argument("--unit-params", type=param_count,
                       help="stage 3 with --params: params per gathering unit (e.g. one layer)")
    model.add_argument("--root-params", type=param_count,
                       help="stage 3 with --params: params of the root unit (embeddings, final norm)")
    par = ap.add_argument_group("parallelism")
    par.add_argument("--dp", type=count, default=1, help="data-parallel size")
    par.add_argument("--hosts", type=count, default=1,
                     help="hosts the dp ranks are on: bytes between hosts, flat and hybrid (mesh=(hosts, dp/hosts))")
    par.add_argument("--tp", type=count, default=1, help="tensor-parallel size")
    par.add_argument("--pp", type=count, default=1, help="pipeline-parallel size")
    par.add_argument("--micro-batches", type=count, default=1, help="micro-batches per step (pipeline bubble)")
    par.add_argument("--stage", type=count, choices=[0, 1, 2, 3], help="mark this ZeRO stage (all are shown)")
    hw = ap.add_argument_group("training and hardware")
    hw.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    hw.add_argument("--state-precision", default="fp32", choices=list(STATE_BYTES),
                    help="Adam's moments: fp32 (8 bytes/param), bf16 (4) or int8 blocks (2.03); FusedZeroAdam's "
                         "state_precision")
    hw.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam",
                    help="muon or adafactor: torch.optim.Muon / Adafactor on the layers' 2-D weights, each whole on "
                         "one rank, AdamW on the rest (ZeroOptimizer's mixed groups); needs the shape. Adds each "
                         "rank's state and Newton-Schulz work")
    hw.add_argument("--matrix-state-precision", choices=list(MATRIX_STATE_PRECISIONS), default="fp32",
                    help="--optimizer muon: the Muon momentum in fp32 (4 bytes an element) or int8 (uint8 codes, a "
                         "bf16 scale per 64 elements of a row and an fp32 one per column: about 1.05 bytes); a "
                         "Muon param group's \"state_precision\" in ZeroOptimizer")
    hw.add_argument("--matrix-layout", choices=list(LAYOUTS), default="groups",
                    help="--optimizer muon|adafactor: whose order the per-rank rows follow: groups (default) is "
                         "ZeroOptimizer bucketing the params itself at stages 1-2 (no shard()), the matrices' "
                         "param group first, each group in registration order; unit is the model shard()ed as one "
                         "unit. Stage 3 needs shard(): its column is the unit layout's either way")
    hw.add_argument("--no-master-weights", action="store_true",
                    help="bf16 params updated without fp32 masters (stochastic rounding): FusedZeroAdam's "
                         "master_weights=False")
    hw.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"], default="none",
                    help="keep fp32 master weights and Adam state in CPU memory, or on disk (nvme: streamed "
                         "through a few buffers; ZeRO stage 1 and up)")
    hw.add_argument("--disk-bandwidth", type=_disk_rates, metavar="READ,WRITE",
                    help="--offload-optimizer nvme: the disk's O_DIRECT read and write GB/s per GPU (e.g. 6,4), "
                         "for the step's disk time")
    hw.add_argument("--measure-disk", metavar="PATH",
                    help="--offload-optimizer nvme: measure a directory's O_DIRECT read and write GB/s (256 MB "
                         "written and read back) and use them for the step's disk time")
    hw.add_argument("--gpu-memory", type=parse_bytes, default=80e9,
                    help="per GPU, with a unit: 80GB (the default), 141GB, 24GiB")
    hw.add_argument("--dp-bandwidth", type=lambda t: parse_bytes(t, per_second=True), default=None,
                    help="per-GPU data-parallel link bandwidth in bytes (100GB/s) or bits (400Gb/s, 400Gbps: a "
                         "lowercase b is a bit); default 100GB/s, an NVLink-class link (the output says when it "
                         "assumed it): GPUs on PCIe, or links between hosts, are slower")
    hw.add_argument("--reduce-precision", choices=_precision_flag(REDUCE_PRECISIONS), default="none",
                    help="what grads travel in: none (their dtype), fp32, bf16, or int8/int4 blocks with error "
                         "feedback (an 'ef' column); with --hosts only the hop between hosts of hybrid sharding. "
                         "shard()'s reduce_precision")
    hw.add_argument("--gather-precision", choices=_precision_flag(GATHER_PRECISIONS), default="none",
                    help="what the param all-gathers send without a mesh: none (the params' dtype) or int8 blocks")
    hw.add_argument("--bucket-cap-mb", type=float, default=25.0,
                    help="FusedZeroAdam's bucket_cap_mb (stage 2 holds up to 5 such buckets in backward)")
    act = ap.add_argument_group("activations (need the shape; tp = pp = 1)")
    act.add_argument("--seq-len", type=count, help="tokens per sequence: counts one micro-batch's activations into "
                                                   "every stage's total and fit")
    act.add_argument("--micro-batch-size", type=count, default=1, help="sequences per micro-batch (default 1)")
    act.add_argument("--checkpointing", choices=CHECKPOINTING, default="none",
                     help="activation checkpointing: none, or full (every layer recomputed in backward)")
    act.add_argument("--act-dtype", choices=sorted(ACT_BYTES), help="activations' dtype (default: --dtype)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    return ap


def _disk_rates(text):
    try:
        read, write = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected READ,WRITE in GB/s (e.g. 6,4), got {text!r}") from None
    if read <= 0 or write <= 0:
        raise argparse.ArgumentTypeError(f"disk rates must be > 0 GB/s, got {text!r}")
    return disk.DiskRate(read, write, "--disk-bandwidth")


def _gb(x):
    return "n/a" if x is None else f"{x / 1e9:.2f}"


DEFAULT_BANDWIDTH = 100e9  # bytes/s, NVLink-class: what --dp-bandwidth assumes when not given


def render(p, marked=None, bandwidth_assumed=False):
    a = p.activations
    lines = [f"zerokern plan: {p.params_total:.4g} params in all, {p.params_per_gpu:.4g} on each GPU; "
             f"dp={p.dp} tp={p.tp} pp={p.pp}, {p.dtype}, "
             + (f"Adam with {p.state_precision} moments" if p.matrix is None else
                f"{_NAMES[p.optimizer]} on the layers' matrices"
                + (" (int8 momentum)" if p.matrix.state_precision == "int8" else "") + ", AdamW with "
                f"{p.state_precision if p.master_weights else 'bf16'} moments on the rest")
             + ("" if p.master_weights or p.dtype == "fp32" else ", no fp32 masters")
             + ({"cpu": ", optimizer offloaded to CPU", "nvme": ", optimizer state on disk (nvme)"}.get(
                 p.offload_optimizer, "")),
             f"  {p.formula}",
             ("" if p.hosts == 1 else f"flat sharding over all {p.dp} ranks (hybrid: the hosts table below); ")
             + "GB per GPU (1 GB = 1e9 bytes); " + (
                 f"fits in {_gb(p.gpu_memory_bytes)} GB = model states only, headroom left for activations "
                 "(give --seq-len to count them)" if a is None else
                 f"fits in {_gb(p.gpu_memory_bytes)} GB = model states + activations ({a.micro_batch} x {a.seq} "
                 f"tokens, {a.dtype}, checkpointing {a.checkpointing})"),
             ""]
    # optional columns: activations only with --seq-len, error feedback only for int8/int4 reductions
    nvme = p.offload_optimizer == "nvme"
    timed = nvme and any(s.disk_seconds is not None for s in p.stages)
    shown = {"activ": a is not None, "ef": quantized(p.reduce_precision), "cpu": bool(p.offload_optimizer),
             "disk": nvme, "disk time": timed}
    head = [c for c in ("stage", "params", "gathered", "grads", "buffers", "master", "adam", "ef", "activ", "total",
                        "cpu", "disk", "disk time", "fits (headroom)", "comm/step", "comm time")
            if shown.get(c, True)]
    rows = []
    best = p.smallest_fitting_stage
    for s in p.stages:
        cells = {"stage": str(s.stage), "params": _gb(s.params_bytes), "gathered": _gb(s.gathered_bytes),
                 "grads": _gb(s.grads_bytes), "buffers": _gb(s.buffers_bytes), "master": _gb(s.master_bytes),
                 "adam": _gb(s.adam_bytes), "ef": _gb(s.error_feedback_bytes), "activ": _gb(s.activations_bytes),
                 "total": _gb(s.total_bytes), "cpu": _gb(s.cpu_bytes), "disk": _gb(s.disk_bytes),
                 "disk time": "-" if s.disk_seconds is None else f"{s.disk_seconds:.2f} s",
                 "fits (headroom)": f"{'yes' if s.fits else 'no'} ({_gb(s.headroom_bytes)})",
                 "comm/step": f"{_gb(s.comm_bytes)} GB", "comm time": f"{s.comm_seconds * 1e3:.1f} ms"}
        row = [cells[c] for c in head]
        notes = []
        if s.stage == best:
            notes.append("<- smallest stage that fits")
        if s.stage == marked:
            notes.append("<- --stage")
        rows.append(row + [" ".join(notes)])
    widths = [max(len(r[i]) for r in [head + [""]] + rows) for i in range(len(head) + 1)]
    for r in [head + [""]] + rows:
        lines.append("  ".join(c.rjust(w) if 0 < i < len(head) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    lines.append("")
    lines.append(f"comm: bytes each GPU sends per step over the data-parallel group at "
                 f"{p.dp_bandwidth_bytes_per_s / 1e9:g} GB/s (ring; 2x params for stages 0-2, 3x for stage 3"
                 + (")" if p.reduce_precision is None and p.gather_precision is None else
                    f"; grads in {p.reduce_precision or p.dtype}, params gathered in {p.gather_precision or p.dtype}: "
                    "[Note: bytes on the wire] in zerokern/plan/traffic.py)")
                 + ("; 100 GB/s is the default --dp-bandwidth, an NVLink-class link: GPUs on PCIe (about 25 GB/s "
                    "for PCIe 4.0 x16) or a link between hosts are slower, so pass yours" if bandwidth_assumed else ""))
    if quantized(p.reduce_precision):
        lines.append("ef: error feedback of int8/int4 reductions, bf16 residuals of what a rank quantizes (flat: the "
                     "whole grads, plus 1/dp at stage 0 on > 2 ranks), committed and pending: 4 bytes per element "
                     "during a step (counted), 2 between steps")
    lines.append("buffers: what zerokern holds beyond the ZeRO paper's figures with dp > 1: stage 1 the reduced grad "
                 "shard (grads/dp), stages 2 and 3 up to 5 buckets of --bucket-cap-mb in backward (2 in flight, 2 filling, 1 a tied embedding holds open). DeepSpeed's ZeRO-2 "
                 "estimator says 2 + 18/dp bytes/param (it keeps fp32 grads); zerokern 2 + 14/dp plus buffers")
    if p.stages[3].gathered_bytes is None:
        lines.append("gathered n/a: stage 3's working set is not modelled from a parameter count, and its total and "
                     "fit leave it out: pass --unit-params (and --root-params) or the shape (--layers --hidden "
                     "--heads --vocab); in Python unit_params= to plan or from_model")
    else:
        lines.append("gathered: stage 3's full params while units compute (the root unit, the unit computing and "
                     "the one prefetched; one layer per unit from the shape, or --unit-params/--root-params)")
    lines += _matrix_lines(p)
    lines += _activation_lines(p)
    if p.hosts > 1:
        lines += ["", f"across {p.hosts} hosts ({p.dp // p.hosts} ranks each), per step, all ranks' sends together "
                  "([Note: bytes across hosts]): flat sharding over all ranks vs hybrid (mesh=(hosts, ranks per "
                  "host): sharded within a host, replicated across)"
                  + ("" if p.reduce_precision is None else
                     f"; grads reduced in {p.reduce_precision}: flat, every reduction; hybrid, only the all-reduce "
                     "across hosts (within a host in the grads' dtype)")
                  + ("" if p.gather_precision is None else
                     f"; params gathered in {p.gather_precision}: flat only (hybrid gathers in the params' dtype)")]
        ef = quantized(p.reduce_precision)
        # MB for a model whose bytes would read 0.0x GB
        unit, scale = ("GB", 1e9) if max(s.intra_host_bytes + s.hybrid_intra_host_bytes for s in p.stages) >= 1e9 \
            else ("MB", 1e6)
        rows = [["stage", f"flat {unit} across", f"flat {unit} within", f"hybrid {unit} across",
                 f"hybrid {unit} within", "hybrid saves", f"hybrid total {unit}/GPU"] + (["of which ef"] if ef else [])
                + ["hybrid fits (headroom GB)", ""]]
        hybrid_best = p.smallest_fitting_hybrid_stage
        for s in p.stages:
            cells = [s.inter_host_bytes, s.intra_host_bytes, s.hybrid_inter_host_bytes, s.hybrid_intra_host_bytes]
            rows.append([str(s.stage)] + [f"{x / scale:.2f}" for x in cells]
                        + [f"{s.inter_host_bytes / s.hybrid_inter_host_bytes:.2f}x"]
                        + [f"{x / scale:.2f}" for x in [s.hybrid_total_bytes] + ([s.hybrid_error_feedback_bytes] if ef
                                                                                  else [])]
                        + [f"{'yes' if s.hybrid_fits else 'no'} ({_gb(p.gpu_memory_bytes - s.hybrid_total_bytes)})",
                           "<- smallest stage that fits, hybrid" if s.stage == hybrid_best else ""])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.rjust(w) if 0 < i < len(r) - 1 else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    if p.pp > 1:
        lines.append(f"pipeline bubble: (pp-1)/(m+pp-1) = {p.pipeline_bubble:.1%} with m={p.micro_batches} micro-batches")
    if p.offload_optimizer:
        lines.append("offload applies from stage 1 on (ZeRO-Offload moves the sharded optimizer state); "
                     "stage 0 keeps it on the GPU")
    if nvme:
        lines.append(f"nvme: disk = this GPU's shard of the state ({p.state_precision} moments"
                     + (", and fp32 masters of 16-bit params" if p.master_weights else ", no masters") + "), "
                     "read from one slot and written to the other every step (the file holds two slots); cpu = "
                     "host buffers: OffloadPolicy's defaults (4 buffers x 3 arrays x 16 MB) and one param shard"
                     + ("" if not timed else f"; disk time = disk / read + disk / write at {p.disk_rate[0]:.2f} / "
                        f"{p.disk_rate[1]:.2f} GB/s ({p.disk_rate[2]}): the step takes at least that, or the CPU "
                        "update if longer (they overlap)"))
    lines += _verdict(p)
    return "\n".join(lines)


def _verdict(p):
    """One verdict that names the layout it judges: flat sharding over all dp ranks (the first
    table), and with --hosts also hybrid sharding (the hosts table), so it agrees with both."""
    fix = ("raise dp, tp or pp, or offload the optimizer (--offload-optimizer cpu)"
           + ("" if p.activations is None else "; for activations --checkpointing full or a smaller "
              "--micro-batch-size or --seq-len (the table above)"))
    flat, gb = p.smallest_fitting_stage, _gb(p.gpu_memory_bytes)
    flat_says = ("no stage fits" if flat is None else
                 f"stage {flat} is the smallest that fits, {_gb(p.stages[flat].total_bytes)} of {gb} GB")
    if p.hosts == 1:
        return [f"verdict for flat sharding over {p.dp} ranks: {flat_says}" + ("" if flat is not None else f": {fix}")]
    hybrid = p.smallest_fitting_hybrid_stage
    if flat is None and hybrid is None:
        return [f"verdict: no stage fits, with flat sharding over {p.dp} ranks or hybrid over {p.hosts} hosts: {fix}"]
    hybrid_says = ("no stage fits" if hybrid is None else
                   f"stage {hybrid} is the smallest that fits, {_gb(p.stages[hybrid].hybrid_total_bytes)} of {gb} GB")
    return [f"verdict for hybrid sharding, mesh=({p.hosts}, {p.dp // p.hosts}) (the hosts table): {hybrid_says}; "
            f"for flat sharding over {p.dp} ranks (the first table): {flat_says}"]


_NAMES = {"muon": "Muon", "adafactor": "Adafactor"}


def _matrix_lines(p):
    """[Note: matrix optimizers in the plan] in matrix.py: the state column's split and the work per rank."""
    m = p.matrix
    if m is None:
        return []
    name = _NAMES[m.optimizer]
    kind = m.state_precision  # without masters torch keeps bf16 state
    state = (f"an {kind} momentum" if kind == "int8" else f"a {kind} momentum") if m.optimizer == "muon" else \
        f"{kind} row and column statistics"
    state += " each"
    if kind == "int8":  # [Note: int8 momentum of whole matrices]: the codec's tensors, exactly
        state += (": uint8 codes, a bf16 scale per 64 elements of a row and an fp32 one per column, "
                  f"{m.matrix_state_bytes:,.0f} bytes in all, {m.matrix_state_bytes / m.matrix_params:.3f} an "
                  "element against fp32's 4")
    work = (f"Newton-Schulz per step, GFLOP per rank: max {max(m.work) / 1e9:.3g}, mean "
            f"{sum(m.work) / len(m.work) / 1e9:.3g}" if m.optimizer == "muon" else
            f"elements per step per rank: max {max(m.work):.4g}, mean {sum(m.work) / len(m.work):.4g}")
    return [f"{m.optimizer}: {name} on {m.matrices} matrices ({m.matrix_params:.4g} params, {state}), each whole on "
            f"one rank and stepped there once a step; AdamW on {m.elementwise_params:.4g} params; the adam column is "
            f"both optimizers' state on the busiest of {p.dp} ranks",
            f"{m.optimizer}: per-rank rows in "
            + ("ZeroOptimizer's own layout (its param groups' order, stages 1-2; stage 3's column: one shard() unit)"
               if p.matrix_layout == "groups" else "one shard() unit's layout (registration order)")
            + " (--matrix-layout)",
            f"{m.optimizer}: {work}, balance {m.balance:.3f} (max/mean); the matrix-whole layout pads "
            f"{m.padding_params:,} params ({m.padding_params / p.params_per_gpu:.1%}; not in the sharded params, "
            "grads and master columns: [Note: matrix optimizers in the plan] in zerokern/plan/matrix.py)"]


def _activation_lines(p):
    a = p.activations
    if a is None:
        return []
    lines = [f"activ: one micro-batch's activations at their peak in forward + backward ([Note: activation memory] "
             f"in zerokern/plan/activations.py): {a.formula}",
             "", f"largest micro-batch of {a.seq}-token sequences that fits beside the model states, {a.dtype} "
                 "activations (in brackets: tokens per micro-batch that fit):"]
    rows = [["checkpointing"] + [f"stage {s.stage}" for s in p.stages]]
    for c, tokens in p.fit_tokens.items():
        rows.append([c] + [f"{t // a.seq} ({t / 1e3:.1f}k)" for t in tokens])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return lines


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if (args.disk_bandwidth or args.measure_disk) and args.offload_optimizer != "nvme":
        ap.error("--disk-bandwidth and --measure-disk are for --offload-optimizer nvme")
    try:
        rate = disk.measure(args.measure_disk) if args.measure_disk else args.disk_bandwidth
    except ValueError as e:
        ap.error(str(e))
    try:
        p = plan(args.params, layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                 ffn_hidden=args.ffn_hidden, arch=args.arch, kv_heads=args.kv_heads, dp=args.dp, tp=args.tp, pp=args.pp, dtype=args.dtype,
                 offload_optimizer=args.offload_optimizer, gpu_memory=args.gpu_memory,
                 micro_batches=args.micro_batches,
                 dp_bandwidth=DEFAULT_BANDWIDTH if args.dp_bandwidth is None else args.dp_bandwidth,
                 bucket_cap_mb=args.bucket_cap_mb, unit_params=args.unit_params, root_params=args.root_params,
                 state_precision=args.state_precision, master_weights=not args.no_master_weights,
                 hosts=args.hosts, seq=args.seq_len, micro_batch_size=args.micro_batch_size,
                 checkpointing=args.checkpointing, act_dtype=args.act_dtype,
                 reduce_precision=None if args.reduce_precision == "none" else args.reduce_precision,
                 gather_precision=None if args.gather_precision == "none" else args.gather_precision,
                 disk_rate=rate, optimizer=args.optimizer, matrix_state_precision=args.matrix_state_precision,
                 matrix_layout=args.matrix_layout)
    except ValueError as e:
        ap.error(str(e))  # exit code 2
    if args.json:
        print(json.dumps(dict(p.to_dict(), marked_stage=args.stage, dp_bandwidth_assumed=args.dp_bandwidth is None),
                         indent=1))
    else:
        print(render(p, args.stage, bandwidth_assumed=args.dp_bandwidth is None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
