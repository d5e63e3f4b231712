"""`python -m zerokern.plan` prints its table without importing torch or the compiled
extensions, and `import zerokern` still gives every public name."""

import subprocess
import sys

# Runs the planner as `python -m` does, then reports which heavy modules got imported. The
# planner's __main__ ends in sys.exit(), so the check runs after catching SystemExit.
RUN_PLANNER = r"""
import runpy, sys
sys.argv = ["zerokern.plan"] + sys.argv[1:]
try:
    runpy.run_module("zerokern.plan", run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton", "numpy")
               or m in ("zerokern._C", "zerokern._ext", "zerokern.ops"))
print("HEAVY", heavy[:5])
sys.exit(code)
"""


def _python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_planner_cli_imports_no_torch():
    proc = _python("-c", RUN_PLANNER, "--params", "7.5e9", "--dp", "64")
    assert proc.returncode == 0, proc.stderr
    assert "<- smallest stage that fits" in proc.stdout
    assert "HEAVY []" in proc.stdout, proc.stdout.splitlines()[-1]


def test_planner_python_api_imports_no_torch():
    code = ("import sys; from zerokern.plan import plan; p = plan(7.5e9, dp=64, gpu_memory=24e9); "
            "assert p.smallest_fitting_stage == 2, p.smallest_fitting_stage; "
            "p = plan(arch='llama', layers=2, hidden=64, heads=4, vocab=100, ffn_hidden=176, seq=64); "
            "assert p.activations.peak_bytes > 0; "
            "p = plan(7.5e9, dp=64, hosts=8, reduce_precision='int4', gather_precision='int8'); "
            "assert p.stages[3].error_feedback_bytes > 0 and p.stages[3].hybrid_inter_host_bytes > 0; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr


def test_zerokern_public_names_still_resolve():
    """The package loads its torch-backed parts on first use: attribute access, `from zerokern
    import X`, `import *` and dir() all see them; with torch imported first, `import zerokern`
    registers torch.ops.zerokern at once, as before."""
    code = """
import sys
import zerokern
assert "torch" not in sys.modules, "import zerokern alone stays light"
assert set(zerokern.__all__) <= set(dir(zerokern)), dir(zerokern)
assert zerokern.__version__
print(zerokern.FusedZeroAdam.__name__, zerokern.ops.__name__, zerokern.shard.__name__)
from zerokern import FusedAdam, FusedZeroAdam, GradScaler, OffloadPolicy, full_state_dict, shard, ops
from zerokern import available_backends, unavailable_backends
assert available_backends()["torch"] is True
ns = {}
exec("from zerokern import *", ns)
assert set(zerokern.__all__) <= set(ns), sorted(set(zerokern.__all__) - set(ns))
try:
    zerokern.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e), e
else:
    raise AssertionError("zerokern.no_such_name resolved")
"""
    proc = _python("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["FusedZeroAdam", "zerokern.ops", "shard"]
    ops = _python("-c", "import torch, zerokern; print(torch.ops.zerokern.cpu_capability())")
    assert ops.returncode == 0, ops.stderr
    assert ops.stdout.strip() in ("avx512", "avx2", "baseline")
