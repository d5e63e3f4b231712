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
for every collective queued by then ([Note: announcing in rounds]). On a mismatch every rank
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
import itertools
import os
import queue
import sys
import threading
import zlib
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..core.errors import CollectiveMismatch, RankLost


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
# (tests/test_agreement_patterns.py: a sub-group trained on, then a world group.)
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


def _post_cause(message: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(_CAUSE_KEY, message)
        except Exception:  # noqa: BLE001  best effort ([Note: the cause, on every rank])
            pass


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
# WINDOW) and all-reduces (MAX) one ticket with a slot per collective, [v_1..v_W, -v_1..-v_W] for
# v_j = (sequence number + 1, checksum of name, shape, dtype) of this rank's j-th, 0 for a slot
# it has nothing for. Every rank gets the same reduced ticket and so decides alike: the leading
# slots where max(v) == -max(-v) > 0 (every rank announced the same) are launched, in order; the
# rest wait for the next round (a rank that has not queued them yet, or differs there: the next
# round's first slot tells). A rank takes part in a round only with something queued, and every
# rank launched the same collectives before, so the first slot is filled on every rank with the
# same sequence number: if it differs, the ranks are at different collectives, and every rank
# raises. A collective is still launched only after every rank announced it; what changes is
# that a unit's gathers, or the reduce-scatters a backward queued while the thread was waiting,
# share one round trip, and the thread is never more than a round behind the caller.
WINDOW = 32


class _Queued:
    """A collective the check's thread launches once every rank announced it; Work-like."""

    def __init__(self, rank=None, what=""):
        self._ready = threading.Event()
        self._work = None
        self._error = None
        self._rank, self._what = rank, what

    def _launched(self, work) -> None:
        self._work = work
        self._ready.set()

    def _failed(self, error) -> None:
        self._error = error
        self._ready.set()

    def wait(self):
        self._ready.wait()
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        try:
            return self._work.wait()
        except RuntimeError as e:  # announced and launched, then a peer vanished mid-transfer
            if any(g in str(e) for g in _GONE):
                raise _rank_lost(self._rank, f"during {self._what}", e) from None
            raise

    def is_completed(self) -> bool:
        return self._ready.is_set() and (self._error is not None or self._work.is_completed())


class CollectiveCheck:
    """The announcements of one process group: their gloo group, the group zerokern's own
    collectives run on, the sequence number, and the thread that launches in order."""

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
        self.seq = 0
        self.rounds = 0  # announcement rounds so far (tests and bench/collective_check.py read it)
        self._queue = queue.SimpleQueue()
        self._error = None  # the first failure: every later collective fails with it
        self._thread = None
        self._side = {}  # CUDA device index -> the stream launches are made on
        _install_excepthook()  # [Note: the cause, on every rank]

    def submit(self, name: str, tensor, launch):
        """Queue launch() (which starts the collective on self.data and returns its Work) behind
        its announcement; the Work-like answer waits for both."""
        if self._error is not None:
            raise type(self._error)(*self._error.args)
        self.seq += 1
        what = name if tensor is None else f"{name} {tuple(tensor.shape)} {tensor.dtype}"
        mark = device = None
        if tensor is not None and tensor.is_cuda:
            device = tensor.device
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(device))
        elif torch.cuda.is_initialized():  # the current device is per thread (NCCL's object gathers use it)
            device = torch.device("cuda", torch.cuda.current_device())
        queued = _Queued(self.rank, f"#{self.seq} {what}")
        self._queue.put((self.seq, what, name, launch, device, mark, queued))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"zerokern-collectives-{id(self)}", daemon=True)
            self._thread.start()
        return queued

    def _run(self) -> None:
        pending = collections.deque()  # queued, not yet launched, in order
        while True:
            if not pending:
                pending.append(self._queue.get())
            while len(pending) < WINDOW:  # [Note: announcing in rounds]: whatever else is queued goes along
                try:
                    pending.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._error is not None:
                while pending:
                    pending.popleft()[-1]._failed(self._error)
                continue
            try:
                agreed = self._announce([item[:2] for item in itertools.islice(pending, WINDOW)])
            except BaseException as e:  # noqa: BLE001  handed to the waiters, and to every later collective
                self._fail(e, *pending[0][:2])
                continue
            for _ in range(agreed):
                seq, what, name, launch, device, mark, queued = pending.popleft()
                try:
                    with self._stream(device, mark), record_function(f"zerokern::{name}"):
                        queued._launched(launch())
                except BaseException as e:  # noqa: BLE001
                    self._fail(e, seq, what)
                    queued._failed(self._error)
                    break
            if self._error is not None:
                while pending:
                    pending.popleft()[-1]._failed(self._error)

    def _fail(self, e, seq, what) -> None:
        """The first failure: the waiter of #seq gets it, and so does every later collective."""
        self._error = e if isinstance(e, CollectiveMismatch) else CollectiveMismatch(
            f"zerokern (rank {self.rank}): launching #{seq} {what} failed: {type(e).__name__}: {e}")

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

    def _announce(self, items) -> int:
        """One round ([Note: announcing in rounds]): `items`, this rank's next (seq, what) in
        order (at least one, at most WINDOW), against every rank's. Returns how many of them every
        rank announced alike (the collectives to launch now); raises alike on every rank if the
        first differs."""
        self.rounds += 1
        seq, what = items[0]
        mine = [((s % (1 << 30) + 1) << 32) | zlib.crc32(w.encode()) for s, w in items]  # > 0: 0 is an empty slot
        mine += [0] * (WINDOW - len(mine))
        ticket = torch.tensor(mine + [-v for v in mine], dtype=torch.int64)
        self._call(lambda: dist.all_reduce(ticket, op=dist.ReduceOp.MAX, group=self.control), seq, what)
        top, bottom = ticket[:WINDOW].tolist(), [-x for x in ticket[WINDOW:].tolist()]
        agreed = 0
        while agreed < WINDOW and bottom[agreed] > 0 and top[agreed] == bottom[agreed]:
            agreed += 1
        if agreed:
            return agreed
        # Every rank announced at least one, for the same sequence number (every rank launched the
        # same ones before): the first slot differs, so the ranks are at different collectives.
        everyone = [None] * self.world_size
        self._call(lambda: dist.all_gather_object(everyone, (seq, what), group=self.control), seq, what)
        raise CollectiveMismatch(
            "zerokern: the ranks reached different collectives, which cannot pair: "
            + "; ".join(f"rank {r} at #{s} {w}" for r, (s, w) in enumerate(everyone)) + ". " + _HINT)

    def _call(self, op, seq, what) -> None:
        try:
            op()
        except RuntimeError as e:
            cause = str(e).splitlines()[0][:160]
            if any(g in str(e) for g in _GONE):
                raise _rank_lost(self.rank, f"while this one waited for #{seq} {what}", e) from None
            error = CollectiveMismatch(
                f"zerokern (rank {self.rank}): waiting for the other ranks to reach #{seq} {what} failed "
                f"({cause}): a rank stopped, raised, or waits elsewhere (timeout "
                f"{self.timeout:g} s, ZEROKERN_COLLECTIVE_TIMEOUT). " + _HINT)
            _post_cause(str(error))  # [Note: the cause, on every rank]
            raise error from None


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
