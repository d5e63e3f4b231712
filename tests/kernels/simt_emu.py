"""The CUDA kernels of csrc/cuda on the CPU: their host build on the SIMT emulator (csrc/emu), and
ctypes calls into it. See [Note: the SIMT emulator] in csrc/emu/simt.h.

The build: each csrc/cuda file, with its launches `k<<<cfg>>>(args)` rewritten as
`::zk_emu::launch(k, "k", cfg)(args)` (the one thing a host compiler cannot read; nvcc's front end
rewrites them for its host pass too) and nothing else changed, is compiled by the host C++ compiler
with csrc/emu/simt.h force-included, CUDA's own half/bfloat16 headers, and -fsanitize=alignment
(a misaligned access faults on a GPU; here simt.cpp reports it). The library is cached under
build/simt_emu/<hash of the sources and flags>/, built once per change (a file lock serialises
pytest-xdist's workers). ZEROKERN_EMU_CUDA_SRC builds another copy of csrc/cuda instead, and
ZEROKERN_EMU_BUILD_DIR puts the build elsewhere (the mutation check, tests/scripts/mutate_cuda.py).

Needs a C++ compiler and the CUDA toolkit's headers (CUDA_HOME, or the nvcc on PATH): where the
toolkit is missing the tests skip, unless ZEROKERN_CUDA=1 (CI) says it is expected, then they fail.
"""

import contextlib
import ctypes
import fcntl
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
EMU_DIR = ROOT / "csrc" / "emu"
EMU_SOURCES = ["simt.cpp", "kernels_api.cpp"]  # with simt.h and include/cuda_runtime.h: all of csrc/emu
EMU_KERNELS = ["selftest.cu"]  # the emulator's own checks (tests/kernels/test_simt_emulator.py)
CUDA_SOURCES = ["adam_cuda.cu", "adam_cuda_f32.cu", "adam_cuda_f16.cu", "adam_cuda_bf16.cu", "cast_cuda.cu",
                "lowbit_cuda.cu", "wire_cuda.cu"]
# -ffp-contract=off: every product rounded (the emulator does not guess nvcc's FMAs; simt.h says so).
# -fvisibility=hidden: see ZK_EMU_API in simt.h.
FLAGS = ["-std=c++17", "-O1", "-g0", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-fast-math",
         "-DZEROKERN_WITH_CUDA"]
KERNEL_FLAGS = ["-fsanitize=alignment"]

DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # zerokern::DType
LAUNCH = re.compile(r"(?P<kernel>[A-Za-z_][\w:]*)(?P<targs><[^<>;{}]*>)?(?P<ws>\s*)<<<(?P<cfg>.*?)>>>", re.S)


class EmulatedLaunchError(RuntimeError):
    """A kernel on the emulator failed as it would on a GPU (misaligned access, bad launch, ...)."""


def cuda_home():
    """The CUDA toolkit's root (as setup.py finds it), or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (pathlib.Path(home) / "include" / "cuda_fp16.h").exists():
            return pathlib.Path(home)
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                                 timeout=60)
            match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
        except (OSError, subprocess.SubprocessError):
            match = None
        home = (pathlib.Path(os.path.realpath(match.group(1).strip())) if match
                else pathlib.Path(nvcc).resolve().parents[1])
        if (home / "include" / "cuda_fp16.h").exists():
            return home
    return None


def translate(text, name):
    """The host compiler's view of a .cu file: its launches rewritten, line numbers kept."""
    count = text.count("<<<")

    def launch(m):
        return (f'::zk_emu::launch({m["kernel"]}{m["targs"] or ""},{m["ws"]}"{m["kernel"].split("::")[-1]}", '
                f'{m["cfg"]})')

    out, done = LAUNCH.subn(launch, text)
    if done != count or "<<<" in out or ">>>" in out:
        raise RuntimeError(f"{name}: {count} launches, {done} rewritten; a launch this rewrite does not read")
    return f'#line 1 "{name}"\n' + out


def _compiler():
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (c++ or g++ on PATH, or CXX) for the emulated CUDA build")
    return cxx


def _shared_libstdcxx():
    """The libstdc++ this process runs with, named first on the link line: [Note: one libstdc++] in
    setup.py (a toolchain with only a static one would put a private copy in the library)."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})[:1]
    except OSError:
        return []


def _build(cuda_src, home):
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    files = sorted(p for d in (cuda_src, EMU_DIR, ROOT / "csrc" / "include") for p in d.rglob("*") if p.is_file())
    digest = hashlib.sha256("\0".join(FLAGS + KERNEL_FLAGS + CUDA_SOURCES + EMU_SOURCES + EMU_KERNELS +
                                      [version, str(home), str(cuda_src)]).encode())
    for p in files:
        digest.update(str(p).encode() + b"\0" + p.read_bytes())
    root = pathlib.Path(os.environ.get("ZEROKERN_EMU_BUILD_DIR", ROOT / "build" / "simt_emu"))
    out = root / digest.hexdigest()[:16]
    lib = out / "libzk_simt.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be building the same library
        if lib.exists():
            return lib
        src = out / "src"
        src.mkdir(parents=True, exist_ok=True)
        for p in [*sorted(cuda_src.iterdir()), *(EMU_DIR / n for n in EMU_KERNELS)]:
            if p.suffix in (".cu", ".cuh"):
                (src / p.name).write_text(translate(p.read_text(), str(p)))
        include = ["-I", str(EMU_DIR / "include"), "-I", str(ROOT / "csrc" / "include"), "-I", str(home / "include")]
        common = [cxx, *FLAGS, "-include", str(EMU_DIR / "simt.h"), *include]
        jobs = [(src / n, [*KERNEL_FLAGS, "-x", "c++"]) for n in CUDA_SOURCES + EMU_KERNELS]
        jobs += [(EMU_DIR / n, []) for n in EMU_SOURCES]

        def compile_one(job):
            path, extra = job
            obj = out / (path.name + ".o")
            proc = subprocess.run([*common, *extra, "-c", str(path), "-o", str(obj)], capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"the emulated build of {path.name} failed:\n{proc.stderr[-6000:]}")
            return obj

        with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
            objects = list(pool.map(compile_one, jobs))
        tmp = out / f"libzk_simt.{os.getpid()}.so"
        proc = subprocess.run([cxx, "-shared", "-Wl,-Bsymbolic", "-o", str(tmp), *_shared_libstdcxx(),
                               *map(str, objects)], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"linking the emulated build failed:\n{proc.stderr[-6000:]}")
        os.replace(tmp, lib)
    return lib


_LIB = None


def library():
    """The emulated build, built on first use; skips (or fails under ZEROKERN_CUDA=1) without the toolkit."""
    global _LIB
    if _LIB is None:
        home = cuda_home()
        if home is None:
            import pytest
            why = "the emulated CUDA build needs the CUDA toolkit's headers (CUDA_HOME or nvcc on PATH)"
            if os.environ.get("ZEROKERN_CUDA") == "1":
                pytest.fail(why + ", and ZEROKERN_CUDA=1 says the CUDA build is expected")
            pytest.skip(why)
        cuda_src = pathlib.Path(os.environ.get("ZEROKERN_EMU_CUDA_SRC", ROOT / "csrc" / "cuda")).resolve()
        lib = ctypes.CDLL(str(_build(cuda_src, home)))
        lib.zk_emu_last_message.restype = ctypes.c_char_p
        lib.zk_emu_launch.restype = ctypes.c_char_p
        lib.zk_emu_launches.restype = ctypes.c_int64
        _LIB = lib
    return _LIB


# --- calls ----------------------------------------------------------------------------------------

def _ptrs(tensors):
    return (ctypes.c_void_p * max(1, len(tensors)))(*[t.data_ptr() for t in tensors])


def _i64(values):
    return (ctypes.c_int64 * max(1, len(values)))(*values)


def _u8(values):
    return (ctypes.c_uint8 * max(1, len(values)))(*values)


def _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale):
    return (ctypes.c_double * 7)(lr, beta1, beta2, eps, weight_decay, step, grad_scale)


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _check(rc):
    lib = library()
    if rc != 0:
        message = lib.zk_emu_last_message().decode()
        lib.zk_emu_reset()
        raise EmulatedLaunchError(f"CUDA error {rc}: {message}")


def reset():
    library().zk_emu_reset()


def launches():
    """[(kernel name, grid (x, y, z), block (x, y, z))] of the launches since reset()."""
    lib = library()
    out = []
    for i in range(lib.zk_emu_launches()):
        dims = (ctypes.c_uint * 6)()
        name = lib.zk_emu_launch(ctypes.c_int64(i), dims).decode()
        out.append((name, tuple(dims[:3]), tuple(dims[3:])))
    return out


@contextlib.contextmanager
def emulated(device=0, reverse=False):
    """Launches on emulated device `device` (0: 3 SMs, 1: 1 SM, 2: 2^20 SMs: a block per tile),
    threads and blocks in reverse order if asked. Yields the list of launches, filled at exit."""
    lib = library()
    lib.zk_emu_reset()
    assert lib.zk_emu_set_device(device) == 0
    lib.zk_emu_set_schedule(int(reverse))
    seen = []
    try:
        yield seen
    finally:
        seen.extend(launches())
        lib.zk_emu_set_device(0)
        lib.zk_emu_set_schedule(0)


def fused_adam(params, grads, exp_avgs, exp_avg_sqs, model_params=None, *, lr, beta1, beta2, eps, weight_decay,
               step, adam_w_mode=True, bias_correction=True, grad_scale=1.0, lr_tensor=None, step_tensor=None,
               grad_scale_tensor=None, found_inf=None):
    """fused_adam_cuda (csrc/cuda/adam_cuda.cu) on CPU tensors."""
    lib = library()
    model = model_params or []
    rc = lib.zk_emu_fused_adam(
        ctypes.c_int64(len(params)), _ptrs(params), _ptrs(grads), _ptrs(exp_avgs), _ptrs(exp_avg_sqs),
        _ptrs(model) if model else None, _i64([p.numel() for p in params]), _u8([DTYPE[g.dtype] for g in grads]),
        _u8([DTYPE[m.dtype] for m in model]) if model else None,
        _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale), int(adam_w_mode), int(bias_correction),
        _ptr(lr_tensor), _ptr(step_tensor), _ptr(grad_scale_tensor), _ptr(found_inf))
    _check(rc)


def cast_copy(srcs, dsts):
    """cast_copy_cuda (csrc/cuda/cast_cuda.cu): dsts[i] = srcs[i] converted, element for element."""
    lib = library()
    rc = lib.zk_emu_cast_copy(ctypes.c_int64(len(srcs)), _ptrs(srcs), _ptrs(dsts), _i64([s.numel() for s in srcs]),
                              _u8([DTYPE[s.dtype] for s in srcs]), _u8([DTYPE[d.dtype] for d in dsts]))
    _check(rc)


def fused_adam_lowbit(params, grads, exp_avgs, exp_avg_sqs, *, exp_avg_scales=None, exp_avg_sq_scales=None,
                      model_params=None, index_bases, maps, seed, lr, beta1, beta2, eps, weight_decay, step,
                      adam_w_mode=True, bias_correction=True, grad_scale=1.0):
    """fused_adam_lowbit_cuda (csrc/cuda/lowbit_cuda.cu) on CPU tensors; maps: lowbit.maps()."""
    lib = library()
    state = {torch.uint8: 2, torch.bfloat16: 1}.get(exp_avgs[0].dtype, 0)
    model = model_params or []
    rc = lib.zk_emu_fused_adam_lowbit(
        ctypes.c_int64(len(params)), _ptrs(params), _ptrs(grads), _ptrs(exp_avgs), _ptrs(exp_avg_sqs),
        _ptrs(exp_avg_scales) if exp_avg_scales else None, _ptrs(exp_avg_sq_scales) if exp_avg_sq_scales else None,
        _ptrs(model) if model else None, _i64([p.numel() for p in params]), _i64(list(index_bases)),
        _u8([DTYPE[g.dtype] for g in grads]), DTYPE[model[0].dtype] if model else 3,
        int(params[0].dtype == torch.bfloat16), state, _hyper(lr, beta1, beta2, eps, weight_decay, step, grad_scale),
        int(adam_w_mode), int(bias_correction), ctypes.c_uint64(seed), _ptrs(list(maps)))
    _check(rc)


def wire_encode(x, out, bits, seed, step, stream, base, error=None, stochastic=True, residual=None):
    """wire_encode_cuda (csrc/cuda/wire_cuda.cu), with wire_ops.encode_'s arguments."""
    lib = library()
    rc = lib.zk_emu_wire_encode(
        _ptr(x), DTYPE[x.dtype], ctypes.c_int64(x.numel()), _ptr(out), _ptr(error),
        DTYPE[error.dtype] if error is not None else 0, _ptr(residual),
        DTYPE[residual.dtype] if residual is not None else 0, bits, ctypes.c_uint64(seed), ctypes.c_int64(step),
        ctypes.c_int64(stream), ctypes.c_int64(base), int(stochastic))
    _check(rc)


def wire_decode(buf, n, bits, out, accumulate=False):
    """wire_decode_cuda (csrc/cuda/wire_cuda.cu)."""
    lib = library()
    rc = lib.zk_emu_wire_decode(_ptr(buf), ctypes.c_int64(n), bits, _ptr(out), int(accumulate))
    _check(rc)


if __name__ == "__main__":  # build (or find) the library and say where it is
    print(library()._name, file=sys.stderr)
