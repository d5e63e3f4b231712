"""The errors zerokern raises on purpose, so that users can catch them (all exported from
`zerokern`). Each is raised alike on every rank that the cause reaches."""

import dataclasses


class CollectiveMismatch(RuntimeError):
    """The ranks reached different collectives (raised alike on every rank)."""


class RankLost(CollectiveMismatch):
    """Another rank's connection closed while this one waited for it: that rank exited, crashed
    or was killed (a CollectiveMismatch too, so code that catches those catches this)."""


class WrappedInDDPError(RuntimeError):
    """The model's params that a FusedZeroAdam trains are reduced by torch's DistributedDataParallel."""


def which_differ(everyone) -> str:
    """For an agreement error: each field (a key of the ranks' dicts, in rank 0's order) whose
    value is not the same on every rank, with every rank's value:
    "reduce_precision (rank 0: None; rank 1: 'int8')"."""
    keys = [k for k in everyone[0] if any(e.get(k) != everyone[0][k] for e in everyone)]
    return ", ".join(f"{k} (" + "; ".join(f"rank {r}: {e.get(k)!r}" for r, e in enumerate(everyone)) + ")"
                     for k in keys)


def fields_of(config) -> dict:
    """A dataclass's fields by name (ShardConfig): compared field by field across ranks."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
