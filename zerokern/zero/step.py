"""The records of the step protocol: what begin_step() hands the optimizer (Step), and the
flags a round carries from backward to step() (RoundFlags, reset in one place: new_round())."""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch


class Piece(NamedTuple):
    """This rank's part of one param in a store's shard: trainable param `t`'s elements
    [start, start + numel) of its flattened values, at [offset, offset + numel) of the shard."""

    t: int
    offset: int
    numel: int
    start: int


@dataclass
class Step:
    """One step() as begin_step() decided it, on every rank alike."""

    had: List[bool]  # per trainable param: it had a grad on some rank
    # the update runs: some param had a grad and no rank saw an inf/nan. Decided once, by begin_step();
    # set False by a step whose update failed on every rank (its round then ends as a skipped one's)
    updates: bool
    divisor: Optional[torch.Tensor] = None  # loss scale x clip factor (a 1-element tensor), or None


@dataclass
class RoundFlags:
    """What a round (the backwards between two step()/zero_grad() calls) learned that its step()
    needs, and what the last step() did."""

    clip: Optional[Tuple[float, torch.Tensor]] = None  # (max_norm, norm) from clip_grad_norm_
    overflow_seen: bool = False  # clip_grad_norm_'s reduction found an overflow (fp16)
    last_grad_norm: Optional[torch.Tensor] = None
    last_step_skipped: bool = False  # the last step() skipped the update (an inf/nan on some rank)

    def new_round(self) -> None:
        """After step() and at zero_grad(): a clip or an overflow of the round does not carry over."""
        self.clip = None
        self.overflow_seen = False
