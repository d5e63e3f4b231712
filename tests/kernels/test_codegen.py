"""What the compilers emit for an H100/H200 (sm_90), read without a GPU.

Speed on a GPU is decided by the instructions the compilers emit, and those can be read here:
- CUDA: each kernel file is compiled for sm_90 with the flags the extension build uses and
  disassembled (cuobjdump -sass). In every Adam and cast instantiation the aligned path must move
  every stream in 128-bit accesses (LDG.E.128 / STG.E.128; see [Note: vector stores] in
  csrc/cuda/multi_tensor.cuh), and the registers must let the number of resident blocks the
  launch bounds promise fit on an SM, with nothing spilled.
- Triton: every kernel variant is compiled for GPUTarget("cuda", 90, 32) (Triton ships its own
  ptxas) and, when the host found the pointers aligned, must use 16-byte vector loads and stores
  (see [Note: vector access in Triton] in zerokern/kernels/backends/triton_common.py).

Before those fixes the CUDA casts stored element by element and every Triton access was scalar;
these checks failed then. The CUDA half needs nvcc: where it is missing the test is skipped,
unless ZEROKERN_CUDA=1 (CI) says the CUDA build is expected, then it fails.
"""

import collections
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
KERNEL_FILES = ["adam_cuda.cu", "adam_cuda_f32.cu", "adam_cuda_f16.cu", "adam_cuda_bf16.cu", "cast_cuda.cu",
                "wire_cuda.cu"]
SIZE = {"float": 4, "__half": 2, "__nv_bfloat16": 2}


def _triton_tool(name):
    try:
        import triton
    except ImportError:
        return None
    path = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else None


def _need(tool, path):
    if path:
        return path
    if os.environ.get("ZEROKERN_CUDA") == "1":
        pytest.fail(f"{tool} not found, and ZEROKERN_CUDA=1 says the CUDA build (and this check) is expected")
    pytest.skip(f"{tool} not found")


def _source_constant(name):
    match = re.search(rf"constexpr int {name} = (\d+);", (CUDA_DIR / "multi_tensor.cuh").read_text())
    assert match, f"{name} not found in multi_tensor.cuh"
    return int(match.group(1))


@pytest.fixture(scope="module")
def cuda_kernels(tmp_path_factory):
    """{demangled kernel name: (Counter of SASS memory opcodes, resource usage dict)} for sm_90."""
    nvcc = _need("nvcc", shutil.which("nvcc"))
    cuobjdump = _need("cuobjdump", shutil.which("cuobjdump") or _triton_tool("cuobjdump"))
    cxxfilt = _need("c++filt", shutil.which("c++filt"))
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS  # the flags the extension is built with

    out = tmp_path_factory.mktemp("sass")
    jobs = []
    for name in KERNEL_FILES:
        cubin = out / (name + ".cubin")
        cmd = [nvcc, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "-DZEROKERN_WITH_CUDA", *COMMON_NVCC_FLAGS,
               "-I", str(ROOT / "csrc" / "include"), "-o", str(cubin), str(CUDA_DIR / name)]
        jobs.append((name, cubin, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    kernels = {}
    for name, cubin, proc in jobs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"nvcc failed on {name}:\n{log}"
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        resources = {m.group(1): dict(re.findall(r"(\w+):(\d+)", m.group(2)))
                     for m in re.finditer(r"Function (\S+):\s*\n\s*(REG:.*)", usage)}
        for section in re.split(r"\n\s*Function : ", sass)[1:]:
            mangled = section.split(None, 1)[0]
            opcodes = collections.Counter(re.findall(r"\b((?:LDG|STG)\.E[.A-Z0-9]*)", section))
            kernels[mangled] = (opcodes, {k: int(v) for k, v in resources[mangled].items()})
    names = subprocess.run([cxxfilt], input="\n".join(kernels), capture_output=True, text=True,
                           check=True).stdout.split("\n")
    return {demangled: kernels[mangled] for mangled, demangled in zip(kernels, names)}


def _wide(opcodes, op):
    """How many 128-bit accesses (any cache or scope suffix) of op ("LDG" or "STG")."""
    return sum(n for code, n in opcodes.items() if code.startswith(f"{op}.E.128"))


def _template_args(kernels, kernel):
    found = {}
    for name, data in kernels.items():
        match = re.search(rf"{kernel}<([^,]+), ([^>]+)>", name)
        if match:
            found[(match.group(1).split("::")[-1], match.group(2).split("::")[-1])] = (name, *data)
    return found


def test_cuda_adam_moves_every_stream_in_128_bit_accesses(cuda_kernels):
    found = _template_args(cuda_kernels, "adam_kernel")
    combos = {(g, o) for g in SIZE for o in ("NoOut", "__half", "__nv_bfloat16")}
    assert set(found) == combos, f"adam_kernel instantiations: {sorted(found)}"
    for (grad, out), (name, opcodes, _) in sorted(found.items()):
        vec = 8 if SIZE[grad] == 2 or out != "NoOut" else 4  # adam_vec: 16 bytes of the narrowest stream
        loads = 3 * vec * 4 // 16 + vec * SIZE[grad] // 16  # p, m, v + the grad
        stores = 3 * vec * 4 // 16 + (vec * 2 // 16 if out != "NoOut" else 0)  # p, m, v + the model param
        assert _wide(opcodes, "LDG") >= loads, f"{name}: {dict(opcodes)}; expected {loads} LDG.E.128"
        assert _wide(opcodes, "STG") >= stores, f"{name}: {dict(opcodes)}; expected {stores} STG.E.128"


def test_cuda_casts_move_both_sides_in_128_bit_accesses(cuda_kernels):
    found = _template_args(cuda_kernels, "cast_kernel")
    assert set(found) == {(s, d) for s in SIZE for d in SIZE}, f"cast_kernel instantiations: {sorted(found)}"
    for (src, dst), (name, opcodes, _) in sorted(found.items()):
        vec = 16 // min(SIZE[src], SIZE[dst])
        assert _wide(opcodes, "LDG") >= vec * SIZE[src] // 16, f"{name}: {dict(opcodes)}"
        assert _wide(opcodes, "STG") >= vec * SIZE[dst] // 16, f"{name}: {dict(opcodes)}"


def test_cuda_register_use_fits_the_blocks_the_launch_bounds_promise(cuda_kernels):
    """[Note: grid size]: the grid is SMs x the blocks that fit; __launch_bounds__(kThreads, kMinBlocksPerSM)
    caps registers so at least kMinBlocksPerSM fit (65536 registers per SM on sm_80/sm_90), with no spills."""
    threads, min_blocks = _source_constant("kThreads"), _source_constant("kMinBlocksPerSM")
    budget = 65536 // (threads * min_blocks)
    kernels = {n: d for n, d in cuda_kernels.items() if "adam_kernel<" in n or "cast_kernel<" in n}
    assert len(kernels) == 18
    for name, (_, res) in kernels.items():
        assert res["REG"] <= budget, f"{name} uses {res['REG']} registers; {min_blocks} x {threads} threads need <= {budget}"
        assert res["LOCAL"] == 0 and res["STACK"] == 0, f"{name} spills: {res}"


def test_cuda_wire_kernels_compile_without_spills(cuda_kernels):
    """The wire kernels cannot run here: each instantiation (x fp32, fp16, bf16; decode) compiles for
    sm_90 and keeps its Philox state in registers."""
    kernels = {n: d for n, d in cuda_kernels.items() if "wire_encode_kernel<" in n or "wire_decode_kernel" in n}
    assert len(kernels) == 4, sorted(kernels)
    for name, (_, res) in kernels.items():
        assert res["LOCAL"] == 0 and res["STACK"] == 0, f"{name} spills: {res}"


# ---- Triton ----------------------------------------------------------------------------------------

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
NUM_WARPS = 4  # what the launches use (Triton's default)


@pytest.fixture(scope="module")
def triton_ptx():
    """{variant: counts of its sm_90 PTX}, from tests/kernels/codegen_triton.py in a process of its own: the
    tests run Triton under TRITON_INTERPRET=1, where kernels are interpreted, not compiled."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = pathlib.Path(__file__).with_name("codegen_triton.py")
    proc = subprocess.run([sys.executable, str(script), str(NUM_WARPS)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("grad", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("out", [None, "fp16", "bf16"])
def test_triton_adam_uses_vector_access_when_aligned(triton_ptx, grad, out):
    from zerokern.kernels.backends import triton_adam

    per_thread = triton_adam.BLOCK // (NUM_WARPS * 32)
    loads = 3 * per_thread * 4 // 16 + per_thread * BYTES[grad] // 16
    stores = 3 * per_thread * 4 // 16 + (per_thread * BYTES[out] // 16 if out else 0)
    variants = {}
    for coef_ptr, found_inf in ((True, True), (True, False), (False, False)):
        key = f"adam grad={grad} out={out} coef_ptr={coef_ptr} found_inf={found_inf} aligned=True"
        counts = variants[coef_ptr, found_inf] = triton_ptx[key]
        assert counts["ld_v4"] >= loads, f"{key}: {counts}; expected {loads} 16-byte loads"
        assert counts["st_v4"] >= stores, f"{key}: {counts}; expected {stores} 16-byte stores"
    # found_inf costs one scalar load per program, not one per element.
    assert variants[True, True]["ld"] - variants[True, False]["ld"] == 1, variants


@pytest.mark.parametrize("src", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dst", ["fp32", "fp16", "bf16"])
def test_triton_casts_use_vector_access_when_aligned(triton_ptx, src, dst):
    from zerokern.kernels.backends import triton_flat

    per_thread = triton_flat.BLOCK // (NUM_WARPS * 32)
    counts = triton_ptx[f"cast src={src} dst={dst} aligned=True"]
    assert counts["ld_v4"] >= per_thread * BYTES[src] // 16, counts
    assert counts["st_v4"] >= per_thread * BYTES[dst] // 16, counts


def test_triton_unaligned_variant_makes_no_alignment_claim(triton_ptx):
    """A launch with a misaligned pointer runs the variant without the hint: no vector access there."""
    counts = triton_ptx["cast src=fp32 dst=fp32 aligned=False"]
    assert counts["ld_v4"] == 0 and counts["st_v4"] == 0 and counts["ld"] > 0, counts


def test_triton_lowbit_compiles_for_sm90_in_every_variant(triton_ptx):
    """The low-bit kernel cannot run here; every variant (state fp32/bf16/int8, fp32 masters or bf16
    params, grad dtypes) compiles for sm_90 and loads its operands from global memory."""
    lowbit = {k: v for k, v in triton_ptx.items() if k.startswith("lowbit ")}
    assert len(lowbit) == 12, sorted(lowbit)
    for key, counts in lowbit.items():
        assert counts["ld"] >= 4, (key, counts)  # param, grad, two moments (and the tables)


def test_triton_wire_kernels_round_twice_where_the_reference_does(triton_ptx):
    """x * inv + u, x - code * scale and out + code * scale are two roundings each in wire.py; Triton
    fuses them into FMAs by default (it did: 4 in encode, 2 in decode), which would change the
    bytes on a GPU. The launches' options (triton_wire.OPTIONS) leave none."""
    for op in ("encode", "encode nearest", "decode"):
        assert triton_ptx[f"wire {op} options=launch"]["fma"] == 0, triton_ptx[f"wire {op} options=launch"]
        assert triton_ptx[f"wire {op} options=default"]["fma"] > 0  # what the check would miss otherwise
