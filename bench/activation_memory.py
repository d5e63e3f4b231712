"""The planner's activation memory against measured peaks of real forward + backward steps on CPU.

    python bench/activation_memory.py                 # the three shapes below, a table
    python bench/activation_memory.py --json out.json

Shapes (small, so a run takes seconds on two cores; nothing is downloaded):
  gpt         examples/train_gpt.py's GPT (LayerNorm, 4h GELU MLP, SDPA, tied head), bf16, its loss
  llama       transformers' LlamaForCausalLM from a tiny local config (RMSNorm, SwiGLU, GQA), bf16,
              its own loss (labels=)
  llama-ckpt  the same with full per-layer activation checkpointing (activation_checkpointing_enable)
  --shapes    also gpt-fp32, gpt-ckpt (blocks wrapped in torch.utils.checkpoint), llama-mha-fp32 (no GQA,
              other widths) and gpt-vocab128 (a vocabulary too small for the loss to set the peak)
For each: measured `peak` (the peak of activation bytes over the step beyond model states),
`saved` (bytes kept for backward at the end of forward) and `rss peak` (the OS's resident
high-water mark over the step, a check from below torch), [Note: measuring activations on CPU] in
bench/_live_bytes.py, beside zerokern.plan's estimate of each ([Note: activation memory] in
zerokern/plan/activations.py). The estimate must be within 15% of the measured peak.
"""

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # this checkout's zerokern, not an installed one
from _live_bytes import measure, rss_peak  # noqa: E402

from zerokern.plan.activations import activation_memory  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# name -> (arch, dict of the shape, activation dtype, checkpointing)
SHAPES = {
    "gpt": ("gpt", dict(layers=4, hidden=256, heads=4, vocab=4096, seq=256, micro_batch=4), "bf16", "none"),
    "llama": ("llama", dict(layers=4, hidden=256, heads=8, kv_heads=2, ffn_hidden=688, vocab=4096, seq=256,
                            micro_batch=4), "bf16", "none"),
    "llama-ckpt": ("llama", dict(layers=4, hidden=256, heads=8, kv_heads=2, ffn_hidden=688, vocab=4096, seq=256,
                                 micro_batch=4), "bf16", "full"),
    # (--shapes) more settings, not among those the formula was worked out from
    "gpt-fp32": ("gpt", dict(layers=4, hidden=256, heads=4, vocab=4096, seq=256, micro_batch=4), "fp32", "none"),
    "gpt-ckpt": ("gpt", dict(layers=4, hidden=256, heads=4, vocab=4096, seq=256, micro_batch=4), "bf16", "full"),
    "llama-mha-fp32": ("llama", dict(layers=3, hidden=384, heads=6, ffn_hidden=1024, vocab=6000, seq=128,
                                     micro_batch=6), "fp32", "none"),
    # a vocabulary below a layer's width: the peak is a layer's backward, which the planner bounds
    "gpt-vocab128": ("gpt", dict(layers=4, hidden=256, heads=4, vocab=128, seq=256, micro_batch=4), "bf16", "none"),
}


def _train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(HERE, "..", "examples", "train_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(arch, shape, dtype, checkpointing):
    """(model, batch, loss_fn): the model in `dtype`, one random micro-batch, the loss as its user computes it."""
    torch.manual_seed(0)
    s, b, v = shape["seq"], shape["micro_batch"], shape["vocab"]
    ids = torch.randint(v, (b, s + 1))
    if arch == "gpt":
        model = _train_gpt().GPT(v, shape["hidden"], shape["heads"], shape["layers"], s).to(DTYPES[dtype])
        if checkpointing == "full":  # each block recomputed in backward, as gradient_checkpointing_enable does
            for blk in model.blocks:
                blk.forward = functools.partial(checkpoint, blk.forward, use_reentrant=False)

        def loss_fn(m, batch):  # as examples/train_gpt.py computes it
            return F.cross_entropy(m(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=v, hidden_size=shape["hidden"], intermediate_size=shape["ffn_hidden"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape.get("kv_heads") or shape["heads"], max_position_embeddings=s,
                          attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to(DTYPES[dtype])
        if checkpointing == "full":
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def loss_fn(m, batch):  # transformers' own loss: labels=
            return m(input_ids=batch[:, :-1], labels=batch[:, :-1], use_cache=False).loss
    model.train()
    return model, ids, loss_fn


def run(name):
    arch, shape, dtype, ckpt = SHAPES[name]
    model, batch, loss_fn = build(arch, shape, dtype, ckpt)
    measure(model, batch, loss_fn)  # warm-up: first-call allocations (caches, lazy inits) are not activations
    got = measure(model, batch, loss_fn)
    rss = rss_peak(model, batch, loss_fn)
    est = activation_memory(arch=arch, dtype=dtype, checkpointing=ckpt, **shape)
    return dict(name=name, arch=arch, dtype=dtype, checkpointing=ckpt, **shape,
                measured_peak=got["peak"], measured_saved=got["saved"], rss_peak=rss, planned_peak=est.peak_bytes,
                planned_saved=est.saved_bytes, error=est.peak_bytes / got["peak"] - 1)


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["gpt", "llama", "llama-ckpt"], choices=list(SHAPES))
    ap.add_argument("--json", help="also write the rows (and versions) to this file")
    args = ap.parse_args(argv)
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform == "linux" and argv is None:
        # the rss check needs glibc to map every large tensor on its own, set before start-up
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = [run(n) for n in args.shapes]
    mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
    versions = {"torch": torch.__version__, "transformers": _version("transformers"), "python": platform.python_version(),
                "machine": platform.machine()}
    print(", ".join(f"{k} {v}" for k, v in versions.items()) + "; MiB of activations per step (bytes counted, "
          "deterministic: one step after a warm-up one)")
    head = ["shape", "dtype", "ckpt", "s x b", "planned peak", "measured peak", "error", "rss peak", "planned saved",
            "measured saved"]
    table = [head] + [[r["name"], r["dtype"], r["checkpointing"], f"{r['seq']}x{r['micro_batch']}",
                       mib(r["planned_peak"]), mib(r["measured_peak"]), f"{r['error']:+.2%}",
                       "n/a" if r["rss_peak"] is None else mib(r["rss_peak"]),
                       mib(r["planned_saved"]), mib(r["measured_saved"])] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    for t in table:
        print("  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(versions, rows=rows), f, indent=1)
    return 0 if all(abs(r["error"]) <= 0.15 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
