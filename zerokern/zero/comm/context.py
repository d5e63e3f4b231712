"""What zerokern's collectives keep per process and per process group, owned in one place, and
the one exit path (issue 48: nine module registries and three `atexit` hooks had each kept a
piece of it, with their own lifetimes).

PROCESS (the one module registry) holds a GroupContext per process group (its collective check,
its hosts, its p2p tags, its relay worker), the salts of the check's off-the-books groups, the
meshes and HybridComms zerokern made, and every ordered worker started. Entries are keyed by
`id(group)` and keep the group, checked on every look-up (`entry.group is group`), so a reused
id never returns another group's entry.

[Note: exit drain] Under torch 2.14 a tensor that has a Python object keeps that object alive
while C++ code holds the tensor too, and the C++ side drops it (Py_DECREF, or the whole dealloc)
when its last reference goes. gloo runs each collective on a worker thread, and that thread often
holds the last C++ reference to the collective's tensors: it releases them just after wait() has
returned in Python, and then needs the GIL. If the main thread runs on to interpreter shutdown
first (a collective in the last few milliseconds of a script, e.g. averaging the loss for the
log), CPython ends the waiting thread with pthread_exit; inside a noexcept C++ destructor that is
std::terminate: "terminate called without an active exception", SIGABRT, and torchrun reports the
job as failed after it finished. dist.destroy_process_group() does not help: torch's own modules
keep the group (and its threads) alive (constructing any torch.optim optimizer imports enough of
torch to do so). The fix is to give those threads the GIL before shutdown starts: at exit, the
main thread sleeps (without the GIL) for a few tens of milliseconds, long enough for a thread
waiting on the GIL, or one preempted on an oversubscribed machine, to release its tensors.
atexit callbacks run before CPython marks itself as finalizing, so the threads are still allowed
to take the GIL then. The cost is that pause, once, at the exit of a distributed process that
built a zerokern optimizer (comm/exit_drain.register() asks for it). zerokern's own threads (the
ordered workers) are then told to return after what was queued before, and given a moment to, so
none is still inside gloo when the interpreter finalizes.
"""

import atexit
import itertools
import time

# 50 ms was seen to fall short once in a few hundred 2-rank runs on a loaded 2-core machine
# (a DeepSpeed test, SIGABRT at exit); 200 ms, once per process, is still cheap.
EXIT_DRAIN_SECONDS = 0.2


class GroupContext:
    """What zerokern keeps for one process group (a user's, or one the check made)."""

    def __init__(self, group):
        self.group = group
        self.check = None  # its CollectiveCheck ([Note: announced collectives]), made by check.for_group
        self.hosts = None  # every rank's host, gathered once ([Note: what a host is] in comm/factory.py)
        # p2p tags: the members issue the group's collectives in one order ([Note: one collective
        # order]), so both sides of an exchange take the same tag, also where a rank is in several groups
        self.tags = itertools.count()
        self.relay = None  # the OrderedWorker of its collectives across hosts ([Note: the relay thread])


class ProcessContext:
    """Everything zerokern's collectives keep per process; shutdown() is the one exit path."""

    def __init__(self):
        self.groups = {}  # id(group) -> GroupContext
        self.salts = {}  # a set of ranks -> a counter of the check groups made for them ([Note: groups only some ranks make])
        self.meshes = {}  # (device type, sizes, id(default group)) -> the DeviceMesh zerokern made
        self.hybrids = {}  # (id(shard group), id(replica group)) -> HybridComm: every shard() call shares one
        self.workers = []  # every OrderedWorker started, stopped at exit
        self.drains = False  # [Note: exit drain] asked for

    def of(self, group) -> GroupContext:
        entry = self.groups.get(id(group))
        if entry is None or entry.group is not group:
            entry = self.groups[id(group)] = GroupContext(group)
        return entry

    def salt(self, ranks) -> int:
        return next(self.salts.setdefault(tuple(ranks), itertools.count()))

    def stop_relays(self) -> None:
        """Every group's relay returns once what was queued before is done ([Note: the relay thread])."""
        relays = [g for g in self.groups.values() if g.relay is not None]
        stop_all([g.relay for g in relays])
        for g in relays:
            g.relay = None

    def shutdown(self) -> None:
        """At exit ([Note: exit drain]): the drain's pause, then every worker told to return."""
        if self.drains:
            time.sleep(EXIT_DRAIN_SECONDS)
        stop_all(self.workers)  # (the groups' relays among them)


def stop_all(workers) -> None:
    """Each told first, then each waited for: a moment for all, not one after another."""
    workers = [w for w in workers if not w.stopping]  # (one stopped already was given its moment)
    for w in workers:
        w.stop(join=False)
    for w in workers:
        w.stop()


PROCESS = ProcessContext()
atexit.register(PROCESS.shutdown)  # the one exit hook in zerokern
