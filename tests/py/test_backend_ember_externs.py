"""backend="ember": fewer torch calls per run. Views an extern call reads are made from their base in
one as_strided (or are a kernel's output, allocated in the view's layout, or the base itself);
dropout in eval, contiguous() of a contiguous value and to() the dtype a value has are the value
itself; split/chunk/unbind pieces are views; factories, arange, bitwise ops and diff are kernels.
Every case is compared with eager PyTorch (values, dtypes, shapes, strides) and asserts the torch
calls left (cache_info()["externs"], docs/backend_cpu.md)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
from conftest import same_as_eager as _same

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("cpu_tensors", "ember_cache_dir")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def check(fn, *args):
    """fn under backend="ember" equals eager (twice: the second call reuses buffers and views);
    returns the entry's ember info."""
    ref = fn(*args)
    c = ember.compile(fn, backend="ember")
    _same(c(*args), ref)
    _same(c(*args), ref)
    info = ember.cache_info(c)[0]
    assert info["kind"] == "graph" and not info["ember"].get("fallback"), info["ember"].get("fallback")
    return info["ember"]


def calls(info):
    """info's extern_list with each attention written as its kernel op (an inference graph calls the
    op eager's scaled_dot_product_attention runs, then takes its first result: passes/
    em_pass_decompose.c, dz_sdpa_kernel) named scaled_dot_product_attention again."""
    out = []
    for name in info["extern_list"]:
        if name.startswith("_scaled_dot_product_"):
            out.append("scaled_dot_product_attention")
        elif not (name.startswith("getitem") and out and out[-1] == "scaled_dot_product_attention"):
            out.append(name)
    return out


# ---- views an extern call reads --------------------------------------------------------------

def test_view_and_transpose_feeding_a_matmul():
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    info = check(lambda x, w: x.view(-1, 8) @ w.t(), x, w)
    assert info["extern_list"] == ["view", "t", "matmul"] and info["views"] == 2  # one as_strided each
    # a chain of views is one as_strided: view, transpose, narrow of an input
    info = check(lambda x, w: torch.matmul(x.view(6, 8).t()[:, 1:].t(), w.t()), x, w)
    assert info["externs"] == 3 and info["views"] == 2


def test_view_chain_of_an_extern_result_is_one_as_strided():
    x, w, k = torch.randn(2, 16, 8), torch.randn(64, 8), torch.randn(2, 2, 16, 32)
    f = lambda x, w, k: F.scaled_dot_product_attention(F.linear(x, w).view(2, 16, 2, 32).transpose(1, 2), k, k)  # noqa: E731
    info = check(f, x, w, k)
    assert calls(info) == ["linear", "transpose", "scaled_dot_product_attention"]


def test_views_of_a_kernel_output_are_the_kernel_output():
    """A kernel whose output only views read is allocated in a view's layout: the heads of a scaled
    linear and a layer_norm flattened for a matmul cost no torch call. A bias add that only an
    extern call reads stays in F.linear (no kernel; the heads are one as_strided)."""
    x, w, b, k = torch.randn(2, 16, 8), torch.randn(64, 8), torch.randn(64), torch.randn(2, 2, 16, 32)
    info = check(lambda x, w, b, k: F.scaled_dot_product_attention(F.linear(x, w, b).view(2, 16, 2, 32).transpose(1, 2), k, k),
                 x, w, b, k)
    assert calls(info) == ["linear", "transpose", "scaled_dot_product_attention"] and info["kernels"] == 0
    info = check(lambda x, w, b, k: F.scaled_dot_product_attention((F.linear(x, w, b) * 2).view(2, 16, 2, 32).transpose(1, 2),
                                                                   k, k), x, w, b, k)
    assert calls(info) == ["linear", "scaled_dot_product_attention"] and info["views"] == 0
    assert info["kernels"] == 1
    w2 = torch.randn(8, 24)
    info = check(lambda x, w: torch.addmm(torch.zeros(24), F.layer_norm(x, (8,)).view(-1, 8), w), x, w2)
    assert info["extern_list"] == ["addmm"]
    # two views of a pointwise value read only by them: each view is pushed down to the loads, so
    # each matmul input is a kernel's output in that view's shape (no as_strided)
    info = check(lambda x, w: (torch.mm((x * 2).view(-1, 8), w), torch.mm((x * 2).view(-1, 8)[1:], w)), x, w2)
    assert info["extern_list"] == ["mm", "mm_1"] and info["views"] == 0 and info["kernels"] == 2
    # one value read by two views: one kernel, its output seen by the second view through as_strided
    info = check(lambda x, w: (lambda y: (torch.mm(y.view(-1, 8), w), torch.mm(y.view(-1, 8)[1:], w)))(x * 2), x, w2)
    assert info["extern_list"] == ["mm", "getitem", "mm_1"] and info["kernels"] == 1


def test_views_pushed_down_through_pointwise_values():
    """A view of a pointwise value read only through views is applied to the value's loads (the heads
    of a linear's bias epilogue: one kernel reads the matmul's result permuted); a reader that sees the
    layout (as_strided, the graph's output) keeps the value materialized in eager's layout."""
    x, w, b = torch.randn(2, 16, 8), torch.randn(64, 8), torch.randn(64)
    f = lambda x, w, b: (F.linear(x, w, b).view(2, 16, 2, 32).transpose(1, 2) * 0.5).sum(-1)  # noqa: E731
    info = check(f, x, w, b)
    assert info["extern_list"] == ["linear"] and info["kernels"] == 1
    f = lambda x, w, b: torch.as_strided((F.linear(x, w, b) + 1)[:, 1:], (5,), (3,))  # noqa: E731
    check(f, x, w, b)
    f = lambda x, w, b: (F.linear(x, w, b) + 1).view(2, 16, 2, 32).transpose(1, 2)  # noqa: E731
    ref, out = f(x, w, b), ember.compile(f)(x, w, b)
    assert out.stride() == ref.stride()


def test_views_keep_eager_layout_and_storage_offset():
    """torch.as_strided reads the argument's raw layout and storage offset: the extern call must get
    exactly eager's tensor (sliced input, a view at an offset, contiguous() of a transposed value)."""
    big = torch.randn(12, 6)
    x = big[2:]  # an input with a storage offset
    info = check(lambda x: (torch.as_strided(x[1:].t(), (3, 2), (1, 6)), torch.as_strided(x.t().contiguous(), (4,), (2,)),
                            torch.as_strided((x + 1)[2:, 1:], (5,), (3,))), x)
    assert info["externs"] == 3 + 2  # the two views made by as_strided; contiguous() is a kernel's copy


def test_identity_views_are_the_value_itself():
    x, w = torch.randn(4, 6), torch.randn(5, 6)
    info = check(lambda x, w: torch.mm(F.dropout(x * 2, 0.3, False).contiguous().to(torch.float32), w.t()), x, w)
    assert info["extern_list"] == ["t", "mm"]
    info = check(lambda x, w: torch.mm(x.to("cpu").contiguous(), w.t()) + x.to(w).float().sum(), x, w)
    assert info["extern_list"] == ["t", "mm"]


def test_returned_views_and_self_aliases_stay_torch_ops():
    x = torch.randn(4, 6)
    c = ember.compile(lambda x: (x.to(torch.float32), x.float(), x.t(), x.contiguous()), backend="ember")
    out = c(x)
    assert out[0] is x and out[1] is x and out[3] is x  # torch returns self
    assert out[2].data_ptr() == x.data_ptr()
    # an extern result that aliases its argument aliases the base (the view is made on its storage)
    a = ember.compile(lambda x: torch.ops.aten.alias(x[1:].t()), backend="ember")(x)
    assert a.data_ptr() == x[1:].data_ptr() and a.stride() == (1, 6)


def test_extern_result_with_another_layout_than_its_meta():
    """A view of an extern result is made from it in the layout its meta promised: the result is
    copied into that layout first when torch chose another (as kernels do)."""
    lib = torch.library.Library("embertest_externs", "FRAGMENT")
    lib.define("colmajor(Tensor x) -> Tensor")
    lib.impl("colmajor", lambda x: (x * 2).t().contiguous().t(), "CPU")
    lib.impl("colmajor", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format), "Meta")
    x, w = torch.randn(4, 6), torch.randn(3, 6)
    info = check(lambda x, w: torch.mm(torch.ops.embertest_externs.colmajor(x)[1:].reshape(6, 3), w[:, :3].t()), x, w)
    assert info["views"] == 2


def test_attention_output_layout_is_the_kernels():
    """Attention over head views of a projection: the CPU flash kernel writes (B, S, H, D) memory,
    which the meta device's math kernel does not (contiguous (B, H, S, D)). Its meta comes from fake
    tensors (em_ir_layout_needs_fake), so the heads merged back for the output projection are a
    view, not a copy kernel (and no copy into the meta's layout at run time)."""
    x, w, w2 = torch.randn(2, 16, 64), torch.randn(192, 64), torch.randn(64, 64)

    def f(x, w, w2):
        q, k, v = F.linear(x, w).view(2, 16, 3, 4, 16).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return F.linear(o.transpose(1, 2).reshape(2, 16, 64), w2)
    info = check(f, x, w, w2)
    assert info["kernels"] == 0, info["kernel_list"]


def test_split_chunk_unbind_pieces_are_views():
    t = torch.randn(2, 4, 12)
    heads = lambda t: F.scaled_dot_product_attention(*[p.view(2, 4, 2, 2).transpose(1, 2) for p in t.split(4, dim=2)])  # noqa: E731
    info = check(heads, t)
    assert calls(info) == ["transpose", "transpose_1", "transpose_2", "scaled_dot_product_attention"]
    info = check(lambda t: tuple(p * 2 for p in t.split(5, -1)) + tuple(u + 1 for u in torch.cat(t.chunk(3, 1), 1).unbind(0)), t)
    assert info["externs"] == 0
    info = check(lambda t: torch.mm(t.split([3, 9], -1)[-1][0], torch.ones(9, 2)) + t.unbind(1)[2].sum(), t)
    assert info["extern_list"] == ["getitem_2", "mm"]
    info = check(lambda t: t.split(5, -1), t)  # returned: the torch op's views
    assert info["extern_list"][0] == "split"


# ---- a parameter's view is made once -----------------------------------------------------------

def test_view_of_a_parameter_is_made_once_and_follows_the_parameter():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 6))

        def forward(self, x):
            return x @ self.w.t(), torch.ops.aten.alias(self.w.t())

    m, x = M(), torch.randn(3, 6)
    c = ember.compile(m, backend="ember")
    outs = []
    with torch.no_grad():
        for i in range(4):
            got, ref = c(x), m(x)
            _same(got, ref)
            outs.append(got)
            if i == 1:
                m.w.mul_(2)  # in place: the view sees it
            if i == 2:
                m.w.data = torch.randn(5, 6)  # new storage: a new view
    assert outs[0][1] is not outs[1][1]  # an output holds the view: never handed out again
    assert outs[3][1].data_ptr() == m.w.data_ptr()
    info = ember.cache_info(c)[0]["ember"]
    assert info["views"] == 1 and info["input_views"] == 1


# ---- the attention-mask construction is kernels ------------------------------------------------

def test_attention_mask_from_int_ids_is_one_kernel():
    """Padding mask from token ids (comparisons, a constant, where, expand, to(dtype)) and a causal
    mask from aranges, added to attention scores: one kernel, no torch call besides the attention."""
    ids = torch.randint(0, 5, (2, 7))
    q = torch.randn(2, 2, 7, 4)

    def f(ids, q):
        pad = (ids != 0)[:, None, None, :].expand(2, 1, 7, 7)
        causal = torch.arange(7)[None, :] <= torch.arange(7)[:, None]
        keep = pad & causal & ids.new_ones((), dtype=torch.bool)
        bias = torch.where(keep, 0.0, -3.4028234663852886e38).to(torch.float32)
        scores = q @ q.transpose(-1, -2) + bias
        return torch.softmax(scores, -1) @ q

    info = check(f, ids, q)
    # the hand-written attention is one scaled_dot_product_attention (passes/em_pass_attention.c),
    # its float mask one kernel; two more give rows the mask leaves no key eager's NaN (a reduction
    # of mask == -inf over the keys, the fill after the attention)
    assert calls(info) == ["scaled_dot_product_attention"] and info["kernels"] == 3, (info["extern_list"], info["kernels"])
    m = lambda ids: (1.0 - (ids > 0)[:, None, None, :].to(torch.float32)) * -10000.0  # noqa: E731
    info = check(lambda ids, q: F.scaled_dot_product_attention(q, q, q, attn_mask=m(ids)), ids, q)
    assert calls(info) == ["scaled_dot_product_attention"]


# ---- new lowerings -------------------------------------------------------------------------------

def test_factories():
    x = torch.randn(4, 6)
    info = check(lambda x: (torch.ones(3, 4), torch.zeros((2,), dtype=torch.int64), torch.full((2, 3), 1.5),
                            x.new_ones(3), x.new_zeros((2, 2), dtype=torch.bool), x.new_full((3,), 7),
                            torch.ones_like(x), torch.full_like(x, -2.0, dtype=torch.float16), x + torch.ones(6),
                            torch.full((6,), 2.0, dtype=torch.int32) + x.int(), x.new_ones((), dtype=torch.bool) & (x > 0)), x)
    assert info["externs"] == 0
    info = check(lambda x: torch.full((3,), 0.1, dtype=torch.float16) + x[0, :3].half(), x)  # 0.1: not float-exact
    assert info["extern_list"] == ["full"]


def test_arange():
    x = torch.randn(4, 6)
    info = check(lambda x: (torch.arange(6), torch.arange(2, 10), torch.arange(10, 2, -3), torch.arange(5, dtype=torch.float32),
                            torch.arange(0, 12, 2, dtype=torch.int32), x + torch.arange(6),
                            torch.mm(x, torch.arange(12, dtype=torch.float32).view(6, 2))), x)
    assert info["extern_list"] == ["mm"]
    info = check(lambda x: torch.arange(0, 1, 0.25) + x[0, :4], x)  # fractional: torch computes it
    assert info["extern_list"] == ["arange"]


def test_bitwise_ops():
    i8 = torch.randint(-100, 100, (4, 5), dtype=torch.int8)
    u8 = torch.randint(0, 255, (4, 5), dtype=torch.uint8)
    i64 = torch.randint(-1000, 1000, (4, 5))
    b = torch.rand(4, 5) > 0.5
    info = check(lambda a, u, c, m: (a & u, a | 3, a ^ u, ~a, ~u, c & 255, ~c, m & (m | ~m), m ^ True,
                                     torch.bitwise_and(a, c), c | m, torch.bitwise_not(m)), i8, u8, i64, b)
    assert info["externs"] == 0


def test_diff():
    x, y, b = torch.randn(4, 6), torch.randint(-9, 9, (4, 5)), torch.rand(4, 5) > 0.5
    info = check(lambda x, y, b: (torch.diff(x), torch.diff(x, dim=0), torch.diff(x, prepend=x[:, :2], append=x[:, -1:]),
                                  torch.diff(y), torch.diff(b, dim=0), torch.diff(y, prepend=y[:, :1] - 1)), x, y, b)
    assert info["externs"] == 0
    info = check(lambda y: torch.diff(y, n=2), y)  # n > 1: torch's
    assert info["extern_list"] == ["diff"]


def test_attention_decomposed_in_inference():
    """F.multi_head_attention_forward (nn.TransformerEncoderLayer with the fast path off) is decomposed
    as for training (csrc/autograd): the in-projection's bias and the heads' permute are one kernel
    (contiguous() materializes, the q/k/v views are free), the out-projection's bias joins the
    residual + layer_norm kernel; values as eager's."""
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True).eval()
    x = torch.randn(2, 10, 32)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        f = ember.compile(layer)
        with torch.no_grad():
            ref = layer(x)
            torch.testing.assert_close(f(x), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(f(x), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    info = ember.cache_info(f)[0]["ember"]
    assert info["decomposed"] == ["multi_head_attention_forward"]
    # the (L, N, E) view of the input made contiguous for one in-projection GEMM (pass fold_mm: a
    # batched GEMM of the expanded weight before), in-projection bias + heads, out-projection bias +
    # residual + norm1, feed-forward bias + relu, bias + residual + norm2; the attention output's
    # permute is a view (the flash kernel writes (B, S, H, D) memory, which the fake-tensor meta
    # knows; it was a copy kernel before 2026-11-25)
    assert info["kernels"] == 5 and info["kernel_list"][0]["nodes"] == ["transpose"], info["kernel_list"]
    assert [e for e in info["extern_list"] if not e.startswith(("view", "transpose"))] == [
        "linear", "scaled_dot_product_attention", "linear_1", "linear_2", "linear_3"], info["extern_list"]


def test_safe_softmax_is_lowered():
    """aten._safe_softmax (the math attention kernel's softmax): rows of -inf give 0, as eager."""
    x = torch.randn(4, 8)
    x[1] = -float("inf")
    x[2, :3] = -float("inf")
    info = check(lambda x: torch.ops.aten._safe_softmax(x * 2, -1), x)
    assert info["extern_list"] == [] and info["kernels"] == 1
