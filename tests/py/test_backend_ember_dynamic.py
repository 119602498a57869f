"""backend="ember" with symbolic sizes (docs/backend_cpu.md, "Symbolic sizes"): one set of C
kernels serves every size an entry's guards admit. Differential against eager over sequences of
sizes (odd sizes, sizes 0 and 1, which are specialised, non-contiguous inputs), and the number of
libraries built (compiler calls plus disk-cache loads: a second size must not build another)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember
from conftest import on_threads
from ember import _C

pytestmark = pytest.mark.usefixtures("cpu_tensors")


@pytest.fixture(autouse=True)
def _reset():
    ember.reset()
    yield
    ember.reset()


def builds():
    """Libraries built so far: compiler calls and disk-cache loads (one per graph compiled)."""
    s = _C._cc_stats()
    return s["compiles"] + s["disk_hits"]


def run_sizes(f, make_args, sizes, dynamic=True, rtol=1e-5, atol=1e-5):
    """Compiles f with backend "ember", checks it against eager on make_args(n) for each n, and
    returns (compiled f, libraries built)."""
    b0 = builds()
    cf = ember.compile(f, backend="ember", dynamic=dynamic)
    for n in sizes:
        args = make_args(n)
        want = f(*args)
        got = cf(*args)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    return cf, builds() - b0


def ember_infos(cf):
    return [e["ember"] for e in ember.cache_info(cf) if "ember" in e]


def assert_compiled(cf):
    infos = ember_infos(cf)
    assert infos and all("fallback" not in i for i in infos), [i.get("fallback") for i in infos]
    return infos


def test_pointwise_chain_with_broadcasting_one_build():
    def f(x, y, z):
        return (torch.cos(x) * y + z).relu() - 0.5 * x

    cf, n = run_sizes(f, lambda n: (torch.randn(n, 7), torch.randn(7), torch.randn(n, 1)), [3, 5, 8, 33, 100, 1000])
    infos = assert_compiled(cf)
    assert n == 1 and len(infos) == 1
    assert infos[0]["kernels"] == 1
    assert "sv[" in infos[0]["source"]  # sizes are kernel arguments


def test_sizes_zero_and_one_are_specialised_entries():
    def f(x):
        return x.exp() * 2

    cf, n = run_sizes(f, lambda n: (torch.randn(n, 3),), [4, 0, 1, 6, 9])
    assert_compiled(cf)
    # s0 (4, 6, 9), 0 and 1 each an entry of their own
    assert len(ember.cache_info(cf)) == 3 and n == 3


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_row_ops_over_rows_and_row_lengths(fn):
    def f(x):
        if fn == "softmax":
            return torch.softmax(x, -1)
        if fn == "log_softmax":
            return F.log_softmax(x, dim=-1)
        if fn == "layer_norm":
            return F.layer_norm(x, x.shape[-1:])
        return F.rms_norm(x, x.shape[-1:])

    shapes = [(4, 8), (6, 13), (9, 3), (2, 3000), (17, 5)]
    cf, n = run_sizes(f, lambda s: (torch.randn(*s) * 3,), shapes)
    infos = assert_compiled(cf)
    assert n == 1 and len(infos) == 1
    assert infos[0]["kernels"] == 1  # still one fused kernel per row block


def test_layer_norm_module_over_batch_sizes_automatic_dynamic():
    m = nn.LayerNorm(16).eval()
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        m.bias.uniform_(-1, 1)
        cf, n = run_sizes(m, lambda b: (torch.randn(b, 5, 16),), [3, 4, 7, 2, 11], dynamic=None)
    assert_compiled(cf)
    assert n == 2  # static for the first size, then one dynamic graph for all others


def test_reductions():
    def f(x):
        return x.sum(0), x.amax(-1), x.mean(), x.var(1), x.std(0, correction=0), x.argmax(1), (x > 0).any(1), x.prod(1)

    cf, n = run_sizes(f, lambda s: (torch.randn(*s),), [(4, 5), (7, 3), (3, 9), (20, 2)])
    assert_compiled(cf)
    assert n == 1


def test_views():
    def f(x):
        a = x.view(x.size(0), -1) * 2
        b = x.permute(2, 0, 1).sin()
        c = x[:, 0] + x.select(1, 1)
        d = x.transpose(0, 1).reshape(-1, x.shape[2] * x.shape[0]).cos()
        return a.sum(1), b, c, d

    cf, n = run_sizes(f, lambda s: (torch.randn(*s),), [(4, 3, 5), (6, 2, 7), (9, 4, 3), (2, 5, 2)])
    assert_compiled(cf)
    assert n == 1


def test_expand_and_scalar_size_operands():
    def f(x, y):
        return x + y.expand(x.shape[0], -1) * x.shape[0] - x.shape[1]

    cf, n = run_sizes(f, lambda n: (torch.randn(n, n + 1), torch.randn(1, n + 1)), [3, 5, 9])
    infos = assert_compiled(cf)
    assert n == 1 and infos[0]["extern_list"] == []


def test_non_contiguous_inputs():
    def f(x, y):
        return (x * 2 + y).sum(-1)

    # x transposed (dense in another dim order, so it stays dynamic), y contiguous
    cf, n = run_sizes(f, lambda n: (torch.randn(n + 2, n).t(), torch.randn(n, n + 2)), [3, 5, 8])
    assert_compiled(cf)
    assert n == 1


def test_dtypes():
    def f(x):
        return (x.float().sigmoid() * 3).to(x.dtype) + x

    for dt in (torch.float64, torch.float16, torch.bfloat16, torch.int32):
        ember.reset()
        cf, n = run_sizes(f, lambda n: ((torch.randn(n, 4) * 4).to(dt),), [3, 6, 11], rtol=1e-2, atol=1e-2)
        assert_compiled(cf)
        assert n == 1, dt


def test_mark_dynamic():
    def f(x):
        return torch.softmax(x * 2, -1)

    b0 = builds()
    cf = ember.compile(f, backend="ember")
    for n in [4, 6, 9]:
        x = torch.randn(n, 10)
        ember.mark_dynamic(x, 0)
        torch.testing.assert_close(cf(x), f(x))
    assert_compiled(cf)
    assert builds() - b0 == 1 and len(ember.cache_info(cf)) == 1


def test_mlp_over_batch_sizes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    with torch.no_grad():
        cf, n = run_sizes(m, lambda b: (torch.randn(b, 16),), [2, 3, 8, 5, 64, 7], dynamic=None, rtol=1e-4, atol=1e-4)
    infos = assert_compiled(cf)
    assert n == 2 and len(infos) == 2
    assert infos[-1]["kernels"] >= 2  # bias + activation epilogues after the matmuls


def test_conv_net_over_batch_sizes():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
        cf, n = run_sizes(m, lambda b: (torch.randn(b, 3, 12, 12),), [2, 3, 5, 4, 9], dynamic=None, rtol=1e-4, atol=1e-4)
    infos = assert_compiled(cf)
    assert n == 2 and len(infos) == 2
    assert infos[-1]["kernels"] >= 3


def test_image_sizes_vary():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval()
    with torch.no_grad():
        cf, n = run_sizes(m, lambda s: (torch.randn(2, 3, s, s + 1),), [8, 10, 13, 6], dynamic=True, rtol=1e-4, atol=1e-4)
    assert_compiled(cf)
    assert n == 1


def test_broadcast_relation_guarded():
    # x and y dims of different symbols that broadcast: the trace guarded on it; sizes that break
    # the relation recompile (or raise as eager does), never a wrong result
    def f(x, y):
        return x * y

    cf = ember.compile(f, backend="ember", dynamic=True)
    for a, b in [(4, 4), (5, 5), (6, 1), (3, 7)]:
        x, y = torch.randn(a, 3), torch.randn(b, 3)
        try:
            want = f(x, y)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                cf(x, y)
            continue
        torch.testing.assert_close(cf(x, y), want)


def test_empty_rows_after_symbolic_compile():
    def f(x):
        return x.sum(-1), torch.softmax(x, 0)

    cf, n = run_sizes(f, lambda s: (torch.randn(*s),), [(3, 4), (5, 6), (7, 2)])
    assert_compiled(cf)
    x = torch.randn(0, 5)
    torch.testing.assert_close(cf(x)[0], f(x)[0])


def test_cache_info_and_explain_show_symbolic_kernels():
    cf = ember.compile(lambda x: torch.softmax(x, -1), backend="ember", dynamic=True)
    cf(torch.randn(3, 5))
    info = ember_infos(cf)[0]
    assert "ember_k0_meta" in info["source"]
    assert "domain [s0 |, s1]" in info["source"]


def test_training_graph_under_automatic_dynamic_is_compiled_once_for_all_sizes():
    """ember's AOT autograd compiles a symbolic training graph to one region: after the static
    entry of the first size, one symbolic entry (joint graph, partition and both halves through the
    code generator, sizes as kernel arguments and saved ints) serves every later size."""
    def f(x, w):
        return (torch.tanh(x @ w) * 2).sum()

    cf = ember.compile(f, backend="ember")
    for n in [3, 5, 7, 9]:
        x = torch.randn(n, 4)
        w1 = torch.randn(4, 3, requires_grad=True)
        w2 = w1.detach().clone().requires_grad_()
        f(x, w1).backward()
        cf(x, w2).backward()
        torch.testing.assert_close(w2.grad, w1.grad)
    entries = ember.cache_info(cf)
    assert [e["kind"] for e in entries] == ["graph"] * 2
    assert [bool(e["dynamic"]) for e in entries] == [True, False]  # newest first
    for e in entries:
        assert "fallback" not in e["autograd"], e["autograd"]
        assert set(e["autograd"]["ember"]) == {"forward", "backward"}


def test_training_graph_a_rule_of_which_reads_sizes_is_compiled_per_size():
    """A training graph whose derivative reads a symbolic size as a number (group_norm's native op
    takes N, C, HxW) is not sent to eager autograd: under dynamic=None the frame is traced again with
    concrete sizes and each size gets its own compiled forward/backward."""
    def f(x, w):
        return torch.nn.functional.group_norm(x * w, 2).square().sum()

    cf = ember.compile(f, backend="ember")
    for n in [3, 5, 7]:
        x = torch.randn(n, 4, 3)
        w1 = torch.randn(4, 3, requires_grad=True)
        w2 = w1.detach().clone().requires_grad_()
        f(x, w1).backward()
        cf(x, w2).backward()
        torch.testing.assert_close(w2.grad, w1.grad)
    entries = ember.cache_info(cf)
    assert [e["kind"] for e in entries] == ["graph"] * 3
    for e in entries[:2]:  # the sizes after the first: why not one symbolic region
        assert len(e["dynamic"]) == 1 and "traced per size" in e["dynamic"][0] and "group_norm" in e["dynamic"][0]
    for e in entries:
        assert "fallback" not in e["autograd"], e.get("autograd")


def test_horizontal_fusion_in_symbolic_graphs():
    """Independent kernels over the same symbolic domain are one loop nest (em_schedule.c,
    horizontal fusion: the same size expressions); the kernel allocates its other outputs per call
    from its meta function's layouts and returns them with the first."""
    def pointwise(x, y):
        return x.sin() * 2, x.cos() + y, (x * y).relu(), (x > y), (x - y).half()

    cf, n = run_sizes(pointwise, lambda n: (torch.randn(n, 33), torch.randn(n, 33)), [5, 7, 300, 2, 64])
    (info,) = assert_compiled(cf)
    assert n == 1 and info["kernels"] == 1 and info["kernel_list"][0]["outputs"] == 5, info["kernel_list"]
    body = info["source"].split("void ember_k0(")[1].split("\n}\n")[0]
    assert body.count("a0[") == 1 and body.count("a1[") == 1, body  # x and y each read once per element

    def reductions(x, y):  # per-row values, joined one by one through shared reads (x, then y)
        return x.var(-1), x.sum(-1), (x * y).argmax(-1), y.amin(-1)

    cf, n = run_sizes(reductions, lambda n: (torch.randn(n, n + 3), torch.randn(n, n + 3)), [4, 9, 2, 40])
    (info,) = assert_compiled(cf)
    assert n == 1 and [k["outputs"] for k in info["kernel_list"]] == [4], info["kernel_list"]

    # not joined: another domain (a slice), a transposed layout; read again by a later kernel and an extern
    def mixed(x, w):
        a = x.sigmoid()
        b = x[1:].exp()
        c = x.t() * 2
        return a, b, c, (a + x.tanh()) @ w, a.sum(0)

    cf, n = run_sizes(mixed, lambda n: (torch.randn(n, 6), torch.randn(6, 5)), [3, 8, 17])
    (info,) = assert_compiled(cf)
    assert n == 1 and all(k["outputs"] == 1 for k in info["kernel_list"] if {"getitem", "t"} & set(k["nodes"])), info

    # without a shared read and with a step between, a symbolic domain is joined when it is small
    # for every admitted size
    def no_shared_read(x, w, w2):  # x.exp() (read by a @ w, which runs between) and m.sigmoid(): both (s0, 4)
        m = x @ w2
        a = x.exp()
        return a, m.sigmoid(), a @ w

    for bound, kernels in ((None, 2), (100, 1)):  # unbounded: small for the example only
        ember.reset()
        cf = ember.compile(no_shared_read, backend="ember")
        for n in (3, 5, 100):
            x, w, w2 = torch.randn(n, 4), torch.randn(4, 4), torch.randn(4, 4)
            ember.mark_dynamic(x, 0, max=bound)
            torch.testing.assert_close(cf(x, w, w2), no_shared_read(x, w, w2))
        (info,) = assert_compiled(cf)
        assert info["kernels"] == kernels, (bound, info["kernel_list"])

    # nothing between them: joined whatever the sizes (no buffer lives longer)
    def adjacent(x, w):  # x.exp() and the matmul's m.sigmoid(), both made after the matmul
        m = x @ w
        return x.exp(), m.sigmoid()

    ember.reset()
    cf = ember.compile(adjacent, backend="ember")
    for n in (3, 5, 100):
        x, w = torch.randn(n, 4), torch.randn(4, 4)
        ember.mark_dynamic(x, 0)
        torch.testing.assert_close(cf(x, w), adjacent(x, w))
    (info,) = assert_compiled(cf)
    assert info["kernels"] == 1 and info["kernel_list"][0]["outputs"] == 2, info["kernel_list"]


def test_column_reductions_in_symbolic_graphs():
    """A reduction over outer dims with the kept dim contiguous takes the column form in a symbolic
    kernel too (em_codegen_c.c, column reductions): blocks, block count and thread decision follow
    this call's sizes; one library serves every size, partial last blocks included."""
    def f(x, b):
        return x.sum(0) + b, x.amax(0)

    cf, n = run_sizes(f, lambda n: (torch.randn(n, n + 61), torch.randn(n + 61)), [5, 7, 300, 2, 64], atol=1e-4)
    (info,) = assert_compiled(cf)
    assert n == 1 and "column form" in info["source"], info["source"][-1500:]

    def g(x):  # (B, T, C).mean(1): a pooled sequence, the reduced dim between two kept ones
        return x.mean(1)

    cf, n = run_sizes(g, lambda n: (torch.randn(3, n, 40),), [9, 2, 33])
    (info,) = assert_compiled(cf)
    assert n == 1 and "column form" in info["source"], info["source"][-1500:]


def heads(x, w):
    """A projection split into heads of 16, as attention does: (B, S, D) -> (B, H, S, 16)."""
    b, s, _ = x.shape
    return F.linear(x, w).view(b, s, -1, 16).transpose(1, 2)


def test_views_read_by_extern_calls_are_views_of_this_calls_sizes():
    """A view an extern call reads (the heads of a projection into matmul, slices of them) is one
    as_strided of the base with eager's sizes, strides and offset computed for each call's sizes,
    not a chain of torch view calls; the matmul's operands alias the projection as in eager."""
    def f(x, w):
        q = heads(x, w)
        return q @ q.transpose(-1, -2), q[:, :, 1:] @ q[:, :, :-1].transpose(-1, -2), q[:, :, 2:-1:2] * 3

    w = torch.randn(64, 64)
    cf, n = run_sizes(f, lambda s: (torch.randn(4, s, 64), w), [24, 20, 17, 9], dynamic=None)
    infos = assert_compiled(cf)
    sym = infos[0]  # newest first: the symbolic entry
    assert n == 2
    ops = [x.rstrip("_0123456789") for x in sym["extern_list"]]
    assert ops.count("linear") == 1 and ops.count("matmul") == 2, ops
    assert sym["views"] == len(ops) - 3  # every other torch call is one as_strided view
    assert "view" not in ops


def test_cat_and_stack_along_a_static_dim_in_symbolic_graphs():
    """cat / stack whose pieces have the same extent along the joined dim for every size (rotary
    embeddings' rotate_half: cat((-x2, x1), -1)) are masked loads in one kernel, not torch calls."""
    def f(x, w):
        q = heads(x, w)
        rot = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
        return q * 0.5 + rot * 2, torch.stack((x[:, 1:], x[:, :-1]), dim=1).sum(1)

    w = torch.randn(64, 64)
    cf, n = run_sizes(f, lambda s: (torch.randn(3, s, 64), w), [12, 7, 10, 33], dynamic=None)
    infos = assert_compiled(cf)
    assert n == 2
    assert [x for x in infos[0]["extern_list"] if x.startswith(("cat", "stack", "getitem"))] == []


def test_slices_of_symbolic_dims():
    """Slices of a symbolic dim (x[:, 1:], x[:, :-1], x[:, 2:-1:2], x[:, -3:], x[:, :5]) are loads
    whose offsets and lengths are size expressions, with torch's clamping of the bounds as Min/Max
    (x[:, :5] of 3 columns has 3), not torch calls."""
    def f(x):
        return x[:, 1:] - x[:, :-1], x[:, 2:-1:2].cos(), x[:, -3:] * 2, x[:, :5] + 1

    cf, n = run_sizes(f, lambda s: (torch.randn(4, s),), [9, 12, 17, 3, 4], dynamic=None)
    infos = assert_compiled(cf)
    assert n == 2 and len(infos) == 2
    assert infos[0]["extern_list"] == []


def test_symbolic_training_region_rotary_and_mean_lower_whole():
    """The backward of a symbolic training region: slice_backward of a static dim, mean over a static
    dim (its element count is a number, not a size int of the forward) and the gradient of a weight
    broadcast over leading dims (one sum, no squeeze) are all code-generated; gradients equal eager's."""
    def f(x, w, g):
        q = heads(x, w)
        rot = torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
        y = (q + rot) * g
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).sum()

    torch.manual_seed(0)
    w0, g0 = torch.randn(64, 64), torch.randn(16)
    cf = ember.compile(f, backend="ember")
    for s in [12, 9, 14, 5]:
        x = torch.randn(3, s, 64)
        w1, g1 = w0.clone().requires_grad_(), g0.clone().requires_grad_()
        w2, g2 = w0.clone().requires_grad_(), g0.clone().requires_grad_()
        f(x, w1, g1).backward()
        cf(x, w2, g2).backward()
        torch.testing.assert_close((w2.grad, g2.grad), (w1.grad, g1.grad), rtol=1e-4, atol=1e-4)
    e = ember.cache_info(cf)[0]
    assert e["dynamic"] and "fallback" not in e["autograd"], e.get("autograd")
    bw = [x.rstrip("_0123456789") for x in e["autograd"]["ember"]["backward"]["extern_list"]]
    assert not {"slice_backward", "truediv", "squeeze", "expand", "cat"} & set(bw), bw


def test_arange_of_a_symbolic_size():
    """arange whose end is a size (position ids, causal masks) reads the index table with a symbolic
    length: no torch call for integer results; a float arange stays torch's (its exactness bound
    needs the length)."""
    def f(x):
        n = x.shape[1]
        p = torch.arange(n)
        return x + p, (p[None, :] <= p[:, None]).float() * 2, torch.arange(2, n + 2, 3) * 2, torch.arange(
            n, dtype=torch.float32) * x[0]

    cf, n = run_sizes(f, lambda s: (torch.randn(3, s),), [5, 7, 9, 12, 2], dynamic=None)
    infos = assert_compiled(cf)
    assert n == 2 and len(infos) == 2
    ops = [x.rstrip("_0123456789") for x in infos[0]["extern_list"]]
    assert ops == ["arange"], ops  # the float one


def test_embedding_gathers_in_symbolic_graphs():
    """F.embedding of ids whose dims are sizes is a gather load of a table of fixed rows: token and
    position embeddings and the layer_norm of their sum are one kernel for every sequence length;
    an id outside the table raises eager's IndexError from that kernel, and nothing is written."""
    def f(ids, w, p):
        pos = torch.arange(ids.shape[1])
        return F.layer_norm(F.embedding(ids, w) + F.embedding(pos, p), (16,))

    w, p = torch.randn(50, 16), torch.randn(40, 16)
    cf, n = run_sizes(f, lambda s: (torch.randint(0, 50, (3, s)), w, p), [5, 7, 9, 12, 33], dynamic=None)
    infos = assert_compiled(cf)
    assert n == 2 and len(infos) == 2
    assert infos[0]["extern_list"] == [] and infos[0]["kernels"] == 1
    bad = torch.randint(0, 50, (3, 6))
    bad[1, 2] = 50
    with pytest.raises(IndexError, match="index out of range in self"):
        f(bad, w, p)
    with pytest.raises(IndexError, match="index out of range in self"):
        cf(bad, w, p)
    assert len(ember_infos(cf)) == 2  # the symbolic entry raised it


def test_split_rows_decided_per_call():
    """A symbolic reduction kernel splits a call's rows when they are few and long (docs/backend_cpu.md
    "Split rows") and keeps the row form otherwise, one library for all sizes; the same bits on 1
    thread as on 2."""
    def f(x):
        return x.sum(-1), x.abs().amax(-1), (x * x).mean(), x.var(-1)

    sizes = [1000, 131077, 70000, 3]
    cf, n = run_sizes(f, lambda s: (torch.randn(3, s, dtype=torch.float64),), sizes, rtol=1e-9, atol=1e-9)
    infos = assert_compiled(cf)
    assert n == 1 and "split rows: this call's rows" in infos[0]["source"]
    x = torch.randn(2, 131077)
    one, two = on_threads(cf, x)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    torch.testing.assert_close(two, f(x), rtol=1e-5, atol=1e-4)
