"""LowBitStore: a shard store of Adam's moments in bf16 or 8-bit blocks, and of bf16 params trained
without an fp32 master: the same protocol as ShardStore (operands(), finish(), master_valid,
refresh_master(), nbytes()), plus the block scales of int8 state (scales()).

Bytes per param this rank holds for its shard (bf16 params and grads, 2 + 2 of them, aside):
fp32 state with masters 12, int8 state with masters 6.03, int8 state without masters 2.03
(the codes, 1 + 1, and one fp32 scale per moment per 256 elements).

[Note: int8 shards in blocks] A block never straddles two ranks' shards: the engine lays the
buckets out with every param and every shard starting at a multiple of lowbit.BLOCK elements
(ShardConfig.align), so blocks are counted from each param's first element, and they are the
same blocks at every world size: each rank quantizes its own shard with no communication, and
a checkpoint's codes and scales re-shard exactly.
"""

from typing import TYPE_CHECKING

import torch

from ...kernels import lowbit
from ..core.stage import StatePolicy
from .store import ShardStore

if TYPE_CHECKING:  # annotations only
    from ..unit import FlatParams

class LowBitStore(ShardStore):
    """ShardStore's protocol and master bookkeeping (refresh_master, refresh_params, the round-trip
    check), over state of another precision; in memory (on disk: LowBitNvmeStore, lowbit_nvme_store.py)."""

    def __init__(self, flat: "FlatParams", b: int, policy: StatePolicy,  # noqa: D107 (ShardStore's allocation differs)
                 holds_gathered: bool = False):
        self.flat, self.b, self.policy = flat, b, policy
        self.holds_gathered = holds_gathered  # as ShardStore's (the engine refuses it without masters)
        self.bucket = flat.buckets[b]
        shard = self._param_shard = flat.param_shard(b)
        self.device = shard.device
        self.offloaded = False
        self.low_precision = shard.dtype != torch.float32
        self.separate_master = policy.master_weights and (self.low_precision or holds_gathered)
        self.master = torch.zeros_like(shard, dtype=torch.float32) if self.separate_master else shard
        self.staging = None
        n = shard.numel()
        dtype = policy.state_dtype
        self.state = {"exp_avg": torch.zeros(n, dtype=dtype, device=self.device),
                      "exp_avg_sq": torch.zeros(n, dtype=dtype, device=self.device)}
        self._scales = None
        if dtype == torch.uint8:  # [Note: int8 shards in blocks]: n is a multiple of BLOCK
            zero_m, _ = lowbit.quantize(torch.zeros(1, device=self.device), True)
            self.state["exp_avg"].fill_(int(zero_m[0]))  # the signed map's 0 is not code 0
            self._scales = {k: torch.zeros(lowbit.num_blocks(n), device=self.device) for k in self.state}
        self.refresh_master()
        self.master_valid = not self.separate_master
        self._filled_version = None

    def scales(self):
        """{state key: fp32 block scales} of int8 state, else None."""
        return self._scales

    def operands(self):
        """(params, grad, exp_avg, exp_avg_sq, model): params the fp32 master, or without one the
        bf16 param shard itself; model the bf16/fp16 shard written from a separate master."""
        model = self._param_shard if self.separate_master and not self.holds_gathered else None
        return (self.master, self.bucket.reduced_grad(), self.state["exp_avg"], self.state["exp_avg_sq"], model)

    def finish(self) -> None:
        pass

    def nbytes(self) -> dict:
        size = self.state["exp_avg"].element_size()
        scales = sum(t.numel() * 4 for t in self._scales.values()) if self._scales else 0
        return {"master_params": self.master.numel() * 4 if self.separate_master else 0,
                "adam_state": sum(t.numel() * size for t in self.state.values()) + scales}
