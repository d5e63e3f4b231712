"""Rank bodies of test_zero_muon_count.py (issue 51 item 8, no silent SGD): how many times
Newton-Schulz ran on each rank in each optimizer step, counted in torch's own Muon, when a
GradScaler skips a step, under no_sync accumulation, and both (the inf in a no_sync
micro-batch). The model, its optimizer and the one-process reference are muon_units_workers.py's;
every rank on the same batch."""

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


def _poisoned(model, rank):
    """A forward hook on blocks.0.up that adds inf x one weight element to the loss on rank 1 when
    armed (returned: arm(bool), and the term to add to the loss after each forward): the loss and
    that element's grad are inf, every other grad finite. A forward hook, so at stage 3 too."""
    term, armed = [], [False]
    model.blocks[0].up.register_forward_hook(
        lambda mod, inp, out: term.append(mod.weight[0, 0] * (float("inf") if armed[0] and rank == 1 else 0.0)))

    def arm(on):
        armed[0] = on
        term.clear()

    return arm, lambda: term[0]


def _snapshot(model, opt):
    """The full params and the optimizer's state and masters (_state), to see what a step changed."""
    return zerokern.full_state_dict(model, rank0_only=False), _state(opt)


def _changed(before, after):
    """(whether a param changed, whether the optimizer state or a master changed) between snapshots."""
    (params, state), (params_after, state_after) = before, after
    return (any(not torch.equal(params[n], params_after[n]) for n in params),
            state.keys() != state_after.keys() or any(not torch.equal(v, state_after[k]) for k, v in state.items()))


def scaler_skip(rank, world, stage, dtype=torch.float32, steps=4):
    """torch.amp.GradScaler on dtype params (fp32, or fp16 trained through zerokern's fp32 masters);
    at step BAD an inf reaches one element of blocks.0.up.weight's grad on rank 1 only (_poisoned:
    from a forward hook, so at stage 3 too; the plan gives that matrix to rank 0 at stages 1-2 and
    to rank 1 at stage 3, so the inf reaches another rank's matrix in one case and its own in the
    other: the test prints the owners). Returns per step: (NS calls, matrices_stepped's increase,
    the scale after update(), whether the params changed, whether the optimizer state or a master
    changed); the owned matrices; the params' and
    momentum's max diff from one-process Muon + AdamW on fp32 masters that skipped step BAD; the full
    params; the masters' max diff from the reference's."""
    counter = CountNS()
    try:
        model, opt = w._built(stage, None, dtype, _how(stage), False)
        ref = w._net(dtype)
        ref_opt = w._Reference(ref)  # fp16: steps fp32 masters, the params their rounding, as zerokern
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        arm, poison = _poisoned(model, rank)
        log = []
        for t, x in enumerate(w._batches()[:steps]):
            arm(t == BAD)
            before = _snapshot(model, opt)
            stepped = opt.matrices_stepped
            opt.zero_grad()
            used = scaler.get_scale()
            scaler.scale(model(x) + poison()).backward()
            calls = counter.step(lambda: scaler.step(opt))
            scaler.update()
            log.append((calls, opt.matrices_stepped - stepped, scaler.get_scale(),
                        *_changed(before, _snapshot(model, opt))))
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


def accumulate(rank, world, stage=3, steps=5, micro=2, dtype=torch.float32, scaler=False):
    """micro micro-batches an optimizer step, all but the last under opt.no_sync(), against
    one-process Muon + AdamW accumulating the same micro-batches. scaler: through a
    torch.amp.GradScaler, and at step BAD an inf reaches blocks.0.up.weight's grad on rank 1 in the
    first micro-batch only, under no_sync (_poisoned): only rank 1's local accumulation holds it
    until the synced micro-batch, and every rank must skip the step; the reference skips it.
    Returns per step (NS calls, matrices_stepped's increase; with scaler also the scale after
    update(), whether the params changed, whether the optimizer state or a master changed), the
    owned matrices, the params' and momentum's max diff, the full params, and (scaler) the fp32
    masters' max diff from the reference's."""
    counter = CountNS()
    try:
        model, opt = w._built(stage, None, dtype, _how(stage), False)
        ref = w._net(dtype)
        ref_opt = w._Reference(ref)
        amp = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaler)
        arm, poison = _poisoned(model, rank)
        xs = w._batches()[:steps * micro]
        log = []
        for t, k in enumerate(range(0, len(xs), micro)):
            before = _snapshot(model, opt) if scaler else None
            used = amp.get_scale() if scaler else 1.0
            ref_opt.zero_grad()
            opt.zero_grad()
            for j, x in enumerate(xs[k:k + micro]):
                (ref(x) * used / micro).backward()
                arm(scaler and t == BAD and j == 0)
                if j < micro - 1:
                    with opt.no_sync():
                        amp.scale(model(x) / micro + poison()).backward()
                else:
                    amp.scale(model(x) / micro + poison()).backward()
            if not (scaler and t == BAD):
                ref_opt.step(used if scaler else None)
            stepped = opt.matrices_stepped
            entry = (counter.step(lambda: amp.step(opt)), opt.matrices_stepped - stepped)
            if scaler:
                amp.update()
                entry += (amp.get_scale(), *_changed(before, _snapshot(model, opt)))
            log.append(entry)
        masters = (_master_diff(model, opt, ref, ref_opt),) if scaler else ()
        return (log, _owned(opt), *_against(model, opt, ref, ref_opt), *masters)
    finally:
        counter.close()
