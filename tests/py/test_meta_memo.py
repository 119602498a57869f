"""The meta-call memo (csrc/ir/em_ir_memo.c, ember.config.meta_memo): a traced graph's metadata is
the same with the memo off, with a cold memo and with a warm one, and compiled results are eager's.

Every test compares the recorded graphs (each node's sizes, strides, dtype, device) of one program
compiled three ways, and the hazards the key must tell apart: dtypes, Python scalar types, the
default dtype, layouts, in-place calls that keep or change their argument's metadata, tuple and
structseq results, views (never memoized)."""
import pytest
import torch
import torch.nn as nn

import ember
from ember import _C


@pytest.fixture(autouse=True)
def _memo_on():
    old = ember.config.meta_memo
    _C._meta_memo(True)
    yield
    ember.config.meta_memo = old
    _C._meta_memo(True)


def graphs_of(fn, *args):
    """fn compiled with a recording backend: (the result, each graph's [(name, shape, stride, dtype, device)])."""
    seen = []

    def record(gm, example_inputs):
        rows = []
        for n in gm.graph.nodes:
            m = n.meta.get("ember_meta")
            if isinstance(m, dict) and "shape" in m:
                rows.append((n.name, tuple(m["shape"]), tuple(m["stride"]), m["dtype"], str(m.get("device"))))
        seen.append(rows)
        return gm.forward

    ember.reset()
    out = ember.compile(fn, backend=record)(*args)
    return out, seen


def three_ways(fn, *args):
    """The graphs with the memo off, cold and warm; asserts they agree and the result is eager's."""
    ref = fn(*args)
    ember.config.meta_memo = False
    _, off = graphs_of(fn, *args)
    ember.config.meta_memo = True
    _C._meta_memo(True)
    _, cold = graphs_of(fn, *args)
    got, warm = graphs_of(fn, *args)
    assert off and off == cold == warm
    torch.testing.assert_close(got, ref)
    return off


class Block(nn.Module):  # torchvision's BasicBlock: in-place relu and +=
    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        y += x
        return self.relu(y)


def test_repeated_layers_hit_and_agree():
    torch.manual_seed(0)
    net = nn.Sequential(Block(8), Block(8), Block(8)).eval()
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        three_ways(net, x)
    info = _C._meta_memo()
    assert info["hits"] > 0 and info["entries"] > 0


def test_transformer_layer_agrees():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0).eval()
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        three_ways(enc, x)


def test_channels_last_and_contiguous_differ():
    def f(a, b):
        return torch.relu(a) * 2, torch.relu(b) * 2
    a = torch.randn(2, 3, 4, 5)
    b = a.to(memory_format=torch.channels_last)
    rows = three_ways(f, a, b)[0]
    strides = {r[2] for r in rows if r[0].startswith("relu")}
    assert strides == {a.stride(), b.stride()}


def test_scalar_types_and_dtypes_differ():
    def f(i, x):
        return i * 2, i * 2.0, i * True, x * 2, x.double() * 2
    rows = three_ways(f, torch.arange(6, dtype=torch.int32), torch.randn(6))[0]
    dtypes = [r[3] for r in rows if r[0].startswith("mul")]
    assert dtypes == [torch.int32, torch.float32, torch.int32, torch.float32, torch.float64]


def test_default_dtype_is_part_of_the_key():
    def f(i):
        return i * 1.5
    i = torch.arange(4)
    _, g32 = graphs_of(f, i)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out, g64 = graphs_of(f, i)
        assert out.dtype == torch.float64 == f(i).dtype
    finally:
        torch.set_default_dtype(old)
    assert g32[0][-1][3] == torch.float32 and g64[0][-1][3] == torch.float64


def test_in_place_calls():
    def keeps(x):
        y = x + 1
        y.add_(2)
        y.relu_()
        return y * 3

    def changes(x):
        y = x + 1
        y.unsqueeze_(0)  # in place, but the metadata changes: never memoized
        z = x + 1
        z.unsqueeze_(0)
        return y * 2, z.shape

    x = torch.randn(3, 4)
    three_ways(keeps, x)
    rows = three_ways(changes, x)[0]
    assert rows[-1][1] == (1, 3, 4)


def test_tuple_and_structseq_results():
    def f(x):
        v, m = torch.var_mean(x, 1)
        mx = torch.max(x, 1)
        return v + m, mx.values * 2, mx.indices + 1, torch.max(x, 0)[0]
    three_ways(f, torch.randn(5, 6))
    three_ways(f, torch.randn(5, 6))  # warm: the structseq is rebuilt as its own type


def test_views_are_not_memoized_but_agree():
    def f(x):
        a = x.view(4, 6).t()
        b = x.reshape(6, 4)[1:, ::2]
        return a * 2, b + 1, x.transpose(0, 1).contiguous()
    three_ways(f, torch.randn(2, 12))


def test_kept_across_reset_and_cleared_on_request():
    def f(x):
        return torch.sin(x) * torch.cos(x)
    x = torch.randn(8)
    graphs_of(f, x)
    n = _C._meta_memo()["entries"]
    assert n > 0
    ember.reset()
    assert _C._meta_memo()["entries"] == n
    before = _C._meta_memo(True)
    assert before["entries"] == n and _C._meta_memo()["entries"] == 0


def test_backend_ember_layout_pass_with_memo():
    """The channels_last layout pass re-infers metas through the memo: values and strides as eager."""
    torch.manual_seed(0)
    net = nn.Sequential(Block(8), Block(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)).eval()
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        ref = net(x)
        for _ in range(2):  # cold, then warm memo
            ember.reset()
            cf = ember.compile(net, backend="ember")
            out = cf(x)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            assert out.stride() == ref.stride()
        info = ember.cache_info(cf)[0]["ember"]
        assert info.get("channels_last"), info



def test_pass_factory_call_keeps_its_device_on_a_memo_hit():
    """A graph pass's factory call (the causal mask's torch.ones(L, S, dtype=bool, device=...) of a
    decomposed attention) runs on the real device; a memo hit rebuilds its result on meta, and the
    memo keeps the device it was made on (before, the second graph with the same mask had a node
    on the meta device and ran on the eager backend)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):  # two graphs, one mask: the second hits the memo
        q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=dtype) for _ in range(3))
        ember.reset()
        c = ember.compile(f)
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
            torch.testing.assert_close(c(q, k, v), f(q, k, v))
        (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
        assert e["ember"].get("decomposed") == ["scaled_dot_product_attention"] and "fallback" not in e["ember"], e["ember"]
