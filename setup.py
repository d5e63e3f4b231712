"""Builds zerokern's extensions against the torch already installed.

    pip install --no-build-isolation -e .

--no-build-isolation: the extensions must be compiled against the torch that
will import them (its headers and C++ ABI); an isolated build would download
and build against another torch.

What is built:
  zerokern._C       C++ CPU operators, always.
  zerokern._C_cuda  CUDA operators, when torch is a CUDA build, nvcc is found and
                    torch sees a GPU (torch.cuda.is_available()). ZEROKERN_CUDA=1
                    builds it without a GPU too (CI; an image built for GPUs) and
                    fails loudly if it cannot be built; ZEROKERN_CUDA=0 skips it.
                    Architectures: TORCH_CUDA_ARCH_LIST, default "8.0;9.0+PTX"
                    (A100, H100/H200).
No GPU is needed to build either; nothing is downloaded and nvidia-smi is not run.
What was built and why, and a line per compiled file, reach the terminal even
under pip, which hides a build's output without -v (see say()).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"


def find_cuda_home():
    """The CUDA toolkit's root, or None.

    torch guesses CUDA_HOME as the parent of nvcc's folder, which is wrong when
    `nvcc` on PATH is a wrapper script (here: /usr/local/bin/nvcc). nvcc itself
    knows its root: `nvcc --dryrun` prints it as TOP=...
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60)
            match = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.MULTILINE)
        except (OSError, subprocess.SubprocessError):
            match = None
        if match:
            return os.path.realpath(match.group(1).strip())
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def wheel_cuda_includes():
    """Headers torch includes that a minimal toolkit may lack (cublas_v2.h,
    cusparse.h, ...), as shipped by the nvidia-* wheels torch depends on."""
    site = sysconfig.get_paths()["purelib"]
    dirs = sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    return [d for d in dirs if glob.glob(os.path.join(d, "cu*.h"))]


def cuda_decision(torch_cuda_version, cuda_home, gpu_visible):
    """(build?, reason) for the CUDA extension; honours ZEROKERN_CUDA."""
    want = os.environ.get("ZEROKERN_CUDA", "auto").strip().lower()
    if want in ("0", "off", "false", "no"):
        return False, "ZEROKERN_CUDA=0"
    forced = want in ("1", "on", "true", "yes")
    problems = []
    if not torch_cuda_version:
        problems.append("torch is a CPU-only build")
    if not cuda_home:
        problems.append("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    if problems and forced:
        sys.exit("zerokern: ZEROKERN_CUDA=1 but the CUDA extension cannot be built: " + "; ".join(problems))
    if problems:
        return False, "; ".join(problems)
    if not gpu_visible and not forced:
        # Minutes of nvcc for an extension nothing here can load (issue 38: 3m20s of a newcomer's first install).
        return False, "no GPU is visible (torch.cuda.is_available() is False); ZEROKERN_CUDA=1 builds it anyway"
    return True, f"nvcc in {cuda_home}, torch CUDA {torch_cuda_version}" + ("" if gpu_visible else ", ZEROKERN_CUDA=1")


def say(line, _out=[]):
    """Print a build message where the person installing sees it.

    pip shows nothing of a build's output (ours, ninja's) without -v, and a clean
    build takes minutes: so the terminal itself (/dev/tty) when there is one; else
    stdout, which pip -v and CI logs show."""
    if not _out:
        try:
            _out.append(sys.stdout if sys.stdout.isatty() else open("/dev/tty", "w"))
            if _out[0] is not sys.stdout:
                _out[0].write("\n")  # off the line pip's spinner is on
        except OSError:  # no terminal: CI, a pipe, a detached job
            _out.append(sys.stdout)
    out = _out[0]
    # on a terminal, \r writes over the spinner character pip leaves at the start of the line
    out.write(("\r" if out.isatty() else "") + line + "\n")
    out.flush()


class SayEachFile:
    """Mixed into torch's BuildExtension (one ninja run per extension): says what is built and
    why (summary), then each file as it is compiled. ninja's own [n/N] lines go to stdout,
    which pip hides; this watches the object files instead."""

    summary = ""

    def build_extensions(self):
        say(self.summary)  # here, not when setup.py runs: pip runs it for the metadata too
        super().build_extensions()

    def build_extension(self, ext):
        done = threading.Event()
        watch = threading.Thread(target=self._watch, args=(ext, done), daemon=True)
        watch.start()
        try:
            super().build_extension(ext)
        finally:
            done.set()
            watch.join()

    def _watch(self, ext, done):
        objects = self.compiler.object_filenames(ext.sources, output_dir=os.path.abspath(self.build_temp))
        stamp = {o: os.path.getmtime(o) if os.path.exists(o) else None for o in objects}
        start, compiled = time.monotonic(), 0
        while True:
            finished = done.wait(1.0)
            for src, obj in zip(ext.sources, objects):
                if obj in stamp and os.path.exists(obj) and os.path.getmtime(obj) != stamp[obj]:
                    del stamp[obj]
                    compiled += 1
                    say(f"zerokern: {ext.name} [{compiled}/{len(objects)}] {src} ({time.monotonic() - start:.0f} s)")
            if finished:
                return


def torch_libstdcxx():
    """The libstdc++.so.6 this process (torch) runs with, as a link input; [] where none is found.

    [Note: one libstdc++] The extensions must use the C++ runtime torch uses. A toolchain that
    has only a static libstdc++ (the GPU image's /opt/gcc, picked by its CXX) linked a private
    copy into each extension, and every error message that formats a number (c10::str of a size)
    segfaulted in that copy's ostream: found on the first GPU run, CPU and CUDA ops alike. Naming
    the shared library first makes the linker take std:: from it, whatever the toolchain's
    default; with an ordinary g++ it is the library it would have linked anyway."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:  # not Linux
        return []
    return sorted(paths)[:1]


def write_build_info(built_cuda, reason, archs):
    # Read by zerokern.backends to explain an unavailable backend.
    path = os.path.join(ROOT, "zerokern", "_build_info.py")
    with open(path, "w") as f:
        f.write("# Written by setup.py at build time.\n")
        f.write(f"CUDA_BUILT = {built_cuda!r}\n")
        f.write(f"CUDA_REASON = {reason!r}\n")
        f.write(f"CUDA_ARCHS = {archs!r}\n")


def extensions():
    cuda_home = find_cuda_home()
    if cuda_home:
        # Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME once.
        os.environ["CUDA_HOME"] = cuda_home
    try:
        import torch
    except ImportError:
        sys.exit("zerokern: torch is not importable here. Install torch first, then build with "
                 "`pip install --no-build-isolation -e .` (an isolated build cannot see the installed torch).")
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    include = [os.path.join(ROOT, "csrc", "include")]
    # -fno-math-errno / -fno-trapping-math let the compiler vectorize sqrtf and the
    # branchless fp16 conversions; -ffp-contract=off keeps every SIMD variant
    # bit-identical (no FMA contraction on one and not another).
    # -g0: Python's CFLAGS ask for -g; debug info was 45% of the compile time (issue 38) and
    # does not change the code (CMake's Release build has none either).
    cxx = ["-O3", "-g0", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp"]
    exts = [
        CppExtension(
            "zerokern._C",
            sources=[
                "csrc/torch/ops_cpu.cpp",
                "csrc/torch/adam_args.cpp",
                "csrc/torch/lowbit_args.cpp",
                "csrc/torch/wire_args.cpp",
                "csrc/torch/adam_cache.cpp",
                "csrc/torch/flat_ops.cpp",
                "csrc/cpu/adam_cpu.cpp",
                "csrc/cpu/lowbit_cpu.cpp",
                "csrc/cpu/wire_cpu.cpp",
                "csrc/cpu/cast_cpu.cpp",
                "csrc/cpu/dispatch.cpp",
                "csrc/cpu/kernels_avx512.cpp",
                "csrc/cpu/kernels_avx2.cpp",
                "csrc/cpu/kernels_baseline.cpp",
            ],
            include_dirs=include,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"] + torch_libstdcxx(),
        )
    ]

    build_cuda, reason = cuda_decision(torch.version.cuda, cuda_home, torch.cuda.is_available())
    archs = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS) if build_cuda else ""
    if build_cuda:
        exts.append(
            CUDAExtension(
                "zerokern._C_cuda",
                sources=[
                    "csrc/torch/ops_cuda.cpp",
                    "csrc/torch/adam_args.cpp",
                    "csrc/torch/lowbit_args.cpp",
                "csrc/torch/wire_args.cpp",
                    "csrc/torch/adam_cache.cpp",
                    "csrc/torch/flat_ops.cpp",
                    "csrc/cuda/cast_cuda.cu",
                    "csrc/cuda/adam_cuda.cu",
                    "csrc/cuda/adam_cuda_f32.cu",
                    "csrc/cuda/adam_cuda_f16.cu",
                    "csrc/cuda/adam_cuda_bf16.cu",
                    "csrc/cuda/lowbit_cuda.cu",
                    "csrc/cuda/wire_cuda.cu",
                ],
                include_dirs=include + wheel_cuda_includes(),
                extra_compile_args={
                    "cxx": ["-O3", "-g0", "-DZEROKERN_WITH_CUDA"],
                    "nvcc": ["-O3", "-DZEROKERN_WITH_CUDA", "-lineinfo"],
                },
                extra_link_args=torch_libstdcxx(),
            )
        )
        summary = f"zerokern: building CPU and CUDA extensions (archs {archs}; {reason})"
    else:
        summary = f"zerokern: building the CPU extension; CUDA extension skipped: {reason}"
    write_build_info(build_cuda, reason, archs)
    return exts, {"build_ext": type("BuildExt", (SayEachFile, BuildExtension), {"summary": summary})}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
