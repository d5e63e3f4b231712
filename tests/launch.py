"""Run a script under torchrun (or plainly, for one process) as a user would, with a timeout, and
read back what rank 0 wrote (or, for a run expected to fail, what each rank raised); shared by the
HF Trainer, Accelerate and DDP-guard tests."""

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


def _command(script, world, out, args):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
           if world > 1 else [sys.executable]) + [os.path.join(SCRIPTS, script), "--out", out, *args]
    # PYTHONFAULTHANDLER: a worker killed by a signal prints its Python stacks
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONFAULTHANDLER="1")
    return cmd, env


def run_script(script, world, out, args, timeout):
    """`script` (in tests/scripts) on `world` processes; rank 0 writes `out` (torch.save)."""
    proc = _launch(*_command(script, world, out, args), out, timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=True)


def run_failing_script(script, world, out, args, timeout):
    """`script` on `world` processes, expected to fail: each rank writes what it raised to
    `out`.rank<r>; returns those texts, rank by rank (each rank must have written one)."""
    for r in range(world):
        if os.path.exists(f"{out}.rank{r}"):
            os.remove(f"{out}.rank{r}")
    proc = _launch(*_command(script, world, out, args), out, timeout)
    assert proc.returncode != 0, f"{script} {args} was expected to fail:\n{proc.stdout[-3000:]}"
    errors = []
    for r in range(world):
        path = f"{out}.rank{r}"
        errors.append(open(path).read() if os.path.exists(path) else None)
    assert all(errors), f"not every rank recorded an error: {errors}\n{proc.stderr[-6000:]}"
    return errors


def max_diff(a, b):
    """Largest difference between two {name: tensor} dicts."""
    return max(abs_diff(a[n], b[n]) for n in a)
