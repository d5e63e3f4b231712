"""Activation memory of one micro-batch's forward and backward: pure arithmetic, no torch.

[Note: activation memory] What PyTorch eager keeps for backward, counted op by op for the
repo's two model families as they run (examples/train_gpt.py's GPT; transformers'
LlamaForCausalLM with its default SDPA attention), per token (s*b tokens in a micro-batch), in
bytes, with B the activation dtype's bytes (4 fp32, 2 bf16/fp16), h hidden, f MLP width, a heads,
kv = kv_heads * h/a:

  GPT layer    B*(8h + 2f) + 4B + 4a  (LayerNorm statistics in B: in the input's dtype on CPU)
               kept: the layer input and LayerNorm-1 output (2h), the qkv output (3h: SDPA keeps
               q, k, v as views of it), the attention output (h; its transpose-reshape is a view),
               the residual after attention and LayerNorm-2 output (2h), fc1 and GELU outputs
               (2f); each LayerNorm's mean and rstd (4B); SDPA's fp32 logsumexp (4a)
  Llama layer  2*((4 + 2B)h + 4) + B*(2h + 2kv) + 4Bf + 4a
               each RMSNorm upcasts to fp32 and keeps that copy (4h; in fp32 it is the input
               itself), the normalised tensor and the weighted output (2Bh) and the fp32 rsqrt
               (4); attention keeps RoPE'd q and k, v (B(h + 2kv): SDPA takes grouped kv heads as
               they are) and its output (Bh); the SwiGLU MLP keeps gate, SiLU, up and product (4Bf)
  final norm   GPT 2Bh + 2B, Llama (4 + 2B)h + 4
  token ids    16: the int64 inputs (the embedding keeps them) and targets (the loss keeps them)
  loss         both models compute cross entropy in fp32 over s*b*V logits: the log-softmax
               output is kept (4V) and backward holds beside it its incoming gradient and the one it
               passes on (8V more): 12V at the start of backward, whatever the activation dtype
               (the 16-bit logits and their fp32 copy are freed within forward)

This is Korthikanti et al.'s sbh(34 + 5as/h) ("Reducing Activation Recomputation in Large
Transformer Models", fp16 GPT) without dropout masks (the repo's models use none) and without
the 5as/h term: SDPA (flash or memory-efficient, on CPU and GPU) never materialises the s*s
attention scores. RoPE's cos/sin (per position, not per token) are left out: under 1%.

Peak: everything kept, plus the transient at the start of backward (the loss's 8V), or a
layer's backward transient if larger; measured on the tiny models at 0.15-0.31 of a layer's kept
bytes, bounded here by half of them (it matters only when V is below about a layer's width).
With full activation checkpointing (each layer recomputed in backward, torch.utils.checkpoint
or transformers' activation_checkpointing_enable) a layer keeps only its input (Bh) and the peak
is the larger of the loss's (final norm, loss 12V) and one layer recomputed with its backward
transient (1.5 x a layer's kept bytes), on top of every layer's input.

Measured against real forward + backward steps on CPU by bench/activation_memory.py ([Note:
measuring activations on CPU] in bench/_live_bytes.py). Not modelled: tensor and pipeline
parallelism (sequence/tensor-parallel split of activations, 1F1B's micro-batches in flight),
materialised attention (attn_implementation="eager"), and the allocator's fragmentation.
"""

from dataclasses import asdict, dataclass

ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
CHECKPOINTING = ("none", "full")
TOKEN_IDS_BYTES = 16  # int64 inputs and targets, per token


@dataclass(frozen=True)
class ActivationPlan:
    seq: int
    micro_batch: int
    dtype: str
    checkpointing: str
    layer_bytes_per_token: float  # kept by one layer without checkpointing
    kept_bytes_per_token: float  # kept for backward at the end of forward, all layers, head and loss
    peak_bytes_per_token: float  # the peak over forward and backward
    formula: str

    @property
    def tokens(self):
        return self.seq * self.micro_batch

    @property
    def saved_bytes(self):
        return self.kept_bytes_per_token * self.tokens

    @property
    def peak_bytes(self):
        return self.peak_bytes_per_token * self.tokens

    def to_dict(self):
        return dict(asdict(self), saved_bytes=self.saved_bytes, peak_bytes=self.peak_bytes)


def layer_bytes_per_token(arch, hidden, heads, ffn_hidden=None, kv_heads=None, dtype="bf16"):
    """Bytes one transformer layer keeps for backward per token ([Note: activation memory])."""
    B, h, a = ACT_BYTES[dtype], hidden, heads
    if arch == "gpt":
        f = ffn_hidden or 4 * h
        return B * (8 * h + 2 * f) + 4 * B + 4 * a
    kv = (kv_heads or heads) * (h // heads)
    return 2 * ((4 + 2 * B) * h + 4) + B * (2 * h + 2 * kv) + 4 * B * ffn_hidden + 4 * a


def activation_memory(*, arch, layers, hidden, heads, vocab, seq, micro_batch=1, ffn_hidden=None, kv_heads=None,
                      dtype="bf16", checkpointing="none") -> ActivationPlan:
    """Activation bytes of one micro-batch of `micro_batch` sequences of `seq` tokens through
    the whole model on one GPU (tp = pp = 1), as [Note: activation memory] counts them."""
    if arch not in ("gpt", "llama"):
        raise ValueError(f"arch must be 'gpt' or 'llama', got {arch!r}")
    if dtype not in ACT_BYTES:
        raise ValueError(f"unknown activation dtype {dtype!r}; choose one of {', '.join(ACT_BYTES)}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    for name, v in (("seq", seq), ("micro_batch", micro_batch), ("layers", layers), ("hidden", hidden),
                    ("heads", heads), ("vocab", vocab)):
        if v is None or v <= 0 or v != int(v):
            raise ValueError(f"{name} must be a whole number > 0, got {v!r}")
    if arch == "llama" and ffn_hidden is None:
        raise ValueError("arch='llama' needs ffn_hidden (the gated MLP's width)")
    B, h, V = ACT_BYTES[dtype], hidden, vocab
    layer = layer_bytes_per_token(arch, hidden, heads, ffn_hidden, kv_heads, dtype)
    final_norm = (2 * B * h + 2 * B if arch == "gpt" else (4 + 2 * B) * h + 4) + TOKEN_IDS_BYTES
    loss_kept, loss_peak = 4 * V, 12 * V
    if checkpointing == "none":
        kept = layers * layer + final_norm + loss_kept
        peak = kept + max(loss_peak - loss_kept, layer / 2)
        shape = f"{layers} x {layer:,.0f} (layer) + {final_norm:,.0f} (final norm, ids) + 12V = {12 * V:,} (loss)"
    else:
        kept = layers * B * h + final_norm + loss_kept
        peak = layers * B * h + max(final_norm + loss_peak, TOKEN_IDS_BYTES + 1.5 * layer)
        shape = (f"{layers} x {B * h:,} (layer inputs) + max({final_norm:,.0f} + 12V = {12 * V:,} (final norm, loss), "
                 f"{TOKEN_IDS_BYTES} + 1.5 x {layer:,.0f} (ids, one layer recomputed))")
    formula = f"activations per token, {dtype}, checkpointing {checkpointing}: {shape} = {peak:,.0f} bytes at the peak"
    return ActivationPlan(seq=int(seq), micro_batch=int(micro_batch), dtype=dtype, checkpointing=checkpointing,
                          layer_bytes_per_token=layer, kept_bytes_per_token=kept, peak_bytes_per_token=peak,
                          formula=formula)


def largest_tokens(room_bytes, peak_bytes_per_token):
    """The most tokens per micro-batch whose activations fit in `room_bytes` (0 if none)."""
    return max(0, int(room_bytes // peak_bytes_per_token))
