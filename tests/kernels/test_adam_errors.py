"""Bad input to fused_adam_: the same clear error, naming the culprit, from every backend."""

import re

import pytest
import torch

from backends import ALL, device_for
from zerokern import ops

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)


def good(device, n=2, size=8):
    return dict(
        params=[torch.zeros(size, device=device) for _ in range(n)],
        grads=[torch.zeros(size, device=device) for _ in range(n)],
        exp_avgs=[torch.zeros(size, device=device) for _ in range(n)],
        exp_avg_sqs=[torch.zeros(size, device=device) for _ in range(n)],
    )


def _set(lst_name, i, make):
    def apply(args, device):
        args[lst_name][i] = make(args[lst_name][i], device)
    return apply


def _hyper(**kw):
    def apply(args, device):
        args.update(kw)
    return apply


# (id, mutation, exception type, message regex)
CASES = [
    ("short-grads", lambda a, d: a["grads"].pop(), ValueError, r"^grads has 1 tensors, params has 2$"),
    ("model-len", lambda a, d: a.update(model_params=[torch.zeros(8, device=d, dtype=torch.bfloat16)]),
     ValueError, r"^model_params has 1 tensors, params has 2$"),
    ("grad-numel", _set("grads", 1, lambda t, d: torch.zeros(9, device=d)), ValueError,
     r"^grads\[1\] has 9 elements, params\[1\] has 8$"),
    ("param-dtype", _set("params", 1, lambda t, d: t.half()), TypeError,
     r"^params\[1\] is float16, expected float32$"),
    ("grad-dtype", _set("grads", 0, lambda t, d: t.double()), TypeError,
     r"^grads\[0\] is float64, expected float32, float16 or bfloat16$"),
    ("grad-int", _set("grads", 0, lambda t, d: t.int()), TypeError,
     r"^grads\[0\] is int32, expected float32, float16 or bfloat16$"),
    ("state-dtype", _set("exp_avg_sqs", 1, lambda t, d: t.bfloat16()), TypeError,
     r"^exp_avg_sqs\[1\] is bfloat16, expected float32$"),
    ("model-dtype", lambda a, d: a.update(model_params=[torch.zeros(8, device=d)] * 2), TypeError,
     r"^model_params\[0\] is float32, expected float16 or bfloat16$"),
    ("noncontig", _set("exp_avgs", 1, lambda t, d: torch.zeros(16, device=d)[::2]), ValueError,
     r"^exp_avgs\[1\] is not contiguous$"),
    ("aliased", lambda a, d: a["exp_avgs"].__setitem__(0, a["params"][0]), ValueError,
     r"^params\[0\], exp_avgs\[0\] and exp_avg_sqs\[0\] must not share memory$"),
    ("found-inf-dtype", _hyper(found_inf=torch.zeros(1, dtype=torch.bool)), TypeError,
     r"^found_inf is bool, expected a one-element float32 tensor$"),
    ("lr-shape", _hyper(lr=torch.zeros(2)), ValueError, r"^lr has 2 elements, expected one$"),
    ("neg-lr", _hyper(lr=-1.0), ValueError, r"^Invalid learning rate: -1"),
    ("beta1", _hyper(beta1=1.0), ValueError, r"^Invalid beta parameter at index 0: 1"),
    ("beta2", _hyper(beta2=-0.1), ValueError, r"^Invalid beta parameter at index 1: -0.1"),
    ("eps", _hyper(eps=-1e-8), ValueError, r"^Invalid epsilon value: -1"),
    ("wd", _hyper(weight_decay=-0.5), ValueError, r"^Invalid weight_decay value: -0.5"),
    ("step0", _hyper(step=0), ValueError, r"^step must be >= 1 \(the 1-based number of the update being made\), got 0"),
    ("scale0", _hyper(grad_scale=0.0), ValueError, r"^grad_scale must be finite and non-zero, got 0"),
]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_culprit(backend, case):
    _, mutate, exc, pattern = case
    device = device_for(backend)
    args = {**good(device), **HYPER}
    mutate(args, device)
    before = [t.clone() for t in args["params"]]
    with pytest.raises(exc) as info:
        ops.fused_adam_(backend=backend, **args)
    # C++ errors carry torch's location suffix on some builds; the message itself comes first.
    assert re.search(pattern, str(info.value).splitlines()[0]), str(info.value)
    for a, b in zip(args["params"], before):
        assert torch.equal(a, b), "a rejected call must change nothing"


def test_mixed_devices_are_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device to mix devices")
    args = {**good("cuda"), **HYPER}
    args["grads"][1] = args["grads"][1].cpu()
    with pytest.raises(ValueError, match=r"^grads\[1\] is on cpu, params\[0\] is on cuda:0"):
        ops.fused_adam_(backend="cuda", **args)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        ops.fused_adam_(backend="fastest", **good("cpu"), **HYPER)
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        ops.fused_adam_([], [], [], [], backend="fastest", **HYPER)


def test_unavailable_backend_raises_with_reason():
    missing = ops.unavailable_backends()
    if not missing:
        pytest.skip("every backend is available here")
    name, reason = next(iter(missing.items()))
    with pytest.raises(ops.BackendUnavailableError, match=re.escape(reason)):
        ops.fused_adam_(backend=name, **good("cpu"), **HYPER)


def test_backend_on_wrong_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match="backend 'cpu' runs on cpu tensors; params\\[0\\] is on cuda"):
        ops.fused_adam_(backend="cpu", **good("cuda"), **HYPER)


def test_available_backends_report():
    avail = ops.available_backends()
    assert set(avail) == {"cuda", "triton", "cpu", "torch"}
    assert avail["cpu"] and avail["torch"]
    missing = ops.unavailable_backends()
    assert set(missing) == {name for name, ok in avail.items() if not ok}
    assert all(isinstance(r, str) and r for r in missing.values())
    assert avail["cuda"] == torch.cuda.is_available()
