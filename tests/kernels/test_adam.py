"""fused_adam_ on every backend against the plain-PyTorch reference and torch.optim."""

import pytest
import torch

from backends import ALL, KERNELS, device_for
from zerokern import ops

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
ODD_SIZES = [0, 1, 3, 127, 4097, 70001]

# (rtol, atol) for fp32 master weights after a few steps, kernel vs reference.
# Both do the same fp32 arithmetic on the same (already rounded) grads; they
# differ only in operation order and in the bias-correction power (float powf
# in C++, exp2/log2 in Triton, double pow in the reference): a few ulps, which
# Adam's normalised update does not amplify. So the grad dtype does not loosen it.
TOL = {torch.float32: (2e-6, 1e-7), torch.float16: (2e-6, 1e-7), torch.bfloat16: (2e-6, 1e-7)}


def make_state(sizes, grad_dtype, device, seed=0, model_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen).to(device) for n in sizes]
    grads = [(torch.randn(n, generator=gen) * 0.1).to(device, grad_dtype) for n in sizes]
    m = [torch.zeros(n, device=device) for n in sizes]
    v = [torch.zeros(n, device=device) for n in sizes]
    out = [torch.empty(n, device=device, dtype=model_dtype) for n in sizes] if model_dtype else None
    return [params, grads, m, v, out]


def clone_state(state):
    return [None if lst is None else [t.clone() for t in lst] for lst in state]


def run(backend, state, steps, **kw):
    params, grads, m, v, out = state
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        # fresh grads each step, identical across backends
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=gen) * 0.1)
        ops.fused_adam_(params, grads, m, v, step=step, model_params=out, backend=backend, **{**HYPER, **kw})


def assert_close_lists(actual, expected, rtol, atol):
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.cpu(), e.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"tensor {i}: {m}")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model_dtype", [None, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_reference(backend, grad_dtype, model_dtype, adam_w_mode):
    device = device_for(backend)
    # Under TRITON_INTERPRET each 1024-element tile is a numpy program (~30 ms a step): 70001's 69 of
    # them made this test 10 s; 4097 has full tiles and a masked tail too (as in test_lowbit.py).
    interpreted = backend == "triton" and device == "cpu"
    state = make_state(ODD_SIZES[:-1] if interpreted else ODD_SIZES, grad_dtype, device, model_dtype=model_dtype)
    ref = clone_state(state)
    run(backend, state, 5, adam_w_mode=adam_w_mode)
    run("torch", ref, 5, adam_w_mode=adam_w_mode)
    rtol, atol = TOL[grad_dtype]
    for k in range(3):  # params, exp_avgs, exp_avg_sqs
        assert_close_lists([state[0], state[2], state[3]][k], [ref[0], ref[2], ref[3]][k], rtol, atol)
    if model_dtype is not None:
        # The write-back is the rounding of this backend's own master weights, bit for bit.
        for i, (o, p) in enumerate(zip(state[4], state[0])):
            assert torch.equal(o, p.to(model_dtype)), f"model_params[{i}] != params[{i}].to({model_dtype})"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_matches_torch_optim(backend, adam_w_mode):
    """20 steps against torch.optim.AdamW / Adam (fp32, the semantics we promise)."""
    device = device_for(backend)
    state = make_state([4097, 127, 1], torch.float32, device)
    params, grads, m, v, _ = state
    ref_params = [p.clone().requires_grad_() for p in params]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = cls(ref_params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
              weight_decay=HYPER["weight_decay"], foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 21):
        for g, rp in zip(grads, ref_params):
            g.copy_(torch.randn(g.shape, generator=gen))
            rp.grad = g.clone()
        ops.fused_adam_(params, grads, m, v, step=step, adam_w_mode=adam_w_mode, backend=backend, **HYPER)
        opt.step()
    # 20 steps of error accumulation at lr 1e-2 on values of order 1: a few 1e-6.
    assert_close_lists(params, [p.detach() for p in ref_params], rtol=1e-5, atol=1e-5)
    assert_close_lists(m, [opt.state[p]["exp_avg"] for p in ref_params], rtol=1e-5, atol=1e-6)
    assert_close_lists(v, [opt.state[p]["exp_avg_sq"] for p in ref_params], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ALL)
def test_no_bias_correction(backend):
    """torch.optim has no such switch; check two steps against the closed form."""
    device = device_for(backend)
    g = torch.tensor([1.0, -2.0, 0.5, 0.0, 4.0], device=device)
    p, m, v = torch.zeros(5, device=device), torch.zeros(5, device=device), torch.zeros(5, device=device)
    for step in (1, 2):
        ops.fused_adam_([p], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=step,
                        bias_correction=False, backend=backend)
    m1, v1 = 0.1 * g, 0.01 * g * g
    m2, v2 = 0.9 * m1 + 0.1 * g, 0.99 * v1 + 0.01 * g * g
    expected = -0.1 * m1 / (v1.sqrt() + 1e-8) - 0.1 * m2 / (v2.sqrt() + 1e-8)
    torch.testing.assert_close(p, expected)


@pytest.mark.parametrize("backend", KERNELS)
def test_many_tensors_mixed_dtypes(backend):
    """Hundreds of tensors (more than one CUDA launch batch of 224) with grads of all three dtypes."""
    device = device_for(backend)
    sizes = [(7 * i) % 300 for i in range(500)]
    state = make_state(sizes, torch.float32, device, model_dtype=torch.bfloat16)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    state[1] = [g.to(dtypes[i % 3]) for i, g in enumerate(state[1])]
    ref = clone_state(state)
    for st, be in ((state, backend), (ref, "torch")):
        ops.fused_adam_(st[0], st[1], st[2], st[3], step=1, model_params=st[4], backend=be, **HYPER)
    assert_close_lists(state[0], ref[0], *TOL[torch.float32])
    for o, p in zip(state[4], state[0]):
        assert torch.equal(o, p.to(torch.bfloat16))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_grad_scale_divides(backend, as_tensor):
    device = device_for(backend)
    a = make_state([1000, 33], torch.float16, device)
    b = clone_state(a)
    b[1] = [(g.float() * 1024).half() for g in b[1]]  # exact: a power of two
    scale = torch.tensor([1024.0], device=device) if as_tensor else 1024.0
    ops.fused_adam_(a[0], a[1], a[2], a[3], step=1, backend=backend, **HYPER)
    ops.fused_adam_(b[0], b[1], b[2], b[3], step=1, grad_scale=scale, backend=backend, **HYPER)
    for x, y in zip(a[0] + a[2] + a[3], b[0] + b[2] + b[3]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("backend", ALL)
def test_found_inf_changes_nothing(backend):
    device = device_for(backend)
    state = make_state([513, 4], torch.bfloat16, device, model_dtype=torch.bfloat16)
    ops.fused_adam_(state[0], state[1], state[2], state[3], step=1, model_params=state[4], backend=backend, **HYPER)
    before = clone_state(state)
    found = torch.ones(1, device=device)
    ops.fused_adam_(state[0], state[1], state[2], state[3], step=2, model_params=state[4], found_inf=found,
                    backend=backend, **HYPER)
    for lst_a, lst_b in zip(state, before):
        for x, y in zip(lst_a, lst_b):
            assert torch.equal(x, y)
    # and a zero found_inf steps as usual
    ops.fused_adam_(state[0], state[1], state[2], state[3], step=2, model_params=state[4],
                    found_inf=torch.zeros(1, device=device), backend=backend, **HYPER)
    assert not torch.equal(state[0][0], before[0][0])


@pytest.mark.parametrize("backend", ALL)
def test_tensor_lr_and_step_equal_numbers(backend):
    device = device_for(backend)
    a = make_state([300, 5], torch.float32, device)
    b = clone_state(a)
    kw = {k: v for k, v in HYPER.items() if k != "lr"}
    ops.fused_adam_(a[0], a[1], a[2], a[3], lr=0.01, step=3, backend=backend, **kw)
    ops.fused_adam_(b[0], b[1], b[2], b[3], lr=torch.tensor([0.01], device=device),
                    step=torch.tensor([3], device=device), backend=backend, **kw)  # an int64 step counter
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)


@pytest.mark.triton
@pytest.mark.skipif(ops.unavailable_backends().get("triton") is not None, reason="triton unavailable")
def test_triton_reuses_its_pointer_table_across_steps():
    """A training loop passes the same tensors every step: the device table is built once."""
    from zerokern.kernels.backends import triton_common

    device = device_for("triton")
    state = make_state([300, 5000], torch.bfloat16, device, model_dtype=torch.bfloat16)
    expected = clone_state(state)
    run("triton", state, 1)
    tables = dict(triton_common._BATCHES)
    run("triton", state, 3)
    assert triton_common._BATCHES.keys() == tables.keys()
    assert all(triton_common._BATCHES[k] is b for k, b in tables.items()), "the same table objects"
    run("torch", expected, 1)  # the same calls on the reference: the cached tables gave the right answer
    run("torch", expected, 3)
    for a, b in zip(state[0], expected[0]):
        torch.testing.assert_close(a, b, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])


def test_cpu_results_do_not_depend_on_thread_count():
    state = make_state([200_000, 77], torch.bfloat16, "cpu", model_dtype=torch.float16)
    other = clone_state(state)
    threads = torch.get_num_threads()
    try:
        for n, st in ((1, state), (max(2, threads), other)):
            torch.set_num_threads(n)
            ops.fused_adam_(st[0], st[1], st[2], st[3], step=1, model_params=st[4], backend="cpu", **HYPER)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(state[0] + state[4], other[0] + other[4]):
        assert torch.equal(a, b)


def test_empty_list_is_a_no_op():
    ops.fused_adam_([], [], [], [], step=1, **HYPER)


GPU_KERNELS = [p for p in KERNELS if p.id != "cpu"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_KERNELS)
def test_gpu_tensor_over_2_31_elements(backend):
    """int64 offsets: an update past element 2^31 lands where it should (needs ~30 GB of GPU memory)."""
    n = 2**31 + 4099
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs a GPU with 40 GB")
    p = torch.zeros(n, device="cuda")
    g = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    g[-3:] = 1.0
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ops.fused_adam_([p], [g], [m], [v], lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                    backend=backend)
    assert torch.allclose(p[-3:], torch.full((3,), -0.1, device="cuda"))
    assert p[:-3].abs().max().item() == 0.0
    del p, g, m, v
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_KERNELS)
def test_cuda_graph_replay_equals_eager_steps(backend):
    """lr, step and found_inf as device tensors: one captured call replays as steps 1..4 (the
    third skipped by found_inf), bit-equal to eager calls with the same numbers. For Triton
    (issue 16): the capture works because nothing on its path syncs with or copies from the
    host once the warm-up call has built the plan."""
    sizes = [1000, 4097, 3, 70001]
    graphed = make_state(sizes, torch.bfloat16, "cuda", model_dtype=torch.bfloat16)
    eager = clone_state(graphed)
    kw = {k: v for k, v in HYPER.items() if k != "lr"}
    lr, step = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    found_inf = torch.zeros(1, device="cuda")

    def call():
        ops.fused_adam_(graphed[0], graphed[1], graphed[2], graphed[3], lr=lr, step=step, found_inf=found_inf,
                        model_params=graphed[4], backend=backend, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as torch.cuda.graph asks; found_inf set: no change
        found_inf.fill_(1.0)
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for k in range(1, 5):
        skip = k == 3
        lr.fill_(0.01 / k)
        step.fill_(k)
        found_inf.fill_(float(skip))
        graph.replay()
        if not skip:
            ops.fused_adam_(eager[0], eager[1], eager[2], eager[3], lr=0.01 / k, step=k, model_params=eager[4],
                            backend=backend, **kw)
    torch.cuda.synchronize()
    for a, b in zip(graphed[0] + graphed[2] + graphed[3] + graphed[4], eager[0] + eager[2] + eager[3] + eager[4]):
        assert torch.equal(a, b)
    assert not torch.equal(graphed[0][0], make_state(sizes, torch.bfloat16, "cuda")[0][0]), "the replays changed params"


def test_triton_launches_on_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device, not on its arguments': every Triton launch
    (Adam, flatten, unflatten) enters the tensors' device first, as the CUDA backend's device
    guard does (issue 16: params on cuda:1 while cuda:0 is current)."""
    from zerokern.kernels.backends import triton_common

    real, seen = triton_common.device_guard, []

    def recording(device):
        seen.append(device)
        return real(device)

    monkeypatch.setattr(triton_common, "device_guard", recording)
    device = torch.device(device_for("triton"))
    run("triton", make_state([300, 20], torch.float32, device), 1)
    flat = ops.flatten([torch.ones(5, device=device), torch.ones(3, device=device)], torch.bfloat16, backend="triton")
    ops.unflatten(flat, [torch.empty(5, device=device), torch.empty(3, device=device)], backend="triton")
    assert seen == [device] * 3, seen
    guard = real(torch.device("cuda", 1))  # entering it needs a GPU; what it would enter is checked here
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
