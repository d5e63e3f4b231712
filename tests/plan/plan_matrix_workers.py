"""Per-rank bodies of test_plan_matrix.py's runtime checks: a tiny GPT registered in the order the
planner's model_shapes("gpt") lists its tensors, a real ZeroOptimizer (Muon on the blocks'
matrices, AdamW on the rest) stepped once, and the bytes of the optimizer state it then holds."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import zerokern

# the planner's shape arguments, and the model built from them
SHAPE = dict(layers=2, hidden=64, heads=2, vocab=96)
SEQ = 8


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        # registration order = model_shapes' per layer: ln1, qkv, proj, ln2, fc1, fc2 (weight, bias each)
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """The planner's GPT (zerokern/plan/model.py): tied embedding and head, no position table."""

    def __init__(self, layers, hidden, heads, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.emb.weight)


def hidden_matrices(model):
    """Muon's group: the blocks' 2-D weights, as model_shapes picks them."""
    return [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]


def state_bytes(precision, stage=2, bucket_cap_mb=0.05, units=True, dtype=torch.float32, rank=0, world=1):
    """Train a TinyGPT one step with ZeroOptimizer, the Muon group's momentum in `precision`, and
    return this rank's state as {"per_element": bytes of its state tensors of one or more
    dimensions, "scalars": (key, bytes) of its 0-dim ones, "matrices": names of the matrices it
    owns}. units: zerokern.shard(model) first, so the layout follows the model's registration
    order (the planner's); else the optimizer buckets the params in its param groups' order."""
    torch.manual_seed(0)
    model = TinyGPT(**SHAPE).to(dtype)
    hidden = hidden_matrices(model)
    names = {p: n for n, p in model.named_parameters()}
    if units:
        zerokern.shard(model, stage=stage, bucket_cap_mb=bucket_cap_mb, matrices=hidden)
        sharding = {}
    else:
        sharding = dict(zero_stage=stage, bucket_cap_mb=bucket_cap_mb)
    rest = [p for p in model.parameters() if all(p is not q for q in hidden)]
    opt = zerokern.ZeroOptimizer(
        [{"params": hidden, "optimizer": torch.optim.Muon, "lr": 0.02, "state_precision": precision},
         {"params": rest}], torch.optim.AdamW, lr=1e-3, **sharding)
    g = torch.Generator().manual_seed(1 + rank)
    idx = torch.randint(0, SHAPE["vocab"], (2, SEQ + 1), generator=g)
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.float().reshape(-1, SHAPE["vocab"]), idx[:, 1:].reshape(-1)).backward()
    opt.step()
    per_element, scalars = 0, []
    for p, st in opt.state.items():
        for key, v in st.items():
            if not torch.is_tensor(v):
                continue
            if v.dim():
                per_element += v.numel() * v.element_size()
            else:
                scalars.append((key, v.numel() * v.element_size()))
    return {"per_element": per_element, "scalars": scalars,
            "matrices": sorted(names[p] for p in hidden if opt.state.get(p))}


def ranks(rank, world, cases):
    """state_bytes for each case (precision, kwargs) on this rank."""
    return [state_bytes(precision, rank=rank, world=world, **kw) for precision, kw in cases]
