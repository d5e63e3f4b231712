"""Run a function on N processes joined by a process group (gloo on CPUs;
nccl for the GPU tests), and fail (not hang) if one of them does not finish in
time, or dies on its way out (a crash at exit fails a torchrun job too)."""

import os
import pickle
import tempfile
import traceback

import torch.multiprocessing as mp


def _entry(fn, rank, world, tmp, args, backend):
    import torch
    import torch.distributed as dist

    out = os.path.join(tmp, f"result{rank}.pkl")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001  reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(out, "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def run(fn, world, *args, timeout=120, backend="gloo"):
    """[rank 0's result, rank 1's, ...]; a rank that raised gives ("error", text)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, tmp, args, backend)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
        died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
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
