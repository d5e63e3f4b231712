"""The wire format's kernels (zerokern.kernels.wire_ops) against the plain-PyTorch reference.

    python bench/wire_throughput.py [--numel 16777216] [--ref-numel 262144] [--json out.json]

Per precision (int8, int4), on fp32 chunks:
  encode             x -> wire bytes                   (4 B/element read + the wire bytes written)
  encode+error       also x - decode(bytes)            (+ 4 B/element written)
  decode_add         out += decode(bytes)              (the wire bytes + 4 B read, 4 B written)
  encode+decode_add  a round trip: both of the above   (their bytes summed)
The compiled kernel runs on --numel elements; the reference (its Philox is a few dozen int64 tensor
ops per element) on --ref-numel, its time scaled by numel / ref-numel to the same chunk: the
per-element cost does not depend on the size at these sizes. Each kernel is checked against the
reference's bytes before it is timed. GB/s counts the bytes above; %copy compares it with a plain
copy of the chunk (torch's copy_, 8 B/element) timed in the same interleaved rounds. Medians (and
25th-75th percentiles) of the rounds.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

from zerokern.kernels import wire, wire_ops  # noqa: E402

KEY = (1234, 7, 0, 0)  # seed, step, stream, base


def _ops(x, bits, backend):
    """name -> (step function, bytes it moves) for one backend on chunk x."""
    n, device = x.numel(), x.device
    out = torch.empty(wire.nbytes(n, bits), dtype=torch.uint8, device=device)
    err = torch.empty(n, device=device)
    acc = torch.zeros(n, device=device)
    wire_ops.encode_(x, out, bits, *KEY, backend=backend)
    enc = lambda: wire_ops.encode_(x, out, bits, *KEY, backend=backend)  # noqa: E731
    dec = lambda: wire_ops.decode_add_(out, n, bits, acc, backend=backend)  # noqa: E731
    wb = wire.nbytes(n, bits)
    return {
        "encode": (enc, 4 * n + wb),
        "encode+error": (lambda: wire_ops.encode_(x, out, bits, *KEY, error=err, backend=backend), 8 * n + wb),
        "decode_add": (dec, wb + 8 * n),
        "encode+decode_add": (lambda: (enc(), dec()), 12 * n + 2 * wb),
    }


def validate(x, bits, backend):
    """The backend's bytes, error and decode_add are the reference's (on x)."""
    n = x.numel()
    ref, ref_err = wire.encode_with_error(x, bits, *KEY)
    out, err = torch.empty_like(ref), torch.empty(n)
    wire_ops.encode_(x, out, bits, *KEY, error=err, backend=backend)
    acc = torch.ones(n)
    wire_ops.decode_add_(ref, n, bits, acc, backend=backend)
    ok = (torch.equal(out, ref) and torch.equal(err.view(torch.int32), ref_err.view(torch.int32))
          and torch.equal(acc.view(torch.int32), (1 + wire.decode(ref, n, bits)).view(torch.int32)))
    if not ok:
        sys.exit(f"backend {backend!r} does not give the reference's bytes at int{bits}: not timing it")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--ref-numel", type=int, default=1 << 18)
    ap.add_argument("--backend", default="cpu", help="the kernel timed against the reference")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cpu"
    info = H.machine_info(device)
    print(f"wire format on {info['cpu']} ({info['torch_threads']} threads): {args.backend} on {args.numel:,} "
          f"elements, the reference on {args.ref_numel:,} (scaled)")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=gen)
    x_ref = x[:args.ref_numel].clone()
    copy_dst = torch.empty_like(x)
    scale = args.numel / args.ref_numel
    rows = []
    for bits in (8, 4):
        validate(x_ref, bits, args.backend)
        kernel, ref = _ops(x, bits, args.backend), _ops(x_ref, bits, "torch")
        fns = {f"{args.backend}/{op}": f for op, (f, _) in kernel.items()}
        fns.update({f"torch/{op}": f for op, (f, _) in ref.items()})
        fns["roof/copy"] = lambda: copy_dst.copy_(x)  # in the same rounds: the machine is shared
        load = H.OtherLoad()
        times = H.interleaved(fns, device, args.rounds)
        others, _ = load.cpus()
        copy = 8 * args.numel / H.summary(times.pop("roof/copy"))["median_ms"] / 1e6
        for name, t in times.items():
            backend, op = name.split("/")
            s = H.summary(t)
            factor = scale if backend == "torch" else 1.0  # the reference's time for the full chunk
            med, p25, p75 = (s[k] * factor for k in ("median_ms", "p25_ms", "p75_ms"))
            nbytes = kernel[op][1]
            rows.append({"bits": bits, "op": op, "backend": backend, "numel": args.numel,
                         "timed_numel": args.ref_numel if backend == "torch" else args.numel,
                         "median_ms": med, "p25_ms": p25, "p75_ms": p75, "rounds": s["n"],
                         "ns_per_element": med * 1e6 / args.numel, "gb_per_s": nbytes / med / 1e6,
                         "other_load_cpus": others, "copy_gb_per_s": copy,
                         "pct_of_copy": 100 * nbytes / med / 1e6 / copy})
    for r in rows:
        ref = next(q for q in rows if q["bits"] == r["bits"] and q["op"] == r["op"] and q["backend"] == "torch")
        r["speedup_vs_reference"] = ref["median_ms"] / r["median_ms"]
    H.print_table(rows, [("bits", "bits", "int{}"), ("op", "op", "{}"), ("backend", "backend", "{}"),
                         ("median_ms", "ms", "{:.2f}"), ("p25_ms", "p25", "{:.2f}"), ("p75_ms", "p75", "{:.2f}"),
                         ("ns_per_element", "ns/el", "{:.3f}"), ("gb_per_s", "GB/s", "{:.2f}"),
                         ("pct_of_copy", "%copy", "{:.0f}"), ("speedup_vs_reference", "vs ref", "{:.0f}x")])
    for bits in (8, 4):
        r = next(q for q in rows if q["bits"] == bits)
        print(f"int{bits}: copy of {args.numel:,} fp32 (read + write) {r['copy_gb_per_s']:.1f} GB/s in the same "
              f"rounds; other processes used {r['other_load_cpus'] or 0:.1f} CPUs meanwhile")
    if args.json:
        H.write_json(args.json, info, rows, {"settings": vars(args)})


if __name__ == "__main__":
    main()
