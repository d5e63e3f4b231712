"""The parent of one rank's processes (run by dist_harness, one per rank index): it imports torch and
zerokern once, then forks a fresh process for each test's rank, so a rank starts in milliseconds
instead of the seconds a spawned interpreter spends importing them.

Each test still gets new processes (nothing a test leaves behind, in zerokern's registries, torch's
default group, seeds or the default dtype, reaches the next one), and each ends as a spawned one
does: by returning from this script, so Python's full shutdown (atexit, module teardown, C++ static
destructors) runs and a crash at exit shows in its exit code. This process itself never runs test
code; it only forks and reports each child's exit code. One per rank index, because each Python
interpreter hashes strings with its own random seed (as ranks on different hosts do): ranks that
shared one would hide an order that depends on it (a set of names iterated on every rank).

Protocol on the socket passed as argv[1]: it receives sys.path, answers "ready", then per job
receives a dict, answers the child's pid, and later the child's exit code (-N: killed by signal N).
"""

import gc
import os
import sys
from multiprocessing.connection import Connection


def serve(conn):
    """Fork a child per job; in the child, return its job (None here when the session ends)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return None
        pid = os.fork()
        if pid == 0:
            conn.close()
            return job
        conn.send(pid)
        conn.send(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


def run_rank(job):
    """What a spawned rank did, in this fresh child: the test's environment and directory, output
    to a log the harness shows, then dist_harness's rank entry."""
    import faulthandler
    import pickle
    import random

    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    log = os.open(os.path.join(job["tmp"], f"rank{job['rank']}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable()  # a fatal signal (a crash at exit too) writes the Python stacks to the log
    random.seed()  # a forked child starts with its parent's generators; a spawned one had its own
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    import dist_harness

    fn, args = pickle.loads(job["call"])  # here, not in the zygote: the test's modules load in the child
    dist_harness._entry(fn, job["rank"], job["world"], job["tmp"], args, job["backend"])


def main():
    conn = Connection(int(sys.argv[1]))
    sys.path[:] = conn.recv()
    import torch  # noqa: F401  the imports every rank shares, done once
    import torch.distributed  # noqa: F401
    import zerokern  # noqa: F401

    # The imports' objects live as long as any process that has them: the collector need never
    # traverse them again (in the children's collections and their shutdown's: a shutdown took
    # 3.5 s without this, 0.65 s with it, on the loaded 2-core test machine).
    gc.freeze()
    conn.send("ready")
    job = serve(conn)
    if job is not None:
        run_rank(job)


if __name__ == "__main__":
    main()
