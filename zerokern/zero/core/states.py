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


class ParamState(enum.Enum):
    """Where one param bucket's full buffer stands (BucketParams owns it, at every stage)."""

    SHARDED = "sharded"  # only this rank's slice is current (stage 3: the buffer has no storage, the params' data is empty)
    GATHERING = "gathering"  # the all-gather runs into the full buffer: nothing may read or write it yet
    GATHERED = "gathered"  # the full buffer holds every rank's slice
