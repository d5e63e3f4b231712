"""Run a function on N processes joined by a process group (gloo on CPUs;
nccl for the GPU tests), and fail (not hang) if one of them does not finish in
time, or dies on its way out (a crash at exit fails a torchrun job too).

Every run gets new processes. By default they are forked from rank_zygote.py
processes that imported torch and zerokern once (a spawned rank spent seconds
on those imports, most of a distributed test's time); fresh=True spawns them,
for a test whose ranks must start from a new interpreter (an environment
variable read at process start, such as glibc's MALLOC_*). The GPU tests
always spawn: CUDA is never initialised in a process that forks."""

import atexit
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Pipe, wait

import torch.multiprocessing as mp


_run_dir = None  # in a rank process: its run's directory, where tell_ranks() and wait_for() meet


def tell_ranks(what):
    """In a rank: tell the other ranks of this run that `what` happened (a file in the run's
    directory, so it takes no collective: for the orderings a test sets up around its collectives)."""
    open(os.path.join(_run_dir, f"told-{what}"), "w").close()


def wait_for(what, timeout=60):
    """In a rank: return once a rank of this run called tell_ranks(what); raise after `timeout` s."""
    path, deadline = os.path.join(_run_dir, f"told-{what}"), time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rank told {what!r} within {timeout} s")
        time.sleep(0.005)


def _entry(fn, rank, world, tmp, args, backend):
    import torch
    import torch.distributed as dist

    global _run_dir
    _run_dir = tmp
    out = os.path.join(tmp, f"result{rank}.pkl")
    # One thread per rank unless the test's environment says otherwise, as torchrun starts its
    # processes (OMP_NUM_THREADS=1): two ranks on two cores, each with a pool of two threads that
    # spin while they wait for work, ran a tiny bf16 matmul ~10x slower (7 ms against 0.6 ms).
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        if backend == "gloo":
            # init returns on a rank once its own connections are up: a rank function that ended at
            # once could close them while a peer still connects ("Connection closed by peer" there,
            # seen on a loaded 2-core machine). Every rank has joined once this returns.
            dist.barrier()
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001  reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(out, "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _spawned(fn, world, tmp, args, backend, timeout):
    """Each rank in a new interpreter: {rank: exit code}, without the ranks that did not finish."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, tmp, args, backend)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    return {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}


_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_zygote.py")
_zygotes = {}  # rank index -> (its process, our end of its socket)


def _zygotes_for(world):
    """The zygotes of ranks 0..world-1, started (together) where missing."""
    new = [r for r in range(world) if r not in _zygotes]
    for r in new:
        ours, theirs = Pipe()
        proc = subprocess.Popen([sys.executable, _ZYGOTE, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        ours.send(sys.path)
        _zygotes[r] = (proc, ours)
    try:
        for r in new:
            if _recv(_zygotes[r][1], time.monotonic() + 120) != "ready":
                raise RuntimeError(f"rank zygote {r} did not start")
    except BaseException:
        _stop_zygotes()
        raise
    return [_zygotes[r] for r in range(world)]


def _recv(conn, deadline):
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("a rank zygote did not answer")
    return conn.recv()


def _stop_zygotes():
    """Kill the zygotes (the next run starts new ones): after a run that did not end cleanly, the
    protocol's state is unknown, and nothing is cheaper to trust than a new process."""
    for proc, conn in _zygotes.values():
        conn.close()
        proc.kill()
        proc.wait()
    _zygotes.clear()


atexit.register(_stop_zygotes)


def _forked(fn, world, tmp, args, backend, timeout):
    """Each rank forked from its zygote: {rank: exit code}, without the ranks that did not finish."""
    job = dict(call=pickle.dumps((fn, args)), world=world, tmp=tmp, backend=backend, env=dict(os.environ),
               cwd=os.getcwd())
    zygotes = _zygotes_for(world)
    pids, codes, clean = {}, {}, False
    try:
        for r, (_, conn) in enumerate(zygotes):
            conn.send(dict(job, rank=r))
        for r, (_, conn) in enumerate(zygotes):
            pids[r] = _recv(conn, time.monotonic() + 60)
        deadline = time.monotonic() + timeout
        waiting = {conn: r for r, (_, conn) in enumerate(zygotes)}
        while waiting:
            ready = wait(list(waiting), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                codes[waiting.pop(conn)] = conn.recv()
        clean = not waiting
    finally:
        if not clean:
            for r, pid in pids.items():
                if r not in codes:
                    os.kill(pid, signal.SIGKILL)
            _stop_zygotes()
    return codes


def _show_logs(tmp, world):
    """The forked ranks' output, where pytest captures it (shown for a failed test)."""
    for r in range(world):
        path = os.path.join(tmp, f"rank{r}.log")
        if os.path.exists(path):
            text = open(path, errors="replace").read()
            if text:
                sys.stderr.write(f"--- rank {r} ---\n{text}")


def run(fn, world, *args, timeout=120, backend="gloo", fresh=False):
    """[rank 0's result, rank 1's, ...]; a rank that raised gives ("error", text)."""
    with tempfile.TemporaryDirectory() as tmp:
        if fresh or backend != "gloo":
            codes = _spawned(fn, world, tmp, args, backend, timeout)
        else:
            try:
                codes = _forked(fn, world, tmp, args, backend, timeout)
            finally:
                _show_logs(tmp, world)
        hung = [r for r in range(world) if r not in codes]
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
        died = {r: codes[r] for r in sorted(codes) if codes[r] != 0}  # by rank: the same text whichever exited first
        if died:
            raise AssertionError(f"rank processes exited abnormally (rank: exit code, -6 = SIGABRT): {died}")
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def values(results):
    """The ranks' return values, raising if any rank failed."""
    for r, (status, value) in enumerate(results):
        if status != "ok":
            raise AssertionError(f"rank {r} failed:\n{value}")
    return [v for _, v in results]
