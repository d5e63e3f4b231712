"""Save and load a FusedZeroAdam (and, optionally, its model) with
torch.distributed.checkpoint: every rank writes its own slice of the sharded
state once, and loading at another world size re-shards it. A thin layer over
torch's helpers, which work with FusedZeroAdam directly too:

    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, ...)

([Note: sharded state in checkpoints] in zerokern/optim/state_dict.py says how.)
Collective: call on every rank of the optimizer's process group.

A checkpoint saved without reduce_precision has no "error_feedback" entries; an optimizer with
it asks for them, and DCP refuses a missing key: load_optimizer asks only for those the
checkpoint has, so the residuals start at 0 ([Note: error feedback in checkpoints] in
zerokern/optim/wire_checkpoint.py). With dcp.load directly, call drop_missing_error_feedback.
"""

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ..optim.wire_checkpoint import KEYS as ERROR_FEEDBACK_KEYS


def save_optimizer(model, optimizer, path):
    """Write `optimizer`'s whole state (every rank's slice) under the directory `path`."""
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def load_optimizer(model, optimizer, path):
    """Load what save_optimizer wrote, at this world size (it may differ from the saving one)."""
    sd = {"optim": get_optimizer_state_dict(model, optimizer)}
    drop_missing_error_feedback(sd, path)
    dcp.load(sd, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, sd["optim"])


def drop_missing_error_feedback(sd, path) -> None:
    """Remove from the load template `sd` ({name: optimizer state dict}) the error-feedback
    entries that the checkpoint under `path` lacks (saved without reduce_precision)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for top, osd in sd.items():
        for k, st in osd.get("state", {}).items():
            for key in ERROR_FEEDBACK_KEYS:
                if key in st and f"{top}.state.{k}.{key}" not in saved:
                    del st[key]
