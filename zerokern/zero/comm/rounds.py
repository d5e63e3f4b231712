"""The check's rounds and plan ([Note: announcing in rounds], [Note: planned collectives]): the
ticket one round all-reduces, packed and unpacked by itself, and the plan's bookkeeping, shared
by the caller and the check's thread under the check's lock. No torch.distributed here."""

import collections
from typing import NamedTuple, Tuple

import torch

from .forecast import Forecast

# [Note: announcing in rounds] One announcement per collective cost a round trip on the control
# group each (0.3-1 ms on 2 loaded CPU ranks, and a ring all-reduce's 2(N-1) hops on N ranks), so
# the check's thread announces in rounds: each round takes every collective queued by then (up to
# WINDOW) and all-reduces (MAX) one ticket: where the round starts (the first sequence number it
# covers) and per slot j, v_j = (1, checksum of name, shape, dtype) of this rank's collective there
# (0: nothing there) and whether that collective was queued (real) or only forecast ([Note:
# planned collectives]), each also negated, so the MAX gives every slot's max and min over the
# ranks. Every rank gets the same reduced ticket and so decides alike: the leading slots where
# every rank has the same nonzero v are agreed, in order; the rest wait for the next round (a
# rank that has not queued them yet, or one whose forecast was wrong). The ranks are at
# different collectives, and every rank raises, when the rounds start at different places or
# every rank's first slot is real and they differ.
WINDOW = 64

# [Note: planned collectives] Even in rounds, a collective launched only after a round trip waits
# for it whenever the caller needs its result at once (a stage-3 unit's gather, the next step's
# first collective): 1.3-1.5x a stage-3 step on 2 CPU ranks (bench/collective_check.py). But a
# training loop makes the same collectives every step, so each round also fills the slots after
# the queued collectives with a forecast (forecast.py: what followed the same collectives last
# time; every rank forecasts alike, from the same agreed past). Forecast slots every rank agrees
# on are a plan: when the caller then queues the planned collective it is launched at once, on
# the caller's thread, with no round trip, and when the caller passes the middle of the plan the
# thread agrees the next stretch in the background. A planned collective is safe to launch
# early: every rank agreed to make exactly it at that point, so it can only ever meet its
# partner. What is left is a rank that makes something else at a planned point (it deviates):
#   - it never launches the planned collective (nor any after it) and announces what it made
#     instead, in a round that starts there; if every rank deviated alike, they agree on it and go
#     on (a batch skipped on every rank);
#   - a rank that followed the plan is waiting on a collective the deviating rank never makes, or
#     its thread is in the next round, which starts elsewhere: a mismatch, and every rank raises.
#     For the first case the deviating rank posts where it deviated on the store, and a rank whose
#     planned collective has waited over POLL_SECONDS looks there (one store read per poll, only
#     then) and announces, in a round that starts at that point, what it made there.
# A planned wait is bounded like an announcement: ZEROKERN_COLLECTIVE_TIMEOUT, then the same
# error. Plans are used where the backend's waits block the host (gloo): on NCCL the host does not
# wait on a collective, so a rank that followed a plan would hang in the GPU's stream instead of
# raising, and every collective is announced first, as before. ZEROKERN_PLAN_COLLECTIVES=0 turns
# plans off.
POLL_SECONDS = 0.2
_DEVIATION_KEY = "zerokern/deviation/"



class Ticket(NamedTuple):
    """One rank's slots in a round, or (unpacked) their max or min over the ranks: where the round
    starts, each slot's checksum (0: empty) and whether it was queued (1) or only forecast (0)."""
    start: int
    codes: Tuple[int, ...]  # WINDOW of them
    reals: Tuple[int, ...]  # WINDOW of them

    @staticmethod
    def of(start, slots) -> "Ticket":
        """slots: (seq, what, code, real) each, at most WINDOW."""
        pad = (0,) * (WINDOW - len(slots))
        return Ticket(start, tuple(code for _, _, code, _ in slots) + pad,
                      tuple(int(real) for _, _, _, real in slots) + pad)

    def pack(self) -> torch.Tensor:
        """[v, -v]: a MAX all-reduce of it gives every value's max and min over the ranks."""
        v = [self.start, *self.codes, *self.reals]
        return torch.tensor(v + [-x for x in v], dtype=torch.int64)

    @staticmethod
    def unpack(reduced: torch.Tensor) -> Tuple["Ticket", "Ticket"]:
        """The (max, min) tickets over the ranks from a MAX-reduced pack()."""
        n = 1 + 2 * WINDOW
        top, bottom = reduced[:n].tolist(), [-x for x in reduced[n:].tolist()]
        return tuple(Ticket(t[0], tuple(t[1:1 + WINDOW]), tuple(t[1 + WINDOW:])) for t in (top, bottom))

    def agreed(self, bottom: "Ticket", slots: int):
        """(self: the max.) How many of the leading `slots` every rank has alike, and per agreed
        slot whether some rank had it only as a forecast; None where the ranks are at different
        collectives: the rounds start at different places, or every rank queued a different first one."""
        if self.start != bottom.start or (bottom.reals[0] and self.codes[0] != bottom.codes[0]):
            return None
        n = 0
        while n < slots and bottom.codes[n] > 0 and self.codes[n] == bottom.codes[n]:
            n += 1
        return n, [bottom.reals[j] == 0 for j in range(n)]


class Plan:
    """What the ranks agreed to ahead, and what this rank launched lately (the check's lock held)."""

    def __init__(self):
        self.forecast = Forecast()  # every agreed collective; its end is the last agreed sequence number
        self.steps = {}  # seq -> checksum: agreed, not queued here yet ([Note: planned collectives])
        self.blocking = set()  # checksums of collectives whose launch blocks (object gathers): never forecast
        self.refill_at = None  # the caller queueing this planned seq asks for the next stretch
        # The next stretch was asked for and no round has been made since (the thread reads this, not
        # the refill items, which only wake it: one queued before a round that answered it is stale).
        self.refill_due = False
        self.made = collections.OrderedDict()  # seq -> (what, checksum, from the plan) launched here lately
        self.in_flight = []  # planned collectives launched, maybe not completed
        self.joined = 0  # the last deviation this rank answered
        self.launched_to = 0  # the last collective launched here (in order, each one agreed)
        self.planned = 0  # collectives launched from the plan, without a round of their own

    def planned_launch(self, seq, what, code) -> bool:
        """The planned collective at seq is being launched, by the caller or the thread:
        remembered; True where the next stretch is to be asked for now (remember())."""
        self.planned += 1
        return self.remember(seq, what, code, planned=True)

    def void(self, seq) -> None:
        """This rank left the plan at seq: what was planned before it still stands (the collectives
        queued before it, which the thread launches), nothing from it on does."""
        self.steps = {s: c for s, c in self.steps.items() if s < seq}
        if self.refill_at is not None and self.refill_at >= seq:
            self.refill_at = None

    def remember(self, seq, what, code, planned=False) -> bool:
        """What was launched at seq, and whether from the plan. Launching the middle of the plan
        asks for the next stretch (True: the caller wakes the thread): every rank that launches it
        does (a rank that left the plan before it does not, and neither do the others, who left it
        alike or raise)."""
        if seq not in self.made:  # (a planned one was remembered as it was launched)
            self.made[seq] = (what, code, planned)
            while len(self.made) > 4 * WINDOW:
                self.made.popitem(last=False)
        if seq > self.launched_to:
            self.launched_to = seq
            if seq == self.refill_at:
                self.refill_at = None
                self.refill_due = True
                return True
        return False
