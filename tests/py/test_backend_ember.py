"""backend="ember" (lowering, fusion, C codegen, runtime) against eager PyTorch on the same inputs.

Each test compiles one graph that computes many ops at once (one C translation unit), so the
suite pays a few compiler calls per dtype/layout; the on-disk cache lives in a per-session temp dir.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ember
from conftest import on_threads
from conftest import same_as_eager as _same

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("cpu_tensors", "ember_cache_dir")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def check(fn, *args):
    """Runs fn eagerly and under backend="ember"; returns the entry's ember info."""
    ref = fn(*args)
    c = ember.compile(fn, backend="ember")
    out = c(*args)
    _same(out, ref)
    out2 = c(*args)  # the cached entry, a second time (buffers reused across calls must not leak values)
    _same(out2, ref)
    info = ember.cache_info(c)[0]
    assert info["kind"] == "graph"
    return info["ember"]


def _floats(shape, dtype, special=True):
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    if special and x.numel() >= 4:
        flat = x.view(-1) if x.is_contiguous() else None
        if flat is not None:
            flat[0], flat[1], flat[2] = float("nan"), float("inf"), -float("inf")
    return x


UNARY = [torch.abs, torch.neg, torch.reciprocal, torch.sqrt, torch.rsqrt, torch.exp, torch.exp2, torch.expm1,
         torch.log, torch.log2, torch.log10, torch.log1p, torch.sin, torch.cos, torch.tan, torch.tanh, torch.asin,
         torch.acos, torch.atan, torch.sinh, torch.cosh, torch.erf, torch.sigmoid, torch.relu, torch.floor,
         torch.ceil, torch.round, torch.trunc, torch.sign, torch.logical_not, torch.isnan, torch.isinf, F.relu,
         F.silu, lambda x: F.gelu(x.clamp(-20, 20)), lambda x: F.gelu(x.clamp(-20, 20), approximate="tanh"),
         F.softplus, lambda x: F.softplus(x, 2.0, 5.0),
         torch.square, lambda x: x.float(), lambda x: x.double(), lambda x: x.half(), lambda x: x.to(torch.int32),
         lambda x: x.bool(), lambda x: x.sigmoid(), lambda x: -x, lambda x: abs(x)]


def unary_all(x):
    return tuple(f(x) for f in UNARY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_unary_contiguous(dtype):
    info = check(unary_all, _floats((5, 37), dtype))
    # only the cast to the input's own dtype stays a torch call (it returns the input itself)
    assert all(n.split("_")[0] in ("float", "double", "half") for n in info["extern_list"]), info["extern_list"]
    assert info["externs"] <= 1


@pytest.mark.parametrize("make", [
    lambda: _floats((37, 5), torch.float32).t(),                      # transposed
    lambda: torch.randn(1, 7).expand(6, 7),                           # zero stride
    lambda: torch.randn(4, 0),                                        # empty
    lambda: torch.tensor(0.75),                                       # 0-d
    lambda: torch.randn(8, 10, 3)[::2, 1:9:3],                        # sliced, odd strides
], ids=["transposed", "expanded", "empty", "0d", "sliced"])
def test_unary_layouts(make):
    check(unary_all, make())


def binary_all(a, b):
    return (a + b, a - b, a * b, a / b, torch.add(a, b, alpha=2.5), torch.sub(a, b, alpha=-1), a + 1.5, 2 * a,
            a / 3, torch.div(a, b, rounding_mode="floor"), torch.div(a, b, rounding_mode="trunc"), a // b,
            torch.pow(a, 2), a ** 3, torch.pow(a.abs(), 0.5), torch.pow(a.abs() + 1, b), a ** -1,
            torch.maximum(a, b), torch.minimum(a, b), a < b, a <= b, a > 0.5, a >= b, a == b, a != b,
            torch.logical_and(a > 0, b > 0), torch.logical_or(a > 0, b < 0), torch.logical_xor(a > 0, b > 0),
            torch.where(a > b, a, b), torch.where(a > 0, a, 0.0), torch.clamp(a, -0.5, 0.5), a.clamp(min=0.1),
            a.clamp_max(0.2), a.masked_fill(b > 0, -1.0), torch.max(a, b), torch.min(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_binary_broadcast(dtype):
    a = _floats((6, 1, 5), dtype)
    b = _floats((4, 1), dtype, special=False)
    info = check(binary_all, a, b)
    assert info["externs"] == 0


def test_binary_mixed_dtypes_and_0d():
    a = torch.randn(5, 7)
    b = torch.randn(7, dtype=torch.float64)
    c = torch.tensor(2.5, dtype=torch.float64)  # 0-d: does not promote the category
    i = torch.randint(-5, 5, (5, 7))
    h = torch.randn(5, 7, dtype=torch.float16)
    check(lambda a, b, c, i, h: (a + b, a * c, i + a, i * 2.5, i < 0.5, h + a, h * c, i / 2, h > i, (i + c)),
          a, b, c, i, h)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integers(dtype):
    info_ = torch.iinfo(dtype)
    a = torch.randint(max(info_.min, -100), min(info_.max, 100), (6, 9), dtype=dtype)
    a[0, 0], a[0, 1] = info_.max, info_.min  # overflow wraps as in torch
    b = torch.randint(1, 7, (9,), dtype=dtype)

    def f(a, b):
        return (a + b, a - b, a * b, a * 3, a + 1, -a, torch.abs(a), a < b, a == 3, torch.maximum(a, b),
                torch.clamp(a, 0, 50), a.sum(), a.sum(1), a.amax(0), a.amin(1, keepdim=True), a.float() / 3,
                a / b, a.to(torch.float16), a.bool(), torch.where(a > 0, a, b), a.argmax(1), a.argmin(),
                a.prod(1), torch.sign(a), a.max(), a.any(1), a.all())
    check(f, a, b)


def test_integer_division_is_extern_and_raises_like_eager():
    a = torch.tensor([7, -7, 3])
    b = torch.tensor([2, 2, 0])
    c = ember.compile(lambda a, b: torch.div(a, b, rounding_mode="floor"), backend="ember")
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        c(a, b)
    b2 = torch.tensor([2, -2, 5])
    info = check(lambda a, b: (a // b, torch.div(a, b, rounding_mode="trunc") + 1), a, b2)
    assert info["externs"] == 2


def test_bool():
    a = torch.rand(4, 5) > 0.5
    b = torch.rand(5) > 0.5
    check(lambda a, b: (a & b if False else torch.logical_and(a, b), a + b, a * b, a.sum(), a.any(), a.all(0),
                        ~a if False else torch.logical_not(a), a.to(torch.float32) * 2, a == b, a.int()), a, b)


def reductions(x):
    return (x.sum(), x.sum(1), x.sum((0, 2), keepdim=True), x.mean(-1), x.mean((0, 1)), x.amax(1), x.amin(-1),
            x.prod(2), x.var(1), x.std(-1, keepdim=True), torch.var(x, 1, correction=0), x.std(), torch.var(x, True),
            x.argmax(2), x.argmin(1), x.argmax(), torch.softmax(x, -1), F.softmax(x, dim=1), F.log_softmax(x, -1),
            torch.logsumexp(x, 2), torch.logsumexp(x, (0, 1), keepdim=True), (x > 0).any(1), (x > 0).all(-1),
            torch.max(x), x.sum(2, dtype=torch.float64))


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "large_rows"])
def test_reductions(layout):
    if layout == "contiguous":
        x = torch.randn(3, 7, 33)
    elif layout == "permuted":
        x = torch.randn(33, 3, 7).permute(1, 2, 0)
    else:
        x = torch.rand(2, 3, 4100) + 0.5  # positive: sums of 24600 terms stay well conditioned
    check(reductions, x)


def test_reductions_over_empty_rows():
    x = torch.randn(4, 0, 3)
    check(lambda x: (x.sum(1), x.prod(1), x.mean(1), x.any(1), x.all(1), x.sum(), x.sum(-1), torch.logsumexp(x, 1)), x)


def test_reductions_nan_and_half():
    x = torch.randn(4, 9)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    check(reductions, x.view(4, 9, 1).expand(4, 9, 3).contiguous())
    check(reductions, torch.randn(3, 5, 17, dtype=torch.float16))
    check(lambda x: (x.sum(1), x.mean(), torch.softmax(x, -1), x.amax(0)), torch.randn(6, 129, dtype=torch.bfloat16))


def views(x):
    return (x.reshape(6, 20).exp(), x.reshape(-1).sin(), x.permute(2, 0, 1).cos() + 1, x.transpose(0, 1) * 2,
            x[:, 1:4].abs(), x[1].neg(), x[..., ::2] + 1, x[:, None, 2] * 3, x.narrow(2, 1, 3).relu(),
            x.select(1, 2).sigmoid(), x.unsqueeze(1).squeeze(1).tanh(), x.flatten(1) + 0.5,
            x[0].t().exp(), x[:, :, :1].expand(2, 3, 20) * x, x.contiguous() - 1)


def test_views_as_index_arithmetic():
    x = torch.randn(2, 3, 20)
    info = check(views, x)
    assert info["externs"] == 0
    check(lambda x: (x.view(6, 20).exp(), x.view(-1, 5)[1:].cos()), x)
    check(views, torch.randn(20, 3, 2).permute(2, 1, 0))  # reshape of a non-viewable layout copies


def test_copy_of_a_copy_reads_the_source():
    """A reshape that copies a view of another reshape's copy reads the first copy's source over a
    finer domain (compose_copy_view, csrc/lower): one copy, not two (nn.MultiheadAttention's
    backward merges the attention's gradients' heads, transposes and merges again). Values as
    eager's; a dim that steps along two of the copy's dims (8 = 2 x 4 rows), a strided step within
    one (every second row), stacked pieces."""
    x = torch.randn(3, 10, 4, 16).transpose(1, 2)  # (N, H, L, D) of an (N, L, H, D) tensor
    info = check(lambda x: x.reshape(12, 10, 16).transpose(0, 1).reshape(10, 3, 64) + 1, x)
    assert len(info["kernel_list"]) == 2 and "reshape" not in info["kernel_list"][0]["nodes"], info["kernel_list"]
    info = check(lambda y: y.reshape(24).view(3, 8).t().reshape(24) * 2, torch.randn(4, 6).t())
    assert len(info["kernel_list"]) == 2, info["kernel_list"]
    q, k, v = (torch.randn(3, 10, 4, 16).transpose(1, 2) for _ in range(3))
    info = check(lambda q, k, v: torch.stack([t.reshape(12, 10, 16).transpose(0, 1).reshape(10, 3, 64) for t in (q, k, v)]),
                 q, k, v)
    assert len(info["kernel_list"]) == 2, info["kernel_list"]
    # the source updated in place between the two reshapes: the second copy must see the first
    # copy's values, not the updated source (such a graph runs on the eager backend today; lowered,
    # Ctx.immutable would keep its copies apart)
    def update(x):
        y = x.reshape(12, 10, 16)
        x.add_(1)
        return y.transpose(0, 1).reshape(10, 3, 64)
    xa, xb = x.clone().transpose(1, 2).contiguous().transpose(1, 2), x.clone()
    got, ref = ember.compile(update, backend="ember")(xa), update(xb)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(xa, xb, rtol=0, atol=0)


def test_reshape_copy_chains_match_eager():
    """Random chains reshape -> view (transpose, a step, a slice, an expand) -> reshape of permuted
    inputs, the first reshape often a copy, the second a copy of its view (compose_copy_view where
    the steps stay within the copy's dims, the two copies where they would carry): eager's values."""
    import random
    rnd = random.Random(7)

    def factor(n):
        out = []
        while n > 1 and len(out) < 3:
            d = rnd.choice([d for d in range(2, n + 1) if n % d == 0])
            out.append(d)
            n //= d
        return out + [n] if n > 1 else out or [1]

    def view(y, op, d):
        if op == "t":
            return y.transpose(d, (d + 1) % y.dim())
        if op == "step":
            return y[(slice(None),) * d + (slice(None, None, 2),)]
        if op == "slice":
            return y[(slice(None),) * d + (slice(1, None),)] if y.shape[d] > 1 else y
        return y.unsqueeze(d).expand(*y.shape[:d], 3, *y.shape[d:])

    for _ in range(120):
        shape = [rnd.choice([1, 2, 3, 4, 6, 8]) for _ in range(rnd.randint(2, 4))]
        perm = list(range(len(shape)))
        rnd.shuffle(perm)
        x = torch.randn(*shape).permute(*perm)
        s1 = factor(x.numel())
        s1 = s1 + [1] if len(s1) < 2 else s1
        op, d = rnd.choice(["t", "step", "slice", "expand"]), rnd.randrange(len(s1))
        s2 = tuple(factor(view(x.reshape(s1), op, d).numel()))
        fn = lambda x, s1=tuple(s1), op=op, d=d, s2=s2: view(x.reshape(s1), op, d).reshape(s2) * 2  # noqa: E731
        ember.reset()
        torch.testing.assert_close(ember.compile(fn, backend="ember")(x), fn(x), rtol=0, atol=0)


def test_stack_through_size_one_reshape_and_transpose_is_one_kernel():
    """A stack (or cat) seen through a reshape that inserts or drops dims of size 1 and a transpose,
    then copied by a reshape (nn.MultiheadAttention's backward: stack(grads).reshape(3, L, N, 1, E)
    .transpose(0, -2).reshape(L, N, 3, E)): the pieces' masked loads are viewed (view_leaf), and one
    kernel writes the stack in the copy's layout. Values as eager's."""
    q, k, v = (torch.randn(10, 3, 64) for _ in range(3))
    info = check(lambda q, k, v: torch.stack([q, k, v]).reshape(3, 10, 3, 1, 64).transpose(0, -2).reshape(10, 3, 3, 64) * 2,
                 q, k, v)
    assert len(info["kernel_list"]) == 1, info["kernel_list"]
    # cat along a dim, a 1 inserted in front and one dropped; a reshape that merges dims (not of 1s: a copy)
    a, b = torch.randn(4, 1, 6), torch.randn(5, 1, 6)
    check(lambda a, b: torch.cat([a, b]).reshape(1, 9, 6).transpose(1, 2).reshape(6, 9) + 1, a, b)
    check(lambda a, b: torch.cat([a, b], 0).reshape(9, 6).t().reshape(3, 18) - 1, a, b)


def test_view_outputs_alias_like_eager():
    x = torch.randn(4, 6)
    c = ember.compile(lambda x: (x.t(), x.view(2, 12), x[1:], (x + 1).view(24)), backend="ember")
    t, v, s, w = c(x)
    assert t.data_ptr() == x.data_ptr() and v.data_ptr() == x.data_ptr()
    assert s.data_ptr() == x[1:].data_ptr()
    torch.testing.assert_close(w, (x + 1).view(24))


def norms(x, w, b, rm, rv):
    return (F.layer_norm(x, (x.shape[-1],), w, b), F.layer_norm(x, x.shape[1:]), F.layer_norm(x, (16,), w, eps=1e-3),
            F.rms_norm(x, (16,), w), F.rms_norm(x, (16,), eps=1e-4),
            F.batch_norm(x, rm, rv, w[:5], b[:5], training=False),
            F.batch_norm(x, rm, rv, training=False, eps=1e-3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_norms(dtype):
    x = torch.randn(3, 5, 16, dtype=dtype)
    w, b = torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)
    rm, rv = torch.randn(5, dtype=dtype), torch.rand(5, dtype=dtype) + 0.5
    info = check(norms, x, w, b, rm, rv)
    assert info["externs"] == 0


# ---- fusion: the kernel count is part of the contract ----

def test_fusion_pointwise_chain_is_one_kernel():
    info = check(lambda x, y: torch.cos(torch.cos(x)) * y + 1, torch.randn(64, 65), torch.randn(64, 65))
    assert info["kernels"] == 1


@pytest.mark.parametrize("fn", [
    lambda x, w, b: torch.softmax(x, -1),
    lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
    lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w),
    lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    lambda x, w, b: F.log_softmax(x * 2 + b, -1),
    lambda x, w, b: (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + 1e-5).sqrt(),
], ids=["softmax", "layer_norm", "rms_norm", "rms_norm_by_hand", "log_softmax_epilogue", "standardize"])
def test_fusion_row_kernels(fn):
    x, w, b = torch.randn(32, 100), torch.randn(100), torch.randn(100)
    info = check(fn, x, w, b)
    assert info["kernels"] == 1, info["kernel_list"]
    assert info["kernel_list"][0]["kind"] == "reduction"


def test_fusion_epilogue_after_extern_matmul():
    x, w, b, r = torch.randn(16, 32), torch.randn(24, 32), torch.randn(24), torch.randn(16, 24)
    info = check(lambda x, w, b, r: F.relu(F.linear(x, w) + b) + r, x, w, b, r)
    assert info["externs"] == 1 and info["kernels"] == 1
    assert info["kernel_list"][0]["inplace"] == 1  # the epilogue writes into the matmul's own result
    info = check(lambda x, w, b: F.gelu(x @ w.t() + b), x, w, b)
    assert info["extern_list"] == ["t", "matmul"] and info["kernels"] == 1  # the view an extern reads: one as_strided
    assert info["kernel_list"][0]["inplace"] == 1


def _stores(info, k=0):
    """How many outputs kernel k of the entry's C source writes (its non-const pointer arguments)."""
    src = info["source"].split(f"void ember_k{k}(")[1].split("\n}\n")[0]
    return sum(1 for line in src.splitlines() if "*restrict a" in line and "const " not in line.split("=")[0])


def test_horizontal_fusion_of_independent_kernels():
    """Independent pointwise kernels over the same domain become one loop nest with several stores,
    and a buffer both read is loaded once (em_schedule.c, horizontal fusion)."""
    x, y = torch.randn(64, 33), torch.randn(64, 33)
    x.sin()  # torch's first CPU sin of a process was once 3e-4 off here (torch 2.13): not the reference
    f = lambda x, y: (x.sin() * 2, x.cos() + y, (x * y).relu())  # noqa: E731
    info = check(f, x, y)
    assert info["kernels"] == 1 and _stores(info) == 3 and info["kernel_list"][0]["outputs"] == 3, info["kernel_list"]
    assert "3 outputs" in ember.explain(ember.compile(f, backend="ember"), x, y)
    body = info["source"].split("void ember_k0(")[1]
    assert body.count("a0[") == 1 and body.count("a1[") == 1, body  # x and y each read once per element
    # mixed output dtypes; an output read again by a later kernel of another domain
    info = check(lambda x, y: ((x > y), (x * y).half(), (x - y).sum(-1)), x, y)
    assert info["kernels"] == 2, info["kernel_list"]
    # large domains (above the small-kernel size) fuse when they share a read, or when nothing runs
    # between them and both walk the innermost dim with stride 0 or 1 (a launch saved: nothing
    # moves past anything)
    a, b = torch.randn(256, 257), torch.randn(256, 257)
    info = check(lambda a, b: (a.exp(), a.sigmoid()), a, b)
    assert info["kernels"] == 1, info["kernel_list"]
    info = check(lambda a, b: (a.exp(), b.sigmoid()), a, b)
    assert info["kernels"] == 1 and info["kernel_list"][0]["outputs"] == 2, info["kernel_list"]
    info = check(lambda a, b: (a.exp(), (a @ b.t()).relu(), b.sigmoid()), a, b)  # a matmul between
    assert info["kernels"] == 3 and all(k["outputs"] == 1 for k in info["kernel_list"]), info["kernel_list"]
    sq = [torch.randn(256, 256) for _ in range(3)]
    info = check(lambda a, b, c: (a.exp(), b.t() + c), *sq)  # a transposed read: not joined
    assert info["kernels"] == 2, info["kernel_list"]
    # reductions over the same domain that store per-row values: one loop nest, x read once
    info = check(lambda x, y: (x.var(-1), x.sum(-1), y.amin(-1), (x * y).argmax(-1)), x, y)
    assert info["kernels"] == 1 and _stores(info) == 4, info["kernel_list"]
    info = check(lambda x, y: (x.sum(0), y.mean(0)), x, y)
    assert info["kernels"] == 1, info["kernel_list"]
    # one with element-wise outputs keeps its row cache (a kernel of one output): not joined
    info = check(lambda x, y: (x.softmax(-1), x.log_softmax(-1), x.sum(-1)), x, y)
    assert info["kernels"] == 3, info["kernel_list"]


def test_horizontal_fusion_keeps_dependencies_and_side_effects():
    x, y, w = torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 8)

    def through_extern(x, y, w):  # the second kernel reads what a matmul made of the first's output
        a = x.sin()
        m = a @ w
        return a, x.cos() * m
    info = check(through_extern, x, y, w)
    assert info["kernels"] == 2, info["kernel_list"]

    def different_domains(x, y):
        return x.sin(), x[:8].cos(), x.t() * y.t()
    check(different_domains, x, y)

    def mutation_between(x, y):  # the update of y runs between the two reads of y
        a = x * y
        y.mul_(3)
        return a, x + y
    for backend in ("ember", "eager"):
        yy = y.clone()
        c = ember.compile(mutation_between, backend=backend)
        ra = c(x, yy)
        yr = y.clone()
        _same(ra, mutation_between(x, yr))
        _same(yy, yr)

    def gather_error(x, i):  # a gather load (embedding) is never moved above another step
        return x * 2, x[i] + 1
    check(gather_error, x, torch.tensor([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0]))
    c = ember.compile(gather_error, backend="ember")
    with pytest.raises(IndexError):
        c(x, torch.tensor([99] * 16))


def test_horizontal_fusion_outputs_reuse_dead_buffers():
    """A fused kernel's outputs after the first take buffers dead before it, as its first one does.
    Tensor.mm takes no out=, so only the kernels' outputs take dead buffers here."""
    def f(x, w):
        a, b = x.mm(w), w.mm(x)                       # read only by the next kernel
        t, u = a.sigmoid(), b.tanh()                  # one kernel, two outputs (read by matmuls): t in a's memory
        m1, m2 = t.mm(w), u.mm(w)                     # allocated: t and u die here
        p, q = m1.sigmoid(), m2.tanh()                # one kernel: p in m1's memory (in place), q in u's
        return p.mm(w), q.mm(w)
    info = check(f, torch.randn(16, 16), torch.randn(16, 16))
    assert info["kernels"] == 2 and _stores(info, 0) == 2 and _stores(info, 1) == 2, info["kernel_list"]
    assert info["reused_buffers"] == 3, info


def test_matmul_results_written_into_dead_buffers():
    """torch.mm / matmul / F.linear results go into a buffer dead before the call (out=), and a
    buffer that only such fresh calls read is dead after its last one, as Inductor's
    extern_kernels.mm(a, b, out=buf) into a reused buffer; the values are eager's."""
    def f(x, w):
        a, b = torch.mm(x, w), torch.mm(w, x)
        t, u = a.sigmoid(), b.tanh()                  # t in a's memory (in place); u new
        m1, m2 = torch.mm(t, w), torch.mm(u, w)       # m1 into b's memory, m2 into t's (out=)
        p, q = m1.sigmoid(), m2.tanh()                # p in m1's memory (in place), q in u's
        return torch.mm(p, w), torch.mm(q, w)         # the results into m2's and p's memory
    info = check(f, torch.randn(16, 16), torch.randn(16, 16))
    assert info["reused_buffers"] == 7, info          # three buffers allocated: a, b and u

    def relayout(x, w1, w2):
        h = F.linear(x, w1).relu()                    # (4, 32, 16): the bias-free linear and its relu
        y = torch.mm(h.view(-1, 16), w2)              # (128, 16) read by a view, then the mm
        z = (y * 2).view(4, 32, 16) + h              # a kernel output in y's or x's shape
        return F.linear(z.sigmoid(), w1).sum(-1)     # this linear's result into a dead buffer of another shape
    x, w1, w2 = torch.randn(4, 32, 16), torch.randn(16, 16), torch.randn(16, 16)
    info = check(relayout, x, w1, w2)
    assert info["reused_buffers"] >= 2, info

    def unbound(x, w):                                # torch.Tensor.mm takes no out=: it allocates
        a = torch.Tensor.mm((x * 2).sin(), w)
        return torch.Tensor.mm((a + 1).cos(), w), torch.Tensor.matmul((a - 1).cos(), w)
    check(unbound, torch.randn(8, 8), torch.randn(8, 8))


def test_dead_buffer_not_held_across_an_allocation():
    """A dead buffer is taken only by the next buffer made after it dies, as torch's allocator would
    hand out its memory: held longer, across an allocation, it would raise the call's peak."""
    def f(x, y, w, w2):
        a = (x * 2).sin()                             # 16x16, dead after the mm reads it
        m = torch.mm(a, w)                            # a is still read here: m is allocated
        c = (y * 3).cos()                             # 16x32, allocated (nothing of its size is dead)
        return m, torch.mm(c, w2)                     # 16x16: a died before c's allocation, so not a's
    args = torch.randn(16, 16), torch.randn(16, 32), torch.randn(16, 16), torch.randn(32, 16)
    info = check(f, *args)
    assert info["reused_buffers"] == 0, info

    def g(x, y, w, w2):
        a = (x * 2).sin()
        m = torch.mm(a, w)
        return m, torch.mm((y * 3).cos(), w2), torch.mm(m.tanh(), w)  # m.tanh() takes nothing: a is older
    info = check(g, *args)
    assert info["reused_buffers"] == 0, info


def test_buffers_that_may_outlive_a_call_are_not_reused():
    """A buffer read by a call that may return an alias of it (a view op, an unknown function), or
    returned to the user through a view, keeps its memory: later kernels never write into it."""
    def f(x, w):
        a = (x * 2).sin()                             # read by torch.mm (fresh) and by an alias
        v = a.t()                                     # a view the user gets
        m = torch.mm(a, w)
        return v, (m + 1).cos() * 3, (m - 1).exp()
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    c = ember.compile(f, backend="ember")
    ref = f(x, w)
    out = c(x, w)
    _same(out, ref)
    v_first = out[0].clone()
    out2 = c(x * 0.5, w)                              # a second call must not write into the first's results
    _same(out[0], v_first)
    _same(out2, f(x * 0.5, w))

    def g(x):
        y = x.exp()
        z = torch.diagonal(y)                         # no rule: an extern that returns a view of y
        k = (y * 3).relu()                            # a kernel after y's last read: not in y's memory
        return z, k
    xs = torch.randn(6, 6)
    c = ember.compile(g, backend="ember")
    z, k = c(xs)
    zr, kr = g(xs)
    _same((z, k), (zr, kr))


def test_exact_math_functions():
    """EM_EXACT_MATH (training halves; graphs comparing floats): exp, tanh, log, erf, log1p and expm1
    are ember's own plain-arithmetic versions, so a vectorized loop and its scalar remainder give the
    same bits (equal inputs anywhere in a tensor give equal outputs), within 2.5 ulp of the exact
    value over a sample of all float bit patterns (expm1 2.46 measured exhaustively, the others under
    2), and eager's results on NaN, infinities, zeros, overflow and underflow."""
    def f(x):
        return x.exp(), x.tanh(), x.log(), x.erf(), x.log1p(), x.expm1(), x == x  # the comparison: exact_math
    c = ember.compile(f, backend="ember")
    bits = torch.arange(0, 1 << 32, 9973, dtype=torch.int64)
    sample = torch.cat([(bits - (bits >= 1 << 31).long() * (1 << 32)).to(torch.int32).view(torch.float32),
                        torch.randn(1 << 16) * 5])
    *outs, _ = c(sample)
    src = ember.cache_info(c)[0]["ember"]["source"]
    body = src.split("void ember_k0(")[1]
    # the graph is exact-math, so the kernel's calls are the prelude's em_ versions (#define expf ...)
    assert src.startswith("#define EM_EXACT_MATH"), src[:200]
    assert all(f"{fn}(" in body for fn in ("expf", "tanhf", "logf", "erff", "log1pf", "expm1f")), body[:3000]
    x64 = sample.double()
    for got, ref in zip(outs, (x64.exp(), x64.tanh(), x64.log(), x64.erf(), x64.log1p(), x64.expm1())):
        reff = ref.float()
        fin = torch.isfinite(reff) & (reff != 0) & (reff.abs() >= torch.finfo(torch.float32).tiny)
        ulp = (torch.nextafter(reff.abs(), torch.tensor(float("inf"))) - reff.abs()).double()
        err = ((got.double() - ref).abs() / ulp)[fin]
        assert err.max().item() <= 2.5, err.max().item()
        special = ~fin
        assert torch.equal(got[special].isnan(), reff[special].isnan())
        both = special & ~reff.isnan()
        torch.testing.assert_close(got[both], reff[both], atol=torch.finfo(torch.float32).tiny, rtol=0)
    edge = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 88.8, -104.0, 0.625, -0.625, 1e-30,
                         1.0, 1e-45, 1e-40, 3.4e38, 0.7071067, 0.7071068])
    edge = torch.cat([edge, torch.tensor([3.919206, -3.9192057, 3.9192057, 0.99999994, -1.0, 1e-20, -2.5, -1.5, 88.72,
                                          88.73, -0.99999994, 6e-8, -6e-8])])
    *eo, _ = c(edge)
    _same(eo, [edge.exp(), edge.tanh(), edge.log(), edge.erf(), edge.log1p(), edge.expm1()])
    for got in eo[1], eo[3], eo[4], eo[5]:  # tanh, erf, log1p, expm1 of -0.0 are -0.0
        assert torch.equal(torch.signbit(got[:2]), torch.tensor([False, True]))
    vals = torch.randn(7) * 3
    x = vals.repeat(1000003 // 7 + 1)[:1000003].contiguous()
    for out in c(x.abs())[:6]:
        for i in range(7):
            col = out[i::7]
            assert torch.equal(col, col[:1].expand_as(col)), i


def test_small_reduction_runs_right_after_its_input():
    """A reduction with a small output (a bias gradient's column sum) runs right after the step
    that makes its input, not where the graph's output needs it: its large input can die early
    (em_schedule.c, hoisting reductions). Kernel numbers follow the program's order."""
    def f(g, x, w):
        t = (g * x).relu()
        m = t @ w
        n = m.sigmoid() @ w.t()
        return n, t.sum(0)
    info = check(f, torch.randn(256, 64), torch.randn(256, 64), torch.randn(64, 64))
    assert [k["kind"] for k in info["kernel_list"]] == ["pointwise", "reduction", "pointwise"], info["kernel_list"]

    def written_between(x, y):  # y is updated in place after the sum's input is made: the sum stays after it
        t = x * 2
        y.add_(t)
        return t.sum(0) + y.sum(0)
    for backend in ("ember", "eager"):
        yy = torch.ones(8, 4)
        out = ember.compile(written_between, backend=backend)(torch.ones(8, 4), yy)
        _same(out, torch.full((4,), 40.0))  # 8 x 2 + 8 x 3
        _same(yy, torch.full((8, 4), 3.0))


def test_shared_value_stored_where_that_frees_memory():
    """A pointwise value computed inline now and needed again after extern calls is stored by the
    kernel that computes it when its inputs then die and hold more bytes than it (em_schedule.c,
    shared values): `s = a + b` is stored with `g`, so the last kernel loads s instead of keeping
    the matmul results a and b alive across the two extern calls. A value of the inputs that the
    kernel does not compute yet (`s * t`, t a graph input the kernel does not read) is not added."""
    def f(x, w0, w1, h, t, w2):
        a, b = x @ w0, x @ w1
        s = a + b
        g = s * h
        m = g @ w2
        n = m @ w2.t()
        return (s * t + n).relu()
    x, w0, w1, w2 = torch.randn(64, 32), torch.randn(32, 48), torch.randn(32, 48), torch.randn(48, 48)
    info = check(f, x, w0, w1, torch.randn(64, 48), torch.randn(64, 48), w2)
    assert [(k["kind"], k["outputs"]) for k in info["kernel_list"]] == [("pointwise", 2), ("pointwise", 1)], \
        info["kernel_list"]

    def only_inputs(a, b, h, t, w2):  # s's inputs are the caller's: storing s frees nothing
        s = a + b
        return ((s * h) @ w2 @ w2.t() + s * t).relu()
    info = check(only_inputs, *(torch.randn(64, 48) for _ in range(4)), w2)
    assert [k["outputs"] for k in info["kernel_list"]] == [1, 1], info["kernel_list"]

    def gate(g3, w3, w4, h1, th):  # the MLP's backward: the kernel of gt stores p too, not add_1
        add_1 = g3 @ w3 + g3 @ w4
        gt = add_1 * h1 * (1 - th * th)
        p = add_1 * th
        mm = gt @ w3.t()
        return gt.t() @ h1, (p + mm).relu()
    info = check(gate, torch.randn(64, 48), w2, w2.flip(0), torch.randn(64, 48), torch.randn(64, 48).tanh())
    assert [k["outputs"] for k in info["kernel_list"]] == [2, 1], info["kernel_list"]
    assert "mul_3" in info["kernel_list"][0]["nodes"] and "add" not in info["kernel_list"][1]["nodes"], \
        info["kernel_list"]


def test_value_read_whole_and_through_a_view_by_externs_is_one_kernel():
    """A linear's backward: one extern reads y, another y.t() (its view). One kernel writes y; the
    view is eager's view of that tensor (an as_strided), not a second kernel computing y again."""
    x, w, v = torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 3)

    def f(x, w, v):
        y = torch.sigmoid(x)
        return torch.matmul(y, w), torch.mm(y.t(), v), torch.mm(y.reshape(-1, 16).t(), v)
    info = check(f, x, w, v)
    assert info["kernels"] == 1, info["kernel_list"]
    assert info["extern_list"] == ["matmul", "t", "mm", "mm_1"], info["extern_list"]


def test_memory_planning_reuses_dead_intermediates():
    def f(x):
        a = torch.softmax(x, -1)           # reduction kernel -> buffer
        b = torch.cumsum(a, -1)            # extern: a is materialized
        c = (b * 2).sum(-1)                # non-keepdim: its own kernel
        d = torch.cumsum(c.unsqueeze(-1) * b, -1)
        return (d * 0.01).exp()
    check(f, torch.randn(8, 16))

    def g(x):
        y = x.sum(-1)            # non-keepdim reduction: materialized
        z = (x - y[:, None]).exp()
        return z.sum(-1) + y     # y read again after z's kernel
    info = check(g, torch.randn(8, 16))
    assert info["kernels"] >= 2


def test_externs_cover_everything_eager_runs():
    x = torch.randn(2, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    with torch.no_grad():
        info = check(lambda x: F.relu(conv(x)).flatten(1).cumsum(1).sort(-1)[0] * 2, x)
    assert info["externs"] >= 3
    check(lambda x: torch.topk(x.flatten(1), 3, dim=1).values + 1, x)


def test_grad_inputs_train_through_aot_autograd():
    # issue 12: a graph that needs a backward is split by csrc/autograd into a forward and a
    # backward graph, each compiled by this backend (tests/py/test_autograd.py has the rest)
    x = torch.randn(4, 4, requires_grad=True)
    c = ember.compile(lambda x: (x.sin() * 2).sum(), backend="ember")
    out = c(x)
    out.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    info = ember.cache_info(c)[0]["autograd"]
    assert set(info["ember"]) == {"forward", "backward"}
    assert "kernels" in info["ember"]["backward"]


def test_inplace_op_on_a_fresh_value_is_functionalized():
    """y.add_(1) on a value made in the graph and not read again as y: lowered as y + 1, one kernel."""
    def f(x):
        y = x * 2
        y.add_(1)
        return y.exp()
    info = check(f, torch.randn(5))
    assert not info.get("fallback") and info["kernels"] == 1 and info["externs"] == 0


@pytest.mark.parametrize("name,fn,shape", [
    ("column_expand", lambda x: x.expand(3, 4) + 1, (3, 1)),
    ("scalar_expand", lambda x: x.expand(3, 3) * 2, ()),
    ("middle_expand", lambda x: x.expand(2, 5, 3, 4).exp(), (2, 1, 3, 1)),
    ("row_value_two_outputs", lambda x: (x.expand(4, 6) - 1, x.sum() + 0), (4, 1)),
])
def test_row_values_stored_along_the_row(name, fn, shape):
    """A value that does not vary along a kernel's inner dims (a broadcast load) stored into an
    output that does: the store runs for every inner element. (It used to be written once per row,
    leaving the rest of the output uninitialised; x.expand(3, 4) + 1 returned garbage.)"""
    check(fn, torch.randn(shape))


def test_gradient_through_a_broadcast_scalar():
    """The backward of ((x @ w) * 2).sum() expands the scalar tangent and scales it: the same
    store pattern, in a compiled backward graph."""
    def f(x, w):
        return ((x @ w) * 2).sum() + torch.tanh(x @ w).mean()
    x = torch.randn(3, 4)
    w1 = torch.randn(4, 3, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    f(x, w1).backward()
    ember.compile(f, backend="ember")(x, w2).backward()
    torch.testing.assert_close(w2.grad, w1.grad)


def test_operator_and_is_not_an_in_place_op():
    """operator.and_ / or_ (a & b on masks, as transformers' GPT-2 builds its attention mask) end in
    an underscore but are out-of-place: the graph stays on backend "ember" (it used to fall back)."""
    def f(x, y):
        m = (x > 0) & (y < 0.5)
        k = (x < -1) | m
        return torch.where(k, x, y) + 1
    info = check(f, torch.randn(6, 5), torch.randn(6, 5))
    assert not info.get("fallback"), info.get("fallback")


def _inplace_same_as_eager(f):
    """f(x) compiled with backend "ember" and eager on copies of one input: results and the input's
    final contents equal; returns the cache entry."""
    x = torch.randn(5)
    xe, xc = x.clone(), x.clone()
    ref = f(xe)
    c = ember.compile(f, backend="ember")
    _same(c(xc), ref)
    _same(xc, xe)
    return ember.cache_info(c)[0]


def test_inplace_op_on_an_input_then_read():
    """x.mul_(2) on the input, then its new value read: an extern call on the input (the graph's
    inputs guarded apart, ___no_overlap), the read after it; the input ends as eager leaves it. With
    a read of the input before the update (y = x * 3, computed before the update runs) and views of
    the new value, results and the input equal eager's too."""
    def f(x):
        x.mul_(2)
        return x + 1
    info = _inplace_same_as_eager(f)
    assert not info["ember"].get("fallback") and any(g.startswith("___no_overlap(L['x'])") for g in info["guards"])

    def g(x):
        y = x * 3
        x.mul_(2)
        return y + x, x.view(-1)[0] * 1
    _inplace_same_as_eager(g)


def test_module_on_ember_backend():
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with torch.no_grad():
        ref = m(x)
        out = ember.compile(m, backend="ember")(x)
    torch.testing.assert_close(out, ref)


def test_torch_compile_backend_ember():
    """torch.compile(backend="ember") through the torch_dynamo_backends entry point."""
    import ember._C as C

    def f(x, w, b):
        return F.layer_norm(torch.cos(x) * 2, (x.shape[-1],), w, b).relu() + x.sum(-1, keepdim=True)
    x, w, b = torch.randn(8, 32), torch.randn(32), torch.randn(32)
    torch._dynamo.reset()
    before = C._cc_stats()
    torch.testing.assert_close(torch.compile(f, backend="ember")(x, w, b), f(x, w, b))
    after = C._cc_stats()
    assert after["compiles"] + after["disk_hits"] > before["compiles"] + before["disk_hits"]  # ember's kernels ran
    torch._dynamo.reset()


def test_explain_shows_kernels_and_source_or_why_eager():
    text = ember.explain(ember.compile(lambda x: torch.softmax(x * 2, -1), backend="ember"), torch.randn(4, 8))
    assert "backend ember: 1 kernel(s)" in text and "void ember_k0(" in text
    x = torch.randn(3, requires_grad=True)
    text = ember.explain(ember.compile(lambda x: x.sin() * 2, backend="ember"), x)
    # issue 12: training graphs show the joint/forward/backward graphs and each half's kernels
    assert "autograd:" in text and "backward graph:" in text and "backward half:" in text
    assert "backend ember:" in text


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 17, 1000, 3001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_var_std_welford(n, dtype):
    # Welford's one pass (RM2): lanes of 8, their combination and the row's tail; a large mean
    # against the spread; correction 0 and 1 (n = 1 gives NaN with correction 1, as eager)
    x = (torch.randn(3, n, dtype=torch.float64) * 3 + 1000).to(dtype)

    def f(x):
        return x.var(-1), x.std(-1, correction=0), torch.var(x, 0), x.var(-1, keepdim=True) + 1

    info = check(f, x)
    assert "wq" in info["source"]  # the Welford loop, not two passes


def test_var_welford_special_values():
    x = torch.randn(4, 20)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 19] = -float("inf")
    check(lambda x: (x.var(1), x.std(1)), x)


# ---- the row cache (em_codegen_c.c): an expensive element value the last reduction pass computed
# is kept in the output row and read back by the store pass instead of being recomputed ----

def _kernel_src(info):
    """The generated kernels without the prelude (which declares expf, exp ... for libmvec)."""
    src = info["source"]
    return src[src.index("/* kernel"):]


def _exp_calls(info):
    src = _kernel_src(info)
    return src.count("expf(v") + src.count("exp(v")


def _special_rows(x):
    """Rows with NaN, +inf, -inf, all -inf, a huge value, in float64 then cast (a fresh tensor)."""
    x = x.clone()
    if x.shape[0] >= 6 and x.shape[-1] >= 1:
        x[1, -1] = float("nan")
        x[2, 0] = float("inf")
        x[3, x.shape[-1] // 2] = -float("inf")
        x[4] = -float("inf")
        x[5, 0] = 1e30 if x.dtype != torch.float16 else 6e4
    return x


@pytest.mark.parametrize("n", [1, 7, 8, 1023, 1025, 2049, 4100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_cache_softmax_row_lengths(n, dtype):
    x = _special_rows(torch.randn(9, n, dtype=dtype) * 4)
    info = check(lambda x: torch.softmax(x, -1), x)
    assert info["kernels"] == 1
    # exp once per element, not twice (n = 1: the row dim is dropped, one row value, no store pass)
    assert ("row cache" in info["source"]) == (n > 1) and _exp_calls(info) == 1
    info = check(lambda x: F.log_softmax(x, -1), x)
    # log_softmax's store pass recomputes only x - max (cheap): no row cache, one exp per element anyway
    assert "row cache" not in info["source"] and _exp_calls(info) == 1


def test_row_cache_empty_rows():
    check(lambda x: torch.softmax(x, -1), torch.randn(4, 0))
    check(lambda x: torch.softmax(x, -1), torch.randn(0, 5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_row_cache_not_for_half_outputs(dtype):
    # softmax computes exp in float: keeping it in a half output row would round it
    x = _special_rows(torch.randn(9, 130).to(dtype))
    info = check(lambda x: torch.softmax(x, -1), x)
    assert "row cache" not in info["source"] and _exp_calls(info) == 2
    # an exp computed in the half type itself: not kept either (the rule takes float32/float64 only)
    info = check(lambda x: x.exp() / x.exp().amax(-1, keepdim=True), x)
    assert "row cache" not in info["source"]
    info = check(lambda x: (lambda e: e / e.sum(-1, keepdim=True))(x.exp()), x)
    assert "row cache" not in info["source"] and _exp_calls(info) == 2
    # a float32 result of a half input: the output row holds float exactly, the cache applies
    info = check(lambda x: torch.softmax(x, -1, dtype=torch.float32), x)
    assert "row cache" in info["source"] and _exp_calls(info) == 1


def test_row_cache_layouts():
    x = _special_rows(torch.randn(9, 301))
    # strided input, contiguous output: the row cache reads the input's layout only once
    info = check(lambda x: torch.softmax(x[:, ::2], -1), x)
    assert "row cache" in info["source"]
    # a transposed input (eager's softmax output is contiguous all the same)
    info = check(lambda x: torch.softmax(x, -1), x.t().contiguous().t())
    assert "row cache" in info["source"] and _exp_calls(info) == 1
    # softmax over dim 0 of a contiguous tensor: the row is a column of the output
    info = check(lambda x: torch.softmax(x, 0), x)
    assert "row cache" not in info["source"] and _exp_calls(info) == 2
    info = check(lambda x: torch.softmax(x, 1), _special_rows(torch.randn(9, 5, 3, 4)))
    assert "row cache" not in info["source"] and _exp_calls(info) == 2
    # a reduction over two inner dims (not merged: one is strided)
    check(lambda x: torch.softmax(x.reshape(9, 7, 43)[:, ::2].flatten(1), -1), x)


def test_row_cache_other_passes_and_values():
    x = _special_rows(torch.randn(9, 65))

    def f(x):
        e, s, t, g = x.exp(), x.sin(), x.tanh(), F.gelu(x.clamp(-20, 20))
        return (e / e.amax(-1, keepdim=True),                                   # kept from a max pass
                s * s.argmax(-1, keepdim=True),                                  # from an argmax pass
                e * (x * e.sum(-1, keepdim=True)).amax(-1, keepdim=True),        # from the first of two passes
                (t - t.mean(-1, keepdim=True)) / t.std(-1, keepdim=True),        # the sum's pass, not Welford's
                torch.softmax(torch.softmax(x, -1) * 3, -1),                     # two softmaxes in one kernel
                g / g.sum(-1, keepdim=True))                                     # erf
    info = check(f, x)
    assert info["externs"] == 0 and info["kernels"] == 6
    assert _kernel_src(info).count("row cache: computed by the reduction pass") == 6


def test_row_cache_two_outputs_of_the_same_rows():
    x = _special_rows(torch.randn(9, 77))

    def f(x):
        m = x.amax(-1, keepdim=True)
        e = (x - m).exp()
        s = e.sum(-1, keepdim=True)
        return e / s, e, s, torch.log_softmax(x, -1), torch.softmax(x, -1) * 2

    check(f, x)
    check(lambda x: (torch.softmax(x, -1), torch.softmax(x, -1).sum(-1)), x)


def test_row_cache_symbolic_sizes():
    cf = ember.compile(lambda x: torch.softmax(x, -1), backend="ember", dynamic=True)
    for shape in [(3, 7), (5, 1025), (9, 2), (2, 4100), (6, 33)]:
        x = _special_rows(torch.randn(*shape) * 3)
        torch.testing.assert_close(cf(x), torch.softmax(x, -1), equal_nan=True)
    info = [e["ember"] for e in ember.cache_info(cf) if "sv[" in e["ember"]["source"]]
    assert info and "row cache" in info[0]["source"] and _exp_calls(info[0]) == 1


def test_row_cache_output_never_aliases_an_input():
    # the matmul's result is dead after the row kernel, but a reduction kernel never writes over
    # what it reads: the row cache writes exp(y) in the sum's pass, and the max pass reads y again
    x, w = torch.randn(9, 16), torch.randn(16, 33)

    def f(x, w):
        y = x @ w
        e = y.exp()
        return e * (y * e.sum(-1, keepdim=True)).amax(-1, keepdim=True)

    info = check(f, x, w)
    assert "row cache" in info["source"] and info["kernel_list"][-1]["inplace"] == 0
    info = check(lambda x, w: torch.softmax(x @ w, -1), x, w)
    assert "row cache" in info["source"] and info["kernel_list"][-1]["inplace"] == 0


def test_pointwise_loops_follow_the_output_layout():
    """A pointwise kernel loops in its output's memory order (csrc/schedule): channels_last tensors
    are walked with stride 1 (C innermost), as a contiguous tensor is, with eager's strides and values."""
    def f(x, y):
        return torch.relu(x * 2 + y)

    x = torch.randn(2, 8, 5, 6).to(memory_format=torch.channels_last)
    y = torch.randn(2, 8, 5, 6).to(memory_format=torch.channels_last)
    c = ember.compile(f, backend="ember")
    _same(c(x, y), f(x, y))
    info = ember.cache_info(f)[0]["ember"]
    assert info["kernels"] == 1
    src = info["source"]
    body = src[src.index("void ember_k0"):]
    # every access walks the inner loop with stride 1: loads and the store index `b + r` / `c + r`
    assert "a0[b0 + r]" in body and "a1[b1 + r]" in body and "a2[c0 + r]" in body, body[:1500]
    # mixed layouts still give eager's values and strides
    z = torch.randn(2, 8, 5, 6)
    _same(ember.compile(lambda x, z: x + z, backend="ember")(x, z), x + z)


def test_channels_last_cpu_convolution_keeps_eager_layout():
    """torch's meta kernels give a convolution or pooling of channels_last tensors CUDA's (contiguous)
    layout; on the CPU eager returns channels_last. The tracer infers those calls on fake CPU
    tensors, so the graph's metas, ember's buffers and the results have eager's strides (no copy
    into a contiguous buffer between the convolution and its consumers)."""
    import torch.nn as nn
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 4, 3)).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    with torch.no_grad():
        out = ember.compile(m, backend="ember")(x)
        ref = m(x)
    _same(out, ref)
    assert out.is_contiguous(memory_format=torch.channels_last)


def _vma_flags(addr):
    """VmFlags of the mapping of this process that holds addr (/proc/self/smaps), or None."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") and os.path.exists("/proc/self/smaps")


@pytest.mark.skipif(not THP, reason="needs Linux transparent huge pages and /proc/self/smaps")
def test_large_outputs_advised_huge_pages():
    """ember.config.huge_pages: a CPU kernel output of 4 MiB or more is advised MADV_HUGEPAGE
    before the kernel writes it (the "hg" flag of its mapping); off, it is not; values as eager's."""
    x = torch.randn(8 << 20)  # a 32 MiB output
    interior = lambda t: (t.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)  # noqa: E731
    old = ember.config.huge_pages
    def f_on(x):
        return x * 2 + 1

    def f_off(x):  # its own code object: its own cache entry, compiled with the flag off
        return x * 2 + 1
    try:
        for on, f in ((True, f_on), (False, f_off)):
            ember.config.huge_pages = on  # read when the graph is compiled (the first call)
            out = ember.compile(f)(x)
            torch.testing.assert_close(out, x * 2 + 1)
            assert ("hg" in (_vma_flags(interior(out)) or [])) == on
    finally:
        ember.config.huge_pages = old


def test_row_invariant_values_hoisted_channels_last():
    """channels_last batch norm (inference): each row is the C channels, so the per-channel
    1 / sqrt(var + eps) is computed once per thread into an array (em_codegen_c.c hoist_plan), not
    per element; the same bits as the NCHW kernel, which computes it once per row."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(64).eval()
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)

    def f_cl(x):
        return torch.relu(bn(x))

    def f_nchw(x):  # its own code object: its own entry
        return torch.relu(bn(x))
    x = torch.randn(4, 64, 8, 8)
    xcl = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        got, ref = ember.compile(f_cl)(xcl), f_cl(xcl)
        nchw = ember.compile(f_nchw)(x)
    assert got.stride() == ref.stride()
    torch.testing.assert_close(got, ref)
    assert torch.equal(got, nchw)
    src = ember.cache_info(f_cl)[0]["ember"]["source"]
    assert "row-invariant values, once per thread" in src
    assert "row-invariant values" not in ember.cache_info(f_nchw)[0]["ember"]["source"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64])
def test_column_reductions(dtype):
    """A reduction over outer dims with the kept dim contiguous (a bias gradient's `g.sum(0)`) runs
    in the column form: blocks of adjacent outputs, the reduced elements walked once per block
    (em_codegen_c.c, column reductions); the row form walked each column at a stride, 30x eager's
    time. Odd sizes (a partial last block), several outer and reduced dims, a transposed input,
    NaN, epilogues that read per-output values, several reductions of one input, long rows;
    var/std (Welford) and argmax/argmin with ties and NaN."""
    fl = dtype.is_floating_point

    def make(*shape):
        if fl:
            return _floats(shape, dtype, special=False)
        return torch.randint(-3, 4, shape, dtype=dtype)

    x, b = make(300, 70), make(70)
    cases = [
        (lambda x: x.sum(0), (x,)),
        (lambda x, b: x.sum(0) * 2 + b, (x, b)),
        (lambda x: (x.sum(0), x.amax(0), x.amin(0), (x * x).sum(0)), (x,)),
        (lambda x: x.sum((0, 1)), (make(5, 7, 40),)),
        (lambda x: x.sum(1), (make(6, 9, 33),)),
        (lambda x: x.t().sum(1), (make(64, 50),)),
    ]
    if dtype not in (torch.float16, torch.bfloat16):  # a half product's last rounding: 1 ulp is 1e-3 (row form too)
        cases.append((lambda x: x.prod(0), (make(9, 40).clamp(-2, 2),)))
    if fl:
        xn = x.clone()
        xn[17, 5], xn[3, 69] = float("nan"), float("inf")
        xt = x.clone()
        xt[:, 4] = 1.5  # ties: argmax / argmin give the first index
        cases += [(lambda x: (x.amax(0), x.amin(0), x.sum(0)), (xn,)),
                  (lambda x: x.mean(0), (x,)),
                  (lambda x, y: (x * y).relu().sum(0), (x, make(300, 70))),
                  # var / std: Welford per column (one count per block), with a large mean
                  (lambda x: (x.var(0), x.std(0, correction=0, keepdim=True), torch.var_mean(x, 0)), (x + 1000,)),
                  (lambda x: (x * 2).var((0, 1)) + 1, (make(5, 7, 40),)),
                  (lambda x: (x.argmax(0), x.argmin(0, keepdim=True)), (xn,)),
                  (lambda x: (x.argmax(0), x.argmin(0)), (xt,))]
    else:
        xt = x.clone()
        xt[:, 4] = 2
        cases += [(lambda x: ((x > 0).any(0), (x > -3).all(0)), (x,)),
                  (lambda x: (x.argmax(0), x.argmin(0), x.argmax(1)), (xt,))]
    for i, (fn, args) in enumerate(cases):
        info = check(fn, *args)
        assert "column form" in info["source"], (i, info["source"][-2000:])
    # a reduction along the contiguous dim keeps the row form
    assert "column form" not in check(lambda x: x.sum(1), x)["source"]
    if dtype == torch.float32:  # float column sums accumulate in double: within rounding of the exact sum
        xl = torch.randn(4100, 24)  # (eager's float sum is 5x further from it on such data)
        c = ember.compile(lambda x: x.sum(0), backend="ember")
        torch.testing.assert_close(c(xl).double(), xl.double().sum(0), rtol=0, atol=1e-5)
        assert "column form" in ember.cache_info(c)[0]["ember"]["source"]


def test_row_and_column_reductions_of_one_tensor_stay_apart():
    """x.sum(1), x.amax(1), x.var(1) and x.mean(0) of a square x have one domain size: horizontal
    fusion joined them, and the fused kernel walked the column in the row form, a row's stride per
    element (issue 44 item 4: 22 ms against Inductor's 3.9 on the dev VM; after, 3.1). The column
    reduction keeps a kernel of its own in the column form."""
    x = torch.randn(256, 256)
    info = check(lambda x: x.sum(1) + x.amax(1) * x.var(1) - x.mean(0), x)
    assert [k["kind"] for k in info["kernel_list"]] == ["reduction", "reduction", "pointwise"], info["kernel_list"]
    assert info["source"].count("column form") == 1, info["source"][-3000:]


def test_a_returned_value_read_inside_is_stored_once_in_eager_layout():
    """A value the graph returns and also reads through a view (a training forward's rotated keys,
    saved for the backward and repeated for grouped-query attention; an inference graph's KV cache)
    is stored once, in eager's layout ((B, S, H, D) memory seen as (B, H, S, D)), where it was
    stored contiguous for the view and computed again in eager's layout for the output. A value
    whose eager layout is not dense keeps the contiguous buffer."""
    def f(x, c, s):
        k = x.view(2, 5, 3, 8).transpose(1, 2) * c + s  # eager: a (B, S, H, D)-ordered result
        return k, k[:, :, None, :, :].expand(2, 3, 2, 5, 8).reshape(2, 6, 5, 8) * 2
    x, c, s = torch.randn(2, 5, 24), torch.randn(5, 8), torch.randn(5, 8)
    info = check(f, x, c, s)  # k, the repeat's copy, * 2 (before: 4, k computed twice)
    assert info["kernels"] == 3 and info["views"] == 0, info["kernel_list"]
    assert sum("add" in k["nodes"] for k in info["kernel_list"]) == 1, info["kernel_list"]
    # the same value returned through a view of it, and a broadcast result (not dense): correct
    check(lambda x, c: (lambda k: (k.transpose(1, 2), k.sum(1)))(x.view(2, 5, 3, 8) * c[:3]), x, c)
    check(lambda x, c: (lambda k: (k, k.exp()))(x[:, :1].expand(2, 5, 24) * c.view(-1)[:24]), x, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_slice_and_select_backward_are_masked_loads(dtype):
    """aten slice_backward / select_backward (the gradients ember's autograd emits for slicing)
    lower to one masked load each: grad inside the range, +0.0 outside (eager's zeros with the
    slice copied in: a -0.0 or NaN of grad stays), so a tensor's pieces' gradients (rotary
    embeddings' x[..., :h] and x[..., h:]) add up in one kernel with no zeros written. A step other
    than 1 keeps the torch op."""
    sb, sel = torch.ops.aten.slice_backward, torch.ops.aten.select_backward

    def f(g1, g2, g3):
        return sb(g1, [4, 6, 8], 2, 0, 4, 1) + sb(g2, [4, 6, 8], -1, 4, 8, 1) + sel(g3, [4, 6, 8], 1, -3)
    g1, g2, g3 = (torch.randn(*s, dtype=torch.float64).to(dtype) for s in ((4, 6, 4), (4, 6, 4), (4, 8)))
    g1[0, 0, 0], g1[0, 1, 1] = -0.0, float("nan")
    info = check(f, g1, g2, g3)
    assert info["kernels"] == 1 and info["externs"] == 0, info["extern_list"]
    info = check(lambda g: sb(g, [4, 6, 8], 2, 1, 8, 2) * 2, torch.randn(4, 6, 4, dtype=torch.float64).to(dtype))
    assert "slice_backward" in str(info["extern_list"])


@pytest.mark.parametrize("src", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_float_to_integer_casts_of_nan_and_out_of_range(src):
    """NaN, infinities and values outside the integer's range cast as eager casts them on x86 CPUs
    (int64 / int32: the integer indefinite, INT_MIN; narrower types through int32, truncated). A
    plain C cast is undefined there: gcc folded a bfloat16 NaN's cast (a known constant after
    rounding) to 0 where eager gives INT64_MIN."""
    vals = [float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3e9, -3e9, 70000.0, 300.0, -3.7, 3.7, 0.0, -0.0]
    x = torch.tensor(vals * 3, dtype=torch.float64).to(src)
    for dst in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        check(lambda x, dst=dst: (x * 1).to(dst), x)


def test_swiglu_backward_gradients_share_one_kernel():
    """SwiGLU's backward (Llama's MLP): the up projection's gradient g * silu(a) and the gate's
    silu_backward(g * b, a) read the same elements of g and a, with the up projection's two matmuls
    between them. The gate's kernel frees as much as it stores when it runs (g, a and b die with it),
    so it joins the up projection's kernel across the matmuls: one kernel of two outputs, where the
    gate's gradient was a second pass over g and a."""
    def mlp(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    x = torch.randn(2, 64, 128, requires_grad=True)
    ws = [(torch.randn(352, 128) / 128 ** 0.5).requires_grad_(), (torch.randn(352, 128) / 128 ** 0.5).requires_grad_(),
          (torch.randn(128, 352) / 352 ** 0.5).requires_grad_()]
    g = torch.randn(2, 64, 128)
    c = ember.compile(mlp, backend="ember")
    c(x, *ws).backward(g)
    got = [t.grad for t in (x, *ws)]
    for t in (x, *ws):
        t.grad = None
    mlp(x, *ws).backward(g)
    for a, b in zip(got, [t.grad for t in (x, *ws)]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    bw = ember.cache_info(c)[0]["autograd"]["ember"]["backward"]
    kl = bw["kernel_list"]
    assert len(kl) == 2 and kl[0]["outputs"] == 2 and "silu_backward" in kl[0]["nodes"], kl


def test_saved_value_joins_the_kernel_reading_the_same_elements():
    """A value stored only as a graph output (a training forward's saved pre-activation `x @ w + b`)
    whose kernel reads only what an earlier kernel reads (the activation's, demanded first by the
    next matmul) joins that kernel across the extern calls between: the matmul's result is read
    once, not kept alive to the end of the graph for a second pass (em_schedule.c, horizontal
    fusion), and the fused kernel of two outputs computes in place into the matmul's result."""
    def f(x, w, b, w2):
        pre = x @ w + b
        out = F.gelu(pre) @ w2
        return out, pre
    # (256, 160): above horizontal fusion's small domains, which join whatever they read
    args = (torch.randn(256, 32), torch.randn(32, 160) / 32 ** 0.5, torch.randn(160), torch.randn(160, 16) / 160 ** 0.5)
    info = check(f, *args)
    kl = info["kernel_list"]
    assert len(kl) == 1 and kl[0]["outputs"] == 2 and kl[0]["inplace"], kl

    # a value that reads something the earlier kernel does not read joins it when it frees as much
    # as it stores (the matmul's result dies with it: hfuse_frees_its_stores), else keeps its own
    # kernel (two outputs for one freed buffer would raise the peak across the matmul)
    def g(x, w, b, w2, c):
        pre = x @ w + b
        out = F.gelu(pre) @ w2
        return out, pre * c
    info = check(g, *args, torch.randn(160))
    assert len(info["kernel_list"]) == 1 and info["kernel_list"][0]["outputs"] == 2, info["kernel_list"]

    def g2(x, w, b, w2, c):
        pre = x @ w + b
        out = F.gelu(pre) @ w2
        return out, pre * c, pre - c
    info = check(g2, *args, torch.randn(160))
    assert len(info["kernel_list"]) == 2, info["kernel_list"]

    # training: the forward half stores the pre-activation and the activation in one kernel
    m = torch.nn.Sequential(torch.nn.Linear(32, 160), torch.nn.GELU(), torch.nn.Linear(160, 16))
    x = torch.randn(256, 32)
    c = ember.compile(m, backend="ember")
    c(x).square().mean().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).square().mean().backward()
    for got, ref in zip(grads, [p.grad for p in m.parameters()]):
        torch.testing.assert_close(got, ref)
    fwd = ember.cache_info(c)[0]["autograd"]["ember"]["forward"]["kernel_list"]
    assert len(fwd) == 1 and fwd[0]["outputs"] == 2, fwd


# ---- split rows (em_codegen_c.c): few long rows, each cut into chunks reduced in parallel and
# combined in chunk order ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool])
def test_split_rows_reductions(dtype):
    """A full reduction and three long rows (131077 elements: 32 chunks), sums, products, max / min
    with a NaN in one row, any / all, var / std, argmax / argmin: eager's values, and the same bits
    on 1 thread as on 2 (the chunks are fixed when the kernel is generated, not by the thread count)."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        x = torch.rand(3, 131077, generator=g) > 0.2
        x[1] = True

        def f(x):
            return x.any(), x.all(), x.any(-1), x.all(-1)
    elif dtype == torch.int64:
        x = torch.randint(-1000, 1000, (3, 131077), generator=g)

        def f(x):
            # argmax / argmin: the max and min repeat across chunks, the first index wins
            return x.sum(), x.sum(-1), x.amax(-1), x.amin(-1), (x % 3 - 1).abs().prod(-1), x.argmax(-1), x.argmin()
    else:
        x = (torch.randn(3, 131077, generator=g, dtype=torch.float64) * 2).to(dtype)
        x[1, 70000] = float("nan")

        def f(x):  # (a float32 product of 131077 factors is too far from eager's float order to compare)
            out = (x.sum(), (x * x).mean(-1), x.amax(-1), x.amin(-1), x[0].max(), x.abs().sum(-1, keepdim=True) + 1,
                   x.var(-1), (x[0] + 100).std(correction=0),  # Welford's: chunks merged by Chan's formula
                   x.argmax(-1), x[0].argmin())  # row 1: the NaN's index
            return out + ((1 + x[2] * 1e-4).prod(),) if x.dtype == torch.float64 else out
    info = check(f, x)
    assert "split rows" in info["source"]
    one, two = on_threads(ember.compile(f, backend="ember"), x)
    for a, b in zip(one, two):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_argmax_two_passes(dtype):
    """argmax / argmin of a value with the same bits in vector and scalar loops: the extreme as a
    vectorized max / min, then a scan for its first index (the first NaN); ties, NaN, -0.0 against
    0.0, constant rows. A libm value (sin) keeps the one-loop form: its vector version rounds
    differently, so a scan could miss the extreme."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (6, 1000), generator=g).to(dtype)  # many ties
    if dtype.is_floating_point:
        x[1, 10] = x[1, 500] = float("nan")
        x[2] = 0.0
        x[2, 7] = -0.0
        x[2, 3] = -0.0
        x[3, ::2] = float("-inf")
    x[4] = 1

    def f(x):
        return x.argmax(-1), x.argmin(-1), (x * 2 - 1).argmax(-1), x.abs().argmin(-1, keepdim=True), x.argmax()

    info = check(f, x)  # (int64 indices: compared exactly)
    assert "#pragma omp simd reduction(max:best" in info["source"]
    if dtype.is_floating_point:
        info = check(lambda x: x.sin().argmax(-1), x)
        assert "reduction(max:best" not in info["source"]


def test_split_rows_only_where_they_apply():
    """A reduction that reads another's value in the same kernel (the sum of exp(x - max) per row)
    and many short rows keep the row form."""
    x = torch.randn(2, 100000)
    info = check(lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1), x)
    assert "split rows" not in info["source"] and "double acc" in info["source"]
    # positive values: a row sum of 4096 signed normals can land near 0, where eager's own error
    # (cascade order, up to 4e-5 here) already exceeds assert_close's default atol of 1e-5
    info = check(lambda x: x.sum(-1), torch.rand(64, 4096))
    assert "split rows" not in info["source"]
