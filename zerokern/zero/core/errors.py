"""The errors zerokern raises on purpose, so that users can catch them (all exported from
`zerokern`). Each is raised alike on every rank that the cause reaches."""


class CollectiveMismatch(RuntimeError):
    """The ranks reached different collectives (raised alike on every rank)."""


class RankLost(CollectiveMismatch):
    """Another rank's connection closed while this one waited for it: that rank exited, crashed
    or was killed (a CollectiveMismatch too, so code that catches those catches this)."""


class WrappedInDDPError(RuntimeError):
    """The model's params that a FusedZeroAdam trains are reduced by torch's DistributedDataParallel."""
