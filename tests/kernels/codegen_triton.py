"""Compiles every Triton kernel variant for sm_90 (no GPU needed) and prints, as one JSON line,
{variant: {"ld": global loads, "ld_v4": 16-byte vector loads, "st_v4": 16-byte vector stores}}
counted in the PTX. Run by tests/kernels/test_codegen.py without TRITON_INTERPRET, which would make the
kernels interpreted instead of compiled. Argument: num_warps (what the launches use)."""

import json
import re
import sys

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from zerokern.kernels.backends import triton_adam, triton_flat, triton_lowbit, triton_wire

DTYPES = {"fp32": tl.float32, "fp16": tl.float16, "bf16": tl.bfloat16}
TABLES = {"table_ptr": "*i64", "tile_tensor_ptr": "*i32", "first_tile_ptr": "*i64", "numel_ptr": "*i64",
          "base_ptr": "*i64", "scells_ptr": "*i32", "ucells_ptr": "*i32"}
INTS = {"n_tensors": "i32", "seed": "i64", "step": "i32"}


def ptx_counts(kernel, constexprs, num_warps):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = TABLES.get(name, "*fp32")
        elif name in INTS:
            signature[name] = INTS[name]
        else:
            signature[name] = "fp32"
    # Tensor arguments are 16-byte aligned (torch's allocator) and Triton's launcher tells the
    # compiler so; the same attribute here.
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if signature[n][0] == "*"}
    src = ASTSource(kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    vector = r"\.global(?:\.[a-z0-9]+)*\.v4\.(?:b32|f32|u32|s32)"
    return {"ld": len(re.findall(r"\bld\.global", ptx)), "ld_v4": len(re.findall(r"\bld" + vector, ptx)),
            "st_v4": len(re.findall(r"\bst" + vector, ptx))}


def wire_fmas(kernel, constexprs, num_warps, options):
    """FMAs in the sm_90 PTX of a wire kernel compiled with `options` (its launches' own, or not)."""
    ints = {"n": "i64", "nb": "i64", "seed": "i64", "step": "i32", "stream": "i32", "base": "i64"}
    signature = {name: "constexpr" if name in constexprs else
                 ("*u8" if name in ("out_ptr", "buf_ptr") else "*fp32") if name.endswith("_ptr") else ints[name]
                 for name in kernel.arg_names}
    src = ASTSource(kernel, signature=signature, constexprs=constexprs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options}).asm["ptx"]
    return {"fma": len(re.findall(r"\bfma\.", ptx))}


def main(num_warps):
    out = {}
    for grad in DTYPES:
        for model in (None, "fp16", "bf16"):
            for coef_ptr, found_inf in ((True, True), (True, False), (False, False)):
                key = f"adam grad={grad} out={model} coef_ptr={coef_ptr} found_inf={found_inf} aligned=True"
                out[key] = ptx_counts(triton_adam._adam_kernel, {
                    "GRAD_T": DTYPES[grad], "OUT_T": DTYPES[model or "fp16"], "HAS_OUT": model is not None,
                    "COEF_PTR": coef_ptr, "FOUND_INF": found_inf, "ALIGNED": True, "BLOCK": triton_adam.BLOCK,
                }, num_warps)
    for src in DTYPES:
        for dst in DTYPES:
            for aligned in (True, False) if src == dst == "fp32" else (True,):
                out[f"cast src={src} dst={dst} aligned={aligned}"] = ptx_counts(triton_flat._cast_kernel, {
                    "SRC_T": DTYPES[src], "DST_T": DTYPES[dst], "ALIGNED": aligned, "BLOCK": triton_flat.BLOCK,
                }, num_warps)
    for state, state_t in ((0, tl.float32), (1, tl.bfloat16), (2, tl.uint8)):
        for param in ("fp32", "bf16"):
            for grad in ("fp32", "bf16"):
                model = "bf16" if param == "fp32" else None
                out[f"lowbit state={state} param={param} grad={grad}"] = ptx_counts(triton_lowbit._lowbit_kernel, {
                    "GRAD_T": DTYPES[grad], "PARAM_T": DTYPES[param], "STATE": state, "STATE_T": state_t,
                    "HAS_OUT": model is not None, "OUT_T": DTYPES[model or "fp16"], "BLOCK": triton_lowbit.BLOCK,
                }, num_warps)
    for name, options in (("launch", triton_wire.OPTIONS), ("default", {})):
        for rounding, stochastic in (("", True), (" nearest", False)):  # x * inv + u, u random or 0.5
            out[f"wire encode{rounding} options={name}"] = wire_fmas(triton_wire._encode_kernel, {
                "BITS": 4, "HAS_ERR": True, "X_BF16": False, "STOCHASTIC": stochastic, "HAS_RES": True,
                "RES_BF16": False, "ERR_BF16": False, "BLOCK": triton_wire.BLOCK},
                num_warps, options)
        out[f"wire decode options={name}"] = wire_fmas(triton_wire._decode_kernel, {
            "BITS": 8, "ACCUMULATE": True, "BLOCK": triton_wire.BLOCK}, num_warps, options)
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]))
