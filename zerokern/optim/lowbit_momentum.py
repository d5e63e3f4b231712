"""ZeroOptimizer's int8 momentum for torch.optim.Muon param groups (issue 51, item 7):
{"params": hidden, "optimizer": torch.optim.Muon, "state_precision": "int8"} keeps each matrix's
momentum_buffer on its owner as 8-bit codes and block scales, and steps it with torch's own Muon.

[Note: int8 momentum of whole matrices] Between steps the owner's state of an int8 matrix is
"momentum_codes" (uint8, the matrix's shape) and "momentum_scales" (fp32, [rows, blocks a row]):
the numbers of [Note: blockwise 8-bit state] in kernels/lowbit.py (the signed dynamic map, one
absmax scale a block, nearest code), with blocks of lowbit.BLOCK elements counted from each row's
first element, the last block of a row short. A block never spans two rows because:
- a row of a weight is one output unit, and its gradient row is that unit's backward signal times
  the inputs: rows differ in scale far more than the elements of one row do, and a block whose
  absmax came from a neighbouring row would round this row's values coarser;
- the blocks depend on the matrix's shape only, not on where the matrix lies in a shard (the
  matrix layout puts it at any offset): the codes are the same at every world size and stage,
  so ranks and one process agree bit for bit;
- a cut between rows (a future row-split owner) never cuts a block.
Bytes per momentum element: 1 + 4 x ceil(cols / BLOCK) / cols (1.03 for 128 columns), against 4.

The step (step(), in place of the inner optimizer's): every other piece steps first, as before;
then each int8 matrix in turn gets its fp32 momentum_buffer decoded, torch.optim.Muon.step() runs
on a copy of its param group holding that matrix alone (Muon's update of one param reads no
other's), and the buffer is encoded again. So at most one matrix's fp32 momentum exists during a
step, plus Muon's own temporaries for that matrix. Elsewhere: construction makes zero codes and
never an fp32 buffer; state_dict() returns torch's layout (fp32 momentum_buffer, decoded), so it
holds every owned matrix's fp32 momentum (the dict is made of them); load_state_dict encodes what
it loaded, which a while holds every loaded fp32 momentum (the caller's dict holds them too).
Encoding a decoded momentum gives the same codes and scales again (a block's largest value
decodes to exactly its scale), so state_dict -> load_state_dict changes no bit.
Refused: another precision, state_precision on a group that is not Muon's (FusedZeroAdam has int8
AdamW state), and state on disk (Muon groups refuse OffloadPolicy(device="nvme") already).
"""

import torch

from ..kernels import lowbit

KEY, CODES, SCALES = "momentum_buffer", "momentum_codes", "momentum_scales"
PRECISIONS = ("fp32", "int8")
OPTION = "state_precision"


def blocks_per_row(cols: int) -> int:
    return lowbit.num_blocks(cols)


@torch.no_grad()
def encode_rows(m: torch.Tensor):
    """(codes uint8 like m, scales fp32 [rows, blocks a row]) of a 2-D fp32 momentum, blocks
    aligned to rows ([Note: int8 momentum of whole matrices])."""
    rows, cols = m.shape
    nb = blocks_per_row(cols)
    pad = nb * lowbit.BLOCK - cols
    # zeros change no block's absmax; with every row padded to whole blocks, lowbit.quantize's
    # blocks (counted from the first element) are the rows' blocks
    padded = torch.nn.functional.pad(m, (0, pad)) if pad else m
    codes, scales = lowbit.quantize(padded.reshape(-1), signed=True)
    return codes.view(rows, nb * lowbit.BLOCK)[:, :cols].contiguous(), scales.view(rows, nb)


@torch.no_grad()
def decode_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 momentum of encode_rows' codes and scales."""
    cols = codes.shape[1]
    per = scales.repeat_interleave(lowbit.BLOCK, dim=1)[:, :cols]
    return lowbit.qmap(True, codes.device)[codes.long()] * per


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
    out = {k: v for k, v in st.items() if k not in (CODES, SCALES)}
    out[KEY] = decode_rows(st[CODES], st[SCALES])
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
                st[CODES], st[SCALES] = encode_rows(st.pop(KEY))
            elif CODES not in st:
                st[CODES], st[SCALES] = encode_rows(torch.zeros_like(piece))

    def step(self, inner):
        """inner.step(), each int8 matrix stepped alone by torch's Muon with its momentum decoded
        for that step only."""
        held = [(o, k, piece, piece.grad) for o, k, piece in self.parts if piece.grad is not None]
        for _, _, piece, _ in held:
            piece.grad = None
        inner.step()  # the other pieces: AdamW's, fp32 Muon groups'
        for o, k, piece, grad in held:
            st = o.state[piece]
            st[KEY] = decode_rows(st.pop(CODES), st.pop(SCALES))
            groups = o.param_groups
            o.param_groups = [{**groups[k], "params": [piece]}]
            piece.grad = grad
            try:
                o.step()
            finally:
                o.param_groups = groups
                piece.grad = None
                st[CODES], st[SCALES] = encode_rows(st.pop(KEY))
