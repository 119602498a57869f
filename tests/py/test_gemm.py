"""ember._C.Gemm (csrc/runtime/em_runtime_gemm.c): a compiled CUDA program's matrix products through
cuBLASLt from C, else the torch function with the same arguments. On the CPU every call is torch's
(checked bitwise here, with torch's errors); the GPU tests compare cuBLASLt's results with torch's for
every layout, dtype, bias form and math-mode flag the Gemm takes, check which calls it leaves to torch
and why, and compile models whose GEMMs it runs."""
import pytest
import torch
import torch.nn.functional as F

import ember

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by tools/gpu_check.sh)")

TARGETS = {"mm": torch.mm, "addmm": torch.addmm, "matmul": torch.matmul, "linear": F.linear}


def _stats():
    return ember._C._gemm_stats()


def test_gemm_is_torch_off_cuda():
    """CPU tensors: every call is the torch function's (bitwise, out= included), counted as torch's,
    and torch's errors come through unchanged."""
    torch.manual_seed(0)
    a, b, bias = torch.randn(6, 5), torch.randn(5, 4), torch.randn(4)
    x3 = torch.randn(2, 3, 5)
    cases = [
        ("mm", (a, b)),
        ("mm", (a.t().contiguous().t(), b.t().contiguous().t())),
        ("addmm", (bias, a, b)),
        ("matmul", (x3, b)),
        ("linear", (x3, b.t())),
        ("linear", (x3, b.t(), bias)),
    ]
    for name, args in cases:
        g = ember._C._gemm(TARGETS[name])
        assert g.__name__ == TARGETS[name].__name__ and g.target is TARGETS[name]
        before = _stats()["torch"]
        assert torch.equal(g(*args), TARGETS[name](*args)), name
        assert _stats()["torch"] == before + 1
    out = torch.empty(6, 4)
    ember._C._gemm(torch.mm)(a, b, out=out)
    assert torch.equal(out, torch.mm(a, b))
    for name, args in [("mm", (a, a)), ("linear", (x3, b)), ("addmm", (bias, a, a))]:
        with pytest.raises(RuntimeError) as want:
            TARGETS[name](*args)
        with pytest.raises(RuntimeError) as got:
            ember._C._gemm(TARGETS[name])(*args)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="not torch.mm"):
        ember._C._gemm(torch.add)


def test_gemm_layout_analysis():
    """Which operand layouts the Gemm reads as a BLAS matrix, checked on the CPU (the analysis comes
    before the device check, so "not one CUDA device" means the layout was taken): n-d inputs whose
    rows collapse (size-1 dims anywhere, padded rows), either unit stride in 2-d; rows that do not
    collapse, two strided dims, a strided bias and an out= overlapping an operand are not, and every
    result is torch's."""
    torch.manual_seed(0)
    K, N = 8, 5
    base = torch.randn(4096)
    B = torch.randn(K, N)
    taken = [
        ("4-d contiguous", torch.matmul, (torch.randn(2, 3, 4, K), B)),
        ("4-d with a size-1 dim", torch.matmul, (torch.randn(2, 1, 4, K), B)),
        ("3-d padded rows", torch.matmul, (torch.randn(2, 3, K + 4)[..., :K], B)),
        ("2-d column-major", torch.mm, (torch.randn(K, 6).t(), torch.randn(N, K).t())),
        ("linear 4-d", F.linear, (torch.randn(2, 3, 4, K), torch.randn(N, K))),
    ]
    refused = [
        ("input rows do not collapse", torch.matmul, (base.as_strided((2, 3, 4, K), (3 * K, 4 * K, K, 1)), B)),
        ("input rows do not collapse", torch.matmul, (torch.randn(3, 2, K).transpose(0, 1), B)),
        ("operand strides", torch.mm, (torch.randn(6, 2 * K)[:, ::2], B)),
        ("bias not a dense row", torch.addmm, (torch.randn(2 * N)[::2], torch.randn(6, K), B)),
    ]
    cases = [(name, "not one CUDA device", t, a) for name, t, a in taken] + [(why, why, t, a) for why, t, a in refused]
    for name, want, target, args in cases:
        got = ember._C._gemm(target)(*args)
        why = _stats()["last_fallback"]
        assert why == want, (name, why)
        torch.testing.assert_close(got, target(*args), rtol=1e-6, atol=1e-6)
    A = torch.randn(6, 6)
    want, got = A.clone(), A.clone()
    torch.mm(want, want, out=want)  # torch computes into a temporary, then copies
    ember._C._gemm(torch.mm)(got, got, out=got)
    assert torch.equal(got, want) and _stats()["last_fallback"] == "out= overlaps an operand"


def test_gemm_is_named_in_cache_info_only_for_cuda_programs():
    """A CPU program calls torch's functions themselves: no "gemm" entry, the extern list unchanged."""
    c = ember.compile(lambda x, w, b: F.linear(torch.relu(x), w, b) + 1, backend="ember")
    x, w, b = torch.randn(8, 16), torch.randn(4, 16), torch.randn(4)
    torch.testing.assert_close(c(x, w, b), F.linear(torch.relu(x), w, b) + 1)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert "gemm" not in e["ember"] and e["ember"]["device"] == "cpu"


def _tol(dtype):
    return {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]


def _layouts(m, k, n, dtype):
    """(name, target, args) for every operand layout and bias form the Gemm takes."""
    dev = "cuda"
    A = torch.randn(m, k, device=dev, dtype=dtype)
    At = torch.randn(k, m, device=dev, dtype=dtype).t()  # column-major
    B = torch.randn(k, n, device=dev, dtype=dtype)
    Bt = torch.randn(n, k, device=dev, dtype=dtype).t()
    bias = torch.randn(n, device=dev, dtype=dtype)
    x3 = torch.randn(2, m, k, device=dev, dtype=dtype)
    W = torch.randn(n, k, device=dev, dtype=dtype)
    pad = torch.randn(m, k + 8, device=dev, dtype=dtype)[:, :k]  # row stride k + 8
    return [
        ("mm rr", torch.mm, (A, B)),
        ("mm cr", torch.mm, (At, B)),
        ("mm rc", torch.mm, (A, Bt)),
        ("mm cc", torch.mm, (At, Bt)),
        ("mm padded rows", torch.mm, (pad, B)),
        ("addmm bias", torch.addmm, (bias, A, B)),
        ("addmm bias 1xn", torch.addmm, (bias[None], At, Bt)),
        ("addmm bias expanded", torch.addmm, (bias.expand(m, n), A, Bt)),
        ("matmul 3d", torch.matmul, (x3, B)),
        ("matmul 2d", torch.matmul, (At, B)),
        ("linear 3d bias", F.linear, (x3, W, bias)),
        ("linear 2d", F.linear, (A, W)),
        ("linear transposed weight", F.linear, (A, B.t())),
    ]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mkn", [(64, 128, 96), (37, 19, 53), (1, 64, 32), (16, 1, 8), (128, 64, 1)])
def test_gpu_gemm_matches_torch(dtype, mkn):
    """Every layout and bias form, aligned and odd sizes: cuBLASLt takes the call and the result is
    torch's (values within the dtype's tolerance; shape, dtype and contiguous strides exactly)."""
    torch.manual_seed(0)
    m, k, n = mkn
    for name, target, args in _layouts(m, k, n, dtype):
        g = ember._C._gemm(target)
        before = _stats()
        got = g(*args)
        want = target(*args)
        after = _stats()
        assert after["cublaslt"] == before["cublaslt"] + 1, (name, after["last_fallback"])
        assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride(), name
        torch.testing.assert_close(got, want, **_tol(dtype), msg=name)


@needs_gpu
def test_gpu_gemm_out_and_leaves_the_rest_to_torch():
    """out= is written in place; batched operands, non-collapsible inputs, a strided bias, mixed dtypes,
    CPU operands and float64 go to torch (the reason recorded) with torch's result."""
    torch.manual_seed(0)
    A = torch.randn(32, 48, device="cuda")
    B = torch.randn(48, 16, device="cuda")
    out = torch.empty(32, 16, device="cuda")
    before = _stats()["cublaslt"]
    r = ember._C._gemm(torch.mm)(A, B, out=out)
    assert _stats()["cublaslt"] == before + 1 and r.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, A @ B, rtol=1e-4, atol=1e-4)
    x3, W, bias = torch.randn(2, 16, 48, device="cuda"), torch.randn(8, 48, device="cuda"), torch.randn(8, device="cuda")
    o3 = torch.empty(2, 16, 8, device="cuda")
    before = _stats()["cublaslt"]
    ember._C._gemm(torch._C._nn.linear)(x3, W, bias, out=o3)  # the program's out= of a dead buffer
    assert _stats()["cublaslt"] == before + 1
    torch.testing.assert_close(o3, F.linear(x3, W, bias), rtol=1e-4, atol=1e-4)
    x4 = torch.randn(3, 4, 48, device="cuda")
    cases = [
        (torch.matmul, (torch.randn(2, 32, 48, device="cuda"), torch.randn(2, 48, 16, device="cuda")), "operand dims"),
        (torch.matmul, (x4.transpose(0, 1), B), "input rows do not collapse"),
        (torch.addmm, (torch.randn(32, device="cuda")[::2], A, B), "bias not a dense row"),
        (torch.mm, (A.double(), B.double()), "dtypes"),
        (torch.mm, (A[:, ::2], B[::2]), "operand strides"),
    ]
    for target, args, why in cases:
        before = _stats()
        got = ember._C._gemm(target)(*args)
        after = _stats()
        assert after["torch"] == before["torch"] + 1 and after["last_fallback"] == why, (why, after)
        torch.testing.assert_close(got, target(*args), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError) as want:  # mixed dtypes: torch's error, from torch
        torch.mm(A.half(), B)
    with pytest.raises(RuntimeError) as got:
        ember._C._gemm(torch.mm)(A.half(), B)
    assert str(got.value) == str(want.value) and _stats()["last_fallback"] == "dtypes"


@needs_gpu
def test_gpu_gemm_follows_torch_math_mode_flags():
    """float32 without TF32 is float32-exact against float64 (TF32 would miss by ~1e-3); with
    allow_tf32 on the call follows (torch's result under the same flag); reduced-precision reductions
    switched off and fp16 accumulation go to torch."""
    torch.manual_seed(0)
    A = torch.randn(256, 2048, device="cuda")
    B = torch.randn(2048, 256, device="cuda")
    g = ember._C._gemm(torch.mm)
    ref = (A.double() @ B.double()).float()
    m = torch.backends.cuda.matmul
    old = (m.allow_tf32, torch._C._get_cublas_allow_bf16_reduced_precision_reduction(),
           torch._C._get_cublas_allow_fp16_reduced_precision_reduction())
    try:
        m.allow_tf32 = False
        torch.testing.assert_close(g(A, B), ref, rtol=1e-5, atol=1e-3)
        m.allow_tf32 = True
        torch.testing.assert_close(g(A, B), A @ B, rtol=1e-2, atol=5e-2)
        m.allow_bf16_reduced_precision_reduction = False
        before = _stats()["torch"]
        g(A.bfloat16(), B.bfloat16())
        assert _stats()["torch"] == before + 1 and _stats()["last_fallback"] == "torch's math-mode flags"
        m.allow_bf16_reduced_precision_reduction = True
        before = _stats()["cublaslt"]
        g(A.bfloat16(), B.bfloat16())
        assert _stats()["cublaslt"] == before + 1
    finally:
        m.allow_tf32, m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


@needs_gpu
def test_gpu_gemm_under_autocast_is_torch():
    """Under torch.autocast the call is torch's, which casts the operands at dispatch: the result is
    autocast's bfloat16, as eager's."""
    A = torch.randn(64, 32, device="cuda")
    B = torch.randn(32, 16, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ember._C._gemm(torch.mm)(A, B)
        want = torch.mm(A, B)
    assert _stats()["last_fallback"] == "autocast is on" and got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


@needs_gpu
def test_gpu_gemm_gradient_and_graph_capture_are_torch():
    """A call autograd would record, and a call while a CUDA graph is being captured, are torch's: the
    gradient is eager's and the captured graph replays the right values."""
    A = torch.randn(64, 32, device="cuda", requires_grad=True)
    B = torch.randn(32, 16, device="cuda")
    g = ember._C._gemm(torch.mm)
    y = g(A, B)
    assert _stats()["last_fallback"] == "gradient recorded" and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(A.grad, B.sum(1).expand(64, 32), rtol=1e-5, atol=1e-5)
    A2 = A.detach().clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g(A2, B)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = g(A2, B)
    assert _stats()["last_fallback"] == "a CUDA graph is being captured"
    A2.copy_(torch.randn(64, 32, device="cuda"))
    graph.replay()
    torch.testing.assert_close(y, A2 @ B, rtol=1e-4, atol=1e-4)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compiled_transformer_gemms_go_through_cublaslt(dtype):
    """A transformer block compiled for inference and for training on CUDA: its GEMM externs are Gemm
    calls (cache_info names them, each call of the program takes cuBLASLt), and outputs and gradients
    are eager's; with ember.config.cublaslt_gemm off the program calls torch's functions."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True).to("cuda", dtype)
    x = torch.randn(4, 64, 256, device="cuda", dtype=dtype)
    tol = _tol(dtype) if dtype != torch.float32 else dict(rtol=1e-3, atol=1e-3)
    c = ember.compile(layer, backend="ember")
    with torch.no_grad():
        want = layer(x)
        got = c(x)
        before = _stats()
        got = c(x)
        after = _stats()
    torch.testing.assert_close(got, want, **tol)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    calls = e["ember"]["gemm"]["calls"]
    taken, given = after["cublaslt"] - before["cublaslt"], after["torch"] - before["torch"]
    # every call is a Gemm call; one whose input rows do not collapse (a permuted view) is torch's
    assert len(calls) >= 4 and taken + given == len(calls) and taken >= 3, (calls, taken, after)
    assert given == 0 or after["last_fallback"] == "input rows do not collapse", after
    wheres = {"bias in cuBLASLt's epilogue", "bias added by the next generated kernel", "no bias"}
    assert all(c.split(": ", 1)[1] in wheres for c in calls), calls
    ember.reset()
    c = ember.compile(layer, backend="ember")
    xs = [x.clone().requires_grad_() for _ in range(2)]
    for fn, xi in zip((c, layer), xs):
        fn(xi).float().pow(2).mean().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    ag = e["autograd"]["ember"]
    assert ag["forward"]["gemm"]["calls"] and ag["backward"]["gemm"]["calls"]
    ember.reset()
    old = ember.config.cublaslt_gemm
    ember.config.cublaslt_gemm = False
    try:
        c = ember.compile(layer, backend="ember")
        with torch.no_grad():
            torch.testing.assert_close(c(x), want, **tol)
        (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
        assert e["ember"]["gemm"]["calls"] == []
    finally:
        ember.config.cublaslt_gemm = old
        ember.reset()
