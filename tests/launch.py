"""Run a script under torchrun (or plainly, for one process) as a user would, with a timeout, and
read back what rank 0 wrote; shared by the HF Trainer and Accelerate tests."""

import os
import subprocess
import sys

import torch

from numerics import abs_diff

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


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
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=True)


def max_diff(a, b):
    """Largest difference between two {name: tensor} dicts."""
    return max(abs_diff(a[n], b[n]) for n in a)
