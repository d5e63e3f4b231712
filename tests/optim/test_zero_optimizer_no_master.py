"""ZeroOptimizer(..., master_weights=False) ([Note: bf16 params without masters] in
zerokern/optim/no_master.py): bf16 params with no fp32 master, the inner torch optimizers stepping
the bf16 shards. With every rank on the same batch the params and state are those of the same
torch optimizers on a one-process bf16 model, bit for bit: one process at stages 1-3, 2 ranks at
stage 2 and stage 3 (shard(matrices=...) units), Muon + AdamW (Adafactor + AdamW on one
process). No store holds an fp32 master;
the state is bf16, as torch keeps it; the state dict loads into torch's optimizers. Other dtypes,
offload, int8 momentum and quantized gathers are refused by name."""

import copy

import pytest
import torch
import torch.nn as nn

import dist_harness
import zerokern

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

STEPS = 5
MUON = dict(lr=0.02, momentum=0.9, weight_decay=0.01)
# lr 1e-2 so AdamW's steps are above half a bf16 ulp of the biases: the params move, and a master
# would matter ([Note: bf16 params without masters]: smaller steps round away without one)
ADAMW = dict(lr=1e-2, weight_decay=0.01)


def _net(dtype=torch.bfloat16):
    torch.manual_seed(3)
    # 4 matrices, odd and rectangular both ways, in two blocks (stage 3's units: each keeps one
    # matrix on each of 2 ranks); 4 biases for AdamW
    return nn.Sequential(nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 12), nn.Tanh()),
                         nn.Sequential(nn.Linear(12, 19), nn.Tanh(), nn.Linear(19, 5))).to(dtype)


def _groups(model):
    """Muon on the weights, AdamW (the default class) on the biases."""
    hidden = [p for p in model.parameters() if p.dim() == 2]
    return [{"params": hidden, "optimizer": torch.optim.Muon, **MUON},
            {"params": [p for p in model.parameters() if p.dim() != 2], **ADAMW}]


def _torch(model):
    g = _groups(model)
    return [torch.optim.Muon(g[0]["params"], **MUON), torch.optim.AdamW(g[1]["params"], **ADAMW)]


def _built(model, stage, **options):
    """ZeroOptimizer over model; stage 3: each block a unit that keeps its weights whole, then the root."""
    if stage == 3:
        hidden = _groups(model)[0]["params"]
        for block in model:
            zerokern.shard(block, stage=3, matrices=hidden, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, matrices=hidden, bucket_cap_mb=1e-4)
        return zerokern.ZeroOptimizer(_groups(model), torch.optim.AdamW, **options)
    return zerokern.ZeroOptimizer(_groups(model), torch.optim.AdamW, zero_stage=stage, bucket_cap_mb=1e-4, **options)


def _batches():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(16, 7, generator=g).to(torch.bfloat16) for _ in range(STEPS)]


def _clip_as_zerokern(params, max_norm):
    """The clip ZeroOptimizer applies ([Note: bf16 params without masters]): the norm in fp32 over
    the bf16 grads, the grads divided in fp32 and rounded to bf16 once."""
    norm = torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]).double().pow(2).sum().sqrt()
    divisor = 1 / torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)
    for p in params:
        p.grad = (p.grad.float() / divisor).to(p.dtype)


def _train(model, opts, clip=None):
    for x in _batches():
        for o in opts:
            o.zero_grad()
        model(x).float().square().mean().backward()
        if clip is not None and not isinstance(opts[0], zerokern.ZeroOptimizer):
            _clip_as_zerokern(list(model.parameters()), clip)
        for o in opts:
            o.step()


def _diff(model, ref):
    """max |param - reference| over the full params (stage 3 gathers them: between forwards a
    rank holds its shards only)."""
    full = zerokern.full_state_dict(model, rank0_only=False)
    return max((full[n].float() - q.float()).abs().max().item() for n, q in ref.state_dict().items())


def _keeps_no_master(opt):
    """Every store's master is the bf16 param shard itself (the same memory), none is fp32, and
    every per-element state tensor is bf16: what master_weights=False promises."""
    stores = opt.engine.stores
    masters = all(not s.separate_master and s.master.dtype == torch.bfloat16
                  and s.master.data_ptr() == s.param_shard().data_ptr() for s in stores)
    state = [v for st in opt.inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    return masters and opt.memory_report()["master_params"] == 0 and all(v.dtype == torch.bfloat16 for v in state)


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_is_torch_on_a_bf16_model_bit_for_bit(stage, clip):
    ref = _net()
    model, kept = copy.deepcopy(ref), copy.deepcopy(ref)
    opt = _built(model, stage, master_weights=False, max_grad_norm=clip)
    _train(ref, _torch(ref), clip)
    _train(model, [opt], clip)
    assert _diff(model, ref) == 0.0, "params from one-process torch on bf16"
    assert opt.matrices_stepped == STEPS * 4
    assert _keeps_no_master(opt)
    # the oracle can tell: with fp32 masters the same run gives other params
    with_masters = _built(kept, stage, max_grad_norm=clip)
    _train(kept, [with_masters], clip)
    assert _diff(kept, ref) > 0.0 and any(s.separate_master for s in with_masters.engine.stores)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is torch 2.5+")
def test_adafactor_groups_too():
    """Adafactor (each param whole on its owner) + AdamW without masters: torch's on bf16, its
    row and column variances in bf16 as torch keeps them."""
    ref = _net()
    model = copy.deepcopy(ref)

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() == 2], "optimizer": torch.optim.Adafactor,
                 "lr": 0.01}, {"params": [p for p in m.parameters() if p.dim() != 2], **ADAMW}]
    g = groups(ref)
    _train(ref, [torch.optim.Adafactor(g[0]["params"], lr=0.01), torch.optim.AdamW(g[1]["params"], **ADAMW)])
    opt = zerokern.ZeroOptimizer(groups(model), torch.optim.AdamW, zero_stage=2, bucket_cap_mb=1e-4,
                                 master_weights=False)
    _train(model, [opt])
    assert _diff(model, ref) == 0.0
    assert _keeps_no_master(opt) and opt.matrices_stepped == STEPS * 4
    assert all(opt.state[p]["row_var"].dtype == torch.bfloat16 for p in groups(model)[0]["params"])


def test_the_state_dict_is_torch_s_and_loads_both_ways():
    """After 3 steps torch's Muon and AdamW load ZeroOptimizer's dict (bf16 state, torch's
    dtypes) and ZeroOptimizer loads torch's; all three then take the same 2 next steps."""
    xs = _batches()
    ref = _net()
    model = copy.deepcopy(ref)
    ref_opts, opt = _torch(ref), _built(model, 2, master_weights=False)
    for x in xs[:3]:
        for m, os in ((ref, ref_opts), (model, [opt])):
            for o in os:
                o.zero_grad()
            m(x).float().square().mean().backward()
            for o in os:
                o.step()
    sd = copy.deepcopy(opt.state_dict())  # torch keeps the tensors it is given
    theirs = [o.state_dict()["state"] for o in ref_opts]
    params = [p for g in _groups(model) for p in g["params"]]
    back = copy.deepcopy(ref)
    back_opts = _torch(back)
    first = 0
    for o, st in zip(back_opts, theirs):
        own = {}
        for i in range(len(st)):
            # one process: AdamW's pieces are the flattened params; torch keeps the param's shape
            own[i] = {k: v.view(params[first + i].shape) if v.dim() == 1 and v.numel() == params[first + i].numel()
                      else v for k, v in sd["state"][first + i].items()}
            for k, v in own[i].items():
                assert v.dtype == st[i][k].dtype and torch.equal(v, st[i][k]), (first + i, k)
        o.load_state_dict({"state": own, "param_groups": [{**o.param_groups[0], "params": list(range(len(st)))}]})
        first += len(st)
    again = copy.deepcopy(ref)
    again_opt = _built(again, 2, master_weights=False)
    merged = {k: st for k, st in enumerate(s for t in theirs for s in t.values())}
    again_opt.load_state_dict({"state": copy.deepcopy(merged), "param_groups": sd["param_groups"]})
    for m, os in ((ref, ref_opts), (model, [opt]), (back, back_opts), (again, [again_opt])):
        for x in xs[3:]:
            for o in os:
                o.zero_grad()
            m(x).float().square().mean().backward()
            for o in os:
                o.step()
    for m in (model, back, again):
        assert _diff(m, ref) == 0.0
    assert _keeps_no_master(again_opt)


def _fp32_bias():
    model = _net()
    model[0][2].bias.data = model[0][2].bias.data.float()  # a norm or bias kept in fp32
    return model


@pytest.mark.parametrize("make, options, error, match", [
    (lambda: _net(torch.float32), {}, ValueError, r"zerokern: 0\.0\.weight is float32: fp32 params are their own"),
    (_fp32_bias, {}, ValueError, r"zerokern: 0\.2\.bias is float32"),
    (lambda: _net(torch.float16), {}, ValueError, r"zerokern: 0\.0\.weight is float16: master_weights=False is for"),
    (_net, {"offload": zerokern.OffloadPolicy(device="cpu")}, ValueError,
     r"master_weights=False\) with OffloadPolicy\(device='cpu'\) is not offered yet"),
    (_net, {"rounding_seed": 3}, ValueError, r"rounding_seed is FusedZeroAdam's"),
    (_net, {"int8": True}, ValueError, r"param group 0 has state_precision='int8' and master_weights=False"),
])
def test_what_it_does_not_take_is_refused_by_name(make, options, error, match):
    model = make()
    groups = [{**g, "params": [(n, p) for n, p in model.named_parameters() if any(p is q for q in g["params"])]}
              for g in _groups(model)]
    if options.pop("int8", False):
        groups[0]["state_precision"] = "int8"
    with pytest.raises(error, match=match):
        zerokern.ZeroOptimizer(groups, torch.optim.AdamW, zero_stage=2, master_weights=False, **options)


def test_master_weights_must_be_a_bool():
    with pytest.raises(TypeError, match=r"master_weights must be True or False, got 'no'"):
        zerokern.ZeroOptimizer(_groups(_net()), torch.optim.AdamW, master_weights="no")


def _two_ranks(rank, world):
    """Stage 2 (the optimizer's layout) and stage 3 (units), every rank on the same batch: torch's
    params and Muon momentum bit for bit, the stores without masters; then quantized gathers,
    refused on every rank."""
    out = []
    for stage in (2, 3):
        ref = _net()
        model = copy.deepcopy(ref)
        ref_opts, opt = _torch(ref), _built(model, stage, master_weights=False)
        owned = sum(1 for t, piece in opt._piece.items() if t in opt._whole and piece.numel())
        _train(ref, ref_opts)
        _train(model, [opt])
        sd = opt.state_dict()  # a collective: each momentum gathered from its owner, in bf16
        mom = [(sd["state"][k]["momentum_buffer"], st["momentum_buffer"])
               for k, st in ref_opts[0].state_dict()["state"].items()]
        same = all(a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in mom)
        weights = {n: v.clone() for n, v in zerokern.full_state_dict(model, rank0_only=False).items()}
        out.append((_diff(model, ref), same, opt.matrices_stepped, owned, _keeps_no_master(opt), weights))
    try:
        zerokern.ZeroOptimizer(_groups(_net()), torch.optim.AdamW, zero_stage=2, gather_precision="int8",
                               master_weights=False)
        refused = None
    except ValueError as e:
        refused = str(e)
    return out, refused


def test_two_ranks_at_stages_2_and_3_are_torch_on_a_bf16_model():
    results = dist_harness.values(dist_harness.run(_two_ranks, 2, timeout=240))
    for stage_at, stage in enumerate((2, 3)):
        for rank, (out, _) in enumerate(results):
            diff, same, stepped, owned, no_master, _ = out[stage_at]
            assert diff == 0.0, f"stage {stage}, rank {rank}: params {diff} from one-process torch on bf16"
            assert same, f"stage {stage}, rank {rank}: momentum not torch's bf16 momentum"
            assert stepped == STEPS * owned and owned > 0, f"stage {stage}, rank {rank}: {stepped} for {owned}"
            assert no_master, f"stage {stage}, rank {rank}: an fp32 master or fp32 state"
        assert sum(out[stage_at][3] for out, _ in results) == 4, "every matrix owned by one rank"
    for stage_at in range(2):
        a, b = results[0][0][stage_at][5], results[1][0][stage_at][5]
        assert all(torch.equal(a[n], b[n]) for n in a), "every rank's params bit for bit"
    for _, refused in results:
        assert refused is not None and "gather_precision='int8') at stage 2 needs fp32 master weights" in refused
