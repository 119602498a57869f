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
    assert set(info["pass_times"]) == {"attention", "decompose", "layout", "pad_mm", "skinny_mm", "lower_codegen_load"}, info["pass_times"]
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
    assert info["passes"] == ["decompose"] and info["decomposed"] == ["multi_head_attention_forward"], info


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
