"""ZeroOptimizer's int8 Muon momentum ({"optimizer": torch.optim.Muon, "state_precision": "int8"}:
[Note: int8 momentum of whole matrices] in zerokern/optim/lowbit_momentum.py). The oracle is
one-process torch.optim.Muon + torch.optim.AdamW whose momentum_buffer is rounded through the
int8 codec (linear codes, row-block x column scales) after every step: zerokern must give its bits
on one process and on 2 ranks (every rank alike), and stay within a derived bound of fp32-momentum
Muon. Also: the codec against its scales' definition and its rounding bound, torch's layout in
state dicts both ways, the bytes held, and what is refused."""

import copy

import pytest
import torch
import torch.nn as nn

import dist_harness
import zerokern
from zerokern.optim.lowbit_momentum import BLOCK, CODES, COLUMNS, SCALES, decode_rows, encode_rows

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

STEPS = 4
MUON = dict(lr=0.02, weight_decay=0.01, momentum=0.9)
ADAMW = dict(lr=3e-3, weight_decay=0.05)
# the largest distance from a value in [-1, 1] to its nearest code: half a step of the linear map
# (1 / 127 / 2); an element's error is at most this x its scale s_ij. Also where |m| / s is above 1
# (rho rounded to bf16 down by at most 2^-9 < HALF_GAP, the end code taken)
HALF_GAP = 0.5 / 127


def _model():
    torch.manual_seed(3)
    # 300 columns: five blocks a row, the last short; 9 and 33: one short block a row; biases for AdamW
    return nn.Sequential(nn.Linear(300, 9), nn.Tanh(), nn.Linear(9, 33), nn.Tanh(), nn.Linear(33, 5, bias=False))


def _split(model):
    hidden = [p for p in model.parameters() if p.dim() == 2]
    return hidden, [p for p in model.parameters() if p.dim() != 2]


def _groups(model, precision="int8"):
    hidden, rest = _split(model)
    muon = {"params": hidden, "optimizer": torch.optim.Muon, **MUON}
    if precision is not None:
        muon["state_precision"] = precision
    return [muon, {"params": rest}]


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(4)
    return [torch.randn(16, 300, generator=g) for _ in range(n)]


def _loss(model, x):
    return model(x).square().mean()


class _Oracle:
    """torch.optim.Muon + torch.optim.AdamW, the momentum rounded through the int8 blocks after
    each step (rounded=True) or kept in fp32."""

    def __init__(self, model, rounded=True):
        hidden, rest = _split(model)
        self.muon, self.adamw = torch.optim.Muon(hidden, **MUON), torch.optim.AdamW(rest, **ADAMW)
        self.rounded = rounded

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()

    def step(self):
        self.muon.step()
        self.adamw.step()
        if self.rounded:
            for st in self.muon.state.values():
                st["momentum_buffer"].copy_(decode_rows(*encode_rows(st["momentum_buffer"])))


def _train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        _loss(model, x).backward()
        opt.step()


def _zero(model, precision="int8", stage=2, **more):
    """ZeroOptimizer, Muon (int8 or fp32 momentum) + AdamW; stage None: the model's shard() units'."""
    sharding = {} if stage is None else {"zero_stage": stage, "bucket_cap_mb": 1e-3}
    return zerokern.ZeroOptimizer(_groups(model, precision), torch.optim.AdamW, **ADAMW, **sharding, **more)


# --- the codec ------------------------------------------------------------------------------------

def _scales_by_definition(m):
    """c_j: column absmax; rho_ib: the largest |m_ik| / c_k of row i's block b, in bf16."""
    c = m.abs().amax(dim=0)
    ratio = torch.where(c > 0, m.abs() / torch.where(c > 0, c, torch.ones_like(c)), torch.zeros_like(m))
    nb = -(-m.shape[1] // BLOCK)
    rho = torch.stack([ratio[:, b * BLOCK:(b + 1) * BLOCK].amax(dim=1) for b in range(nb)], 1).to(torch.bfloat16)
    return rho, c


@pytest.mark.parametrize("shape", [(1, 1), (3, 256), (2, 257), (5, 600), (4, 7), (127, 9)])
def test_rows_round_within_half_a_step_of_their_scales(shape):
    torch.manual_seed(0)
    # rows six decades apart, columns three: the row-block and column scales both matter
    m = torch.randn(shape) * torch.logspace(-3, 3, shape[0]).unsqueeze(1) * torch.logspace(0, 3, shape[1])
    codes, rho, c = encode_rows(m)
    nb = -(-shape[1] // BLOCK)
    assert codes.dtype == torch.uint8 and codes.shape == m.shape and int(codes.max()) <= 254
    assert rho.shape == (shape[0], nb) and rho.dtype == torch.bfloat16 and c.shape == (shape[1],)
    want_rho, want_c = _scales_by_definition(m)
    assert torch.equal(c, want_c) and torch.equal(rho, want_rho), "scales as [Note: int8 momentum ...] defines them"
    s = rho.float().repeat_interleave(BLOCK, dim=1)[:, :shape[1]] * c
    back = decode_rows(codes, rho, c)
    assert ((back - m).abs() <= s * HALF_GAP * (1 + 1e-5)).all()
    # an outlier column (x 2^10: the ratios exactly the same) costs the others nothing: every code
    # and row scale as before, only its own column scale 2^10 times larger
    loud = m.clone()
    loud[:, 0] *= 1024
    codes2, rho2, c2 = encode_rows(loud)
    assert torch.equal(codes2, codes) and torch.equal(rho2, rho)
    assert torch.equal(c2[0], c[0] * 1024) and torch.equal(c2[1:], c[1:])
    # decoding and encoding again changes no bit (what state_dict -> load_state_dict does)
    again = encode_rows(back)
    assert all(torch.equal(a, b) for a, b in zip(again, (codes, rho, c)))
    zero = encode_rows(torch.zeros(shape))
    assert torch.equal(decode_rows(*zero), torch.zeros(shape))


def test_zero_columns_and_rows_round_trip():
    m = torch.randn(6, 300)
    m[:, 5] = 0  # an all-zero column: c_j 0
    m[2] = 0  # an all-zero row: rho 0
    m[4, 256:] = 0  # an all-zero block
    codes, rho, c = encode_rows(m)
    back = decode_rows(codes, rho, c)
    assert torch.equal(back[:, 5], m[:, 5]) and torch.equal(back[2], m[2]) and torch.equal(back[4, 256:], m[4, 256:])
    assert all(torch.equal(a, b) for a, b in zip(encode_rows(back), (codes, rho, c)))


# --- one process ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("adamw_too", [True, False])
def test_one_process_is_muon_with_its_momentum_rounded(stage, adamw_too):
    ref = _model()
    if not adamw_too:  # Muon the only class (one inner optimizer), state_precision given as its option
        for layer in ref:
            if isinstance(layer, nn.Linear) and layer.bias is not None:
                layer.bias.requires_grad_(False)
    model = copy.deepcopy(ref)
    sharding = {"zero_stage": stage, "bucket_cap_mb": 1e-3}
    if stage == 3:  # params gathered in the forward hooks of the modules that own them
        for m in model:
            if isinstance(m, nn.Linear):
                zerokern.shard(m, stage=3, bucket_cap_mb=1e-4)
        zerokern.shard(model, stage=3, bucket_cap_mb=1e-4)
        sharding = {}
    if adamw_too:
        ref_opt, opt = _Oracle(ref), _zero(model, stage=None if stage == 3 else stage)
    else:
        ref_opt = _Oracle(ref)
        opt = zerokern.ZeroOptimizer(_split(model)[0], torch.optim.Muon, state_precision="int8", **sharding, **MUON)
    # at most one matrix's fp32 momentum while torch's Muon steps, and only the one it steps
    muon = next(o for o in getattr(opt.inner, "optimizers", [opt.inner]) if isinstance(o, torch.optim.Muon))
    seen = []
    muon.register_step_pre_hook(lambda o, *_: seen.append(
        [p for g in o.param_groups for p in g["params"] if "momentum_buffer" in o.state[p] or p.grad is not None]))
    batches = _batches()
    _train(ref, ref_opt, batches)
    _train(model, opt, batches)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt.matrices_stepped == 3 * STEPS
    stepped = [s for s in seen if s]
    assert len(stepped) == 3 * STEPS and all(len(s) == 1 for s in stepped), [len(s) for s in seen]
    for p in _split(model)[0]:
        st = opt.state[p]
        assert set(st) == {CODES, SCALES, COLUMNS} and st[CODES].dtype == torch.uint8, "no fp32 momentum between steps"
        assert torch.equal(decode_rows(st[CODES], st[SCALES], st[COLUMNS]), ref_opt.muon.state[_ref_of(ref, model, p)]
                           ["momentum_buffer"])


def _ref_of(ref, model, p):
    return dict(zip(model.parameters(), ref.parameters()))[p]


def test_within_a_derived_bound_of_fp32_momentum():
    """The first step is fp32 Muon's bit for bit: the momentum is g_1 then, and is rounded only
    after the update. From then on both runs step with torch's NS, whose output's elements are at
    most its spectral norm: 5 iterations of Keller's quintic (a, b, c) from singular values in
    [0, 1], at most S (computed below in fp64) plus bf16 slack, 1.5 in all. So a param moves at most
    lr x sqrt(max(1, rows / cols)) x 1.5 a step in each run, and the runs part by at most twice that
    over the steps after the first (weight decay's 1 - lr x wd shrinks the gap)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    s = torch.linspace(0, 1, 100001, dtype=torch.float64)
    for _ in range(5):
        s = a * s + b * s ** 3 + c * s ** 5
    assert s.abs().max() < 1.25  # the largest singular value NS can give: 1.5 leaves bf16's slack
    ref = _model()
    one = copy.deepcopy(ref)
    fp32, int8 = _Oracle(ref, rounded=False), _zero(one)
    batches = _batches(6)
    _train(ref, fp32, batches[:1])
    _train(one, int8, batches[:1])
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), ref.parameters())), "step 1 exact"
    _train(ref, fp32, batches[1:])
    _train(one, int8, batches[1:])
    for p, q in zip(_split(one)[0], _split(ref)[0]):
        bound = 2 * (len(batches) - 1) * MUON["lr"] * max(1, p.shape[0] / p.shape[1]) ** 0.5 * 1.5
        diff = (p - q).abs().max().item()
        assert 0 < diff <= bound, (list(p.shape), diff, bound)


def test_state_dict_is_torch_layout_both_ways():
    model = _model()
    opt = _zero(model, stage=2)
    batches = _batches(4)
    _train(model, opt, batches[:2])
    sd = opt.state_dict()
    hidden = _split(model)[0]
    index = {p: k for k, p in enumerate(sum(_split(model), []))}  # the state dict's: by param group
    for p in hidden:
        st = sd["state"][index[p]]
        assert set(st) == {"momentum_buffer"} and st["momentum_buffer"].dtype == torch.float32
        assert torch.equal(st["momentum_buffer"], decode_rows(opt.state[p][CODES], opt.state[p][SCALES],
                                                              opt.state[p][COLUMNS]))
    # torch.optim.Muon + AdamW take it as it is
    one = copy.deepcopy(model)
    ref = _Oracle(one)
    ref.muon.load_state_dict({"state": {k: sd["state"][index[p]] for k, p in enumerate(hidden)},
                              "param_groups": [{**sd["param_groups"][0], "params": list(range(len(hidden)))}]})
    # a new int8 ZeroOptimizer loads it to the same codes and scales, and steps on to the same bits
    again = copy.deepcopy(model)
    again_opt = _zero(again, stage=2)
    again_opt.load_state_dict(copy.deepcopy(sd))
    for p, q in zip(hidden, _split(again)[0]):
        for key in (CODES, SCALES, COLUMNS):
            assert torch.equal(opt.state[p][key], again_opt.state[q][key]), key
    _train(model, opt, batches[2:])
    _train(again, again_opt, batches[2:])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    # any fp32 momentum (torch's, off the codes' grid) loads rounded into the blocks
    theirs = opt.state_dict()
    for p in hidden:
        theirs["state"][index[p]]["momentum_buffer"] *= 1.37
    fresh_model = copy.deepcopy(model)
    fresh = _zero(fresh_model, stage=2)
    fresh.load_state_dict(theirs)
    for p, q in zip(hidden, _split(fresh_model)[0]):
        codes, rho, c = encode_rows(theirs["state"][index[p]]["momentum_buffer"])
        assert torch.equal(fresh.state[q][CODES], codes) and torch.equal(fresh.state[q][SCALES], rho)
        assert torch.equal(fresh.state[q][COLUMNS], c)


def _momentum_bytes(opt, hidden):
    return sum(v.numel() * v.element_size() for p in hidden for v in opt.state[p].values())


def _scale_bytes(p):
    """bf16 rho a row block, fp32 c a column"""
    return 2 * p.shape[0] * (-(-p.shape[1] // BLOCK)) + 4 * p.shape[1]


def test_state_bytes_are_a_byte_and_the_scales():
    model, other = _model(), _model()
    int8, fp32 = _zero(model), _zero(other, precision=None)
    hidden = _split(model)[0]
    codes = sum(p.numel() for p in hidden)
    scales = sum(_scale_bytes(p) for p in hidden)
    assert _momentum_bytes(int8, hidden) == codes + scales
    assert _momentum_bytes(fp32, _split(other)[0]) == 4 * codes
    saved = fp32.memory_report()["adam_state"] - int8.memory_report()["adam_state"]
    assert saved == 3 * codes - scales


@pytest.mark.parametrize("build, message", [
    (lambda m: zerokern.ZeroOptimizer([{"params": _split(m)[0], "optimizer": torch.optim.Muon},
                                       {"params": _split(m)[1], "state_precision": "int8"}], torch.optim.AdamW),
     r"param group 1 \(AdamW\) has state_precision='int8': .* not Muon's"),
    (lambda m: zerokern.ZeroOptimizer(_groups(m), torch.optim.AdamW, state_precision="int8"),
     r"state_precision='int8' is for torch.optim.Muon's momentum, and the default class here is AdamW"),
    (lambda m: zerokern.ZeroOptimizer(_groups(m, "int4"), torch.optim.AdamW),
     r"param group 0 \(Muon\) has state_precision='int4'; Muon's momentum may be 'fp32' or 'int8'"),
])
def test_bad_options_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build(_model())


def test_state_on_disk_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Muon .* OffloadPolicy\(device='nvme'\)"):
        _zero(_model(), offload=zerokern.OffloadPolicy(device="nvme", path=str(tmp_path)))


# --- 2 ranks, stage 2 -----------------------------------------------------------------------------

def _two_ranks(rank, world, stage):
    """Every rank on the same batch: the reduced grads are one process's, so zerokern must give
    the oracle's bits."""
    ref = _model()
    model = copy.deepcopy(ref)
    ref_opt, opt = _Oracle(ref), _zero(model, stage=stage)
    other = copy.deepcopy(ref)
    fp32 = _zero(other, precision=None, stage=stage)
    batches = _batches()
    _train(ref, ref_opt, batches)
    _train(model, opt, batches)
    same = [torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    hidden = _split(model)[0]
    owned = [k for k, p in enumerate(hidden) if opt.state[p]]
    sd = opt.state_dict()  # a collective: every rank's dict holds every momentum, decoded
    index = {p: k for k, p in enumerate(sum(_split(model), []))}  # the state dict's: by param group
    moms = [sd["state"][index[p]]["momentum_buffer"] for p in hidden]
    ref_moms = [ref_opt.muon.state[q]["momentum_buffer"] for q in _split(ref)[0]]
    again = copy.deepcopy(model)
    again_opt = _zero(again, stage=stage)
    again_opt.load_state_dict(sd)
    reloaded = all(torch.equal(opt.state[p][k], again_opt.state[q][k]) for p, q in zip(hidden, _split(again)[0])
                   for k in opt.state[p])
    return (same, [torch.equal(a, b) for a, b in zip(moms, ref_moms)], opt.matrices_stepped, owned,
            [p.detach().clone() for p in model.parameters()], _momentum_bytes(opt, hidden),
            _momentum_bytes(fp32, _split(other)[0]), reloaded)


@pytest.mark.parametrize("stage", [2])
def test_two_ranks_are_the_oracle_bit_for_bit(stage):
    out = dist_harness.values(dist_harness.run(_two_ranks, 2, stage, timeout=180))
    hidden = _split(_model())[0]
    for rank, (same, moms, stepped, owned, _, int8_bytes, fp32_bytes, reloaded) in enumerate(out):
        assert all(same), f"rank {rank}: params differ from the oracle's: {same}"
        assert all(moms), f"rank {rank}: the state dict's momentum differs from the oracle's: {moms}"
        assert stepped == STEPS * len(owned), f"rank {rank}: {stepped} matrix steps for {len(owned)} owned"
        owned_numel = sum(hidden[k].numel() for k in owned)
        owned_scales = sum(_scale_bytes(hidden[k]) for k in owned)
        assert int8_bytes == owned_numel + owned_scales and fp32_bytes == 4 * owned_numel, rank
        assert reloaded, f"rank {rank}: load_state_dict(state_dict()) changed the codes"
    assert sorted(k for o in out for k in o[3]) == list(range(len(hidden))), "each matrix on one owner"
    assert all(o[3] for o in out), "both ranks own matrices"
    assert sum(o[2] for o in out) == STEPS * len(hidden), "NS once per matrix and step, over the ranks"
    for p, q in zip(out[0][4], out[1][4]):
        assert torch.equal(p, q), "every rank's params bit for bit"
