"""The skinny GEMM: F.linear of 1-8 rows on CUDA by ember's GEMV kernel (ember._C.skinny_linear,
csrc/runtime/em_runtime_skinny.c; the kernel: csrc/codegen/em_codegen_cuda.c em_codegen_cuda_skinny;
the pass that writes it: csrc/passes/em_pass_skinny_mm.c).

CPU (CI): the kernel's CUDA C run on the emulator against float64 products rounded once; the call is
F.linear itself wherever the kernel does not apply (CPU and meta tensors, gradients). GPU: the call
and the pass against eager, static and symbolic graphs, CUDA graphs."""
import pytest
import torch
import torch.nn.functional as F

import ember
from ember import _C
from ember.testing.cuda import emulate_kernel, emulator_available

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run by tools/gpu_check.sh)")
needs_emulator = pytest.mark.skipif(bool(emulator_available()), reason=emulator_available() or "")


def _reference(x, w, b, dtype):
    """float64 products summed, the bias added, rounded once to dtype (the kernel's float32
    accumulation differs from it by float32 rounding only)."""
    y = x.double().reshape(-1, x.shape[-1]) @ w.double().t()
    if b is not None:
        y = y + b.double()
    return y.to(dtype)


@needs_emulator
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,N,K,bias", [(4, 37, 1024, False),   # whole steps of the row, U = 4
                                           (1, 9, 2816, True),     # 11 steps: a last group of 3
                                           (8, 21, 264, True),     # one step and a tail
                                           (3, 6, 72, False)])     # a tail alone (lanes idle)
def test_skinny_kernel_on_the_emulator(dtype, rows, N, K, bias):
    """The generated kernel, every lane a thread: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for every
    row and column, with a grid of 2 blocks of 4 warps (the grid-stride loop covers the other
    columns); nothing else of y is written."""
    g = torch.Generator().manual_seed(rows * 1000 + N)
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    info = _C._skinny_source(dtype, rows, N, K, bias)
    assert info["block"] == 128 and 1 <= info["blocks"] <= (N + 3) // 4
    want = _reference(x, w, b, dtype)
    tol = {torch.float32: (1e-5, 1e-5)}.get(dtype, (1e-2, 1e-2))
    for grid in (2, info["blocks"]):  # the grid-stride loop; the launch's own grid
        y = torch.full((rows + 1, N), float("nan"), dtype=dtype)  # one row past the output: left alone
        emulate_kernel(info["source"], "ember_skinny", grid, info["block"], x, w, b if bias else w, y)
        assert y[rows].isnan().all()
        torch.testing.assert_close(y[:rows], want, rtol=tol[0], atol=tol[1])


def test_skinny_source_refuses_what_the_kernel_cannot_take():
    for args in [(torch.bfloat16, 4, 8, 12, False),    # K * 2 bytes not a multiple of 16
                 (torch.float32, 4, 8, 6, False),      # K * 4 bytes likewise
                 (torch.bfloat16, 0, 8, 64, False),    # no rows
                 (torch.bfloat16, 9, 8, 64, False),    # more rows than the kernel holds
                 (torch.float64, 4, 8, 64, False)]:    # a dtype it has no form for
        with pytest.raises(ValueError):
            _C._skinny_source(*args)


def test_skinny_linear_is_f_linear_off_the_gpu():
    """Where the kernel does not apply the call is F.linear itself: same values bit for bit on the
    CPU, meta results for the passes' meta inference, the autograd graph when gradients are
    recorded, F.linear's own errors."""
    x, w, b = torch.randn(4, 1, 64), torch.randn(32, 64), torch.randn(32)
    before = _C._skinny_launches()
    assert torch.equal(_C.skinny_linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(_C.skinny_linear(x, w, None), F.linear(x, w))
    m = _C.skinny_linear(x.to("meta"), w.to("meta"), b.to("meta"))
    assert m.device.type == "meta" and m.shape == (4, 1, 32) and m.dtype == torch.float32
    xg = x.clone().requires_grad_()
    _C.skinny_linear(xg, w).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(4, 1, 64))
    with pytest.raises(RuntimeError) as got:
        _C.skinny_linear(x, torch.randn(32, 63))
    with pytest.raises(RuntimeError) as want:
        F.linear(x, torch.randn(32, 63))
    assert str(got.value) == str(want.value)
    with pytest.raises(TypeError, match="takes 2 or 3 arguments"):
        _C.skinny_linear(x)
    assert _C._skinny_launches() == before  # no kernel off the GPU


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_skinny_linear_against_eager(dtype):
    """On CUDA: the kernel for 1-8 rows (values within the dtype's tolerance of eager's GEMM, which
    also accumulates in float32); F.linear itself (no launch) for 9 rows, a strided input, a
    misaligned one, a K that is not a multiple of 16 bytes, and under a recorded gradient."""
    dev = "cuda"
    for rows, N, K, bias in [(1, 1024, 1024, False), (4, 2816, 1024, True), (8, 256, 2816, False), (3, 100, 264, True)]:
        x = torch.randn(rows, 1, K, device=dev, dtype=dtype)
        w = torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5
        b = torch.randn(N, device=dev, dtype=dtype) if bias else None
        before = _C._skinny_launches()
        got = _C.skinny_linear(x, w, b)
        assert _C._skinny_launches() == before + 1
        assert got.shape == (rows, 1, N) and got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got, _reference(x, w, b, dtype).view(rows, 1, N),
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4 if dtype == torch.float32 else 1e-2)
    w = torch.randn(64, 128, device=dev, dtype=dtype)
    before = _C._skinny_launches()
    for x in [torch.randn(9, 128, device=dev, dtype=dtype),                     # 9 rows
              torch.randn(128, 4, device=dev, dtype=dtype).t(),                # strided
              torch.randn(4 * 128 + 1, device=dev, dtype=dtype)[1:].view(4, 128),  # misaligned
              torch.randn(4, 128, device=dev, dtype=dtype).requires_grad_()]:  # a gradient to record
        got = _C.skinny_linear(x, w)
        torch.testing.assert_close(got, F.linear(x, w))
        assert got.requires_grad == x.requires_grad
    k = 192 // torch.finfo(dtype).bits  # 24 bytes: not a whole 16-byte vector
    x, w = torch.randn(4, k, device=dev, dtype=dtype), torch.randn(64, k, device=dev, dtype=dtype)
    torch.testing.assert_close(_C.skinny_linear(x, w), F.linear(x, w))
    assert _C._skinny_launches() == before


class _MLP(torch.nn.Module):
    """A Llama-style block's projections: q, SwiGLU, down, over batch x 1 token."""

    def __init__(self, d=256, h=704):
        super().__init__()
        self.q = torch.nn.Linear(d, d, bias=True)
        self.gate, self.up = torch.nn.Linear(d, h, bias=False), torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        x = x + self.q(x)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


@needs_gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_gpu_skinny_mm_pass_in_a_decode_step(mode):
    """The pass writes skinny_linear for every linear of 4 rows (cache_info names them), not for a
    prefill's 4 x 16 rows; results within bf16 tolerance of eager's, also replayed as a CUDA graph
    on new inputs."""
    ember.reset()
    m = _MLP().cuda().to(torch.bfloat16).eval()
    c = ember.compile(m, backend="ember", mode=mode)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 1, 256, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(c(x), m(x), rtol=2e-2, atol=2e-2)
        (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
        assert len(e["ember"]["skinny"]) == 4, e["ember"].get("passes")
        assert e["ember"]["skinny"][0].endswith("4 rows x weight [256, 256]")
        ember.reset()
        c = ember.compile(m, backend="ember", mode=mode)
        x = torch.randn(4, 16, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(c(x), m(x), rtol=2e-2, atol=2e-2)
        (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
        assert "skinny" not in e["ember"]


@needs_gpu
def test_gpu_skinny_mm_pass_in_a_symbolic_graph():
    """A decode step over a growing cache is a symbolic graph: its projections of static rows are
    still skinny (the cache's length does not enter them); values eager's within tolerance."""
    ember.reset()
    m = _MLP().cuda().to(torch.bfloat16).eval()

    def step(x, cache):
        h = m(x)
        att = torch.softmax(h @ cache.transpose(-1, -2), -1) @ cache
        return att

    c = ember.compile(step, backend="ember")  # automatic dynamic: the cache's length, after a change
    with torch.no_grad():
        for n in (7, 9, 12):
            x = torch.randn(4, 1, 256, device="cuda", dtype=torch.bfloat16)
            cache = torch.randn(4, n, 256, device="cuda", dtype=torch.bfloat16)
            torch.testing.assert_close(c(x, cache), step(x, cache), rtol=3e-2, atol=3e-2)
    graphs = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert len(graphs) == 2, graphs  # the static entry, then the symbolic one
    assert [len(g["ember"]["skinny"]) for g in graphs] == [4, 4], [g["ember"].get("passes") for g in graphs]
