"""The mutation check (tests/scripts/mutate_cuda.py --first): one wrong index or bound per kernel
family (fused Adam, casts, low-bit, wire), each in a scratch build of csrc/cuda on the SIMT
emulator, must make that family's emulated tests fail. Slow (a build and a pytest run per
mutation, about half a minute each); the script runs all of them."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_mutation_per_kernel_family_fails_the_emulated_tests():
    pytest.importorskip("simt_emu").library()  # skips (or fails under ZEROKERN_CUDA=1) without the CUDA headers
    proc = subprocess.run([sys.executable, "tests/scripts/mutate_cuda.py", "--first"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": caught") == 4, proc.stdout
