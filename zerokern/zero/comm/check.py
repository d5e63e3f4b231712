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

import atexit
import collections
import itertools
import os
import queue
import sys
import threading
import time
import zlib
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..core.errors import CollectiveMismatch, RankLost
from .works import finished as _finished
from .forecast import Forecast


# What gloo says when the peer's process is gone (its sockets closed by the kernel).
_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")

_RESTART_HINT = ("If torchrun restarted the workers (--max-restarts) with --rdzv-backend c10d, the store it shares "
                 "with them still holds the last attempt's addresses (pytorch/pytorch#135712): set "
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or launch without --rdzv-backend c10d.")


# [Note: groups only some ranks make] torch names a group made with use_local_synchronization
# from its ranks and a salt, the counter _world.group_count, and every group made on a rank
# advances that counter, on the members alone for a local group. So the check's two groups for a
# sub-group (made by its members only: the other ranks never make a zerokern Comm for it) would
# leave the members' counters ahead of the others', and the next group made by every rank (a
# dist.new_group over the world) would get another name, and so another store prefix, on the
# members than on the rest: every rank waits in its barrier for good (issue 39). So the check
# makes its local groups off the books: salted by a counter of its own per set of ranks (the
# members make the check's groups for a set of ranks in the same order), from a range torch's
# counter never reaches, and torch's counter is put back afterwards.
# (tests/zero/comm/test_agreement_patterns.py: a sub-group trained on, then a world group.)
_OFF_THE_BOOKS = 1 << 48
_LOCAL_SALTS = {}  # ranks -> a counter of the check groups made for them


@contextmanager
def _off_the_books(ranks):
    world = dist.distributed_c10d._world
    kept = world.group_count
    salt = next(_LOCAL_SALTS.setdefault(tuple(ranks), itertools.count()))
    world.group_count = _OFF_THE_BOOKS + 16 * salt
    try:
        yield
    finally:
        world.group_count = kept


def _new_group(ranks, **kw):
    """dist.new_group, naming the known cause when it fails on a restarted worker."""
    try:
        return dist.new_group(ranks, **kw)
    except RuntimeError as e:
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            raise RuntimeError(f"zerokern: creating its process groups failed on a restarted worker "
                               f"({str(e).splitlines()[0][:160]}). " + _RESTART_HINT) from e
        raise


def _timeout() -> float:
    raw = os.environ.get("ZEROKERN_COLLECTIVE_TIMEOUT", "600")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"zerokern: ZEROKERN_COLLECTIVE_TIMEOUT={raw!r} is not a positive number of seconds")
    return value


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


def posted_cause():
    """The error another rank posted before it stopped ([Note: the cause, on every rank]), or None."""
    store = _store()
    if store is None:
        return None
    try:
        return store.get(_CAUSE_KEY).decode() if store.check([_CAUSE_KEY]) else None
    except Exception:  # noqa: BLE001  the store went with the rank that hosted it
        return None


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


def _code(what: str) -> int:
    return (1 << 32) | zlib.crc32(what.encode())  # > 0: 0 is an empty slot


_LAUNCHED = threading.Event()  # shared by the collectives launched from the plan: set, never cleared
_LAUNCHED.set()


class _Queued:
    """A collective the check's thread launches once every rank announced it, or one launched from
    the plan at once; Work-like. Where plans are on, its wait gives up when the check failed (a
    rank that left the plan will never make it) or it waited past the timeout ([Note: planned
    collectives]); elsewhere (NCCL) a bounded wait would block the host, so it waits as before."""

    def __init__(self, check, seq, what, launched=False):
        self._ready = _LAUNCHED if launched else threading.Event()  # a planned one is launched at once
        self._work = None
        self._error = None
        self._check, self._seq, self._what = check, seq, what
        self.launched_at = None

    def _launched(self, work) -> "_Queued":
        self._work = work
        self.launched_at = time.monotonic()
        if self._ready is not _LAUNCHED:
            self._ready.set()
        return self

    def _failed(self, error) -> None:
        self._error = error
        self._ready.set()

    def wait(self):
        self._ready.wait()
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        check = self._check
        try:
            while check.plans and not _finished(self._work, POLL_SECONDS):
                if check._error is not None:
                    raise type(check._error)(*check._error.args)
                if time.monotonic() - self.launched_at > check.timeout:
                    check._timed_out(self._seq, self._what)
            return self._work.wait()
        except RuntimeError as e:  # launched, then a peer vanished mid-transfer
            if any(g in str(e) for g in _GONE):
                raise _rank_lost(check.rank, f"during #{self._seq} {self._what}", e) from None
            raise

    def is_completed(self) -> bool:
        return self._ready.is_set() and (self._error is not None or self._work.is_completed())


_REFILL = object()  # queued by the caller at the middle of the plan: agree on the next stretch
_STOP = object()  # queued at exit: the thread returns


def _stop_threads() -> None:
    """At exit, before Python finalizes: a check's thread wakes every POLL_SECONDS ([Note:
    planned collectives]), and one that wakes while the interpreter finalizes is ended inside C++
    code (SIGABRT, as in [Note: exit drain]), so each thread is told to return and given a moment
    to. One still inside a round (its peer gone) stays blocked there, holding nothing."""
    for check in list(_CHECKS.values()):
        check._stop()


atexit.register(_stop_threads)


class CollectiveCheck:
    """The announcements of one process group: their gloo group, the group zerokern's own
    collectives run on, the sequence number, the plan, and the thread that launches in order."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = _timeout()
        ranks = dist.get_process_group_ranks(group)
        # Local synchronization: only the group's members create them (a sub-group's other ranks
        # never make a zerokern Comm for it). WORLD's are made by everyone anyway.
        local = group is not dist.group.WORLD
        with _off_the_books(ranks) if local else nullcontext():
            self.control = _new_group(ranks, backend="gloo", timeout=timedelta(seconds=self.timeout),
                                      use_local_synchronization=local)
            self.data = _new_group(ranks, backend=dist.get_backend(group), use_local_synchronization=local)
        self.seq = 0  # collectives queued by the caller
        self.rounds = 0  # announcement rounds so far (tests and bench/collective_check.py read it)
        self.planned = 0  # collectives launched from the plan, without a round of their own
        self.plans = (dist.get_backend(group) == "gloo"
                      and os.environ.get("ZEROKERN_PLAN_COLLECTIVES", "1") != "0")
        self.forecast = Forecast()  # every agreed collective; its end is the last agreed sequence number
        self._plan = {}  # seq -> checksum: agreed, not queued here yet ([Note: planned collectives])
        self._blocking = set()  # checksums of collectives whose launch blocks (object gathers): never forecast
        self._refill_at = None  # the caller queueing this planned seq asks for the next stretch
        # The next stretch was asked for and no round has been made since (the thread reads this, not
        # the _REFILL items, which only wake it: one queued before a round that answered it is stale).
        self._refill_due = False
        self._made = collections.OrderedDict()  # seq -> (what, checksum, from the plan) launched here lately
        self._in_flight = []  # planned collectives launched, maybe not completed
        self._joined = 0  # the last deviation this rank answered
        self._launched_to = 0  # the last collective launched here (in order, each one agreed)
        self._unlaunched = 0  # queued for the thread, not launched yet: the caller launches nothing before them
        self._lock = threading.Lock()  # the plan and the counts above, between the caller and the thread
        self._queue = queue.SimpleQueue()
        self._error = None  # the first failure: every later collective fails with it
        self._thread = None
        self._stopping = False
        self._side = {}  # CUDA device index -> the stream launches are made on
        self._deviation_key = _DEVIATION_KEY + self.control.group_name  # the same on every member
        _install_excepthook()  # [Note: the cause, on every rank]

    def submit(self, name: str, tensor, launch, blocks: bool = False):
        """Queue launch() (which starts the collective on self.data and returns its Work) behind
        its announcement, or launch it now if it is the planned one; the Work-like answer waits
        for both. blocks: launch() returns only when the collective is done (as an object gather)."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        self.seq += 1
        seq = self.seq
        what = name if tensor is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
        code = _code(what)
        with self._lock:
            if tensor is None or blocks:
                # An object gather's launch blocks until every rank launched it, so one launched from
                # the plan could not be answered when a rank left it there (the caller would hang
                # in it): it is never forecast, every rank announces it. Every code a forecast holds
                # was queued here first, so every rank knows it as blocking before forecasting it.
                self._blocking.add(code)
            planned = self._plan.pop(seq, None)
            # launched here only when nothing queued before it is still to be launched by the thread
            if planned == code and self._unlaunched == 0 and (tensor is None or not tensor.is_cuda):
                self._planned_launch(seq, what, code)
            else:
                if planned == code:
                    self._plan[seq] = code  # the thread launches it, after those queued before it
                elif planned is not None:  # deviates: nothing planned is launched here from seq on
                    self._void_plan(seq)
                planned = None
                self._unlaunched += 1
                mark = device = None
                if tensor is not None and tensor.is_cuda:
                    device = tensor.device
                    mark = torch.cuda.Event()
                    mark.record(torch.cuda.current_stream(device))
                elif torch.cuda.is_initialized():  # the current device is per thread (NCCL's object gathers use it)
                    device = torch.device("cuda", torch.cuda.current_device())
                queued = _Queued(self, seq, what)
                self._queue.put((seq, what, code, name, launch, device, mark, queued))
        if planned is not None:
            try:
                with record_function(f"zerokern::{name}"):
                    work = _Queued(self, seq, what, launched=True)._launched(launch())
            except BaseException as e:  # noqa: BLE001  the others launched it: every later collective fails too
                self._fail(e, seq, what)
                raise type(self._error)(*self._error.args) from e
            with self._lock:
                self._in_flight.append(work)
                if len(self._in_flight) > 2 * WINDOW:  # waited ones go (the thread prunes only when idle)
                    self._in_flight = [q for q in self._in_flight if not q.is_completed()]
            return work
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"zerokern-collectives-{id(self)}", daemon=True)
            self._thread.start()
        return queued

    def _planned_launch(self, seq, what, code) -> None:
        """(Lock held.) The planned collective at seq is being launched, by the caller or the
        thread: remembered, and at the middle of the plan the next stretch is asked for."""
        self.planned += 1
        self._remember(seq, what, code, planned=True)

    def _void_plan(self, seq) -> None:
        """(Lock held.) This rank left the plan at seq: what was planned before it still stands
        (the collectives queued before it, which the thread launches), nothing from it on does."""
        self._plan = {s: c for s, c in self._plan.items() if s < seq}
        if self._refill_at is not None and self._refill_at >= seq:
            self._refill_at = None

    def _remember(self, seq, what, code, planned=False) -> None:
        """(Lock held.) What was launched at seq, and whether from the plan. Launching the middle
        of the plan asks for the next stretch: every rank that launches it does (a rank that left
        the plan before it does not, and neither do the others, who left it alike or raise)."""
        if seq not in self._made:  # (a planned one was remembered as it was launched)
            self._made[seq] = (what, code, planned)
            while len(self._made) > 4 * WINDOW:
                self._made.popitem(last=False)
        if seq > self._launched_to:
            self._launched_to = seq
            if seq == self._refill_at:
                self._refill_at = None
                self._refill_due = True
                self._queue.put(_REFILL)

    def _stop(self) -> None:
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        pending = collections.deque()  # queued, not launched yet, in order
        while True:
            if not pending:
                try:
                    item = self._queue.get(timeout=POLL_SECONDS if self.plans else None)
                except queue.Empty:
                    self._answer_deviation()
                    continue
                self._take(item, pending)
            while True:  # [Note: announcing in rounds]: whatever else is queued goes along
                try:
                    self._take(self._queue.get_nowait(), pending)
                except queue.Empty:
                    break
            if self._stopping:
                return
            if self._error is not None:
                self._fail_all(pending)
                continue
            with self._lock:
                refill, self._refill_due = self._refill_due, False
            if not pending and not refill:
                continue
            try:
                while refill and pending and pending[0][0] <= self.forecast.end:
                    # The caller asked for the next stretch, then left the plan: every rank asks
                    # for that stretch in a round of its own (one that followed the plan, or left
                    # it later, too), so this one does as well, before announcing where it left;
                    # and so for the next stretch that round asks for at once (this rank launched
                    # past its middle already: so did every rank by the time it leaves the plan).
                    self._round(collections.deque())
                    with self._lock:
                        refill, self._refill_due = self._refill_due, False
                self._round(pending)
            except BaseException as e:  # noqa: BLE001  handed to the waiters, and to every later collective
                self._fail(e, *(pending[0][:2] if pending else (self.forecast.end + 1, "planned collectives")))
            if self._error is not None:
                self._fail_all(pending)

    def _take(self, item, pending) -> None:
        """A queued item: the planned collective (launched now), a collective to announce (into
        pending), or a wake-up (the caller asked for the next stretch: self._refill_due)."""
        if item is _REFILL or item is _STOP:
            return
        seq, what, code = item[:3]
        with self._lock:
            planned = not pending and self._plan.get(seq) == code and self._error is None
            if planned:  # planned since it was queued
                del self._plan[seq]
                self._planned_launch(seq, what, code)
            elif seq in self._plan:  # deviates (the caller had not seen the plan yet)
                self._void_plan(seq)
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
                queued._launched(launch())
        except BaseException as e:  # noqa: BLE001
            self._fail(e, seq, what)
            queued._failed(self._error)
        with self._lock:
            self._unlaunched -= 1
            self._remember(seq, what, code, planned)
            if planned:
                self._in_flight.append(queued)

    def _fail_all(self, pending) -> None:
        while pending:
            pending.popleft()[-1]._failed(self._error)
            with self._lock:
                self._unlaunched -= 1

    def _fail(self, e, seq, what) -> None:
        """The first failure: the waiter of #seq gets it, and so does every later collective."""
        error = e if isinstance(e, CollectiveMismatch) else CollectiveMismatch(
            f"zerokern (rank {self.rank}): launching #{seq} {what} failed: {type(e).__name__}: {e}")
        with self._lock:
            if self._error is None:
                self._error = error

    def _timed_out(self, seq, what):
        """A planned collective waited past the timeout: the same error as an announcement's."""
        error = self._waiting_failed(seq, what, "timed out")
        raise type(error)(*error.args)

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
            self._in_flight = [q for q in self._in_flight if not q.is_completed()]
        if not self._in_flight or time.monotonic() - self._in_flight[0].launched_at < POLL_SECONDS:
            return
        store = _store()
        try:
            if store is None or not store.check([self._deviation_key]):
                return
            seq = int(store.get(self._deviation_key))
        except Exception:  # noqa: BLE001  the store is gone too: the wait's own error comes
            return
        made = self._made.get(seq)
        if seq <= self._joined or made is None or not made[2]:  # only where this rank followed the plan
            return
        self._joined = seq
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
            agreed_to = self.forecast.end
        slots = [(seq, what, code, True) for seq, what, code, *_ in itertools.islice(pending, WINDOW)]
        if pending and pending[0][0] <= agreed_to:
            # deviates from the plan at pending[0]: posted for ranks that followed it, no forecast
            start = pending[0][0]
            _post(self._deviation_key, str(start))
        else:
            start = agreed_to + 1
            if self.plans and len(slots) < WINDOW:
                ahead = self.forecast.ahead([code for _, _, code, _ in slots], WINDOW - len(slots))
                ahead = list(itertools.takewhile(lambda c: c not in self._blocking, ahead))
                slots += [(start + len(slots) + i, "", code, False) for i, code in enumerate(ahead)]
        agreed, forecast_somewhere = self._exchange(start, slots)
        launch = []
        with self._lock:
            if start <= self.forecast.end:  # every rank deviated alike at start: the plan after it is void
                self.forecast.truncate(start - 1)
                self._plan.clear()
            for j, (seq, _, code, _) in enumerate(slots[:agreed]):
                self.forecast.append(code)
                if pending and pending[0][0] == seq:
                    # queued here, only forecast on some other rank: planned there, so that rank
                    # may leave the plan at it, and this one must answer ([Note: planned collectives])
                    launch.append((pending.popleft(), forecast_somewhere[j]))
                else:
                    self._plan[seq] = code
            self._refill_at = None
            self._refill_due = False  # asked for before this round, which made one
            # the next stretch, asked for when the caller is half way through this one (if there is a
            # forecast at all: that depends only on what was agreed, so every rank decides alike)
            if agreed and self.plans and self.forecast.ahead((), 1):
                self._refill_at = self.forecast.end - WINDOW // 2
                if self._launched_to >= self._refill_at:
                    self._refill_at = None
                    self._refill_due = True
                    self._queue.put(_REFILL)
        for item, planned_somewhere in launch:  # the caller launches nothing planned until these are (self._unlaunched)
            self._launch_item(item, planned=planned_somewhere)
        while True:  # queued during the round, planned by it
            with self._lock:
                if not pending or pending[0][0] not in self._plan or self._error is not None:
                    return
                seq, what, code = pending[0][:3]
                if self._plan.pop(seq) != code:
                    self._void_plan(seq)
                    return
                self._planned_launch(seq, what, code)
                item = pending.popleft()
            self._launch_item(item, planned=True)

    def _exchange(self, start, slots):
        """The all-reduce of one round's ticket: how many leading slots every rank agreed on, and
        per agreed slot whether some rank had it only as a forecast; raises alike on every rank if
        they are at different collectives."""
        self.rounds += 1
        mine = [start] + [code for _, _, code, _ in slots] + [0] * (WINDOW - len(slots))
        mine += [int(real) for _, _, _, real in slots] + [0] * (WINDOW - len(slots))
        ticket = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
        seq, what = (slots[0][0], slots[0][1]) if slots else (start, "planned collectives")
        self._call(lambda: dist.all_reduce(ticket, op=dist.ReduceOp.MAX, group=self.control), seq, what)
        n = 1 + 2 * WINDOW
        top, bottom = ticket[:n].tolist(), [-x for x in ticket[n:].tolist()]
        codes_top, codes_bottom = top[1:1 + WINDOW], bottom[1:1 + WINDOW]
        everyone_real = bottom[1 + WINDOW]  # every rank's first slot is a queued collective
        if top[0] == bottom[0] and not (everyone_real and codes_top[0] != codes_bottom[0]):
            agreed = 0
            while agreed < len(slots) and codes_bottom[agreed] > 0 and codes_top[agreed] == codes_bottom[agreed]:
                agreed += 1
            return agreed, [bottom[1 + WINDOW + j] == 0 for j in range(agreed)]
        # The rounds start at different places, or every rank queued a different first collective.
        first = bottom[0]
        mine_there = self._made.get(first)
        said = (first, mine_there[0]) if mine_there else (seq, what + ("" if slots and slots[0][3] else " (planned)"))
        everyone = [None] * self.world_size
        self._call(lambda: dist.all_gather_object(everyone, said, group=self.control), seq, what)
        raise CollectiveMismatch(
            "zerokern: the ranks reached different collectives, which cannot pair: "
            + "; ".join(f"rank {r} at #{s} {w}" for r, (s, w) in enumerate(everyone)) + ". " + _HINT)

    def _waiting_failed(self, seq, what, cause):
        error = CollectiveMismatch(
            f"zerokern (rank {self.rank}): waiting for the other ranks to reach #{seq} {what} failed "
            f"({cause}): a rank stopped, raised, or waits elsewhere (timeout "
            f"{self.timeout:g} s, ZEROKERN_COLLECTIVE_TIMEOUT). " + _HINT)
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

# One check per process group (the groups' Comm objects share its sequence numbers: the group's
# collectives pair in one order, whichever Comm launched them).
_CHECKS = {}


def for_group(group):
    """The group's CollectiveCheck, made on first use (a collective: every member makes its
    first Comm for the group at the same call), or None where checks are off."""
    if os.environ.get("ZEROKERN_CHECK_COLLECTIVES", "1") == "0":
        return None
    entry = _CHECKS.get(id(group))
    if entry is None or entry.group is not group:
        entry = _CHECKS[id(group)] = CollectiveCheck(group)
    return entry
