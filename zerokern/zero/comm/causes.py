"""Why a rank stopped, said on every rank ([Note: the cause, on every rank]): the error a rank
posts on the store before it raises, the excepthook that quotes it after an uncaught error, and
the errors the collective check raises when a peer is gone."""

import sys

import torch.distributed as dist

from ..core.errors import RankLost

# What gloo says when the peer's process is gone (its sockets closed by the kernel).
_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")

_HINT = ("Every rank must make the same zerokern calls and run the same units, in the same order: run every unit "
         "on every rank (LayerDrop, MoE experts: give a skipped unit a zero-weight input instead), run as many "
         "batches on every rank (an eval loop over shards of different lengths: pad the shorter ones, as "
         "DistributedSampler does, or give a rank with no batch left a dummy one), skip a failed batch on every "
         "rank or stop, call full_state_dict/save_model on every rank (rank0_only=True keeps the result on rank 0), "
         "and pass synced_gpus=True to generate().")


# [Note: the cause, on every rank] A rank that gives up waiting for the others (the timeout: they
# are in code of their own, e.g. the all_reduce of an eval loss after running fewer batches) raises
# and exits, and the others then fail in whatever collective they were in, often the user's own,
# with gloo's bare "Connection closed by peer". So before raising, the rank posts its error on the
# process group's store, and a rank that meets a vanished peer names it: zerokern's RankLost quotes
# it, and for the user's own collective (which zerokern cannot wrap) an excepthook installed with
# the first check prints it after the traceback of the uncaught error. Best effort: the store may
# be gone too, and nothing here may raise.
_CAUSE_KEY = "zerokern/cause"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  no default group, or a torch without it: no posting
        return None


def _post(key: str, value: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(key, value)
        except Exception:  # noqa: BLE001  best effort: a rank that reads nothing there waits for its timeout
            pass


def _post_cause(message: str) -> None:
    _post(_CAUSE_KEY, message)  # best effort ([Note: the cause, on every rank])


def posted(key: str):
    """What another rank posted under `key` on the store, or None (best effort)."""
    store = _store()
    if store is None:
        return None
    try:
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001  the store went with the rank that hosted it
        return None


def posted_cause():
    """The error another rank posted before it stopped ([Note: the cause, on every rank]), or None."""
    return posted(_CAUSE_KEY)


def explain(error):
    """For an error a vanished peer caused (gloo's connection errors): the line that names the
    cause that peer posted, or None."""
    if not any(g in str(error) for g in _GONE):
        return None
    cause = posted_cause()
    if cause is None:
        return None
    rank = dist.get_rank() if dist.is_initialized() else "?"
    return f"zerokern (rank {rank}): this error follows another rank's, which it posted before it stopped: {cause}"


def _excepthook(previous):
    def hook(kind, value, tb):
        previous(kind, value, tb)
        line = explain(value)
        if line is not None:
            print(line, file=sys.stderr, flush=True)
    hook.zerokern = True
    return hook


def _install_excepthook() -> None:
    if not getattr(sys.excepthook, "zerokern", False):
        sys.excepthook = _excepthook(sys.excepthook)


def _rank_lost(rank, when, error) -> RankLost:
    """The error for a peer whose connection went away (it exited, crashed or was killed)."""
    cause = posted_cause()
    said = (f"It posted before it stopped: {cause}" if cause is not None else
            "Its own log says why.")
    return RankLost(
        f"zerokern (rank {rank}): another rank is gone {when} ({str(error).splitlines()[0][:160]}): it exited, "
        f"crashed or was killed. {said} Every rank stops here rather than wait. To go on, fix that, then restart "
        "all ranks from your last checkpoint (torchrun --max-restarts does, and DCP loads at any world size).")
