"""The cached host path of fused_adam_ ([Note: host cost] in csrc/torch/adam_cache.h).

A call with the tensors of an earlier validated call skips the per-tensor checks. These tests
hold it to the rule that makes that safe: a cached verdict is reused only for tensors with the
same pointers, sizes, dtypes, devices and contiguity. Anything else is checked again, so a bad
tensor swapped in after a good call still raises, and a replaced tensor is updated where it is now.
"""

import pytest
import torch

from backends import KERNELS, device_for
from test_adam import HYPER, TOL, assert_close_lists, clone_state, make_state, run
from zerokern import ops

_C = pytest.importorskip("zerokern._C")
from zerokern.kernels.backends import native, triton_adam  # noqa: E402


def call(state, backend, step=1, **kw):
    params, grads, m, v, out = state
    ops.fused_adam_(params, grads, m, v, step=step, model_params=out, backend=backend, **{**HYPER, **kw})


def test_cpu_second_call_takes_the_cached_path_and_gives_the_same_numbers():
    state = make_state([300, 5, 4097], torch.bfloat16, "cpu", model_dtype=torch.bfloat16)
    ref = clone_state(state)
    cached = native.cached_call("cpu")
    lists = tuple(state[:4]) + (state[4],)
    hyper_args = (HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], 1.0, True, True,
                  1.0, None, None, None, None, True)
    fresh = make_state([300, 5, 4097], torch.bfloat16, "cpu", model_dtype=torch.bfloat16)
    assert cached(tuple(fresh[:4]) + (fresh[4],), *hyper_args) is False, "never validated: the op must run"
    run("cpu", state, 1)
    assert cached(lists, *hyper_args) is True, "validated before: the cached path runs"
    run("cpu", state, 4)  # steps 1..4 again: all cached
    run("torch", ref, 1)
    run("torch", ref, 4)
    for k in (0, 2, 3):  # params, exp_avgs, exp_avg_sqs
        assert_close_lists(state[k], ref[k], *TOL[torch.bfloat16])
    for a, e in zip(state[4], state[0]):
        assert torch.equal(a, e.to(torch.bfloat16)), "model params are the rounded masters"


def test_dry_run_changes_nothing():
    state = make_state([300, 5], torch.float32, "cpu")
    call(state, "cpu")
    before = clone_state(state)
    from zerokern.kernels.backends.hyper import AdamHyper

    h = AdamHyper(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], 2)
    native.fused_adam_(*state[:4], None, h, dry_run=True)
    for a, b in zip(state[0] + state[2] + state[3], before[0] + before[2] + before[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", KERNELS)
def test_a_bad_tensor_swapped_in_after_a_good_call_still_raises(backend):
    device = device_for(backend)
    state = make_state([64, 32], torch.float32, device)
    call(state, backend)
    call(state, backend, step=2)  # cached now
    good = state[1][0]
    cases = [
        (torch.zeros(8, 8, device=device).t(), ValueError, "grads\\[0\\] is not contiguous"),
        (torch.zeros(64, dtype=torch.float64, device=device), TypeError, "grads\\[0\\] is float64"),
        (torch.zeros(65, device=device), ValueError, "grads\\[0\\] has 65 elements"),
    ]
    for bad, error, message in cases:
        state[1][0] = bad
        with pytest.raises(error, match=message):
            call(state, backend, step=3)
    state[1][0] = good
    call(state, backend, step=3)  # and back: fine


@pytest.mark.parametrize("backend", KERNELS)
def test_hyper_parameters_are_checked_on_every_cached_call(backend):
    device = device_for(backend)
    state = make_state([64], torch.float32, device)
    call(state, backend)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        call(state, backend, lr=-1.0)
    with pytest.raises(TypeError, match="found_inf is int32, expected a one-element float32 tensor"):
        call(state, backend, found_inf=torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="step must be >= 1"):
        call(state, backend, step=0)


def cached_hit(state, dry_run=True):
    """Whether the native cached path takes these tensors (a dry run: nothing is updated)."""
    return native.cached_call(state[0][0].device.type)(
        tuple(state[:4]) + (state[4] or [],), HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"],
        HYPER["weight_decay"], 1.0, True, True, 1.0, None, None, None, None, dry_run)


@pytest.mark.parametrize("backend", KERNELS)
def test_replaced_tensors_are_updated_where_they_are_now(backend):
    """p.data = ..., a new grad tensor, an optimizer state reloaded: new pointers, a new verdict."""
    device = device_for(backend)
    state = make_state([300, 77], torch.float16, device, model_dtype=torch.float16)
    ref = clone_state(state)
    run(backend, state, 2)
    run("torch", ref, 2)
    for k in range(5):  # every list gets a fresh tensor with the same values
        state[k][1] = state[k][1].clone()
        ref[k][1] = ref[k][1].clone()
    if backend == "cpu":
        assert not cached_hit(state), "new pointers: not the cached verdict"
    run(backend, state, 3)
    if backend == "cpu":
        assert cached_hit(state), "validated now: cached"
    run("torch", ref, 3)
    for k in range(4):
        if k != 1:
            assert_close_lists(state[k], ref[k], *TOL[torch.float16])


def test_the_key_sees_dtype_contiguity_and_size_at_the_same_address():
    base = torch.zeros(16)
    key = _C.tensor_lists_id
    same = key(([base],))
    assert key(([base],)) == same
    assert key(([base.view(torch.int32)],)) != same, "same pointer and size, other dtype"
    square = base.view(4, 4)
    assert key(([square.t()],)) != key(([square],)), "same pointer and size, not contiguous"
    assert key(([base[:8]],)) != same, "same pointer, other size"
    assert key(([base, base],)) != key(([base], [base])), "the split into lists counts"
    assert key(([torch.nn.Parameter(base)],)) is not None, "parameters are plain tensors"

    class Sub(torch.Tensor):
        pass

    assert key(([base.as_subclass(Sub)],)) is None, "subclasses take the op's path"
    assert key(([base, 3],)) is None


def test_numbers_are_never_reused():
    """A key forgotten (more than 64 others since) and seen again gets a new number, so a
    cached plan is never found under another key's number."""
    tensors = [torch.zeros(4) for _ in range(70)]
    first = _C.tensor_lists_id(([tensors[0]],))
    seen = {first}
    for t in tensors[1:]:
        n = _C.tensor_lists_id(([t],))
        assert n not in seen
        seen.add(n)
    again = _C.tensor_lists_id(([tensors[0]],))
    assert again not in seen


@pytest.mark.triton
@pytest.mark.skipif(ops.unavailable_backends().get("triton") is not None, reason="triton unavailable")
def test_triton_reuses_its_plan_and_makes_a_new_one_for_new_tensors():
    device = device_for("triton")
    state = make_state([300, 2000], torch.bfloat16, device, model_dtype=torch.bfloat16)
    call(state, "triton")
    plans = dict(triton_adam._PLANS)
    call(state, "triton", step=2)
    assert dict(triton_adam._PLANS) == plans and all(triton_adam._PLANS[k] is p for k, p in plans.items())
    state[0][0] = state[0][0].clone()
    call(state, "triton", step=3)
    assert len(triton_adam._PLANS.keys() - plans.keys()) == 1, "a new plan for the new pointer"


def test_copy_on_write_storage_is_left_to_the_op():
    """A lazy clone shares storage until written: the op copies it first (data_ptr()), so
    the cached path must not write through the shared pointer into the clone."""
    state = make_state([64], torch.float32, "cpu")
    call(state, "cpu")
    snapshot = torch._lazy_clone(state[0][0])
    before = snapshot.clone()
    assert not cached_hit(state)
    call(state, "cpu", step=2)
    assert torch.equal(snapshot, before), "the clone kept its values"
    assert not torch.equal(state[0][0], before)


def test_negative_views_are_left_to_the_op():
    """torch._neg_view shares memory and pointer, but its values are the negation: the kernel
    would read the raw bits, so the op (which resolves the view) must take it."""
    state = make_state([64], torch.float32, "cpu")
    ref = clone_state(state)
    call(state, "cpu")
    call(ref, "torch")
    raw = state[1][0].clone()
    state[1][0], ref[1][0] = torch._neg_view(raw), torch._neg_view(raw.clone())
    assert not cached_hit(state)
    call(state, "cpu", step=2)
    call(ref, "torch", step=2)
    torch.testing.assert_close(state[0][0], ref[0][0], rtol=2e-6, atol=1e-7)


def test_dispatch_modes_see_every_call():
    """A TorchDispatchMode (a profiler's, FakeTensor's, a user's logger) sees the op on every
    call, cached or not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    state = make_state([64], torch.float32, "cpu")
    call(state, "cpu")
    with Log() as log:
        call(state, "cpu", step=2)
        call(state, "cpu", step=3)
    assert sum("zerokern.fused_adam_" in op for op in log.ops) == 2, log.ops


def test_booleans_are_checked_as_the_op_checks_them():
    state = make_state([64], torch.float32, "cpu")
    call(state, "cpu")
    args = (tuple(state[:4]) + ([],), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, "no", True, 1.0, None, None, None, None, False)
    with pytest.raises(TypeError):
        native.cached_call("cpu")(*args)


def test_threads_calling_with_rotating_tensors_agree_with_one_thread():
    """Several threads, each stepping its own tensors, with more distinct calls than the cache
    holds: the entries change under the threads' feet (the op remembers without the GIL)."""
    import threading

    sets = [make_state([257, 33], torch.float32, "cpu", seed=i) for i in range(40)]
    expected = [clone_state(st) for st in sets]
    for st in expected:
        for step in (1, 2):
            call(st, "torch", step=step)
    errors = []

    def work(mine):
        try:
            for step in (1, 2):
                for st in mine:
                    call(st, "cpu", step=step)
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(sets[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for st, ex in zip(sets, expected):
        assert_close_lists(st[0], ex[0], *TOL[torch.float32])


@pytest.mark.triton
@pytest.mark.skipif(ops.unavailable_backends().get("triton") is not None, reason="triton unavailable")
def test_triton_a_misaligned_tensor_gets_a_launch_of_its_own():
    """A view at an odd offset cannot take 16-byte accesses; it gets its own launch (compiled
    without the alignment hint) and leaves the aligned tensors theirs. Same numbers either way."""
    device = device_for("triton")
    state = make_state([300, 2000, 513], torch.float32, device)
    for k in range(4):  # tensor 1 becomes a view one element into a bigger buffer
        buf = torch.zeros(2001, device=device)
        buf[1:].copy_(state[k][1])
        state[k][1] = buf[1:]
    ref = clone_state(state)
    run("triton", state, 2)
    run("torch", ref, 2)
    plan = triton_adam._PLANS[next(reversed(triton_adam._PLANS))]
    assert sorted((launch.batch.count, launch.batch.aligned) for launch in plan.launches) == [(1, False), (2, True)]
    for k in (0, 2, 3):
        assert_close_lists(state[k], ref[k], *TOL[torch.float32])
