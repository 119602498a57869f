"""backend="ember": indirect ("gather") loads. embedding, index_select, gather and advanced indexing
(x[idx], x[i, :, j] ...) are LOADs whose position along the indexed dims is another node's value
(em_lower.h, LNode.nidx), fused into the kernel that reads them. Checked against eager on the same
inputs: values (bitwise: a gather is a copy), dtypes, shapes, strides; out-of-range indices raise
eager's exception with eager's message; cache_info shows the gathers fused (no extern call).
CUDA: the generated CUDA C compiles under NVRTC and runs on the CPU emulator (skipped without them)."""
import re

import pytest
import torch
import torch.nn.functional as F

import ember

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("cpu_tensors", "ember_cache_dir")]

GATHER_OPS = ("embedding", "index_select", "gather", "getitem")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _same(out, ref):
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            _same(o, r)
        return
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    assert out.stride() == ref.stride() or out.numel() <= 1, (out.stride(), ref.stride())
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def fused(fn, *args, kernels=None, approx=False):
    """fn compiled with backend ember against eager; asserts that no gather op is left an extern
    call. Returns cache_info's ember dict."""
    ref = fn(*args)
    c = ember.compile(fn, backend="ember")
    out = c(*args)
    if approx:
        torch.testing.assert_close(out, ref)
        assert out.dtype == ref.dtype and out.shape == ref.shape
    else:
        _same(out, ref)
    info = ember.cache_info(c)[0]["ember"]
    assert info.get("fallback") is None, info.get("fallback")
    left = [n for n in info["extern_list"] if n.startswith(GATHER_OPS)]
    assert not left, (left, info["extern_list"])
    assert info["kernels"] >= 1
    if kernels is not None:
        assert info["kernels"] == kernels, (info["kernels"], info["kernel_list"])
    return info


def ids(*shape, hi=10, dtype=torch.int64):
    return torch.randint(0, hi, shape, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# embedding
# ------------------------------------------------------------------------------------------------

def test_embedding_plus_position_layer_norm_is_one_kernel():
    W, P, w, b = torch.randn(10, 8), torch.randn(16, 8), torch.randn(8), torch.randn(8)

    def f(i, W, P, w, b):
        return F.layer_norm(F.embedding(i, W) + F.embedding(torch.arange(16), P), (8,), w, b)

    info = fused(f, ids(2, 16), W, P, w, b, kernels=1, approx=True)
    assert info["externs"] == 0, info["extern_list"]
    src = info["source"]
    assert "em_gidx" in src and "err" in src


@pytest.mark.parametrize("shape", [(5,), (2, 16), (2, 3, 4), ()])
def test_embedding_shapes(shape):
    fused(lambda i, W: F.embedding(i, W) * 1, ids(*shape), torch.randn(10, 6))


def test_embedding_returned_directly():
    info = fused(lambda i, W: F.embedding(i, W), ids(3, 4), torch.randn(10, 6), kernels=1)
    assert info["kernel_list"][0]["nodes"] == ["embedding"] or "embedding" in info["kernel_list"][0]["nodes"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64, torch.bool])
def test_embedding_weight_dtypes(dtype):
    W = (torch.randn(10, 5) * 10).to(dtype)
    fused(lambda i, W: F.embedding(i, W), ids(4, 3), W)


def test_embedding_int32_ids_padding_idx_torch_form():
    W = torch.randn(10, 7)
    fused(lambda i, W: F.embedding(i, W, padding_idx=0) + 1, ids(3, 5, dtype=torch.int32), W)
    fused(lambda i, W: torch.embedding(W, i) + 1, ids(3, 5), W)


def test_embedding_noncontiguous_weight_and_ids():
    Wt = torch.randn(6, 10)           # W = Wt.t(): strides (1, 10)
    i = ids(5, 4).t()                 # transposed ids
    fused(lambda i, Wt: F.embedding(i, Wt.t()) * 2, i, Wt)
    fused(lambda i, W: F.embedding(i, W[:, 1::2]), ids(3, 3), torch.randn(10, 9))


def test_embedding_computed_ids_and_weight():
    fused(lambda i, W: F.embedding((i + 3) % 10, W * 2).relu(), ids(4, 5), torch.randn(10, 6))


def test_embedding_max_norm_stays_extern():
    def f(i, W):
        return F.embedding(i, W, max_norm=1.0)
    W = torch.randn(10, 4)
    c = ember.compile(f, backend="ember")
    i = ids(3)
    torch.testing.assert_close(c(i, W.clone()), f(i, W.clone()))
    assert "embedding" in ember.cache_info(c)[0]["ember"]["extern_list"]


# ------------------------------------------------------------------------------------------------
# index_select
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_index_select_dims(dim):
    x = torch.randn(5, 6, 7)
    idx = torch.randint(0, x.shape[dim], (4,))
    fused(lambda x, i: torch.index_select(x, dim, i) + 1, x, idx)
    fused(lambda x, i: x.index_select(dim, i), x, idx)


def test_index_select_0d_index_int32_noncontiguous():
    x = torch.randn(6, 5)
    fused(lambda x, i: torch.index_select(x.t(), 1, i) * 3, x, torch.tensor(4))
    fused(lambda x, i: torch.index_select(x[:, ::2], 0, i), x, ids(8, hi=6, dtype=torch.int32))


def test_index_select_repeated_and_computed_index():
    x = torch.randn(8, 3)
    fused(lambda x, i: torch.index_select(x * 2, 0, (i * 3) % 8), x, torch.tensor([0, 0, 7, 7, 1]))


# ------------------------------------------------------------------------------------------------
# gather
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_gather_dims(dim):
    x = torch.randn(4, 5, 6)
    shape = [3, 4, 5]
    shape[dim] = 7                    # more than x's size along dim: repeats
    idx = torch.randint(0, x.shape[dim], shape)
    fused(lambda x, i: torch.gather(x, dim, i) - 1, x, idx)
    fused(lambda x, i: x.gather(dim, i), x, idx)


def test_gather_int32_noncontiguous_source_and_index():
    x = torch.randn(6, 8)
    i = torch.randint(0, 6, (8, 5), dtype=torch.int32).t()   # (5, 8), strides (1, 5)
    fused(lambda x, i: torch.gather(x.t(), 1, i), x, i)


def test_gather_of_argmax_in_one_kernel():
    x = torch.randn(7, 9)
    fused(lambda x: torch.gather(x, 1, x.argmax(1, keepdim=True)) * 2, x)


def test_take_along_dim_stays_correct():
    # not lowered (its bounds are not eager's check): runs as the torch op, same values
    x, i = torch.randn(4, 5), torch.randint(0, 5, (4, 2))
    f = lambda x, i: torch.take_along_dim(x, i, 1) + 1  # noqa: E731
    c = ember.compile(f, backend="ember")
    _same(c(x, i), f(x, i))


# ------------------------------------------------------------------------------------------------
# advanced indexing
# ------------------------------------------------------------------------------------------------

ADV = [
    ("x[i]", lambda x, i, j: x[i], (4, 5, 6), (3,), (3,)),
    ("x[i]_2d", lambda x, i, j: x[i], (4, 5, 6), (2, 3), (3,)),
    ("x[:,i]", lambda x, i, j: x[:, i], (4, 5, 6), (3,), (3,)),
    ("x[...,i]", lambda x, i, j: x[..., i], (4, 5, 6), (2, 2), (3,)),
    ("x[i,j]_broadcast", lambda x, i, j: x[i, j], (4, 5, 6), (3, 1), (2,)),
    ("x[i,:,j]_nonadjacent", lambda x, i, j: x[i, :, j], (4, 5, 6), (3, 1), (2,)),
    ("x[:,i,j]", lambda x, i, j: x[:, i, j], (4, 5, 6), (3,), (3,)),
    ("x[None,i]", lambda x, i, j: x[None, i], (4, 5, 6), (3,), (3,)),
    ("x[0,:,i]_select_first", lambda x, i, j: x[0, :, i], (4, 5, 6), (3,), (3,)),
    ("x[i,0,j]", lambda x, i, j: x[i, 0, j], (4, 5, 6), (2,), (2,)),
    ("x[1:3,i]", lambda x, i, j: x[1:3, i], (4, 5, 6), (3,), (3,)),
    ("x[i,::2]", lambda x, i, j: x[i, ::2], (4, 5, 6), (3,), (3,)),
    ("x[i,None,j]", lambda x, i, j: x[i, None, j], (4, 5, 6), (3,), (3,)),
    ("x[i,j,k]", lambda x, i, j: x[i, j, i % 6], (4, 5, 6), (2, 1), (3,)),
    ("x[i]+1", lambda x, i, j: x[i] + 1, (7,), (4, 4), (3,)),
]


def _adv_index(shape, ishape, hi, dtype=torch.int64, negative=False):
    lo = -hi if negative else 0
    return torch.randint(lo, hi, ishape, dtype=dtype)


@pytest.mark.parametrize("name,fn,xs,isz,jsz", ADV, ids=[a[0] for a in ADV])
@pytest.mark.parametrize("negative", [False, True])
def test_advanced_indexing(name, fn, xs, isz, jsz, negative):
    x = torch.randn(*xs)
    # i indexes x's first indexed dim, j the second: draw both within the smaller sizes (4 here)
    i = _adv_index(xs, isz, 4, negative=negative)
    j = _adv_index(xs, jsz, 4, negative=negative)
    ref = fn(x, i, j)
    assert ref.numel() > 0
    fused(fn, x, i, j)


def test_advanced_indexing_int32_and_noncontiguous_source():
    x = torch.randn(6, 5, 4).permute(2, 0, 1)     # (4, 6, 5), not contiguous
    i = torch.tensor([3, -1, 0], dtype=torch.int32)
    j = torch.tensor([[1], [4]], dtype=torch.int32)
    fused(lambda x, i, j: x[i, :, j] * 2, x, i, j)
    fused(lambda x, i: x[:, i], x, i.long())


def test_gpt2_mask_is_one_pointwise_kernel():
    # transformers' GPT-2 mask builder (masking_utils, sdpa_mask with a padding mask): cumsum of the
    # padding positions, read at broadcast aranges, compared; the four getitems are gathers
    def f(am):
        cache = (torch.arange(16) + 0).unsqueeze(0)
        pos = am.cumsum(-1)
        kvpos = cache.expand(2, -1)
        b = torch.arange(2)[:, None, None, None]
        q = (torch.arange(16) + 0)[None, None, :, None]
        kv = (torch.arange(16) + 0)[None, None, None, :]
        same = pos[b, q] == pos[b, kv]
        causal = kvpos[b, kv] <= kvpos[b, q]
        return same & causal
    am = torch.ones(2, 16, dtype=torch.int64)
    am[1, :3] = 0
    info = fused(f, am)
    assert info["extern_list"] == ["cumsum"], info["extern_list"]
    assert info["kernels"] == 1


def test_bool_mask_index_stays_extern():
    x = torch.randn(5, 4)
    f = lambda x: x[x > 0] * 2  # noqa: E731
    c = ember.compile(f, backend="ember")
    _same(c(x), f(x))


# ------------------------------------------------------------------------------------------------
# out-of-range indices: eager's exception and message, nothing read outside the source
# ------------------------------------------------------------------------------------------------

def _eager_error(fn, *args):
    with pytest.raises(Exception) as e:
        fn(*args)
    return type(e.value), str(e.value).splitlines()[0]


OOB = [
    ("embedding_high", lambda x, i: F.embedding(i, x) + 1, (10, 4), [[1, 10]]),
    ("embedding_negative", lambda x, i: F.embedding(i, x) + 1, (10, 4), [[1, -1]]),
    ("embedding_in_layer_norm", lambda x, i: F.layer_norm(F.embedding(i, x), (4,)), (10, 4), [[0, 3, 12]]),
    ("index_select_high", lambda x, i: torch.index_select(x, 0, i[0]) * 2, (10, 4), [[0, 10]]),
    ("index_select_negative", lambda x, i: torch.index_select(x, 0, i[0]), (10, 4), [[-2, 0]]),
    ("index_select_dim1", lambda x, i: torch.index_select(x, 1, i[0]) * 2, (10, 4), [[0, 4]]),  # RuntimeError
    ("index_select_dim1_negative", lambda x, i: torch.index_select(x, 1, i[0]), (10, 4, 3), [[-1, 0]]),
    ("index_select_last_of_3d", lambda x, i: torch.index_select(x, 2, i[0]), (10, 4, 3), [[3, 0]]),
    ("index_select_1d", lambda x, i: torch.index_select(x[0], 0, i[0]), (10, 4), [[3, 4]]),
    ("gather_high", lambda x, i: torch.gather(x, 1, i) + 1, (3, 4), [[0, 9]]),
    ("gather_negative", lambda x, i: torch.gather(x, 0, i), (3, 4), [[0, -1]]),
    ("getitem_high", lambda x, i: x[i] + 1, (10, 4), [[0, 10]]),
    ("getitem_negative", lambda x, i: x[:, i[0]], (10, 4), [[-5, 1]]),
    ("getitem_second_tensor", lambda x, i: x[i[:, :1], i], (10, 4), [[0, 2], [3, 7]]),
]


@pytest.mark.parametrize("name,fn,xs,bad", OOB, ids=[o[0] for o in OOB])
def test_out_of_range_raises_as_eager(name, fn, xs, bad):
    x = torch.randn(*xs)
    good = torch.zeros(len(bad), len(bad[0]), dtype=torch.int64)
    c = ember.compile(fn, backend="ember")
    _same(c(x, good), fn(x, good))
    info = ember.cache_info(c)[0]["ember"]
    assert not [n for n in info["extern_list"] if n.startswith(GATHER_OPS)], info["extern_list"]
    bad = torch.tensor(bad)
    etype, msg = _eager_error(fn, x, bad)
    assert etype in (IndexError, RuntimeError)
    with pytest.raises(etype, match=re.escape(msg)):
        c(x, bad)
    _same(c(x, good), fn(x, good))   # the next call starts clean
    assert ember.cache_info(c)[0]["ember"]["kernels"] == info["kernels"]  # no recompile


def test_out_of_range_in_a_parallel_kernel():
    W = torch.randn(1000, 64)
    i = torch.randint(0, 1000, (64, 64))
    f = lambda i, W: F.embedding(i, W) * 2  # noqa: E731
    c = ember.compile(f, backend="ember")
    _same(c(i, W), f(i, W))
    assert "omp parallel" in ember.cache_info(c)[0]["ember"]["source"]
    i[40, 7] = 1000
    with pytest.raises(IndexError, match="index out of range in self"):
        c(i, W)


def test_symbolic_graph_keeps_the_extern():
    f = lambda x, i: torch.index_select(x, 0, i) * 2  # noqa: E731
    c = ember.compile(f, backend="ember", dynamic=True)
    for n in (5, 7):
        x, i = torch.randn(n, 3), torch.randint(0, n, (4,))
        _same(c(x, i), f(x, i))
    info = ember.cache_info(c)[0]["ember"]
    assert "index_select" in info["extern_list"]


# ------------------------------------------------------------------------------------------------
# autograd: the forward half lowers the embedding, the backward stays eager's formula
# ------------------------------------------------------------------------------------------------

def test_embedding_training_gradients():
    torch.manual_seed(0)
    W = torch.randn(10, 8, requires_grad=True)
    W2 = W.detach().clone().requires_grad_(True)
    i = ids(3, 5)

    def f(i, W):
        return (F.layer_norm(F.embedding(i, W), (8,)) * torch.arange(8.0)).sum()

    c = ember.compile(f, backend="ember")
    out = c(i, W)
    out.backward()
    ref = f(i, W2)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(W.grad, W2.grad)


# ------------------------------------------------------------------------------------------------
# CUDA C: the same graphs compile under NVRTC and run on the emulator (no GPU needed)
# ------------------------------------------------------------------------------------------------
from ember import _C  # noqa: E402
from ember.testing.cuda import cuda_codegen, emulate, emulator_available, nvrtc_available  # noqa: E402

_NVRTC_WHY = nvrtc_available()
_EMU_WHY = emulator_available()

CUDA_GRAPHS = [
    ("embedding_layer_norm", lambda i, W, P: F.layer_norm(F.embedding(i, W) + P, (64,)),
     [ids(2, 16, hi=100), torch.randn(100, 64), torch.randn(16, 64)]),
    ("embedding_pointwise", lambda i, W: F.embedding(i, W) * 2, [ids(3, 5, dtype=torch.int32), torch.randn(10, 8)]),
    ("index_select_dim1", lambda x, i: torch.index_select(x, 1, i) + 1, [torch.randn(4, 9, 5), ids(6, hi=9)]),
    ("gather_dim0", lambda x, i: torch.gather(x, 0, i), [torch.randn(6, 7), ids(4, 7, hi=6)]),
    ("adv_index_broadcast", lambda x, i, j: x[i, :, j] - 1, [torch.randn(4, 5, 6), ids(3, 1, hi=4) - 2, ids(2, hi=6)]),
    ("sum_of_gather", lambda x, i: x[:, i].sum(-1), [torch.randn(6, 50), ids(40, hi=50)]),
]


@pytest.mark.skipif(bool(_NVRTC_WHY), reason=f"NVRTC not available: {_NVRTC_WHY}")
@pytest.mark.parametrize("name,fn,ex", CUDA_GRAPHS, ids=[g[0] for g in CUDA_GRAPHS])
def test_cuda_gather_compiles_for_sm90(name, fn, ex):
    info = cuda_codegen(fn, *ex)
    assert "fallback" not in info, info.get("fallback")
    assert not [n for n in info.get("extern_list", []) if n.startswith(GATHER_OPS)]
    src = info["source"]
    assert "em_gidx(" in src and "__trap()" in src
    ptx = _C._nvrtc_compile(src, arch="compute_90").decode()
    for k in range(len(info["kernel_list"])):
        assert f".entry ember_k{k}(" in ptx
    assert "trap;" in ptx
    for launch in info["launch"]:
        assert launch["vec"] == 1 and launch["cached"] == 0   # gathers run the scalar, re-reading paths


@pytest.mark.skipif(bool(_EMU_WHY), reason=f"emulator: {_EMU_WHY}")
@pytest.mark.parametrize("name,fn,ex", CUDA_GRAPHS, ids=[g[0] for g in CUDA_GRAPHS])
def test_cuda_gather_emulated_matches_eager(name, fn, ex):
    ex = tuple(e.cpu() if isinstance(e, torch.Tensor) else e for e in ex)  # built at import: CUDA under EMBER_TEST_DEVICE=cuda
    outs, info = emulate(fn, *ex)
    ref = fn(*ex)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r)


def test_dead_gather_still_raises():
    # the tracer keeps a call it cannot prove pure (F.embedding) even when nothing reads it: eager
    # raises for the bad id, so the call stays torch's instead of a kernel that never runs
    def f(x, i):
        F.embedding(i, x)
        return x * 2
    c = ember.compile(f, backend="ember")
    x = torch.randn(4, 3)
    _same(c(x, torch.tensor([1])), f(x, torch.tensor([1])))
    with pytest.raises(IndexError, match="index out of range in self"):
        c(x, torch.tensor([7]))
