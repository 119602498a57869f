"""Symbolic training regions (csrc/autograd "Symbolic sizes", docs/autograd.md): a training graph
that automatic dynamic (or dynamic=True) made symbolic compiles to one joint graph, partition and
pair of halves for every size, on backends "aot_eager" and "ember". Each test trains or
differentiates over several sizes against eager autograd (losses, gradients, updated parameters,
running statistics) and checks the entries: the first size static, then one symbolic region with
no fallback."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ember

BACKENDS = ["aot_eager", "ember"]


def entries(c):
    info = ember.cache_info(c)
    return info["entries"] if isinstance(info, dict) else info


def assert_one_symbolic_region(c, nsizes):
    """Two entries for nsizes sizes (newest first): the symbolic region of every size after the
    first, compiled (no fallback, both halves through the code generator with backend ember), and
    the static one of the first size."""
    es = entries(c)
    assert len(es) == 2, [e.get("dynamic") for e in es]
    sym, static = es
    assert sym["dynamic"] and any("automatic dynamic" in d for d in sym["dynamic"]), sym["dynamic"]
    assert static["dynamic"] == []
    for e in es:
        assert e["kind"] == "graph"
        assert "fallback" not in e["autograd"], e["autograd"].get("fallback")
        if "ember" in e["autograd"]:
            assert "fallback" not in e["autograd"]["ember"], e["autograd"]["ember"]
    assert nsizes > 2


def grads_over_sizes(f, backend, make_x, params, sizes=(3, 5, 7, 9), **compile_kw):
    """f(x, *params) compiled with backend; for each size, the gradients of its result with respect
    to params equal eager's. Returns the compiled function."""
    c = ember.compile(f, backend=backend, **compile_kw)
    for s in sizes:
        x = make_x(s)
        gc = torch.autograd.grad(c(x, *params), params)
        ge = torch.autograd.grad(f(x, *params), params)
        for a, e in zip(gc, ge):
            torch.testing.assert_close(a, e)
    return c


def train_steps(model, make_batch, sizes, backend, loss_fn, opt_cls=torch.optim.SGD, **opt_kw):
    """The same steps on model (compiled) and a copy (eager), each from the same RNG state (dropout
    draws eager's masks: ember.config.fallback_random, conftest): losses, gradients and parameters
    compared after every step; returns the compiled callable."""
    ref = copy.deepcopy(model)
    cm = ember.compile(model, backend=backend)
    opt, opt_r = opt_cls(model.parameters(), **opt_kw), opt_cls(ref.parameters(), **opt_kw)
    for n in sizes:
        x, t = make_batch(n)
        state = torch.get_rng_state()
        loss = loss_fn(cm(x), t)
        torch.set_rng_state(state)
        loss_r = loss_fn(ref(x), t)
        torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-5)
        loss.backward()
        loss_r.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} (size {n}): {m}")
        opt.step()
        opt_r.step()
        opt.zero_grad()
        opt_r.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for b, c in zip(model.buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)
    return cm


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp_over_batch_sizes(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    sizes = [4, 6, 8, 10, 13]
    cm = train_steps(model, lambda n: (torch.randn(n, 16), torch.randn(n, 4)), sizes, backend,
                     lambda y, t: F.mse_loss(y, t), lr=0.1)
    assert_one_symbolic_region(cm, len(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cnn_with_batch_norm_over_batch_sizes(backend):
    """BatchNorm in train mode (running statistics updated once per step, as eager), pooling,
    cross_entropy: the last, smaller batch of an epoch no longer compiles a region of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    sizes = [4, 6, 8, 5]
    cm = train_steps(model, lambda n: (torch.randn(n, 3, 8, 8), torch.randint(0, 5, (n,))), sizes, backend,
                     F.cross_entropy, lr=0.1, momentum=0.9)
    assert_one_symbolic_region(cm, len(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_transformer_encoder_layer_over_sequence_lengths(backend):
    """nn.TransformerEncoderLayer over varying sequence lengths: multi-head attention's
    decomposition reads the sequence length as a size node of the graph."""
    torch.manual_seed(0)
    # dropout draws eager's masks on the CPU (fallback_random); a CUDA region's dropout draws others
    # than eager's fused dropout kernel (docs/autograd.md)
    p = 0.1 if torch.empty(0).device.type == "cpu" else 0.0
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=p, batch_first=True)
    sizes = [5, 7, 9, 12]

    def loss_fn(y, t):
        return (y * t).sum() / y.shape[1]

    def batch(n):
        return torch.randn(2, n, 32), torch.randn(2, n, 32)

    # SGD: AdamW turns the key bias's gradient (zero but for rounding: softmax ignores it) into
    # lr-sized steps of either sign, which no tolerance compares
    cm = train_steps(model, batch, sizes, backend, loss_fn, lr=0.1, momentum=0.9)
    assert_one_symbolic_region(cm, len(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sizes_the_backward_reads_are_saved_as_ints(backend):
    """mean over a symbolic dim divides by a symbolic count, sum's gradient expands to a symbolic
    shape: those sizes are ints the forward computes (aten.sym_size.int, numel) and saves, not the
    tensors they are read from."""
    def f(x, w):
        h = (x @ w).relu()
        return h.mean(dim=0).sum() + h.sum(dim=1).square().mean()

    w = torch.randn(6, 5, requires_grad=True)
    c = ember.compile(f, backend=backend)
    for n in [3, 4, 7, 9]:
        x = torch.randn(n, 6, requires_grad=True)
        xe, we = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        gc = torch.autograd.grad(c(x, w), (x, w))
        ge = torch.autograd.grad(f(xe, we), (xe, we))
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b)
    assert_one_symbolic_region(c, 4)
    saved = dict(entries(c)[0]["autograd"]["saved"])
    ints = [k for k, v in saved.items() if v == 8 and ("sym_size" in k or "numel" in k or "floordiv" in k)]
    assert ints, saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_basic_indexing_of_symbolic_tensors(backend):
    """Static slices and None of a tensor with a symbolic dim (kept whole): slice_backward /
    squeeze with the symbolic sizes read from the input."""
    def f(x, w, b):
        h = x @ w
        a = h[:, :, :4] * h[..., 4:]
        z = (a * b[None, None, :4]).tanh()[:, None]
        return z.sum(dim=(1, 3)).mean()

    params = (torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True))
    c = grads_over_sizes(f, backend, lambda s: torch.randn(2, s, 6), params)
    assert_one_symbolic_region(c, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cat_along_a_symbolic_dim(backend):
    """cat's gradient narrows each piece's part out of the gradient: offsets and lengths along a
    symbolic dim are size ints of the forward (a running sum), as transformers' causal masks and
    caches concatenate along the sequence."""
    def f(x, w):
        h = x @ w
        return torch.cat([h, h[:, :2].sin(), h.tanh()], dim=1).square().mean()

    c = grads_over_sizes(f, backend, lambda s: torch.randn(2, s, 6), (torch.randn(6, 4, requires_grad=True),))
    assert_one_symbolic_region(c, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_region_split_around_an_op_without_a_rule(backend):
    """An op without a derivative rule (cummax) splits the symbolic region into symbolic steps and
    an eager-autograd step, as a static region is split (transformers' Llama with grouped-query
    attention: sdpa with enable_gqa); a value crossing steps is passed in the dense layout its
    symbolic meta has (here the transposed cummax values)."""
    def f(x, w):
        h = (x @ w).sin()
        m = torch.cummax(h.transpose(1, 2), dim=2).values.transpose(1, 2)
        return (m * h).tanh().sum()

    c = grads_over_sizes(f, backend, lambda s: torch.randn(2, s, 6), (torch.randn(6, 4, requires_grad=True),))
    assert_one_symbolic_region(c, 4)
    split = entries(c)[0]["autograd"]["split"]
    assert len(split) == 1 and "cummax" in split[0], split


@pytest.mark.parametrize("backend", BACKENDS)
def test_symbolic_int_argument_read_by_the_backward(backend):
    """An int argument automatic dynamic made a graph input (a symbolic int): mul's gradient reads
    it, so the backward gets it as a saved int."""
    def f(x, w, k):
        return ((x @ w) * k).sin().sum()

    w = torch.randn(4, 3, requires_grad=True)
    c = ember.compile(f, backend=backend)
    for k in [2, 3, 5, 7]:
        x = torch.randn(5, 4)
        g1, = torch.autograd.grad(c(x, w, k), (w,))
        g2, = torch.autograd.grad(f(x, w, k), (w,))
        torch.testing.assert_close(g1, g2)
    es = entries(c)
    assert len(es) == 2 and "fallback" not in es[0]["autograd"], es[0]["autograd"].get("fallback")
    assert any("L['k']" in d for d in es[0]["dynamic"]), es[0]["dynamic"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rule_that_reads_sizes_keeps_eager_autograd_under_dynamic_true(backend):
    """group_norm's native backward takes N, C and HxW as numbers: under dynamic=True the region
    keeps eager autograd for every size (one entry, the reason recorded), never a gradient computed
    for the first size's numbers."""
    def f(x, w):
        return F.group_norm(x * w, 2).square().sum()

    # (no size equal to another dim's: duck shaping would tie them)
    c = grads_over_sizes(f, backend, lambda n: torch.randn(n, 4, 6), (torch.randn(4, 6, requires_grad=True),),
                         sizes=(3, 5, 7), dynamic=True)
    es = entries(c)
    assert len(es) == 1
    assert "symbolic sizes" in es[0]["autograd"]["fallback"] and "group_norm" in es[0]["autograd"]["fallback"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_call_of_a_symbolic_training_function(backend):
    """The same compiled function under torch.no_grad after symbolic training calls: the
    forward-only entry (the guard on grad mode), values equal to eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    cm = ember.compile(model, backend=backend)
    for n in [3, 5, 7]:
        cm(torch.randn(n, 8)).sum().backward()
    with torch.no_grad():
        for n in [4, 6]:
            x = torch.randn(n, 8)
            y = cm(x)
            assert not y.requires_grad
            torch.testing.assert_close(y, model(x))
