"""The named states of the ZeRO runtime. Each is changed by the methods of the
one object that owns it (GradBucket for a bucket, ReduceSchedule for a
backward); everything else reads it. docs/DESIGN.md draws the transitions."""

import enum


class BucketState(enum.Enum):
    """Where one gradient bucket stands in the current reduction round (a round
    ends at step() or zero_grad())."""

    IDLE = "idle"  # not reduced in this round; the local buffer (if any) is the truth
    IN_FLIGHT = "in_flight"  # its collective runs: nothing may read the result or write the input
    REDUCED = "reduced"  # the reduced shard is valid for the local grads as they were at launch


class BackwardState(enum.Enum):
    """Where the optimizer's schedule stands between two steps."""

    IDLE = "idle"  # no synced backward has fired a hook since the last step/zero_grad/reset
    RUNNING = "running"  # hooks fired; the end-of-backward callback is queued (it may never run)
    FINISHED = "finished"  # the callback ran: every bucket was launched, in the global order


class GatherState(enum.Enum):
    """Where one bucket's params stand after an update (ParamGather owns it)."""

    CURRENT = "current"  # every rank's slice holds the last update's values
    GATHERING = "gathering"  # the all-gather runs: only this rank's slice is current; nothing may read or write


class ParamState(enum.Enum):
    """Where one stage-3 unit's params stand (UnitParams owns it)."""

    SHARDED = "sharded"  # this rank holds its slices only; the params' data is empty
    GATHERING = "gathering"  # the all-gathers run into the full buffers: nothing may read them yet
    GATHERED = "gathered"  # the full buffers hold every rank's slice; the params view them
