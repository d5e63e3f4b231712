"""Rank bodies of test_zero_muon_count.py (issue 51 item 8, no silent SGD): how many times
Newton-Schulz ran on each rank in each optimizer step, counted in torch's own Muon, when a
GradScaler skips a step and under no_sync accumulation. The model, its optimizer and the
one-process reference are muon_units_workers.py's; every rank on the same batch."""

import torch

import muon_units_workers as w
import zerokern
from matrix_helpers import CountNS

BAD = 1  # the step whose grads hold an inf on rank 1 only


def _how(stage):
    return "list" if stage == 3 else "optimizer"


def _owned(opt):
    """The matrices (trainable indices) whose whole piece this rank holds: the ones it steps."""
    return sorted(t for t, piece in opt._piece.items() if t in opt._whole and piece.numel())


def _state(opt):
    """The optimizer's state dict tensors (a collective: Muon's momentum from its owners), copied, and
    this rank's fp32 masters (fp16 params: what the step changes; the params are its rounding)."""
    state = {(k, key): v.clone() for k, st in opt.state_dict()["state"].items() for key, v in st.items()
             if isinstance(v, torch.Tensor)}
    return {**state, **{("master", s): store.master.clone() for s, store in enumerate(opt.engine.stores)}}


def _master_diff(model, opt, ref, ref_opt):
    """max |zerokern's fp32 master - the reference's| over the pieces this rank holds (each piece the
    flattened param's [start, start + n)); model and ref alike, so a param's name finds its master."""
    masters = dict(zip((n for n, _ in ref.named_parameters()), ref_opt.masters))
    name = {id(p): n for n, p in model.named_parameters()}
    worst = 0.0
    for t, piece in opt._piece.items():
        _, _, n, start = opt._where[t]
        if n:
            want = masters[name[id(opt._member(t)[0])]].detach().reshape(-1)[start:start + n]
            worst = max(worst, (piece.reshape(-1) - want).abs().max().item())
    return worst


def scaler_skip(rank, world, stage, dtype=torch.float32, steps=4):
    """torch.amp.GradScaler on dtype params (fp32, or fp16 trained through zerokern's fp32 masters); at step BAD an inf reaches one element of
    blocks.0.up.weight's grad on rank 1 only (from a forward hook, so at stage 3 too; the plan gives
    that matrix to rank 0 at stages 1-2 and to rank 1 at stage 3, so the inf reaches another rank's
    matrix in one case and its own in the other: the test prints the owners). Returns per
    step: (NS calls, matrices_stepped's increase, the scale after update(), whether the params
    changed, whether the optimizer state or a master changed); the owned matrices; the params' and
    momentum's max diff from one-process Muon + AdamW on fp32 masters that skipped step BAD; the full
    params; the masters' max diff from the reference's."""
    counter = CountNS()
    try:
        model, opt = w._built(stage, None, dtype, _how(stage), False)
        ref = w._net(dtype)
        ref_opt = w._Reference(ref)  # fp16: steps fp32 masters, the params their rounding, as zerokern
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        poison = []
        bad = 0.0
        # inf x one weight element: the loss and that element's grad are inf, every other grad finite
        model.blocks[0].up.register_forward_hook(lambda mod, inp, out: poison.append(mod.weight[0, 0] * bad))
        log = []
        for t, x in enumerate(w._batches()[:steps]):
            bad = float("inf") if t == BAD and rank == 1 else 0.0
            before, state = zerokern.full_state_dict(model, rank0_only=False), _state(opt)
            stepped = opt.matrices_stepped
            opt.zero_grad()
            poison.clear()
            used = scaler.get_scale()
            scaler.scale(model(x) + poison[0]).backward()
            calls = counter.step(lambda: scaler.step(opt))
            scaler.update()
            after, state_after = zerokern.full_state_dict(model, rank0_only=False), _state(opt)
            log.append((calls, opt.matrices_stepped - stepped, scaler.get_scale(),
                        any(not torch.equal(before[n], after[n]) for n in before),
                        state.keys() != state_after.keys() or any(not torch.equal(v, state_after[k])
                                                                  for k, v in state.items())))
            if t != BAD:
                ref_opt.zero_grad()
                (ref(x) * used).backward()
                ref_opt.step(used)
        return (log, _owned(opt), *_against(model, opt, ref, ref_opt), _master_diff(model, opt, ref, ref_opt))
    finally:
        counter.close()


def _against(model, opt, ref, ref_opt):
    """The params' and momentum's max diff from the one-process reference, and the full params."""
    full = zerokern.full_state_dict(model, rank0_only=False)
    diff = max((full[n].float() - q.float()).abs().max().item() for n, q in ref.state_dict().items())
    sd = opt.state_dict()
    mom = max((sd["state"][k]["momentum_buffer"] - st["momentum_buffer"]).abs().max().item()
              for k, st in ref_opt.opts[0].state_dict()["state"].items())
    return diff, mom, full


def accumulate(rank, world, stage=3, steps=5, micro=2):
    """micro micro-batches an optimizer step, all but the last under opt.no_sync(), against
    one-process Muon + AdamW accumulating the same micro-batches. Returns per step (NS calls,
    matrices_stepped's increase), the owned matrices, the params' and momentum's max diff, and the
    full params."""
    counter = CountNS()
    try:
        model, opt = w._built(stage, None, torch.float32, _how(stage), False)
        ref = w._net(torch.float32)
        ref_opt = w._Reference(ref)
        xs = w._batches()[:steps * micro]
        log = []
        for k in range(0, len(xs), micro):
            ref_opt.zero_grad()
            opt.zero_grad()
            for j, x in enumerate(xs[k:k + micro]):
                (ref(x) / micro).backward()
                if j < micro - 1:
                    with opt.no_sync():
                        (model(x) / micro).backward()
                else:
                    (model(x) / micro).backward()
            ref_opt.step()
            stepped = opt.matrices_stepped
            log.append((counter.step(opt.step), opt.matrices_stepped - stepped))
        return (log, _owned(opt), *_against(model, opt, ref, ref_opt))
    finally:
        counter.close()
