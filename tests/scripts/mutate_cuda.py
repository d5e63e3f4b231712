"""The mutation check of the emulated CUDA tests: proof that the kernels execute and that the tests
see what they do.

Each mutation is one deliberately wrong index or bound in a copy of csrc/cuda (a scratch build on
the SIMT emulator, tests/kernels/simt_emu.py); the emulated tests of its kernel family must then fail.
The unmutated sources must pass the same tests first.

    python tests/scripts/mutate_cuda.py                  # every mutation
    python tests/scripts/mutate_cuda.py --family wire    # one family's
    python tests/scripts/mutate_cuda.py --first          # the first mutation of each family
    python tests/scripts/mutate_cuda.py --name vector    # the mutations whose name holds "vector"

Prints a line per mutation (which tests failed, and the first error) and exits non-zero when a
mutation survives (the tests pass with it) or the baseline fails.
"""

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEST = "tests/kernels/test_cuda_emulated.py"

# family -> the tests (-k) that cover it
FAMILIES = {"adam": "adam_kernel", "cast": "cast_kernel", "lowbit": "lowbit_kernel", "wire": "wire_"}

# (family, name, file in csrc/cuda, the text, the wrong text): the text must occur once in the file.
MUTATIONS = [
    ("adam", "tail bound: i > n", "adam_cuda.cuh", "        if (i >= n) break;", "        if (i > n) break;"),
    ("adam", "tile count rounds down", "adam_cuda.cu",
     "batch.first_tile[k] + (t.numel[i] + tile - 1) / tile", "batch.first_tile[k] + t.numel[i] / tile"),
    ("adam", "grid stride skips a tile", "adam_cuda.cuh", "tile < tiles; tile += gridDim.x)",
     "tile < tiles; tile += gridDim.x + 1)"),
    ("adam", "misaligned grads take the vector path", "adam_cuda.cu", "is_aligned(t.grads[i], 16) &&", ""),
    ("adam", "scalar index off by one thread", "adam_cuda.cuh",
     "const int64_t i = base + k * kThreads + threadIdx.x;",
     "const int64_t i = base + k * kThreads + threadIdx.x + 1;"),
    ("cast", "tail bound: i > n", "cast_cuda.cu", "        if (i >= n) break;", "        if (i > n) break;"),
    ("cast", "a partial tile takes the vector path", "multi_tensor.cuh", "return aligned && base + tile_elems <= n;",
     "return aligned && base < n;"),
    ("cast", "tile to tensor search off by one", "multi_tensor.cuh", "if (first_tile[mid] <= tile) lo = mid;",
     "if (first_tile[mid] < tile) lo = mid;"),
    ("cast", "tile count rounds down", "cast_cuda.cu", "b.first_tile[k] + (l.numel[i] + kTile - 1) / kTile",
     "b.first_tile[k] + l.numel[i] / kTile"),
    ("lowbit", "tail bound: i <= numel", "lowbit_cuda.cu", "const bool active = i < numel;",
     "const bool active = i <= numel;"),
    ("lowbit", "random index off by one", "lowbit_cuda.cu",
     "random16(call.seed, call.step, kStreamParam, base + i)",
     "random16(call.seed, call.step, kStreamParam, base + i + 1)"),
    ("lowbit", "block count rounds down", "lowbit_cuda.cu", "const int64_t blocks = (n + kBlock - 1) / kBlock;",
     "const int64_t blocks = n / kBlock;"),
    ("lowbit", "absmax from the first warps' lanes only (the bug the emulator found)", "lowbit_cuda.cu",
     "a = shared[lane & ((kBlock >> 5) - 1)];", "a = lane < (kBlock >> 5) ? shared[lane] : 0u;"),
    ("wire", "tail bound: has1 = i + 1 <= n", "wire_cuda.cu", "has0 = i < a.n, has1 = i + 1 < a.n;",
     "has0 = i < a.n, has1 = i + 1 <= a.n;"),
    ("wire", "decode tail bound: i > n", "wire_cuda.cu", "  if (i >= a.n) return;", "  if (i > a.n) return;"),
    ("wire", "int4 byte index", "wire_cuda.cu", "codes[i / 2] = static_cast<uint8_t>((c0 + 8)",
     "codes[i / 2 + 1] = static_cast<uint8_t>((c0 + 8)"),
    ("wire", "scale byte index", "wire_cuda.cu", "a.out[4 * blk + threadIdx.x] =",
     "a.out[4 * blk + 3 - threadIdx.x] ="),
    ("wire", "block count rounds down", "wire_cuda.cu", "static_cast<unsigned>(wire_blocks(a.n));",
     "static_cast<unsigned>(a.n / kWireBlock);"),
]


def run_tests(family, cuda_src=None, build_dir=None):
    """The family's emulated tests on a copy of csrc/cuda built in build_dir (None: the tests' own build)."""
    env = dict(os.environ)
    if cuda_src is not None:
        env.update(ZEROKERN_EMU_CUDA_SRC=str(cuda_src), ZEROKERN_EMU_BUILD_DIR=str(build_dir))
    cmd = [sys.executable, "-m", "pytest", TEST, "-q", "-n", "0", "-p", "no:cacheprovider", "--durations=0",
           "-k", FAMILIES[family], "-rf"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    errors = re.findall(r"^E\s+(.+)$", proc.stdout, re.M)
    summary = (re.findall(r"^=+ (\d+ (?:passed|failed).*?) =+$|^(\d+ (?:passed|failed).*)$", proc.stdout, re.M)
               or [("", proc.stdout[-300:])])[-1]
    summary = summary[0] or summary[1]
    return proc.returncode, failed, errors[:1], summary, time.monotonic() - start


def mutate(src_dir, file, old, new):
    path = src_dir / file
    text = path.read_text()
    assert text.count(old) == 1, f"{file}: {old!r} occurs {text.count(old)} times"
    path.write_text(text.replace(old, new))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("--first", action="store_true", help="the first mutation of each family only")
    parser.add_argument("--name", help="the mutations whose name holds this text")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.family in (None, m[0]) and (args.name or "") in m[1]]
    if args.first:
        chosen = [m for i, m in enumerate(chosen) if m[0] not in [x[0] for x in chosen[:i]]]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="zk-mutate-") as tmp:
        tmp = pathlib.Path(tmp)
        for family in sorted({m[0] for m in chosen}, key=list(FAMILIES).index):
            rc, failed, errors, summary, secs = run_tests(family)
            print(f"[{family}] baseline (unmutated): {summary} ({secs:.0f} s)", flush=True)
            if rc != 0:
                bad += 1
                print(f"  the baseline fails: {failed} {errors}")
        for i, (family, name, file, old, new) in enumerate(chosen):
            src = tmp / f"cuda{i}"
            shutil.copytree(ROOT / "csrc" / "cuda", src)
            mutate(src, file, old, new)
            rc, failed, errors, summary, secs = run_tests(family, src, tmp / "build")
            killed = (rc == 1 and failed) or rc < 0  # tests failed, or the test process died of a signal
            bad += not killed
            verdict = "SURVIVED" if not killed else "caught" if rc == 1 else f"caught (the tests died: signal {-rc})"
            print(f"[{family}] {name} ({file}): {verdict}: {summary} ({secs:.0f} s)")
            for test in failed[:4]:
                print(f"    {test}")
            if len(failed) > 4:
                print(f"    ... {len(failed) - 4} more")
            if errors:
                print(f"    first error: {errors[0][:200]}")
            sys.stdout.flush()
            shutil.rmtree(src)
    print(f"{len(chosen)} mutations, all caught" if not bad else f"{bad} problem(s): a mutation survived or a "
          "baseline failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
