"""Rank functions for tests/zero/params/test_stage3.py: params sharded too, gathered unit by unit for the
forward and backward ([Note: stage-3 params] in zerokern/zero/params/per_unit.py)."""

import gc

import torch
from torch.utils.checkpoint import checkpoint

import zerokern
from numerics import abs_diff
from param_gather_workers import BATCH, V, TinyGPT, _data
from zerokern.zero.core.states import ParamState
from zerokern.zero.params.empty import held_shape


class CkptGPT(TinyGPT):
    """TinyGPT (tied head, a weight read without calling its module) whose blocks may run under
    activation checkpointing."""

    def __init__(self, layers, ckpt=None):
        super().__init__(layers)
        self.ckpt = ckpt  # None, "reentrant" or "non-reentrant"

    def forward(self, idx):
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]] + self.shift
        for k, b in enumerate(self.blocks):
            if k in self.skip:
                continue
            x = b(x) if self.ckpt is None else checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(self.ln_f(x))


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), idx[:, 1:].reshape(-1))


def _model(stage, layers, ckpt, dtype, cap_mb, reshard_after_forward=True, max_grad_norm=None, head_unit=False):
    """head_unit: the tied head is a unit of its own, so the root's embedding uses another unit's param."""
    torch.manual_seed(0)
    model = CkptGPT(layers, ckpt).to(dtype)
    kw = dict(stage=stage, bucket_cap_mb=cap_mb)
    if stage == 3:
        kw["reshard_after_forward"] = reshard_after_forward
    for b in model.blocks:
        zerokern.shard(b, **kw)
    if head_unit:
        zerokern.shard(model.head, **kw)
    zerokern.shard(model, **kw)
    return model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm)


def _full_params(model, opt):
    """Every param's full values (a stage-3 model is gathered for the read, then freed again)."""
    if opt.stage3 is not None:
        for up in _mine(opt):
            up.unshard()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    if opt.stage3 is not None:
        opt.stage3.reshard_all(opt.units)
    return out


def _step_with_reference(model, opt, ref, ref_opt, idx, rank):
    """One step of the sharded model on this rank's part of idx, and of the one-process reference
    on all of it."""
    opt.zero_grad()
    _loss(model, idx[rank * BATCH:(rank + 1) * BATCH]).backward()
    opt.step()
    ref_opt.zero_grad()
    _loss(ref, idx).backward()
    ref_opt.step()


def _mine(opt):
    """The stage-3 units of this optimizer (the runtime is shared by every model on the group)."""
    return [opt.stage3.of(u) for u in opt.units]


def _states(opt):
    return [up.state for up in _mine(opt)]


def train(rank, world, dtype="float32", ckpt=None, reshard_after_forward=True, accumulate=False,
          max_grad_norm=None, cap_mb=0.002, steps=10, layers=3, skip=(), head_unit=False):
    """Stage 3 against stage 2 on the same ranks (the same reductions and kernels: the same bits)
    and against torch.optim.AdamW on one process over the full batch. Also records what is
    gathered when: between steps nothing, during a block's forward at most the root, that block
    and the next (prefetched) one."""
    dtype = getattr(torch, dtype)
    other, other_opt = _model(3, layers, None, dtype, cap_mb)  # another stage-3 model on the same group,
    _loss(other, _data(0, 1)).backward()  # trained once and dropped: nothing may prefetch its units later
    other_opt.step()
    del other, other_opt
    gc.collect()
    runs = {s: _model(s, layers, ckpt, dtype, cap_mb, reshard_after_forward, max_grad_norm, head_unit)
            for s in (2, 3)}
    torch.manual_seed(0)
    ref = CkptGPT(layers)  # fp32, one process, the whole batch
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = runs[3]
    model.skip = ref.skip = runs[2][0].skip = set(skip)
    out = {"losses": {2: [], 3: []}, "gathered_in_block": [], "next_ready": [], "after_backward": [],
           "after_step": [], "param_shapes_between": None, "nbytes_between": [], "nbytes_full": None}
    units = _mine(opt)
    block_units = [next(up for up in units if up.unit.module() is b) for b in model.blocks]
    # one gather machine at every stage: stage 2's after-step gathers and stage 3's unit gathers
    out["gather_machines"] = {s: sorted({(type(b).__name__, b.frees) for b in bs}) for s, bs in (
        (2, runs[2][1].engine.param_gather.buckets), (3, [b for up in units for b in up.buckets]))}
    for k, b in enumerate(model.blocks):
        def look(*_, k=k):
            if torch._C._current_graph_task_id() != -1:
                return  # a recompute in backward
            out["gathered_in_block"].append(sum(up.state is not ParamState.SHARDED for up in units))
            if k + 1 < len(block_units) and k + 1 not in model.skip:
                out["next_ready"].append(block_units[k + 1].state is not ParamState.SHARDED)
        b.ln.register_forward_pre_hook(look)  # runs after the unit's own hook (registered on the block)
    # [Note: shapes between gathers]: the full shapes to Python, an empty tensor held
    out["param_shapes_between"] = sorted({tuple(p.shape) for p in model.parameters()})
    out["held_shapes_between"] = sorted({tuple(held_shape(p)) for p in model.parameters()})
    out["ref_shapes"] = sorted({tuple(p.shape) for p in ref.parameters()})
    for step in range(steps):
        idx = _data(step, world)
        mine = idx[rank * BATCH:(rank + 1) * BATCH]
        for s, (m, o) in runs.items():
            o.zero_grad()
            if accumulate:
                half = BATCH // 2 + 1
                with o.no_sync():
                    (_loss(m, mine[:half]) * half / BATCH).backward()
                loss = _loss(m, mine[half:]) * (BATCH - half) / BATCH
            else:
                loss = _loss(m, mine)
            loss.backward()
            if s == 3:
                out["after_backward"].append(all(st is ParamState.SHARDED for st in _states(o)))
            o.step()
            if s == 3:
                out["after_step"].append(all(st is ParamState.SHARDED for st in _states(o)))
                out["nbytes_between"].append(sum(up.nbytes() for up in units))
            out["losses"][s].append(loss.item())
        ref_opt.zero_grad()
        _loss(ref, idx).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        ref_opt.step()
    full2 = _full_params(*runs[2])
    out["nbytes_full"] = sum(p.numel() * p.element_size() for p in full2.values())
    # [Note: the stage-3 working set]: the root, the unit computing and the one prefetched
    block = sum(v.numel() * v.element_size() for k, v in full2.items() if k.startswith("blocks.0."))
    out["gathered_peak"], out["working_set"] = opt.stage3.peak_bytes, out["nbytes_full"] - (layers - 2) * block
    with torch.no_grad():  # evaluation: gathered for the forward, freed after it
        ev = {s: m(_data(99, 1)[:, :-1]) for s, (m, _) in runs.items()}
    out["eval_equal"] = torch.equal(ev[2], ev[3])
    out["after_eval"] = all(st is ParamState.SHARDED for st in _states(opt))
    p2, p3 = _full_params(*runs[2]), _full_params(*runs[3])
    out["equal_to_stage2"] = all(torch.equal(p2[k], p3[k]) for k in p2)
    out["losses_equal"] = out["losses"][2] == out["losses"][3]
    out["max_diff_ref"] = max(abs_diff(p3[k], v) for k, v in ref.named_parameters())
    return out


def scaler_overflow(rank, world):
    """fp16 params with torch.amp.GradScaler; an inf in rank 1's loss at step 2: every rank skips
    and backs off alike, and stage 3 gives stage 2's bits."""
    runs = {s: _model(s, 2, None, torch.float16, 0.002) for s in (2, 3)}
    scalers = {s: torch.amp.GradScaler("cpu", init_scale=1024.0) for s in runs}
    scales = {s: [] for s in runs}
    for step in range(5):
        idx = _data(step, world)[rank * BATCH:(rank + 1) * BATCH]
        for s, (m, o) in runs.items():
            o.zero_grad()
            loss = _loss(m, idx)
            if step == 2 and rank == 1:
                loss = loss * float("inf")
            scalers[s].scale(loss).backward()
            scalers[s].step(o)
            scalers[s].update()
            scales[s].append(scalers[s].get_scale())
    p2, p3 = _full_params(*runs[2]), _full_params(*runs[3])
    return {"scales": scales, "equal_to_stage2": all(torch.equal(p2[k], p3[k]) for k in p2),
            "finite": all(bool(torch.isfinite(v).all()) for v in p3.values())}


def errors(rank, world):
    """What stage 3 refuses, with the fix named, on every rank alike (nothing hangs)."""
    model, opt = _model(3, 1, None, torch.float32, 25.0)
    out = {}
    with torch.no_grad():
        model.blocks[0].fc1.weight.data = torch.zeros(2 * 16, 16)
    try:
        opt.step()
        out["replaced data"] = None
    except RuntimeError as e:
        out["replaced data"] = str(e)
    w = model.blocks[0].fc2.weight  # empty between gathers, its full shape to Python ([Note: shapes between gathers])
    out["empty_between"] = held_shape(w) == (0,) and w.shape == (16, 32)
    return out


def _init_root(model, tied_too=True):
    """init= for the root unit: its own params (wte/head tied, wpe, shift, ln_f)."""
    if tied_too:
        torch.nn.init.normal_(model.wte.weight, std=0.02)
    torch.nn.init.normal_(model.wpe.weight, std=0.02)
    torch.nn.init.zeros_(model.shift)
    model.ln_f.reset_parameters()


def meta_init(rank, world, head_unit=False, steps=4):
    """A model built on the meta device, sharded unit by unit: the ranks hold rank 0's initial
    values (reset_parameters() for the blocks, init= for the root, the head still tied), and it
    trains as torch.optim.AdamW on one process from those values."""
    torch.manual_seed(1234 + rank)  # different seeds: the values must come from rank 0
    with torch.device("meta"):
        model = CkptGPT(3)
    for b in model.blocks:
        zerokern.shard(b, stage=3, bucket_cap_mb=0.002)
    if head_unit:  # a unit of its own, tied to the root's embedding: sharded first, it initialises the tie
        zerokern.shard(model.head, stage=3, bucket_cap_mb=0.002,
                       init=lambda head: torch.nn.init.normal_(head.weight, std=0.02))
    zerokern.shard(model, stage=3, bucket_cap_mb=0.002, init=lambda m: _init_root(m, tied_too=not head_unit))
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    out = {"meta_left": [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                         if t.device.type == "meta"],
           "tied": model.head.weight is model.wte.weight}
    start = _full_params(model, opt)
    out["start"] = {k: v for k, v in start.items() if k in ("blocks.0.fc1.weight", "wte.weight", "shift")}
    out["ln_ones"] = bool((start["blocks.1.ln.weight"] == 1).all() and (start["ln_f.weight"] == 1).all())
    bound = 1 / 16 ** 0.5  # nn.Linear(16, 32)'s kaiming-uniform bound
    w = start["blocks.0.fc1.weight"]
    out["linear_in_bound"] = bool((w.abs() <= bound).all() and w.std() > bound / 4)
    ref = CkptGPT(3)
    ref.load_state_dict(start, strict=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(steps):
        _step_with_reference(model, opt, ref, ref_opt, _data(step, world), rank)
    end = _full_params(model, opt)
    out["max_diff_ref"] = max(abs_diff(end[k], v) for k, v in ref.named_parameters())
    return out


class WideBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


class WideNet(torch.nn.Module):
    def __init__(self, d, layers, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(WideBlock(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _peak_rss():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def too_large_for_one_rank(rank, world, d=512, layers=16, vocab=2048, steps=3):
    """A model whose training state (16 bytes/param with Adam in fp32) is over the per-rank budget
    trains at stage 3 from a meta-device init; the process's peak resident memory (getrusage:
    what the OS counted, allocator slack included) grows by less than the budget. Also the peak
    while materialising stays under the size of the whole model's params."""
    base = _peak_rss()
    with torch.device("meta"):
        model = WideNet(d, layers, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    for b in model.blocks:
        zerokern.shard(b, stage=3)
    zerokern.shard(model, stage=3)
    after_init = _peak_rss() - base
    opt = zerokern.FusedZeroAdam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (2, 33), generator=g)
        opt.zero_grad()
        logits = model(idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"n_params": n_params, "after_init": after_init, "peak": _peak_rss() - base, "losses": losses,
            "report": opt.memory_report()}


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise KeyboardInterrupt("a backward cut short")  # not an Exception subclass: nothing swallows it


class _Borrowing(torch.nn.Module):
    """A block whose forward also calls another unit's Linear (held in a list: not a submodule)."""

    def __init__(self, block, lender):
        super().__init__()
        self.block, self._lender = block, [lender]

    def forward(self, x):
        return self.block(x) + self._lender[0](x)[..., :x.shape[-1]]


def interrupted_and_borrowed(rank, world, steps=4):
    """Stage 3 against stage 2 (the same bits) when (a) a backward raises part-way and the same
    batch is run again, and (b) a unit's forward calls a Linear of another unit."""
    runs = {}
    for s in (2, 3):
        torch.manual_seed(0)
        model = CkptGPT(3)
        kw = dict(stage=s, bucket_cap_mb=0.002)
        for b in model.blocks:
            zerokern.shard(b, **kw)
        model.blocks[2] = _Borrowing(model.blocks[2], model.blocks[0].fc1)  # block 2 also runs block 0's fc1
        zerokern.shard(model, **kw)
        runs[s] = (model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01))
    armed = {"on": False}
    for m, _ in runs.values():
        m.blocks[1].register_forward_hook(lambda mod, a, out: _RaiseInBackward.apply(out) if armed["on"] else out)
    losses = {2: [], 3: []}
    for step in range(steps):
        idx = _data(step, world)[rank * BATCH:(rank + 1) * BATCH]
        for s, (m, o) in runs.items():
            o.zero_grad()
            if step == 1:
                armed["on"] = True
                try:
                    _loss(m, idx).backward()
                except KeyboardInterrupt:
                    pass
                armed["on"] = False
                o.zero_grad()
            loss = _loss(m, idx)
            loss.backward()
            o.step()
            losses[s].append(loss.item())
    p2, p3 = _full_params(*runs[2]), _full_params(*runs[3])
    return {"losses_equal": losses[2] == losses[3], "equal_to_stage2": all(torch.equal(p2[k], p3[k]) for k in p2)}


def refusals_after_shard(rank, world):
    """Changing a param in place between steps, and freezing one after shard(): errors naming it."""
    out = {}
    model, opt = _model(3, 1, None, torch.float32, 25.0)
    _loss(model, _data(0, 1)).backward()
    opt.step()
    try:
        with torch.no_grad():
            model.blocks[0].fc1.weight.clamp_(-0.01, 0.01)  # a WGAN-style clip between steps
        out["clamp"] = None
    except RuntimeError as e:  # the param refuses it ([Note: reads between gathers])
        out["clamp"] = str(e)
    with torch.no_grad():  # a write no __torch_function__ sees (the version counter does): at the next gather
        torch.Tensor.clamp_(model.blocks[0].fc1.weight.as_subclass(torch.Tensor), -0.01, 0.01)
    for what, call in (("step", opt.step), ("forward", lambda: _loss(model, _data(1, 1)))):
        try:
            call()
            out[what] = None
        except RuntimeError as e:
            out[what] = str(e)
    torch.manual_seed(0)
    m2 = CkptGPT(1)
    for b in m2.blocks:
        zerokern.shard(b, stage=3)
    zerokern.shard(m2, stage=3)
    m2.blocks[0].fc2.bias.requires_grad_(False)
    try:
        zerokern.FusedZeroAdam(m2.parameters())
        out["frozen"] = None
    except ValueError as e:
        out["frozen"] = str(e)
    return out


class _FrozenNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.ones(8))


def meta_frozen_and_retry(rank, world):
    """A meta init drawn from each rank's own seed: frozen params and buffers take rank 0's values
    too. And shard() called again after its own init error starts from the meta tensors."""
    torch.manual_seed(rank)
    with torch.device("meta"):
        m = _FrozenNet()
    zerokern.shard(m, stage=3, init=lambda mod: (mod.fc.reset_parameters(), mod.frozen.reset_parameters(),
                                                 mod.scale.uniform_()))  # each rank draws its own
    got = {"frozen": m.frozen.weight.detach().clone(), "scale": m.scale.clone()}
    with torch.device("meta"):
        mha = torch.nn.Sequential(torch.nn.MultiheadAttention(8, 2))
    try:
        zerokern.shard(mha, stage=3)  # in_proj_weight: MultiheadAttention has no reset_parameters()
        got["first_error"] = None
    except ValueError as e:
        got["first_error"] = str(e)
    got["back_on_meta"] = mha[0].in_proj_weight.device.type == "meta"
    zerokern.shard(mha, stage=3, init=lambda s: (s[0]._reset_parameters(), s[0].out_proj.reset_parameters()))
    opt = zerokern.FusedZeroAdam(list(m.parameters()) + list(mha.parameters()))
    full = _full_params(mha, opt)
    got["mha_finite"] = all(bool(torch.isfinite(v).all()) for v in full.values())
    return got


def mismatched_shard(rank, world):
    """One rank shards with other options, or a block of another width: every rank raises."""
    out = {}
    torch.manual_seed(0)
    try:
        zerokern.shard(torch.nn.Linear(8, 8), stage=3, bucket_cap_mb=1.0 + rank)
        out["options"] = None
    except ValueError as e:
        out["options"] = str(e)
    try:
        zerokern.shard(torch.nn.Linear(8, 8 + rank), stage=3)
        out["shapes"] = None
    except ValueError as e:
        out["shapes"] = str(e)
    return out


def skipped_shard(rank, world):
    """Rank 1 skips the shard() of a block that rank 0 makes: their agreements pair up unlike
    calls, and every rank raises, saying what each was doing (no hang, no unpacking error)."""
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    try:
        if rank == 0:
            zerokern.shard(seq[0], stage=3)
        zerokern.shard(seq, stage=3)
    except RuntimeError as e:
        return str(e)
    return None


def dropped_model_is_freed(rank, world):
    """A stage-3 model and its optimizer, trained and dropped, are garbage collected (nothing
    keeps their buckets: the param hooks hold their unit weakly)."""
    import weakref

    model, opt = _model(3, 2, None, torch.float32, 0.002)
    _loss(model, _data(0, 1)).backward()
    opt.step()
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model.blocks[0].fc1.weight)]
    del model, opt
    gc.collect()
    return [r() is None for r in refs]


def two_models(rank, world, steps=4, interleaved=False):
    """Two stage-3 models on one process group, each with its own optimizer, trained in turn
    (interleaved: both forwards before either backward), each against its own one-process AdamW."""
    nets, refs = [], []
    for seed, layers in ((0, 2), (1, 3)):
        torch.manual_seed(seed)
        ref = CkptGPT(layers)
        refs.append((ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)))
        torch.manual_seed(seed)
        model = CkptGPT(layers)
        for b in model.blocks:
            zerokern.shard(b, stage=3, bucket_cap_mb=0.002)
        zerokern.shard(model, stage=3, bucket_cap_mb=0.002)
        nets.append((model, zerokern.FusedZeroAdam(model.parameters(), lr=1e-2, weight_decay=0.01)))
    for step in range(steps):
        idx = _data(step, world)
        mine = idx[rank * BATCH:(rank + 1) * BATCH]
        for o in (o for _, o in nets):
            o.zero_grad()
        if interleaved:
            losses = [_loss(m, mine) for m, _ in nets]
            for loss in losses:
                loss.backward()
            for _, o in nets:
                o.step()
        else:
            for m, o in nets:
                _loss(m, mine).backward()
                o.step()
        for ref, ref_opt in refs:
            ref_opt.zero_grad()
            _loss(ref, idx).backward()
            ref_opt.step()
    diffs, units, orders = [], [], []
    for (model, opt), (ref, _) in zip(nets, refs):
        full = _full_params(model, opt)
        diffs.append(max(abs_diff(full[k], v) for k, v in ref.named_parameters()))
        # the runtime each optimizer owns holds its own model's units, in its own forward order
        mine = {id(u) for u in opt.units}
        units.append(sorted(("mine" if id(up.unit) in mine else "other's", up.name) for up in opt.stage3.units))
        orders.append([r().name for r in opt.stage3.order])
    return {"diffs": diffs, "units": units, "orders": orders, "shared": nets[0][1].stage3 is nets[1][1].stage3}


def rebuilt_optimizer(rank, world, steps=2):
    """A stage-3 model's optimizer dropped and a new one built (a new learning-rate phase): trains
    as torch's AdamW rebuilt at the same point, on one process over the full batch."""
    torch.manual_seed(0)
    ref = CkptGPT(2)
    torch.manual_seed(0)
    model = CkptGPT(2)
    for b in model.blocks:
        zerokern.shard(b, stage=3, bucket_cap_mb=0.002)
    zerokern.shard(model, stage=3, bucket_cap_mb=0.002)
    for phase, lr in enumerate((1e-2, 3e-3)):
        opt = zerokern.FusedZeroAdam(model.parameters(), lr=lr, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
        for step in range(steps):
            _step_with_reference(model, opt, ref, ref_opt, _data(10 * phase + step, world), rank)
        if phase == 0:
            try:  # the first optimizer is still alive: the error says how to release the units
                zerokern.FusedZeroAdam(model.parameters(), lr=lr)
                alive_error = None
            except ValueError as e:
                alive_error = str(e)
            del opt
            gc.collect()
    full = _full_params(model, opt)
    return {"alive_error": alive_error, "diff": max(abs_diff(full[k], v) for k, v in ref.named_parameters())}
