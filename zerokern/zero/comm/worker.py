"""OrderedWorker: a thread that runs what it is handed, in the order handed. The collective check
([Note: announced collectives] in comm/check.py), the gloo relay ([Note: the relay thread] in
comm/gloo.py) and hybrid sharding's replica hop ([Note: the replica hop's thread] in
comm/hybrid.py) each run one: each must launch a group's collectives in one order on every rank,
off the caller's thread. One class, so they start, stop at exit and hold nothing alike."""

import queue
import threading

from .context import PROCESS

STOP = object()  # handed at exit: the thread returns once what came before it is done
IDLE = object()  # what take() says when nothing came in time


class OrderedWorker:
    """Started with the first item. serve(worker) is the thread's loop (the check's rounds); the
    default runs each item (a works.Pending) and lets go of it before taking the next."""

    def __init__(self, name: str = "zerokern-relay", serve=None):
        self.name, self.serve = name, serve
        self.queue = queue.SimpleQueue()
        self.thread = None
        self.stopping = False

    def start(self) -> "OrderedWorker":
        """(Once; hand() starts it too.) Once started, `queue.put` hands an item over as hand() does."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=f"{self.name}-{id(self)}", daemon=True)
            PROCESS.workers.append(self)
            self.thread.start()
        return self

    def hand(self, item):
        self.start()
        self.queue.put(item)
        return item

    def take(self, timeout=None):
        """The next item (STOP at exit), or IDLE after `timeout` seconds (0: only what is queued)."""
        try:
            return self.queue.get_nowait() if timeout == 0 else self.queue.get(timeout=timeout)
        except queue.Empty:
            return IDLE

    def stop(self, join: bool = True) -> None:
        """Tells the thread to return after what was handed before (once), then gives it a moment:
        one blocked on a peer that is gone stays there, holding nothing ([Note: exit drain])."""
        if not self.stopping:
            self.stopping = True
            if self.thread is not None:
                self.queue.put(STOP)
        if join and self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=1.0)

    def _loop(self) -> None:
        if self.serve is not None:
            return self.serve(self)
        while True:
            item = self.take()
            if item is STOP:
                return
            item.run()
            del item  # [Note: the relay thread]: nothing held while idle
