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
    except RuntimeError as e:
        with pytest.raises(type(e)):
            c(q, k, v)
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
