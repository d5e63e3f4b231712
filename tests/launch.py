"""Run a script under torchrun (or plainly, for one process) as a user would, with a timeout, and
read back what rank 0 wrote; shared by the HF Trainer and Accelerate tests."""

import os
import subprocess
import sys

import torch

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")

# [Note: launcher aborts] Rarely (in CI on 2026-11-30; never in 40 tries in a row here, also under
# load) a worker of the reference run (Accelerate's DDP + torch.optim.AdamW, which does not import
# zerokern) died with this line from libstdc++, SIGABRT and no Python traceback, under a second
# after start (most likely a native thread torn down while joinable). Such a launch is run once
# more; any other failure, a second abort, or a wrong result fails the test as before.
_NATIVE_ABORT = "terminate called without an active exception"


def _launch(cmd, env, out, timeout):
    if os.path.exists(out):
        os.remove(out)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def run_script(script, world, out, args, timeout):
    """`script` (in tests/scripts) on `world` processes; rank 0 writes `out` (torch.save)."""
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
           if world > 1 else [sys.executable]) + [os.path.join(SCRIPTS, script), "--out", out, *args]
    # PYTHONFAULTHANDLER: a worker killed by a signal prints its Python stacks
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    proc = _launch(cmd, env, out, timeout)
    if proc.returncode != 0 and _NATIVE_ABORT in proc.stderr:
        print(f"{script} {args}: a worker aborted natively ([Note: launcher aborts]); running it again:\n"
              f"{proc.stderr[-4000:]}", file=sys.stderr)
        proc = _launch(cmd, env, out, timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=True)


def max_diff(a, b):
    """Largest difference between two {name: tensor} dicts."""
    return max((a[n] - b[n]).abs().max().item() for n in a)
