"""Every collective zerokern launches is first announced to the other ranks, so ranks that
reached different ones raise alike instead of hanging, aborting or mixing buffers.

[Note: announced collectives] Collectives pair by order: the k-th collective one rank launches
on a group meets the k-th of every other rank. A rank that skips one (a unit one rank's forward
did not run: LayerDrop, MoE experts; an exception one rank caught and went on from; a
full_state_dict or generate on rank 0 only) pairs everything after it with the wrong partner:
gloo aborts the process ("Received data size doesn't match expected size", SIGABRT, no Python
exception), NCCL hangs, and two buffers of the same size silently add up unrelated grads. So
before each collective every rank all-reduces (MAX) a small ticket, [v, -v] for v = (its
sequence number, a checksum of the collective's name, shape and dtype), over a gloo group of
its own: every rank's v is equal exactly when max(v) == -max(-v). Only then is the real
collective launched, so a data collective always meets its partner. One ticket carries a slot
for every collective queued by then ([Note: announcing in rounds]), and the slots after them
carry a forecast: a training loop repeats its collectives, so the ranks agree on the next ones
ahead and launch them with no round trip of their own ([Note: planned collectives]). On a mismatch every rank
gathers what each was at and raises the same error. As torch's TORCH_DISTRIBUTED_DEBUG=DETAIL
(ProcessGroupWrapper) checks collectives, but with one all-reduce of 16 bytes and the unit or
bucket named, on by default.

Who waits: announcing on the calling thread made each rank wait at every collective for the
slowest one (lockstep), which cost 30-45% of a 2-rank CPU training step (bench/train_step.py).
So the caller only queues the collective and gets a Work back at once; one thread per group
announces and launches the queue in order, and Work.wait() waits for the launch and then the
collective, as before. The launch moves off the caller's thread, so zerokern's collectives get a
process group of their own (the same ranks and backend): a user's collective on the group
(a logged loss, generate's synced_gpus flag, DCP) could otherwise be launched between two of
ours on one rank and not on another. On a GPU the caller's stream is marked at the queueing (an
event) and the launch makes a side stream wait for that mark only, so a reduction waits for the
grads it reduces and not for the compute queued after them.

The announcements go over gloo on the CPU: they never queue behind the data collectives in
flight and never wait for the GPU. The group's timeout bounds the wait for a rank that reaches no
collective at all (stuck in its own code, or gone): ZEROKERN_COLLECTIVE_TIMEOUT seconds (600 by
default, NCCL's); a rank that exits makes the others' wait fail at once.
ZEROKERN_CHECK_COLLECTIVES=0 turns all of this off (zerokern's collectives are launched on the
calling thread, on the user's group; a mismatch is then a hang or an abort again).
"""

import collections
import functools
import itertools
import os
import threading
import time
import zlib
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..core.errors import CollectiveMismatch, RankLost  # noqa: F401  (RankLost: check.RankLost is zerokern's)
from .causes import _GONE, _HINT, _install_excepthook, _post, _post_cause, _rank_lost, explain, posted  # noqa: F401
from .context import PROCESS
from .groups import _new_group, _timeout, check_groups  # noqa: F401  (check._new_group, check._timeout: the tests')
from .rounds import _DEVIATION_KEY, POLL_SECONDS, WINDOW, Plan, Ticket
from .worker import IDLE, STOP, OrderedWorker
from .works import Pending, finished


_REFILL = object()  # handed by the caller at the middle of the plan: agree on the next stretch


class CollectiveCheck:
    """The announcements of one process group: their gloo group, the group zerokern's own
    collectives run on, the sequence number, the plan, and the thread that launches in order."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.groups = check_groups(group)  # the announcements' and the launches' groups, and the timeout
        self.data = self.groups.data  # the group zerokern's own collectives are launched on
        self.seq = 0  # collectives queued by the caller
        self.rounds = 0  # announcement rounds so far (tests and bench/collective_check.py read it)
        self.plans = (dist.get_backend(group) == "gloo"
                      and os.environ.get("ZEROKERN_PLAN_COLLECTIVES", "1") != "0")
        self.plan = Plan()  # what the ranks agreed to ahead, and what was launched lately
        self._unlaunched = 0  # queued for the thread, not launched yet: the caller launches nothing before them
        self._lock = threading.Lock()  # the plan and the count above, between the caller and the thread
        self._worker = OrderedWorker("zerokern-collectives", serve=self._run).start()
        self._error = None  # the first failure: every later collective fails with it
        self._side = {}  # CUDA device index -> the stream launches are made on
        _install_excepthook()  # [Note: the cause, on every rank]

    @property
    def control(self):
        return self.groups.control

    @property
    def planned(self) -> int:
        """Collectives launched from the plan, without a round of their own."""
        return self.plan.planned

    def submit(self, name: str, tensor, launch, blocks: bool = False):
        """Queue launch() (which starts the collective on self.data and returns its Work) behind
        its announcement, or launch it now if it is the planned one; the Work-like answer waits
        for both. blocks: launch() returns only when the collective is done (as an object gather)."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        self.seq += 1
        seq = self.seq
        what = name if tensor is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
        code = (1 << 32) | zlib.crc32(what.encode())  # its checksum (> 0: 0 is an empty slot)
        with self._lock:
            if tensor is None or blocks:
                # An object gather's launch blocks until every rank launched it, so one launched from
                # the plan could not be answered when a rank left it there (the caller would hang
                # in it): it is never forecast, every rank announces it. Every code a forecast holds
                # was queued here first, so every rank knows it as blocking before forecasting it.
                self.plan.blocking.add(code)
            planned = self.plan.steps.pop(seq, None)
            # launched here only when nothing queued before it is still to be launched by the thread
            if planned == code and self._unlaunched == 0 and (tensor is None or not tensor.is_cuda):
                self._wake(self.plan.planned_launch(seq, what, code))
            else:
                if planned == code:
                    self.plan.steps[seq] = code  # the thread launches it, after those queued before it
                elif planned is not None:  # deviates: nothing planned is launched here from seq on
                    self.plan.void(seq)
                planned = None
                self._unlaunched += 1
                mark = device = None
                if tensor is not None and tensor.is_cuda:
                    device = tensor.device
                    mark = torch.cuda.Event()
                    mark.record(torch.cuda.current_stream(device))
                elif torch.cuda.is_initialized():  # the current device is per thread (NCCL's object gathers use it)
                    device = torch.device("cuda", torch.cuda.current_device())
                queued = Pending(waits=functools.partial(self._wait, seq, what))
                self._worker.queue.put((seq, what, code, name, launch, device, mark, queued))
        if planned is not None:
            try:
                with record_function(f"zerokern::{name}"):
                    work = Pending(waits=functools.partial(self._wait, seq, what), work=launch())
            except BaseException as e:  # noqa: BLE001  the others launched it: every later collective fails too
                self._fail(e, seq, what)
                raise type(self._error)(*self._error.args) from e
            with self._lock:
                self.plan.in_flight.append(work)
                if len(self.plan.in_flight) > 2 * WINDOW:  # waited ones go (the thread prunes only when idle)
                    self.plan.in_flight = [q for q in self.plan.in_flight if not q.is_completed()]
            return work
        return queued

    def _wait(self, seq, what, queued):
        """A launched collective's wait. Where plans are on, it gives up when the check failed (a
        rank that left the plan will never make it) or it waited past the timeout ([Note: planned
        collectives]); elsewhere (NCCL) a bounded wait would block the host, so it waits as before."""
        try:
            if not self.plans:
                return queued.work.wait()
            while not finished(queued.work, POLL_SECONDS):  # True: completed (not waited for again)
                if self._error is not None:
                    raise type(self._error)(*self._error.args)
                if time.monotonic() - queued.launched_at > self.groups.timeout:
                    error = self._waiting_failed(seq, what, "timed out")  # as an announcement's
                    raise type(error)(*error.args)
            return True
        except RuntimeError as e:  # launched, then a peer vanished mid-transfer
            if any(g in str(e) for g in _GONE):
                raise _rank_lost(self.rank, f"during #{seq} {what}", e) from None
            raise

    def _wake(self, due: bool) -> None:
        """(Lock held.) due: past the middle of the plan, the thread asks for the next stretch."""
        if due:
            self._worker.queue.put(_REFILL)

    def _run(self, worker) -> None:
        """The worker's loop ([Note: announcing in rounds]); returns at exit."""
        pending = collections.deque()  # queued, not launched yet, in order
        while True:
            if not pending:
                item = worker.take(POLL_SECONDS if self.plans else None)
                if item is IDLE:
                    self._answer_deviation()
                    continue
                self._take(item, pending)
            item = worker.take(0)
            while item is not IDLE:  # whatever else is queued goes along
                self._take(item, pending)
                item = worker.take(0)
            if worker.stopping:
                return
            if self._error is not None:
                self._fail_all(pending)
                continue
            with self._lock:
                refill, self.plan.refill_due = self.plan.refill_due, False
            if not pending and not refill:
                continue
            try:
                while refill and pending and pending[0][0] <= self.plan.forecast.end:
                    # The caller asked for the next stretch, then left the plan: every rank asks
                    # for that stretch in a round of its own (one that followed the plan, or left
                    # it later, too), so this one does as well, before announcing where it left;
                    # and so for the next stretch that round asks for at once (this rank launched
                    # past its middle already: so did every rank by the time it leaves the plan).
                    self._round(collections.deque())
                    with self._lock:
                        refill, self.plan.refill_due = self.plan.refill_due, False
                self._round(pending)
            except BaseException as e:  # noqa: BLE001  handed to the waiters, and to every later collective
                self._fail(e, *(pending[0][:2] if pending else (self.plan.forecast.end + 1, "planned collectives")))
            if self._error is not None:
                self._fail_all(pending)

    def _take(self, item, pending) -> None:
        """A queued item: the planned collective (launched now), a collective to announce (into
        pending), or a wake-up (the caller asked for the next stretch: self.plan.refill_due)."""
        if item is _REFILL or item is STOP:
            return
        seq, what, code = item[:3]
        with self._lock:
            planned = not pending and self.plan.steps.get(seq) == code and self._error is None
            if planned:  # planned since it was queued
                del self.plan.steps[seq]
                self._wake(self.plan.planned_launch(seq, what, code))
            elif seq in self.plan.steps:  # deviates (the caller had not seen the plan yet)
                self.plan.void(seq)
        if planned:
            self._launch_item(item, planned=True)
        else:
            pending.append(item)

    def _launch_item(self, item, planned=False) -> None:
        """Launches a queued collective (outside the lock: a launch may block, an object gather).
        planned: another rank may hold it as planned, so may leave the plan there (it is then
        answered, as a collective launched from the plan is: _answer_deviation)."""
        seq, what, code, name, launch, device, mark, queued = item
        try:
            with self._stream(device, mark), record_function(f"zerokern::{name}"):
                queued.resolve(launch())
        except BaseException as e:  # noqa: BLE001
            self._fail(e, seq, what)
            queued.fail(self._error)
        with self._lock:
            self._unlaunched -= 1
            self._wake(self.plan.remember(seq, what, code, planned))
            if planned:
                self.plan.in_flight.append(queued)

    def _fail_all(self, pending) -> None:
        while pending:
            pending.popleft()[-1].fail(self._error)
            with self._lock:
                self._unlaunched -= 1

    def _fail(self, e, seq, what) -> None:
        """The first failure: the waiter of #seq gets it, and so does every later collective."""
        error = e if isinstance(e, CollectiveMismatch) else CollectiveMismatch(
            f"zerokern (rank {self.rank}): launching #{seq} {what} failed: {type(e).__name__}: {e}")
        with self._lock:
            if self._error is None:
                self._error = error

    def _stream(self, device, mark):
        """The caller's CUDA device, and a side stream that waits for the caller's stream as it
        was at the queueing only."""
        if device is None:
            return nullcontext()
        if mark is None:
            return torch.cuda.device(device)
        side = self._side.get(device.index)
        if side is None:
            side = self._side[device.index] = torch.cuda.Stream(device)
        side.wait_event(mark)
        return torch.cuda.stream(side)

    def _answer_deviation(self) -> None:
        """[Note: planned collectives] The thread is idle and a planned collective has waited
        long: if a rank posted that it deviated at a point where this one launched the plan,
        announce what was made there, in a round that starts there (the deviating rank's)."""
        with self._lock:
            self.plan.in_flight = [q for q in self.plan.in_flight if not q.is_completed()]
        if not self.plan.in_flight or time.monotonic() - self.plan.in_flight[0].launched_at < POLL_SECONDS:
            return
        posted_at = posted(_DEVIATION_KEY + self.groups.control.group_name)  # the same key on every member
        if posted_at is None:  # (or the store is gone too: the wait's own error comes)
            return
        seq = int(posted_at)
        made = self.plan.made.get(seq)
        if seq <= self.plan.joined or made is None or not made[2]:  # only where this rank followed the plan
            return
        self.plan.joined = seq
        what, code, _ = made
        try:
            self._exchange(seq, [(seq, what, code, True)])
        except BaseException as e:  # noqa: BLE001
            self._fail(e, seq, what)

    def _round(self, pending) -> None:
        """One round ([Note: announcing in rounds]) over `pending` (this rank's queued
        collectives, in order) and the forecast after them; launches what every rank agreed to,
        keeps the forecast they agreed on as the plan, and raises alike on every rank if they are
        at different collectives."""
        with self._lock:
            agreed_to = self.plan.forecast.end
        slots = [(seq, what, code, True) for seq, what, code, *_ in itertools.islice(pending, WINDOW)]
        if pending and pending[0][0] <= agreed_to:
            # deviates from the plan at pending[0]: posted for ranks that followed it, no forecast
            start = pending[0][0]
            _post(_DEVIATION_KEY + self.groups.control.group_name, str(start))
        else:
            start = agreed_to + 1
            if self.plans and len(slots) < WINDOW:
                ahead = self.plan.forecast.ahead([code for _, _, code, _ in slots], WINDOW - len(slots))
                ahead = list(itertools.takewhile(lambda c: c not in self.plan.blocking, ahead))
                slots += [(start + len(slots) + i, "", code, False) for i, code in enumerate(ahead)]
        agreed, forecast_somewhere = self._exchange(start, slots)
        launch = []
        with self._lock:
            if start <= self.plan.forecast.end:  # every rank deviated alike at start: the plan after it is void
                self.plan.forecast.truncate(start - 1)
                self.plan.steps.clear()
            for j, (seq, _, code, _) in enumerate(slots[:agreed]):
                self.plan.forecast.append(code)
                if pending and pending[0][0] == seq:
                    # queued here, only forecast on some other rank: planned there, so that rank
                    # may leave the plan at it, and this one must answer ([Note: planned collectives])
                    launch.append((pending.popleft(), forecast_somewhere[j]))
                else:
                    self.plan.steps[seq] = code
            self.plan.refill_at = None
            self.plan.refill_due = False  # asked for before this round, which made one
            # the next stretch, asked for when the caller is half way through this one (if there is a
            # forecast at all: that depends only on what was agreed, so every rank decides alike)
            if agreed and self.plans and self.plan.forecast.ahead((), 1):
                self.plan.refill_at = self.plan.forecast.end - WINDOW // 2
                if self.plan.launched_to >= self.plan.refill_at:
                    self.plan.refill_at = None
                    self.plan.refill_due = True
                    self._worker.queue.put(_REFILL)
        for item, planned_somewhere in launch:  # the caller launches nothing planned until these are (self._unlaunched)
            self._launch_item(item, planned=planned_somewhere)
        while True:  # queued during the round, planned by it
            with self._lock:
                if not pending or pending[0][0] not in self.plan.steps or self._error is not None:
                    return
                seq, what, code = pending[0][:3]
                if self.plan.steps.pop(seq) != code:
                    self.plan.void(seq)
                    return
                self._wake(self.plan.planned_launch(seq, what, code))
                item = pending.popleft()
            self._launch_item(item, planned=True)

    def _exchange(self, start, slots):
        """The all-reduce of one round's ticket: how many leading slots every rank agreed on, and
        per agreed slot whether some rank had it only as a forecast; raises alike on every rank if
        they are at different collectives."""
        self.rounds += 1
        ticket = Ticket.of(start, slots).pack()
        seq, what = (slots[0][0], slots[0][1]) if slots else (start, "planned collectives")
        self._call(lambda: dist.all_reduce(ticket, op=dist.ReduceOp.MAX, group=self.groups.control), seq, what)
        top, bottom = Ticket.unpack(ticket)
        agreed = top.agreed(bottom, len(slots))
        if agreed is not None:
            return agreed
        first = bottom.start
        mine_there = self.plan.made.get(first)
        said = (first, mine_there[0]) if mine_there else (seq, what + ("" if slots and slots[0][3] else " (planned)"))
        everyone = [None] * self.world_size
        self._call(lambda: dist.all_gather_object(everyone, said, group=self.groups.control), seq, what)
        raise CollectiveMismatch(
            "zerokern: the ranks reached different collectives, which cannot pair: "
            + "; ".join(f"rank {r} at #{s} {w}" for r, (s, w) in enumerate(everyone)) + ". " + _HINT)

    def _waiting_failed(self, seq, what, cause):
        error = CollectiveMismatch(
            f"zerokern (rank {self.rank}): waiting for the other ranks to reach #{seq} {what} failed "
            f"({cause}): a rank stopped, raised, or waits elsewhere (timeout "
            f"{self.groups.timeout:g} s, ZEROKERN_COLLECTIVE_TIMEOUT). " + _HINT)
        with self._lock:  # the first one (a planned wait's or the thread's) is the one posted and raised
            if self._error is None:
                self._error = error
                _post_cause(str(error))  # [Note: the cause, on every rank]
            return self._error

    def _call(self, op, seq, what) -> None:
        try:
            op()
        except RuntimeError as e:
            if any(g in str(e) for g in _GONE):
                raise _rank_lost(self.rank, f"while this one waited for #{seq} {what}", e) from None
            raise self._waiting_failed(seq, what, str(e).splitlines()[0][:160]) from None

def for_group(group):
    """The group's CollectiveCheck, made on first use (a collective: every member makes its
    first Comm for the group at the same call), or None where checks are off. One per process
    group (in its context): the group's Comm objects share its sequence numbers, as the group's
    collectives pair in one order, whichever Comm launched them."""
    if os.environ.get("ZEROKERN_CHECK_COLLECTIVES", "1") == "0":
        return None
    ctx = PROCESS.of(group)
    if ctx.check is None:
        ctx.check = CollectiveCheck(group)
    return ctx.check
