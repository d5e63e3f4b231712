"""Save and load a FusedZeroAdam (and, optionally, its model) with
torch.distributed.checkpoint: every rank writes its own slice of the sharded
state once, and loading at another world size re-shards it. A thin layer over
torch's helpers, which work with FusedZeroAdam directly too:

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, ...)

([Note: sharded state in checkpoints] in zerokern/optim/state_dict.py says how.)
Collective: call on every rank of the optimizer's process group.
"""

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict


def save_optimizer(model, optimizer, path):
    """Write `optimizer`'s whole state (every rank's slice) under the directory `path`."""
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def load_optimizer(model, optimizer, path):
    """Load what save_optimizer wrote, at this world size (it may differ from the saving one)."""
    sd = {"optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, sd["optim"])
