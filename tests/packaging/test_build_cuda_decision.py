"""setup.py's choice of building the CUDA extension (issue 38): where torch sees no GPU it is skipped
unless ZEROKERN_CUDA=1 asks for it (CI does), and the reason says how to ask. The function is
taken out of setup.py (importing setup.py would run the build)."""
import ast
import os
import pathlib
import sys

import pytest

SETUP = pathlib.Path(__file__).resolve().parents[2] / "setup.py"


def _cuda_decision():
    tree = ast.parse(SETUP.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "cuda_decision")
    scope = {"os": os, "sys": sys}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(SETUP), "exec"), scope)
    return scope["cuda_decision"]


@pytest.mark.parametrize("env, gpu, built, reason", [
    (None, False, False, "no GPU is visible (torch.cuda.is_available() is False); ZEROKERN_CUDA=1 builds it anyway"),
    (None, True, True, "nvcc in /cuda, torch CUDA 13.0"),
    ("1", False, True, "nvcc in /cuda, torch CUDA 13.0, ZEROKERN_CUDA=1"),
    ("0", True, False, "ZEROKERN_CUDA=0"),
])
def test_cuda_is_built_where_a_gpu_is_visible_or_when_asked(monkeypatch, env, gpu, built, reason):
    if env is None:
        monkeypatch.delenv("ZEROKERN_CUDA", raising=False)
    else:
        monkeypatch.setenv("ZEROKERN_CUDA", env)
    assert _cuda_decision()("13.0", "/cuda", gpu) == (built, reason)


def test_asked_for_but_impossible_fails_loudly(monkeypatch):
    monkeypatch.setenv("ZEROKERN_CUDA", "1")
    with pytest.raises(SystemExit, match="ZEROKERN_CUDA=1 but .* torch is a CPU-only build"):
        _cuda_decision()(None, "/cuda", False)
    monkeypatch.delenv("ZEROKERN_CUDA")
    assert _cuda_decision()(None, "/cuda", True) == (False, "torch is a CPU-only build")
