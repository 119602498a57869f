"""The passes stage (csrc/passes/, issue 45): the graph rewrites before autograd and lowering run from
one list (em_passes.c), report the passes that changed the graph in cache_info (["ember"]["passes"]
for inference, ["autograd"]["passes"] for training), and ember.debug.dump writes the graph after each
of them. Every compiled result is compared with eager's."""
import os

import pytest
import torch
import torch.nn.functional as F

import ember
import ember.debug


@pytest.fixture(autouse=True)
def _fresh():
    ember.reset()
    yield
    ember.reset()


def conv_block(x, w):
    return torch.relu(F.conv2d(x, w, padding=1)) + 1


def inference_info(fn):
    (e,) = [e for e in ember.cache_info(fn) if e["kind"] == "graph"]
    return e["ember"]


def test_inference_passes_named_in_cache_info():
    x, w = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3)
    c = ember.compile(conv_block)
    with torch.no_grad():
        torch.testing.assert_close(c(x, w), conv_block(x, w))
    info = inference_info(c)
    assert info["passes"] == ["layout"] and info["channels_last"] == ["conv2d"], info.get("passes")
    # every pass of the inference list ran and was timed, lowering included
    assert set(info["pass_times"]) == {"attention", "decompose", "fold_mm", "layout", "pad_mm", "skinny_mm",
                                       "lower_codegen_load"}, info["pass_times"]
    assert "passes that changed the graph: layout" in str(ember.explain(c, x, w))


def test_no_pass_changes_a_plain_graph():
    c = ember.compile(lambda x: x.sin() * 2)
    x = torch.randn(5)
    torch.testing.assert_close(c(x), x.sin() * 2)
    info = inference_info(c)
    assert "passes" not in info and "decomposed" not in info and "channels_last" not in info


def test_layout_pass_honours_config():
    x, w = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3)
    old = ember.config.layout_optimization
    ember.config.layout_optimization = False
    try:
        c = ember.compile(conv_block)
        with torch.no_grad():
            torch.testing.assert_close(c(x, w), conv_block(x, w))
        assert "passes" not in inference_info(c)
    finally:
        ember.config.layout_optimization = old


def test_decompose_then_lower_in_inference():
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    torch.backends.mha.set_fastpath_enabled(False)  # F.multi_head_attention_forward, decomposed
    try:
        c = ember.compile(layer)
        with torch.no_grad():
            torch.testing.assert_close(c(x), layer(x), rtol=1e-5, atol=1e-5)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    info = ember.cache_info(c)[0]["ember"]
    assert info["passes"] == ["decompose", "fold_mm"] and info["decomposed"] == ["multi_head_attention_forward"], info
    # the in-projection of the (L, N, E) view of a batch_first input: one GEMM (below)
    assert len(info["folded"]) == 1 and "made contiguous" in info["folded"][0], info["folded"]


def test_training_passes_in_order():
    def f(x, w):
        h = x @ w
        h.relu_()  # an in-place update of an intermediate: functionalized
        return F.normalize(h, dim=-1).sum()  # decomposed (training graphs)

    x, w = torch.randn(6, 5), torch.randn(5, 4, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    c = ember.compile(f)
    c(x, w).backward()
    f(x, w2).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    a = e["autograd"]
    assert "fallback" not in a, a.get("fallback")
    assert a["passes"] == ["decompose", "functionalize"], a.get("passes")
    assert a["decomposed"] == ["normalize"] and a["functionalized"] == ["relu_"], a


def test_dump_writes_the_graph_after_each_pass(tmp_path):
    d = str(tmp_path / "dump")
    x, w = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3)
    with ember.debug.dump(d):
        c = ember.compile(conv_block)
        with torch.no_grad():
            torch.testing.assert_close(c(x, w), conv_block(x, w))
    files = [f for f in os.listdir(d) if f.endswith(".passes.txt")]
    assert len(files) == 1, sorted(os.listdir(d))
    text = open(os.path.join(d, files[0]), encoding="utf-8").read()
    assert "# after pass layout" in text and "contiguous" in text and "conv2d" in text
    # outside a dump, the graphs are not printed (compile time)
    ember.reset()
    c = ember.compile(conv_block)
    with torch.no_grad():
        c(x, w)
    assert "pass_graphs" not in inference_info(c)


class MatmulCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten matrix multiplies run under it, as (op name, input shapes)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "bmm", "addmm", "baddbmm"):
            self.calls.append((name, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def run_logged(fn, *args):
    with MatmulCalls() as log:
        out = fn(*args)
    return out, log.calls


@pytest.mark.parametrize("form", ["linear", "linear_no_bias", "matmul", "method", "operator"])
def test_fold_mm_runs_one_gemm_for_a_transposed_batch(form):
    """A linear / matmul of a transposed activation (3+ dims whose batch dims do not flatten) times
    a matrix: ATen would run a batched GEMM of the expanded weight (no tensor requires grad inside a
    compiled graph); pass fold_mm makes the input contiguous (written so by its kernel) and ATen runs
    one GEMM of all the rows, with the bias in the GEMM's epilogue or the consumer's kernel."""
    def f(x, w, b):
        h = x.transpose(0, 1) * 2
        if form == "linear":
            y = F.linear(h, w, b)
        elif form == "linear_no_bias":
            y = F.linear(h, w)
        elif form == "matmul":
            y = torch.matmul(h, w.t())
        elif form == "method":
            y = h.matmul(w.t())
        else:
            y = h @ w.t()
        return y.relu()

    x, w, b = torch.randn(4, 6, 8), torch.randn(5, 8), torch.randn(5)
    c = ember.compile(f)
    with torch.no_grad():
        c(x, w, b)
        out, calls = run_logged(c, x, w, b)
        ref, ref_calls = run_logged(f, x, w, b)
    torch.testing.assert_close(out, ref)
    assert out.stride() == ref.stride()
    assert [n for n, _ in ref_calls] == ["bmm"], ref_calls  # what eager does without grad
    assert calls and all(n in ("mm", "addmm") and shapes[0] == (24, 8) for n, shapes in calls), calls
    info = inference_info(c)
    assert "fold_mm" in info["passes"] and len(info["folded"]) == 1, info.get("passes")


def test_fold_mm_leaves_foldable_inputs_alone():
    def f(x, y, w):  # a contiguous batch, and a slice of the last dim (rows of stride 16 flatten)
        return F.linear(x, w) + torch.matmul(y[..., :8], w.t())

    x, y, w = torch.randn(2, 3, 8), torch.randn(2, 3, 16), torch.randn(5, 8)
    c = ember.compile(f)
    with torch.no_grad():
        torch.testing.assert_close(c(x, y, w), f(x, y, w))
    assert "fold_mm" not in inference_info(c).get("passes", []), inference_info(c).get("passes")


def test_fold_mm_in_training_multihead_attention():
    """nn.TransformerEncoderLayer(batch_first=True) trains through F.multi_head_attention_forward,
    whose in-projection multiplies the (L, N, E) view of the input: one GEMM in the forward, and
    gradients equal to eager's (whose own training path copies the input the same way)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref_layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(3, 7, 32)
    c = ember.compile(layer)
    c(x).square().mean().backward()
    for p in layer.parameters():
        p.grad = None
    out, calls = run_logged(lambda: c(x).square().mean().backward() or c(x))
    ref = ref_layer(x)
    ref.square().mean().backward()
    torch.testing.assert_close(out, ref)
    for (name, p), q in zip(layer.named_parameters(), ref_layer.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert calls and all(n != "bmm" for n, _ in calls), calls
    (e,) = [e for e in ember.cache_info(c) if e["kind"] == "graph"]
    a = e["autograd"]
    assert "fallback" not in a and "fold_mm" in a["passes"] and len(a["folded"]) == 1, (a.get("passes"), a.get("folded"))


def prenorm_block(x, r, w, b, wl):
    h = x + r  # the residual stream, returned as the next block's input
    return F.linear(F.layer_norm(h, (h.shape[-1],), w, b), wl), h


def _prenorm_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(4, 6, 32, dtype=dtype, requires_grad=True), torch.randn(4, 6, 32, dtype=dtype),
            torch.randn(32, dtype=dtype, requires_grad=True), torch.randn(32, dtype=dtype, requires_grad=True),
            (torch.randn(16, 32, dtype=dtype) / 32 ** 0.5).requires_grad_()]


def _train_both(backend, dtype=torch.float32):
    a, e = _prenorm_inputs(dtype), _prenorm_inputs(dtype)
    c = ember.compile(prenorm_block, backend=backend)
    oc, he = c(*a), prenorm_block(*e)
    gen = torch.Generator().manual_seed(1)
    cot = [torch.randn(o.shape, generator=gen).to(dtype) for o in he]
    torch.autograd.backward(oc, cot)
    torch.autograd.backward(he, cot)
    (entry,) = [x for x in ember.cache_info(c) if x["kind"] == "graph"]
    return oc, he, a, e, entry["autograd"]


@pytest.fixture
def decompose_layer_norm():
    old = ember.config.decompose_layer_norm
    yield
    ember.config.decompose_layer_norm = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_decomposed_for_the_code_generators(decompose_layer_norm, dtype):
    """ember.config.decompose_layer_norm True: a training graph of backend "ember" writes F.layer_norm
    as its pieces in float32 (mean, biased variance, rsqrt, affine; aten's kernel's arithmetic), and
    autograd differentiates them: values and gradients as eager's (float32: to rounding; bfloat16:
    the pieces chain in float32 and round once, eager rounds the norm's output once too)."""
    ember.config.decompose_layer_norm = True
    oc, oe, a, e, ag = _train_both("ember", dtype)
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for x, y in zip(oc, oe):
        torch.testing.assert_close(x, y, **tol)
    for x, y in zip(a, e):
        if y.requires_grad:
            torch.testing.assert_close(x.grad, y.grad, **tol)
    assert "fallback" not in ag and "layer_norm" in ag["decomposed"], ag.get("decomposed")
    assert "native_layer_norm" not in ag["joint"]


@pytest.mark.parametrize("setting,backend,decomposed", [(None, "ember", False), (False, "ember", False),
                                                        (True, "aot_eager", False)])
def test_layer_norm_kept_where_it_would_not_fuse(decompose_layer_norm, setting, backend, decomposed):
    """None (the default) decomposes for CUDA inputs only: on the CPU, and with the option off, aten's
    native_layer_norm stays (the C generator stores one output per row kernel); backend
    "aot_eager" runs the graph op by op, so it never decomposes (and stays bitwise eager's)."""
    ember.config.decompose_layer_norm = setting
    oc, oe, a, e, ag = _train_both(backend)
    for x, y in zip(oc, oe):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert ("layer_norm" in ag.get("decomposed", [])) == decomposed and "native_layer_norm" in ag["joint"]


def test_decomposed_layer_norm_forward_is_one_cuda_kernel(decompose_layer_norm, monkeypatch):
    """The CUDA generator's forward of a pre-norm block (the graph a CUDA device compiles, made on
    the CPU: EMBER_TEST_CUDA_SOURCE): the residual add, the norm, its saved statistics and the
    residual stream returned, all from one row kernel (row outputs, em_schedule.c), before the
    linear; aten's path was the add's kernel and native_layer_norm's."""
    monkeypatch.setenv("EMBER_TEST_CUDA_SOURCE", "1")
    ember.config.decompose_layer_norm = True
    *_, ag = _train_both("ember")
    fwd = ag["ember"]["forward"]["cuda_test"]["kernel_list"]
    assert len(fwd) == 1 and fwd[0]["kind"] == "reduction", fwd
