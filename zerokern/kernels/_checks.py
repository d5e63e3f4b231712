"""Argument checks for the Python backends (torch, triton).

The C++ backends check the same rules in csrc/torch/adam_args.cpp with the same
wording; tests/kernels/test_adam_errors.py runs every bad input through every backend.
Errors name the culprit: "grads[3] has 4097 elements, params[3] has 4096".
"""

import math

import torch

from .backends.hyper import AdamHyper

_F32 = (torch.float32,)
_GRAD = (torch.float32, torch.float16, torch.bfloat16)
_LOW = (torch.float16, torch.bfloat16)


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def _names(dtypes):
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _check_tensor(t, name, i, p0, numel, allowed):
    where = f"{name}[{i}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} is {type(t).__name__}, expected a tensor")
    if t.dtype not in allowed:
        raise TypeError(f"{where} is {dtype_name(t.dtype)}, expected {_names(allowed)}")
    if t.device != p0.device:
        raise ValueError(f"{where} is on {t.device}, params[0] is on {p0.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where} is not contiguous")
    if t.numel() != numel:
        raise ValueError(f"{where} has {t.numel()} elements, params[{i}] has {numel}")


def check_scalar_tensor(x, name, p0):
    if not isinstance(x, torch.Tensor):
        return
    if x.dtype != torch.float32:
        raise TypeError(f"{name} is {dtype_name(x.dtype)}, expected a one-element float32 tensor")
    if x.numel() != 1:
        raise ValueError(f"{name} has {x.numel()} elements, expected one")
    if x.device != p0.device:
        raise ValueError(f"{name} is on {x.device}, params[0] is on {p0.device}")


def check_hyper(h: AdamHyper):
    # The same order and wording as torch.optim's constructor checks.
    if not isinstance(h.lr, torch.Tensor) and not h.lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {h.lr}")
    if not h.eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {h.eps}")
    if not 0.0 <= h.beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {h.beta1}")
    if not 0.0 <= h.beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {h.beta2}")
    if not h.weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {h.weight_decay}")
    if not isinstance(h.step, torch.Tensor) and not h.step >= 1:
        raise ValueError(f"step must be >= 1 (the 1-based number of the update being made), got {h.step}")
    s = h.grad_scale
    if s is not None and not isinstance(s, torch.Tensor) and not (math.isfinite(s) and s != 0):
        raise ValueError(f"grad_scale must be finite and non-zero, got {s}")


def check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, h: AdamHyper):
    check_hyper(h)
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} tensors, params has {n}")
    if model_params and len(model_params) != n:
        raise ValueError(f"model_params has {len(model_params)} tensors, params has {n}")
    if n == 0:
        return
    p0 = params[0]
    if not isinstance(p0, torch.Tensor):
        raise TypeError(f"params[0] is {type(p0).__name__}, expected a tensor")
    for i in range(n):
        numel = params[i].numel() if isinstance(params[i], torch.Tensor) else 0
        _check_tensor(params[i], "params", i, p0, numel, _F32)
        _check_tensor(grads[i], "grads", i, p0, numel, _GRAD)
        _check_tensor(exp_avgs[i], "exp_avgs", i, p0, numel, _F32)
        _check_tensor(exp_avg_sqs[i], "exp_avg_sqs", i, p0, numel, _F32)
        if model_params:
            _check_tensor(model_params[i], "model_params", i, p0, numel, _LOW)
        if numel > 0:
            ptrs = (params[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr())
            if len(set(ptrs)) != 3:
                raise ValueError(
                    f"params[{i}], exp_avgs[{i}] and exp_avg_sqs[{i}] must not share memory")
    for name in ("lr", "step", "grad_scale", "found_inf"):
        check_scalar_tensor(getattr(h, name), name, p0)


# --- flatten / unflatten (csrc/torch/flat_ops.cpp has the same rules) ---

_KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def check_flat_list(tensors, name, ref, ref_name):
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] is {type(t).__name__}, expected a tensor")
        if t.dtype not in _KERNEL_FLOATS:
            raise TypeError(f"{name}[{i}] is {dtype_name(t.dtype)}, expected float32, float16 or bfloat16")
        if t.device != ref.device:
            raise ValueError(f"{name}[{i}] is on {t.device}, {ref_name} is on {ref.device}")


def check_flat(flat, name="flat"):
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{name} is {type(flat).__name__}, expected a tensor")
    if flat.dtype not in _KERNEL_FLOATS:
        raise TypeError(f"{name} is {dtype_name(flat.dtype)}, expected float32, float16 or bfloat16")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {list(flat.shape)}"
                         + ("" if flat.is_contiguous() else " (not contiguous)"))


def resolve_offsets(tensors, name, offsets):
    """Each tensor's offset in the flat buffer: the given ones (increasing, no
    overlap) or packed back to back."""
    if offsets is None:
        out, nxt = [], 0
        for t in tensors:
            out.append(nxt)
            nxt += t.numel()
        return out
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(tensors):
        raise ValueError(f"offsets has {len(offsets)} entries, {name} has {len(tensors)}")
    end = 0
    for i, o in enumerate(offsets):
        if o < end:
            if i == 0:
                raise ValueError(f"offsets[0] = {o} is negative")
            raise ValueError(f"offsets[{i}] = {o} overlaps {name}[{i - 1}] (offsets[{i - 1}] = {offsets[i - 1]}, "
                             f"{tensors[i - 1].numel()} elements); offsets must increase")
        end = o + tensors[i].numel()
    return offsets


def check_fits(flat, tensors, name, offsets, packed, flat_name="flat"):
    need = offsets[-1] + tensors[-1].numel() if tensors else 0
    if packed and flat.numel() != need:
        raise ValueError(f"{flat_name} has {flat.numel()} elements, the {name} hold {need}")
    if not packed and flat.numel() < need:
        raise ValueError(f"{name}[{len(tensors) - 1}] ends at element {need}, past {flat_name}'s {flat.numel()}")


def check_flatten_args(tensors, dtype, offsets, numel):
    """-> (offsets, numel of the flat buffer, whether it has gaps to zero)."""
    if not tensors:
        raise ValueError("flatten needs at least one tensor (it takes the device from tensors[0])")
    if dtype not in _KERNEL_FLOATS:
        raise TypeError(f"dtype is {dtype_name(dtype)}, expected float32, float16 or bfloat16")
    check_flat_list(tensors, "tensors", tensors[0], "tensors[0]")
    off = resolve_offsets(tensors, "tensors", offsets)
    need = off[-1] + tensors[-1].numel()
    size = need if numel is None else int(numel)
    if size < need:
        raise ValueError(f"numel {size} is less than the {need} elements the tensors need")
    return off, size, size != need or offsets is not None


def check_unflatten_args(flat, tensors, name, offsets, flat_name="flat"):
    """Also serves flatten_into (flat_name="out", name="tensors")."""
    check_flat(flat, flat_name)
    check_flat_list(tensors, name, flat, flat_name)
    off = resolve_offsets(tensors, name, offsets)
    check_fits(flat, tensors, name, off, offsets is None, flat_name)
    return off


# --- low-bit Adam (lowbit_ops.fused_adam_lowbit_) ---

_STATE = (torch.float32, torch.bfloat16, torch.uint8)
_PARAM_LOWBIT = (torch.float32, torch.bfloat16)


def _one_format(lst, name, allowed):
    dtypes = {t.dtype for t in lst if isinstance(t, torch.Tensor)}
    if len(dtypes) > 1:
        raise TypeError(f"{name} mixes {_names(sorted(dtypes, key=str))}; one call takes one format")
    return lst[0].dtype if lst and isinstance(lst[0], torch.Tensor) else allowed[0]


def _check_scales(scales, name, i, p0, numel):
    from .lowbit import num_blocks

    where = f"{name}[{i}]"
    s = scales[i]
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32:
        raise TypeError(f"{where} must be a float32 tensor (one scale per block)")
    if s.device != p0.device or not s.is_contiguous():
        raise ValueError(f"{where} must be contiguous on {p0.device}")
    if s.numel() != num_blocks(numel):
        raise ValueError(f"{where} has {s.numel()} scales, params[{i}] has {numel} elements: "
                         f"{num_blocks(numel)} blocks")


def check_lowbit_args(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                      index_bases, seed, h: AdamHyper):
    check_hyper(h)
    n = len(params)
    for name, lst in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("model_params", model_params or [None] * n),
                      ("exp_avg_scales", exp_avg_scales if exp_avg_scales is not None else [None] * n),
                      ("exp_avg_sq_scales", exp_avg_sq_scales if exp_avg_sq_scales is not None else [None] * n),
                      ("index_bases", index_bases if index_bases is not None else [0] * n)):
        if len(lst) != n:
            raise ValueError(f"{name} has {len(lst)} entries, params has {n}")
    if n == 0:
        return
    p0 = params[0]
    if not isinstance(p0, torch.Tensor):
        raise TypeError(f"params[0] is {type(p0).__name__}, expected a tensor")
    pdt = _one_format(params, "params", _PARAM_LOWBIT)
    mdt, vdt = _one_format(exp_avgs, "exp_avgs", _STATE), _one_format(exp_avg_sqs, "exp_avg_sqs", _STATE)
    if model_params and pdt != torch.float32:
        raise ValueError("model_params are written from fp32 master params; bf16 params are updated in place")
    stochastic = pdt == torch.bfloat16 or torch.bfloat16 in (mdt, vdt)
    if stochastic and index_bases is None:
        raise ValueError("index_bases are needed where values are rounded stochastically (bf16 params or "
                         "state): the global index of each tensor's first element keys the random stream")
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    for state_dt, scales, name in ((mdt, exp_avg_scales, "exp_avg_scales"), (vdt, exp_avg_sq_scales,
                                                                             "exp_avg_sq_scales")):
        if state_dt == torch.uint8 and scales is None:
            raise ValueError(f"{name} are needed for uint8 state (one float32 scale per block)")
    for i in range(n):
        numel = params[i].numel() if isinstance(params[i], torch.Tensor) else 0
        _check_tensor(params[i], "params", i, p0, numel, _PARAM_LOWBIT)
        _check_tensor(grads[i], "grads", i, p0, numel, _GRAD)
        _check_tensor(exp_avgs[i], "exp_avgs", i, p0, numel, _STATE)
        _check_tensor(exp_avg_sqs[i], "exp_avg_sqs", i, p0, numel, _STATE)
        if model_params:
            _check_tensor(model_params[i], "model_params", i, p0, numel, _LOW)
        if mdt == torch.uint8:
            _check_scales(exp_avg_scales, "exp_avg_scales", i, p0, numel)
        if vdt == torch.uint8:
            _check_scales(exp_avg_sq_scales, "exp_avg_sq_scales", i, p0, numel)
        if index_bases is not None and (not isinstance(index_bases[i], int) or index_bases[i] < 0):
            raise ValueError(f"index_bases[{i}] must be a non-negative int, got {index_bases[i]!r}")
        if numel > 0:
            ptrs = (params[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr())
            if len(set(ptrs)) != 3:
                raise ValueError(f"params[{i}], exp_avgs[{i}] and exp_avg_sqs[{i}] must not share memory")
    for name in ("lr", "step", "grad_scale", "found_inf"):
        check_scalar_tensor(getattr(h, name), name, p0)
