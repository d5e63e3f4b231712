"""ShardStore: the fp32 master weights and the optimizer's per-element state (Adam's two
moments; state_keys) of one bucket's shard on this rank, where the unit's OffloadPolicy says
they live. The protocol an optimizer uses: operands() before its update, finish() after it,
refresh_master() / master_valid, nbytes(); a store of another precision implements the same.

The optimizer's per-param state (self.state[p]) holds views into these
tensors, so the store is the one copy. Where the store lives is decided here
and only here: on the param's device, the fp32 param shard is its own master
(no copy) and the kernel writes fp16/bf16 params in the same pass; with
offload, the master is a separate fp32 copy in (pinned) CPU memory, the
reduced grad is staged to the CPU before the update and the new param shard
is copied back after it (operands() / finish()).

With quantized param gathers at stages 1/2 (`holds_gathered`, [Note: quantized param gathers]
in params/gather.py) the param shard holds what every rank reconstructed from the gathers,
within one int8 step of the master, so the master is always a tensor of its own (fp32 params
too: counted as master_params) and the update writes only the master; the gather after it sends
master - params and writes the params of every rank, this one's too.
"""

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from ..core.stage import OffloadPolicy

if TYPE_CHECKING:  # annotations only: a store sits below the unit that it is built from
    from ..grads.bucket import GradBucket
    from ..unit import FlatParams


class ShardStore:
    def __init__(self, flat: "FlatParams", b: int, offload: Optional[OffloadPolicy],
                 state_keys: Sequence[str] = ("exp_avg", "exp_avg_sq"), holds_gathered: bool = False,
                 master_weights: bool = True):
        """state_keys: the optimizer's fp32 state per element (Adam's two moments; none for an
        optimizer that keeps its own, ZeroOptimizer's inner torch optimizer). holds_gathered: the
        param shard holds quantized gathers' values, not the master (see above). master_weights
        False: a bf16 param shard is what the optimizer updates, no fp32 copy (ZeroOptimizer's
        [Note: bf16 params without masters]; the engine refuses it with offload or holds_gathered)."""
        self.flat, self.b = flat, b
        self.bucket: "GradBucket" = flat.buckets[b]
        param_shard = self._param_shard = flat.param_shard(b)  # a view of a buffer the unit keeps for good
        self.device = offload.compute_device if offload is not None else param_shard.device
        pin = offload is not None and offload.pin_memory and torch.cuda.is_available()
        n = param_shard.numel()

        def alloc(dtype=torch.float32):
            return torch.zeros(n, dtype=dtype, device=self.device, pin_memory=pin)

        self.state = {key: alloc() for key in state_keys}
        self.offloaded = self.device != param_shard.device
        self.low_precision = param_shard.dtype != torch.float32
        self.holds_gathered = holds_gathered
        # The param shard is its own fp32 master only on its own device, and only where it holds the master.
        self.separate_master = (self.low_precision and master_weights) or self.offloaded or holds_gathered
        self.master = alloc() if self.separate_master else param_shard
        # The kernel writes low-precision params into this (on the store's device); the gather writes held ones.
        self.staging = (alloc(param_shard.dtype) if (self.offloaded and self.low_precision and not holds_gathered)
                        else None)
        self.refresh_master()  # so a state dict taken before the first step holds the weights
        # A separate master is read again at the first step: weights loaded into the model
        # between construction and the first step are the ones trained.
        self.master_valid = not self.separate_master
        self._filled_version = None  # the master's _version after fill_unread_master()

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.state["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.state["exp_avg_sq"]

    def param_shard(self) -> torch.Tensor:
        return self._param_shard

    def refresh_master(self) -> None:
        """Re-read a separate fp32 master from the params (before the first step, or after a
        model-only load: FusedZeroAdam.reload_master_weights)."""
        if self.separate_master:
            self.master.copy_(self.param_shard())
        self.master_valid = True

    def fill_unread_master(self) -> None:
        """For a state dict taken before the first step: the master holds what the params hold
        now, but stays unread (a model loaded after this still reaches it at the first step).
        The fill is remembered, so that the same dict loaded back unchanged (a round trip,
        as Accelerate's prepare does) leaves it unread too."""
        if self.separate_master and not self.master_valid:
            self.master.copy_(self.param_shard())
            self._filled_version = self.master._version

    def is_round_trip(self, views, given) -> bool:
        """Would loading `given` into this store's master `views` load nothing new: the master
        is unwritten since fill_unread_master(), and `given` holds the same values (views of
        it, or copies: a dcp.load into the views would have written them)?"""
        return (self._filled_version is not None and self._filled_version == self.master._version
                and all(torch.equal(v, g.to(v.device)) for v, g in zip(views, given)))

    def refresh_params(self, indices) -> None:
        """A separate master re-reads the slices of these params (given new values). Not an
        element the model holds as the master's rounding: that is the same weight (a checkpoint's
        model and optimizer state, loaded in either order; the rows a partial load left alone),
        and its fp32 master stays."""
        if not self.separate_master:
            return
        f = self.flat
        for pc in f.layout.rank_pieces(f.rank, self.b):
            if pc.index in indices:
                sl = slice(pc.shard_offset, pc.shard_offset + pc.numel)
                shard, master = self._param_shard[sl], self.master[sl]
                if not self.master_valid or not self.low_precision:
                    master.copy_(shard)
                    continue
                new = shard.to(master.device)  # element by element: a row re-initialised leaves the rest
                master.copy_(torch.where(master.to(new.dtype) == new, master, new.to(master.dtype)))

    def operands(self):
        """(master, grad, *state (in state_keys order), model) over this shard: for Adam the fused
        kernel's (master, grad, exp_avg, exp_avg_sq, model). model: the fp16/bf16 param shard the
        update writes (None for fp32 params, and for a shard that is its own master)."""
        grad = self.bucket.reduced_grad()
        if self.offloaded:
            # Blocking: the CPU kernel reads it right away (an async device-to-host copy
            # would need an event wait first; overlapping these copies is future work).
            grad = grad.to(self.device)
        model = None
        if self.low_precision and self.separate_master and not self.holds_gathered:  # held: the gather writes them
            model = self.staging if self.offloaded else self.param_shard()
        return (self.master, grad, *self.state.values(), model)

    def finish(self) -> None:
        """After the kernel: an offloaded store sends the new params back."""
        if self.offloaded and not self.holds_gathered:
            # Blocking too: the next update writes the staging buffer again.
            self.param_shard().copy_(self.staging if self.low_precision else self.master)

    def nbytes(self) -> dict:
        return {"master_params": self.master.numel() * 4 if self.separate_master else 0,
                "adam_state": sum(t.numel() * 4 for t in self.state.values())}
