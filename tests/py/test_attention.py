"""The attention pass (csrc/passes/em_pass_attention.c, issue 40): a scaled_dot_product_attention mask
proven True everywhere (transformers' mask of an unpadded batch under a compiler, built from index
comparisons) is dropped, so that the fused kernel eager runs for unmasked attention runs; masks that
are not provably True, and calls where eager raises, are left as they are. Every result is compared
with eager's (values, gradients, errors)."""
import pytest
import torch
import torch.nn.functional as F

import ember


@pytest.fixture(autouse=True)
def _fresh():
    ember.reset()
    yield
    ember.reset()


def graph_info(fn, key="ember"):
    (e,) = [e for e in ember.cache_info(fn) if e["kind"] == "graph"]
    return e[key]


def qkv(b=2, h=4, l=16, s=16, d=8, grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, n, d, generator=g).requires_grad_(grad) for n in (l, s, s)]


def bert_mask(q, k):
    """transformers' sdpa_mask for an unpadded batch under a compiler (BERT, transformers 5.17):
    `(arange(L) + 0)[None, None, :, None] >= 0` expanded to (B, 1, L, S)."""
    L, S = q.shape[-2], k.shape[-2]
    m = (torch.arange(L) + 0)[None, None, :, None] >= 0
    return m.expand(q.shape[0], -1, L, S)


def sdpa_bert(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bert_mask(q, k))


def sdpa_and_of_ranges(q, k, v):
    L, S = q.shape[-2], k.shape[-2]
    kv = torch.arange(S)[None, :]
    qi = torch.arange(2, L + 2)[:, None]
    m = (kv < S) & (qi > 1) & torch.logical_not(kv - 1 >= S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


@pytest.mark.parametrize("fn", [sdpa_bert, sdpa_and_of_ranges], ids=["bert", "and_of_ranges"])
def test_true_mask_dropped(fn):
    q, k, v = qkv()
    c = ember.compile(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(q, k, v), fn(q, k, v))
    info = graph_info(c)
    assert "attention" in info["passes"], info.get("passes")
    assert info["attention"] == ["scaled_dot_product_attention: mask True everywhere, dropped"], info["attention"]


def test_true_mask_dropped_in_training():
    q, k, v = qkv(grad=True)
    c = ember.compile(sdpa_bert)
    out = c(q, k, v)
    out.sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    sdpa_bert(q, k, v).sum().backward()
    torch.testing.assert_close(out, sdpa_bert(q, k, v))
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)
    info = graph_info(c, "autograd")
    assert "fallback" not in info and "attention" in info["passes"], info.get("passes")


def mask_from_input(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m > 0)


def mask_not_all_true(q, k, v):
    L, S = q.shape[-2], k.shape[-2]
    m = torch.arange(S)[None, :] >= 1  # key 0 masked out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(L, S))


def mask_float_zeros(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(q.shape[-2], k.shape[-2]))


def mask_tril(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril())


@pytest.mark.parametrize("fn", [mask_not_all_true, mask_float_zeros, mask_tril], ids=["not_all_true", "float", "tril"])
def test_other_masks_kept(fn):
    q, k, v = qkv()
    c = ember.compile(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(q, k, v), fn(q, k, v))
    assert "attention" not in graph_info(c).get("passes", []), graph_info(c).get("attention")


def test_mask_from_an_input_kept():
    q, k, v = qkv()
    m = torch.randn(16, 16)
    c = ember.compile(mask_from_input)
    with torch.no_grad():
        torch.testing.assert_close(c(q, k, v, m), mask_from_input(q, k, v, m))
    assert "attention" not in graph_info(c).get("passes", [])


def causal_with_true_mask(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bert_mask(q, k), is_causal=True)


def test_mask_with_is_causal_kept():
    """A mask with is_causal=True (an error in some of torch's kernels, and a question of which of
    the two applies): the call keeps its mask, and gives what eager gives."""
    q, k, v = qkv()
    c = ember.compile(causal_with_true_mask)
    try:
        want = causal_with_true_mask(q, k, v)
    except RuntimeError as e:  # torch 2.14 raises here: the compiled call raises eager's error
        with pytest.raises(type(e)):
            c(q, k, v)
        assert all("attention" not in (e.get("ember") or {}).get("passes", []) for e in ember.cache_info(c))
    else:
        torch.testing.assert_close(c(q, k, v), want)
        assert "attention" not in graph_info(c).get("passes", [])


def true_mask_wrong_shape(q, k, v):
    m = torch.arange(5)[None, :] >= 0  # (1, 5): does not broadcast to (L, S) = (16, 16)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_mask_that_does_not_broadcast_raises_as_eager():
    """Dropping a mask that does not broadcast to the scores would hide eager's error: the call
    keeps its mask and raises as eager does."""
    q, k, v = qkv()
    with pytest.raises(RuntimeError) as want:
        true_mask_wrong_shape(q, k, v)
    with pytest.raises(RuntimeError) as got:
        ember.compile(true_mask_wrong_shape)(q, k, v)
    assert type(got.value) is type(want.value)


# ---- hand-written attention -> scaled_dot_product_attention
import math  # noqa: E402


def hf_eager(q, k, v, mask):
    """transformers' eager_attention_forward (Llama, BERT, ViT with attn_implementation="eager")."""
    w = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5)
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.1, training=False)
    return torch.matmul(w, v)


def gpt2_eager(q, k, v, mask):
    """transformers' GPT-2 eager_attention_forward: the cast back is .type(value.dtype)."""
    w = torch.matmul(q, k.transpose(-1, -2)) * q.size(-1) ** -0.5
    w = F.softmax(w + mask, dim=-1).type(v.dtype)
    return torch.matmul(F.dropout(w, p=0.1, training=False), v)


def divided(q, k, v):
    """GPT-2's _attn: scores divided by sqrt(d) (a 0-d torch.full)."""
    w = torch.matmul(q, k.transpose(-1, -2))
    w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
    return torch.matmul(w.softmax(dim=-1), v)


def nanogpt(q, k, v, bias):
    """nanoGPT's CausalSelfAttention without flash: masked_fill of the causal mask with -inf."""
    L = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :L, :L] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    return att @ v


def scale_on_q(q, k, v):
    return torch.softmax((q * 0.25) @ k.permute(0, 1, 3, 2), -1) @ v


def no_scale_bmm(q, k, v):
    return torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), v)


def _hand_cases(dtype):
    q, k, v = (t.to(dtype) for t in qkv(l=12, s=16))
    mask = torch.randn(2, 1, 12, 16).to(dtype)
    bias = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    q16, k16, v16 = (t.to(dtype) for t in qkv(l=16, s=16))
    return [("hf_eager", hf_eager, (q, k, v, mask)), ("divided", divided, (q, k, v)), ("nanogpt", nanogpt, (q16, k16, v16, bias)),
            ("scale_on_q", scale_on_q, (q, k, v)), ("no_scale_bmm", no_scale_bmm, (q[0], k[0], v[0])),
            ("gpt2_eager", gpt2_eager, (q, k, v, mask))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(6), ids=["hf_eager", "divided", "nanogpt", "scale_on_q", "no_scale_bmm", "gpt2_eager"])
def test_hand_written_attention_becomes_sdpa(case, dtype):
    name, fn, args = _hand_cases(dtype)[case]
    c = ember.compile(fn)
    with torch.no_grad():
        got, want = c(*args), fn(*args)
        if dtype == torch.bfloat16:
            # the fused kernel and the hand-written ops round differently (the latter rounds the
            # scores to bf16 before the softmax): both against float32's answer, ember's error at
            # most about eager's (which CPU kernel runs, and so the last bits, differs by host)
            ref = fn(*(a.float() for a in args))
            err_got, err_want = (got.float() - ref).abs().max(), (want.float() - ref).abs().max()
            assert err_got <= 2 * err_want + 1e-2, (err_got, err_want)
        else:
            torch.testing.assert_close(got, want)
    info = graph_info(c)
    assert "attention" in info["passes"], info.get("passes")
    (what,) = info["attention"]
    assert "as scaled_dot_product_attention" in what, what
    ops = info["extern_list"]
    if info.get("decomposed"):  # 3-d fp32 on the CPU: eager's SDPA runs its math kernel, decomposed again
        assert info["decomposed"] == ["scaled_dot_product_attention"] and name == "no_scale_bmm", info["decomposed"]
    else:
        # the call, or (an inference graph) the kernel op it runs, called directly
        kernel_ops = info.get("sdpa_kernel_ops", {})
        assert ("scaled_dot_product_attention" in ops) != (list(kernel_ops) == ["scaled_dot_product_attention"]), (ops, kernel_ops)
        assert not any(o.startswith(("matmul", "bmm")) for o in ops), ops


def test_hand_written_attention_in_training():
    q, k, v = qkv(l=12, s=16, grad=True)
    mask = torch.randn(2, 1, 12, 16)
    c = ember.compile(hf_eager)
    out = c(q, k, v, mask)
    out.square().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = hf_eager(q, k, v, mask)
    want.square().sum().backward()
    torch.testing.assert_close(out, want)
    for a, t in zip(got, (q, k, v)):
        torch.testing.assert_close(a, t.grad)
    info = graph_info(c, "autograd")
    assert "fallback" not in info and "attention" in info["passes"], info.get("passes")


def weights_returned(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * 0.3, -1)
    return w @ v, w  # the attention weights are an output: not rewritten


def dropout_drawn(q, k, v):
    return F.dropout(torch.softmax(q @ k.transpose(-2, -1), -1), 0.5, training=True) @ v


def softmax_other_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), -2) @ v


def mask_promotes(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) + torch.zeros(16, 16, dtype=torch.float64), -1).float() @ v


def not_transposed(q, k, v):
    return torch.softmax(q @ k, -1) @ v  # (L, E) @ (S=E, E): a product, not attention


@pytest.mark.parametrize("fn", [weights_returned, softmax_other_dim, mask_promotes, not_transposed],
                         ids=["weights_returned", "softmax_dim", "mask_promotes", "not_transposed"])
def test_other_forms_not_rewritten(fn):
    q, k, v = qkv(l=16, s=16, d=16)
    c = ember.compile(fn)
    with torch.no_grad():
        torch.testing.assert_close(c(q, k, v), fn(q, k, v))
    assert "attention" not in graph_info(c).get("passes", [])


def test_dropout_that_draws_not_rewritten():
    q, k, v = qkv()
    torch.manual_seed(0)
    c = ember.compile(dropout_drawn)
    with torch.no_grad():
        c(q, k, v)
    assert "attention" not in graph_info(c).get("passes", [])


def fully_masked_rows(q, k, v, m):
    return torch.softmax((q @ k.transpose(-2, -1)).masked_fill(m, float("-inf")), -1) @ v


def fully_masked_rows_additive(q, k, v, bias):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + bias, -1) @ v


def test_rows_masked_everywhere_are_nan_as_eager():
    """A query row whose mask leaves no key: eager's softmax over -inf alone gives NaN, the fused
    kernels 0; the rewritten attention gives eager's NaN rows and eager's values elsewhere."""
    q, k, v = qkv(l=6, s=6)
    m = torch.zeros(6, 6, dtype=torch.bool)
    m[2] = True
    bias = torch.zeros(6, 6).masked_fill(m, float("-inf"))
    for fn, extra in ((fully_masked_rows, m), (fully_masked_rows_additive, bias)):
        ember.reset()
        c = ember.compile(fn)
        with torch.no_grad():
            got, want = c(q, k, v, extra), fn(q, k, v, extra)
        assert torch.isnan(want[..., 2, :]).all()
        torch.testing.assert_close(got, want, equal_nan=True)
        assert "attention" in graph_info(c)["passes"]


def test_sdpa_kernel_context_is_a_guard():
    """A training graph picks the fused attention kernel it calls (and its backward op) when it is
    compiled; an sdpa_kernel context entered later must not find that stale choice: the backend
    flags are guarded (___sdp_flags), so the call under the context compiles again and follows it
    (the math kernel: decomposed), with eager's values and gradients under each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    c = ember.compile(f)
    for ctx in (None, SDPBackend.MATH):
        cm = sdpa_kernel(ctx) if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with cm:
            got_in, want_in = qkv(grad=True), qkv(grad=True)
            got, want = c(*got_in), f(*want_in)
            got.sum().backward()
            want.sum().backward()
        torch.testing.assert_close(got, want)
        for a, b in zip(got_in, want_in):
            torch.testing.assert_close(a.grad, b.grad)
    graphs = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert len(graphs) == 2
    flags = [next(g for g in e["guards"] if g.startswith("___sdp_flags")) for e in graphs]
    assert "flash=False" in flags[0] and "math=True" in flags[0], flags  # most recent first
    assert "flash=True" in flags[1], flags
    # the math-only entry decomposed the attention; the other calls a fused kernel's ops
    assert "decomposed" in graphs[0]["autograd"] and "decomposed" not in graphs[1]["autograd"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["float", "bool", "causal"])
def test_half_precision_math_kernel_is_decomposed_in_float32(dtype, mask):
    """Where eager runs scaled_dot_product_attention's math kernel on half / bfloat16 inputs (T5's
    float position bias on CUDA; an sdpa_kernel(MATH) context here), the kernel computes in float32
    and casts the result back (_scaled_dot_product_attention_math, attention.cpp): the decomposition
    does the same, so the inference graph's softmax is ember's kernel with eager's values, and a
    training graph gets eager's gradients through the decomposed ops."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(dtype) for t in qkv(l=12, s=16))
    g = torch.Generator().manual_seed(1)
    m = {"float": torch.randn(2, 1, 12, 16, generator=g).to(dtype), "bool": torch.rand(12, 16, generator=g) > 0.3,
         "causal": None}[mask]
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=mask == "causal") * 2
    c = ember.compile(f)
    with sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad():
            got, want = c(q, k, v), f(q, k, v)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        info = graph_info(c)
        assert info["decomposed"] == ["scaled_dot_product_attention"], info.get("decomposed")
        assert "fallback" not in info and "scaled_dot_product_attention" not in info["extern_list"], info
        # training: the decomposed ops' rules give eager's gradients
        ember.reset()
        got_in, want_in = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
        got, want = c(*got_in), f(*want_in)
        got.float().square().sum().backward()
        want.float().square().sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(got_in, want_in):
            torch.testing.assert_close(a.grad, b.grad)
        assert "decomposed" in [e for e in ember.cache_info(c) if e["kind"] == "graph"][0]["autograd"]


def test_math_kernel_reduction_flag_is_a_guard():
    """allow_fp16_bf16_reduction_math_sdp(True) lets the math kernel compute bfloat16 in bfloat16:
    the flag is part of ___sdp_flags, so a graph decomposed in float32 is not reused under it; the
    call under it compiles again and keeps the attention call (eager's kernel, eager's values)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(torch.bfloat16) for t in qkv(l=12, s=16))
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    c = ember.compile(f)
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            for allow in (False, True):
                torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allow)
                torch.testing.assert_close(c(q, k, v), f(q, k, v), rtol=0, atol=0)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)
    graphs = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    assert len(graphs) == 2
    assert "math_fp16_bf16_reduction=True" in " ".join(graphs[0]["guards"])
    assert "decomposed" not in graphs[0]["ember"] and graphs[1]["ember"]["decomposed"] == ["scaled_dot_product_attention"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_mask_copied_for_a_fused_kernel_on_cuda(dtype):
    """A float mask made by a permute (T5's relative position bias: (1, H, L, S), last stride H)
    sends eager's CUDA attention to the math kernel (the fused kernels take a unit-strided last
    dimension only). In half precision ember's inference graph copies the mask once and keeps one
    attention call per layer, which torch runs on a fused kernel; in float32 the math kernel is
    decomposed as before (faster there). Values within the dtype's tolerance of eager's; under
    sdpa_kernel(MATH) the math kernel is decomposed (the context is honoured)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 64, generator=g).to("cuda", dtype) for _ in range(3))
    table = torch.randn(64, 64, 4, generator=g).to("cuda", dtype)

    def f(q, k, v, table):
        bias = table.permute(2, 0, 1).unsqueeze(0)  # (1, H, L, S), strides (., 1, ., H)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return F.scaled_dot_product_attention(a, k, v, attn_mask=bias, scale=1.0)  # the same mask again

    assert int(torch._fused_sdp_choice(q, k, v, table.permute(2, 0, 1).unsqueeze(0), 0.0, False, scale=1.0)) == 0
    both = ["scaled_dot_product_attention", "scaled_dot_product_attention_1"]
    c = ember.compile(f)
    with torch.no_grad():
        got, want = c(q, k, v, table), f(q, k, v, table)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    info = graph_info(c)
    if dtype == torch.float32:
        assert info["decomposed"] == both and "sdpa_mask_copied" not in info, info
    else:
        assert "decomposed" not in info and info["sdpa_mask_copied"] == both, info
        # each a call of its kernel op, or where the recipe is not one ember takes, the call
        calls = [e for e in info["extern_list"] if e.startswith("scaled_dot")]
        assert sorted(calls + list(info.get("sdpa_kernel_ops", {}))) == both, info["extern_list"]
    # half precision: one copy of the mask (a kernel storing the permuted view's values) for both
    # calls; float32: none (the softmax kernels read the mask where it is)
    copies = [k["nodes"] for k in info["kernel_list"] if k["nodes"] == ["unsqueeze"]]
    assert len(copies) == (dtype != torch.float32), info["kernel_list"]
    ember.reset()
    c = ember.compile(f)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        torch.testing.assert_close(c(q, k, v, table), f(q, k, v, table), **tol)
        assert graph_info(c)["decomposed"] == both


def _kernel_op_cases(device, dtype):
    """(name, fn, args) of attention calls an inference graph makes calls of their kernel op: a bool
    mask two calls share, a float mask, is_causal with a scale, a call with dropout (stays a call)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 64, generator=g).to(device, dtype) for _ in range(3))
    causal = torch.ones(32, 32, dtype=torch.bool).tril().to(device)
    fmask = torch.randn(2, 1, 32, 32, generator=g).to(device, dtype)

    def shared_bool_mask(q, k, v, m):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        b = F.scaled_dot_product_attention(a * 0.5, k, v, attn_mask=m)
        return b.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def float_mask(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m) + 1

    def causal_scaled(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)

    def with_dropout(q, k, v):  # random draws: the call stays
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    return [("shared_bool_mask", shared_bool_mask, (q, k, v, causal)), ("float_mask", float_mask, (q, k, v, fmask)),
            ("causal_scaled", causal_scaled, (q, k, v)), ("with_dropout", with_dropout, (q, k, v))]


def _check_kernel_op_case(name, fn, args):
    c = ember.compile(fn)
    with torch.no_grad():
        if name == "with_dropout":
            torch.manual_seed(3)
            got = c(*args)
            torch.manual_seed(3)
            want = fn(*args)
        else:
            got, want = c(*args), fn(*args)
    info = graph_info(c)
    ops = info.get("sdpa_kernel_ops", {})
    calls = [e for e in info["extern_list"] if e.startswith("scaled_dot")]
    if name == "with_dropout":  # the call, or eager's math kernel decomposed (the CPU): eager's draws
        tol = dict(rtol=2e-2, atol=2e-2) if got.dtype != torch.float32 else {}
        torch.testing.assert_close(got, want, **tol)
        assert not ops and (calls == ["scaled_dot_product_attention"] or info.get("decomposed")), (ops, info["extern_list"])
        return info
    # the same kernel on the same inputs: the same bits; on the CPU eager's layout too (a CUDA
    # kernel's (B, L, H, E) memory may come back in the call's traced layout, as the call's did)
    assert torch.equal(got, want), (got - want).abs().max()
    assert got.device.type == "cuda" or got.stride() == want.stride(), (got.stride(), want.stride())
    n = 2 if name == "shared_bool_mask" else 1
    assert len(ops) == n and not calls and all(o.startswith("aten._scaled_dot_product_") for o in ops.values()), (ops, calls)
    if name == "shared_bool_mask":  # the bool mask converted by one kernel for both calls
        conv = [k["nodes"] for k in info["kernel_list"] if "masked_fill" in k["nodes"]]
        assert len(conv) == 1, info["kernel_list"]
    return info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(4), ids=["shared_bool_mask", "float_mask", "causal_scaled", "with_dropout"])
def test_attention_calls_its_kernel_op(case, dtype):
    """An inference graph calls the kernel op eager's scaled_dot_product_attention runs (here the
    CPU's flash kernel), with the mask converted as torch converts it, once per mask: the same
    bits as eager's call (csrc/passes/em_pass_decompose.c, dz_sdpa_kernel)."""
    _check_kernel_op_case(*_kernel_op_cases("cpu", dtype)[case])


def test_attention_kernel_op_recipe_is_recorded_from_torch():
    """The recipe is what torch does for these inputs (recorded), not a restatement: the CPU flash
    kernel's op, the bool mask's fill -inf in the query's dtype, an expanded mask's too; GQA's heads
    passed to the op as they are (the CPU kernel takes them); dropout, where torch runs the math
    kernel, gives no recipe, and why is kept."""
    from ember._autograd import _sdpa_recipes, sdpa_kernel_call
    q, k, v = qkv()
    m = torch.ones(16, 16, dtype=torch.bool).tril()
    op, args, kwargs, fill, expand = sdpa_kernel_call(q, k, v, m, 0.0, False, None, False, "cpu")
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(op) and args[:3] == ("@q", "@k", "@v"), (op, args)
    assert "@mask" in tuple(kwargs.values()) + args and fill == (float("-inf"), torch.float32) and expand is None
    assert sdpa_kernel_call(q, k, v, None, 0.0, True, 0.5, False, "cpu")[3:] == (None, None)
    # an expanded mask (strides 0, transformers' masks): its conversion is still read from torch
    expanded = m[None, None].expand(2, 1, 16, 16)
    assert sdpa_kernel_call(q, k, v, expanded, 0.0, False, None, False, "cpu")[3] == (float("-inf"), torch.float32)
    q8, k2 = torch.randn(2, 8, 16, 8), torch.randn(2, 2, 16, 8)
    op, args, _, _, _ = sdpa_kernel_call(q8, k2, k2, None, 0.0, False, None, True, "cpu")
    assert "flash_attention_for_cpu" in str(op) and args[:3] == ("@q", "@k", "@v"), (op, args)
    before = set(_sdpa_recipes)
    assert sdpa_kernel_call(q, k, v, None, 0.5, False, None, False, "cpu") is None
    (why,) = [_sdpa_recipes[key] for key in set(_sdpa_recipes) - before]
    assert isinstance(why, str) and "is not a kernel op" in why, why


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", range(4), ids=["shared_bool_mask", "float_mask", "causal_scaled", "with_dropout"])
def test_attention_calls_its_kernel_op_on_cuda(case, dtype):
    """As test_attention_calls_its_kernel_op, on CUDA: cuDNN, flash or memory-efficient attention
    called directly, the same bits as eager's call."""
    name, fn, args = _kernel_op_cases("cuda", dtype)[case]
    if dtype == torch.float32 and name != "with_dropout":
        # eager runs the math kernel for some float32 inputs: decomposed then, and not checked here
        from ember._autograd import sdpa_backend
        mask = args[3] if len(args) > 3 else None
        if sdpa_backend(*args[:3], mask, 0.0, name == "causal_scaled", None, False, "cuda", (False,) * 3) == "math":
            pytest.skip("eager runs the math kernel")
    _check_kernel_op_case(name, fn, args)
