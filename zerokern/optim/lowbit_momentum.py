"""ZeroOptimizer's int8 momentum for torch.optim.Muon param groups (issue 51, item 7):
{"params": hidden, "optimizer": torch.optim.Muon, "state_precision": "int8"} keeps each matrix's
momentum_buffer on its owner as 8-bit codes and block scales, and steps it with torch's own Muon.

[Note: int8 momentum of whole matrices] Between steps the owner's state of an int8 matrix is
"momentum_codes" (uint8, the matrix's shape), "momentum_scales" (bf16, [rows, blocks a row]) and
"momentum_col_scales" (fp32, [cols]): element (i, j) stands for (code - 127) / 127 x s_ij, a
linear map of 255 codes (254 and 0 are +-1, 255 never made), with a rank-1 scale
    s_ij = rho_ib x c_j,   c_j = the absmax of column j,   rho_ib = max over row i's block b of
                                                              |m_ik| / c_k, rounded to bf16,
blocks of BLOCK elements counted from each row's first element, the last one short; the code is
the nearest (|m_ij| / s_ij above 1 by rho's rounding takes the end code). Why this form:
- the error Muon can bear is set by Newton-Schulz, not by the elements: NS normalises the
  momentum by its Frobenius norm and lifts every singular value near 0 by about 3.4^5 ~ 450, so
  rounding noise of even 1% of the norm, spread over all directions, comes out of NS as update
  directions of nearly unit size. The noise's norm is what counts: on bench/muon_loss.py's GPT a
  run's lag behind fp32 momentum at steps 25-100 grew with it (bench/muon_int8_codecs.py);
- a linear map beats kernels/lowbit.py's dynamic map here: most of a momentum's elements lie in
  the top decade of their block's absmax, where the dynamic map has 64 steps a sign against the
  linear map's 114 (the dynamic map's fine lower decades serve Adam's heavy-tailed moments);
- a column's scale as well as a row block's: a weight's gradient is the sum of output signals
  times inputs, and a few input features (columns) are far larger than the rest, so with one
  scale a row block every row was as coarse as its outlier column made it; with s_ij of both, an
  outlier column costs the others nothing (scaling a column by a power of 2 changes only its c_j);
- stochastic rounding (unbiased, so an EMA's small steps land on average) was tried and is worse:
  it adds more noise than round-to-nearest, and noise, not bias, is what NS amplifies;
- rho in bf16, round trip: decoding and encoding again gives the same codes and scales, so
  state_dict -> load_state_dict changes no bit. Each column's largest element has ratio 1, rho 1
  and the end code, so it decodes to exactly c_j and none of the column decodes above it; a row
  block's largest ratio (its code the end code: bf16 rho is within 2^-9 of it) decodes to
rho_ib x c_k, whose ratio is rho_ib within an fp32 ulp, which
  bf16 rounding takes back to rho_ib exactly (an fp32 rho could come back an ulp off);
- the scales depend on the matrix alone, not on where it lies in a shard: ranks, stages and one
  process agree bit for bit.
Bytes per momentum element: 1 + 2 x ceil(cols / BLOCK) / cols + 4 / rows (1.0625 for 128 x 128),
against 4. The planner (no torch) counts the same in plan/matrix.py's int8_momentum_bytes; a change
of layout here must change it there (tests/plan/test_plan_matrix.py holds the two equal).

The step (step(), in place of the inner optimizer's): every other piece steps first, as before;
then each int8 matrix in turn gets its fp32 momentum_buffer decoded, torch.optim.Muon.step() runs
on a copy of its param group holding that matrix alone (Muon's update of one param reads no
other's), and the buffer is encoded again. So at most one matrix's fp32 momentum exists during a
step, plus Muon's own temporaries for that matrix. Elsewhere: construction makes zero codes and
never an fp32 buffer; state_dict() returns torch's layout (fp32 momentum_buffer, decoded), so it
holds every owned matrix's fp32 momentum (the dict is made of them); load_state_dict encodes what
it loaded, which a while holds every loaded fp32 momentum (the caller's dict holds them too).
Refused: another precision, state_precision on a group that is not Muon's (FusedZeroAdam has int8
AdamW state), and state on disk (Muon groups refuse OffloadPolicy(device="nvme") already).
"""

import torch

BLOCK = 64  # elements of a row a rho covers (64 against 256: about 0.1% less eval loss lag, +0.02 bytes)
LEVELS = 127  # codes 127 +- 127: the linear map's steps a sign

KEY, CODES, SCALES, COLUMNS = "momentum_buffer", "momentum_codes", "momentum_scales", "momentum_col_scales"
PRECISIONS = ("fp32", "int8")
OPTION = "state_precision"


def blocks_per_row(cols: int) -> int:
    return -(-cols // BLOCK)


def _per_element(rho: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """s_ij = rho_ib x c_j, one fp32 product (encode and decode compute it alike)."""
    return rho.float().repeat_interleave(BLOCK, dim=1)[:, :cols.numel()] * cols


def _over(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x / s, 0 where s is 0 (an all-zero column or block)."""
    return torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))


@torch.no_grad()
def encode_rows(m: torch.Tensor):
    """(codes uint8 like m, rho bf16 [rows, blocks a row], c fp32 [cols]) of a 2-D fp32 momentum
    ([Note: int8 momentum of whole matrices])."""
    rows, cols = m.shape
    c = m.abs().amax(dim=0) if rows else m.new_zeros(cols)
    ratio = _over(m.abs(), c)  # <= 1: fp32 division is monotonic
    nb = blocks_per_row(cols)
    pad = nb * BLOCK - cols
    padded = torch.nn.functional.pad(ratio, (0, pad)) if pad else ratio  # zeros change no block's max
    rho = padded.view(rows, nb, BLOCK).amax(dim=2).to(torch.bfloat16) if rows and cols else \
        m.new_zeros(rows, nb, dtype=torch.bfloat16)
    q = torch.round(_over(m, _per_element(rho, c)) * LEVELS).clamp_(-LEVELS, LEVELS)
    return (q + LEVELS).to(torch.uint8), rho, c


@torch.no_grad()
def decode_rows(codes: torch.Tensor, rho: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The fp32 momentum of encode_rows' codes and scales."""
    return ((codes.float() - LEVELS) / LEVELS) * _per_element(rho, c)


def checked_precisions(groups, classes, default_class, given):
    """Check state_precision in every param group, naming the group: only Muon's momentum has an
    int8 form here. given: ZeroOptimizer's state_precision= (None: not given), a default for the
    groups of the default class, written into them."""
    if given is not None and default_class.__name__ != "Muon":
        raise ValueError(f"ZeroOptimizer: state_precision={given!r} is for torch.optim.Muon's momentum, and the "
                         f"default class here is {default_class.__name__}; put \"state_precision\": {given!r} in "
                         "the Muon param group (for int8 AdamW state use zerokern.FusedZeroAdam(state_precision="
                         "'int8'))")
    for gi, (g, cls) in enumerate(zip(groups, classes)):
        if given is not None and cls is default_class:
            g.setdefault(OPTION, given)
        if OPTION not in g:
            continue
        if cls.__name__ != "Muon" or not cls.__module__.startswith("torch."):
            raise ValueError(f"ZeroOptimizer: param group {gi} ({cls.__name__}) has state_precision="
                             f"{g[OPTION]!r}: it keeps torch.optim.Muon's momentum in int8, and this group is not "
                             "Muon's; drop it there (for int8 AdamW state use zerokern.FusedZeroAdam("
                             "state_precision='int8'))")
        if g[OPTION] not in PRECISIONS:
            raise ValueError(f"ZeroOptimizer: param group {gi} (Muon) has state_precision={g[OPTION]!r}; Muon's "
                             f"momentum may be {' or '.join(map(repr, PRECISIONS))}")


def in_torch_layout(st):
    """A state dict entry as torch.optim.Muon keeps it: an int8 matrix's codes and scales replaced
    by the fp32 momentum_buffer they stand for (other entries as they are)."""
    if CODES not in st:
        return st
    out = {k: v for k, v in st.items() if k not in (CODES, SCALES, COLUMNS)}
    out[KEY] = decode_rows(st[CODES], st[SCALES], st[COLUMNS])
    return out


class Int8Momentum:
    """The int8 matrices of an inner optimizer (one torch optimizer, or an InnerSet) and its step
    ([Note: int8 momentum of whole matrices]). parts: per int8 matrix this rank owns, (the torch
    optimizer that steps it, the index of its param group there, its piece)."""

    def __init__(self, parts):
        self.parts = list(parts)

    def settle(self):
        """Every int8 matrix's state as codes and scales: an fp32 momentum_buffer (just loaded)
        encoded, none made as zeros. Run before make_initial_state, which then makes no fp32
        buffer for them."""
        for o, _, piece in self.parts:
            st = o.state[piece]
            if KEY in st:
                st[CODES], st[SCALES], st[COLUMNS] = encode_rows(st.pop(KEY))
            elif CODES not in st:
                st[CODES], st[SCALES], st[COLUMNS] = encode_rows(torch.zeros_like(piece))

    def step(self, inner):
        """inner.step(), each int8 matrix stepped alone by torch's Muon with its momentum decoded
        for that step only."""
        held = [(o, k, piece, piece.grad) for o, k, piece in self.parts if piece.grad is not None]
        for _, _, piece, _ in held:
            piece.grad = None
        inner.step()  # the other pieces: AdamW's, fp32 Muon groups'
        for o, k, piece, grad in held:
            st = o.state[piece]
            st[KEY] = decode_rows(st.pop(CODES), st.pop(SCALES), st.pop(COLUMNS))
            groups = o.param_groups
            o.param_groups = [{**groups[k], "params": [piece]}]
            piece.grad = grad
            try:
                o.step()
            finally:
                o.param_groups = groups
                piece.grad = None
                st[CODES], st[SCALES], st[COLUMNS] = encode_rows(st.pop(KEY))
