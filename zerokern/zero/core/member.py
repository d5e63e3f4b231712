"""Member: one trainable param of a FlatParams, with everything the runtime tracks about its data
(its .grad is the grad path's: grads/members.py).

The runtime finds what the model did to a param between two of its own steps by comparing what
it recorded against the param: where its data must stay (`ptr`, [Note: ownership] in unit.py),
its version counter when the stores last looked (`version`, [Note: in-place weights]), and at
stage 3 its version when its data went empty (`empty_version`, [Note: stage-3 params] in
params/per_unit.py). These live together so one param's record cannot fall out of step with
another's.
"""

from typing import Optional

import torch


class Member:
    __slots__ = ("param", "index", "t", "local_name", "name", "shape", "ptr", "version", "empty_version")

    def __init__(self, param: torch.Tensor, index: int, name: str):
        self.param = param
        self.index = index  # in its FlatParams (backward order): what the layout's slots are numbered by
        self.t: Optional[int] = None  # among the trainable params of the optimizer that owns its unit
        self.local_name = name  # relative to the unit's module
        self.name = name  # from the root once the unit is named (ShardUnit.name_from)
        self.shape = param.shape  # at stage 3 the data is empty while the unit is sharded (p.shape reads this)
        self.ptr = param.data_ptr()
        self.version = param._version
        self.empty_version: Optional[int] = None  # stage 3: param._version when its data went empty

    def check_moved(self, dtype: torch.dtype, device: torch.device) -> None:
        """A clear error for a param moved to another device or dtype after it was sharded."""
        p = self.param
        if p.device != device or p.dtype != dtype:
            raise RuntimeError(
                f"zerokern: {self.name} is now {p.dtype} on {p.device}, but it was sharded as {dtype} on {device} "
                "(model.to(...) after the optimizer or zerokern.shard was built?). Move or cast the model first, "
                "then build the optimizer (and call zerokern.shard)")

    def check_untouched(self, unit_name: str) -> None:
        """Stage 3: a param changed in place while its unit was sharded (its version counter moved:
        clamp_, an init, copy_ into it) changed nothing, since it held no values: an error, not a no-op."""
        v = self.empty_version
        if v is not None and self.param._version != v:
            raise RuntimeError(
                f"zerokern: {self.name} (unit '{unit_name}') was changed in place while its unit was sharded (at "
                "stage 3 a param holds no values between its unit's forward and backward, so p.clamp_(), an "
                "nn.init call or copy_ into it would do nothing). To set new weights between steps, load them: "
                "model.load_state_dict(sd) takes whole tensors into the shards")
