"""torch.autocast around and inside compiled code: dtypes, values and gradients as eager's.

Autocast casts at dispatch, for CPU/CUDA tensors only: the tracer infers metas on fake tensors of
the real device while autocast is on (csrc/trace/em_trace_call.c run_meta), and backend "ember"
hands such graphs to the eager backend (the reason in cache_info), where autocast casts each op as
in eager. Entries traced without autocast are separate (the guard reads autocast's state)."""
import pytest
import torch
import torch.nn.functional as F

import ember

BF16 = torch.bfloat16


def mlp(x, w1, w2):
    h = torch.relu(F.linear(x, w1))
    y = F.linear(h, w2).softmax(-1) * 2
    if y.dtype == BF16:  # a branch on a dtype autocast decides
        return y + 100
    return y


@pytest.mark.parametrize("backend", ["ember", "eager"])
def test_inference_under_autocast(backend):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(5, 16)
    cf = ember.compile(mlp, backend=backend)
    with torch.autocast("cpu", dtype=BF16):
        got, ref = cf(x, w1, w2), mlp(x, w1, w2)
    assert got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    plain = cf(x, w1, w2)  # without autocast: its own entry, float32
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, mlp(x, w1, w2))
    if backend == "ember":
        infos = ember.cache_info(mlp)
        reasons = [(e.get("ember") or {}).get("fallback") or "" for e in infos]
        assert any("torch.autocast is enabled" in r for r in reasons), reasons
        assert any((e.get("ember") or {}).get("kernels") for e in infos)  # the float32 entry has kernels


def test_autocast_inside_the_compiled_function():
    def f(x, w):
        with torch.autocast("cpu", dtype=BF16):
            y = F.linear(x, w)
        return y.float() * 2 + 1, y.dtype == BF16

    x, w = torch.randn(4, 8), torch.randn(3, 8)
    got, ref = ember.compile(f)(x, w), f(x, w)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    assert got[1] == ref[1]


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_training_step_under_autocast(backend):
    """An AMP-style step (bfloat16 autocast on CPU): loss and gradients as eager's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(m.state_dict())
    cm = ember.compile(m, backend=backend)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for model in (cm, ref):
        with torch.autocast("cpu", dtype=BF16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
