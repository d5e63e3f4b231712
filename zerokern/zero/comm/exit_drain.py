"""Let torch.distributed's worker threads finish before Python shuts down.

[Note: exit drain] Under torch 2.14 a tensor that has a Python object keeps
that object alive while C++ code holds the tensor too, and the C++ side drops
it (Py_DECREF, or the whole dealloc) when its last reference goes. gloo runs
each collective on a worker thread, and that thread often holds the last C++
reference to the collective's tensors: it releases them just after wait() has
returned in Python, and then needs the GIL. If the main thread runs on to
interpreter shutdown first (a collective in the last few milliseconds of a
script, e.g. averaging the loss for the log), CPython ends the waiting thread
with pthread_exit; inside a noexcept C++ destructor that is std::terminate:
"terminate called without an active exception", SIGABRT, and torchrun
reports the job as failed after it finished. dist.destroy_process_group()
does not help: torch's own modules keep the group (and its threads) alive
(constructing any torch.optim optimizer imports enough of torch to do so).

The fix is to give those threads the GIL before shutdown starts: at exit,
the main thread sleeps (without the GIL) for a few tens of milliseconds,
long enough for a thread waiting on the GIL, or one preempted on an
oversubscribed machine, to release its tensors. atexit callbacks run before
CPython marks itself as finalizing, so the threads are still allowed to
take the GIL then. The cost is that pause, once, at the exit of a
distributed process that built a zerokern optimizer.
"""

import atexit
import time

# 50 ms was seen to fall short once in a few hundred 2-rank runs on a loaded 2-core machine
# (a DeepSpeed test, SIGABRT at exit); 200 ms, once per process, is still cheap.
EXIT_DRAIN_SECONDS = 0.2
_registered = False


def register():
    """Install the drain once per process (idempotent)."""
    global _registered
    if not _registered:
        atexit.register(time.sleep, EXIT_DRAIN_SECONDS)
        _registered = True
