"""Backends: "eager" (graph replayed from C), custom callables (the torch.compile contract:
(gm: torch.fx.GraphModule, example_inputs) -> callable), "inductor" (slow: marked), unknown names,
and CUDA tensors where a GPU exists. Every backend's results are compared with eager PyTorch."""
import os
import shutil

import pytest
import torch

import ember
from conftest import CountingBackend, assert_same, entries, kinds, run_both


def pointwise(x, y):
    return torch.relu(x * y + torch.cos(x)) - 0.5


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).softmax(-1)


X, Y = torch.randn(4, 8), torch.randn(4, 8)


def test_eager_backend():
    c = run_both(pointwise, [(X, Y), (X, Y), (torch.randn(3), torch.randn(3))], backend="eager")
    info = entries(c)
    assert [e["kind"] for e in info] == ["graph", "graph"] and all(e["backend"] == "eager" for e in info)
    torch.manual_seed(0)
    run_both(Mlp(), [(X,), (X,)], backend="eager")


def test_list_backends_names_the_builtin_ones():
    names = ember.list_backends()
    assert "eager" in names and "inductor" in names


def test_custom_backend_called_once_per_entry(counting_backend):
    c = run_both(pointwise, [(X, Y)] * 3 + [(torch.randn(2), torch.randn(2))], backend=counting_backend)
    assert counting_backend.count == 2
    for gm, ex in counting_backend.calls:
        assert isinstance(gm, torch.fx.GraphModule)
        assert all(isinstance(t, torch.Tensor) for t in ex)
    assert tuple(counting_backend.calls[1][1][0].shape) == (2,)
    assert kinds(c) == ["graph", "graph"]


def test_custom_backend_module_parameters_are_inputs(counting_backend):
    torch.manual_seed(0)
    m = Mlp()
    run_both(m, [(X,)], backend=counting_backend)
    gm, ex = counting_backend.calls[0]
    shapes = sorted(tuple(t.shape) for t in ex)
    # the input and the four parameters reach the backend as example inputs or as gm attributes
    params = {tuple(p.shape) for p in m.parameters()}
    got = set(shapes) | {tuple(p.shape) for p in gm.parameters()} | {tuple(b.shape) for b in gm.buffers()}
    assert params <= got and (4, 8) in shapes


def test_custom_backend_result_is_used():
    """What the backend returns is what runs: a backend that changes the graph's result shows."""
    def doubling_backend(gm, example_inputs):
        def run(*args):
            return tuple(t * 2 for t in gm(*args))
        return run

    def f(x):
        return x + 1.0
    c = ember.compile(f, backend=doubling_backend)
    assert_same(c(X), (X + 1.0) * 2)


def test_custom_backend_not_called_for_fallback(counting_backend, no_graph_breaks):
    def f(x):
        if x.sum() > 0:
            return x * 2.0
        return x
    run_both(f, [(X,)], backend=counting_backend)
    assert counting_backend.count == 0 and kinds(f) == ["fallback"]


def test_backend_exception_propagates_or_falls_back():
    """A backend that raises: the error is not swallowed into a wrong answer."""
    def broken(gm, example_inputs):
        raise RuntimeError("backend exploded")
    c = ember.compile(pointwise, backend=broken)
    try:
        out = c(X, Y)
    except Exception as e:
        assert "backend exploded" in str(e) or "backend exploded" in str(e.__cause__)
    else:
        assert_same(out, pointwise(X, Y))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="no_such_backend"):
        ember.compile(pointwise, backend="no_such_backend")
    with pytest.raises(ValueError, match="eager"):  # the message lists the known ones
        ember.compile(pointwise, backend="no_such_backend")
    with pytest.raises(TypeError):
        ember.compile(pointwise, backend=42)


def test_fx_backend_if_registered():
    if "fx" not in ember.list_backends():
        pytest.skip("no 'fx' backend registered")
    run_both(pointwise, [(X, Y)], backend="fx")


def test_backends_do_not_share_entries(counting_backend):
    """One code object compiled for two backends keeps an entry per backend."""
    run_both(pointwise, [(X, Y)], backend="eager")
    run_both(pointwise, [(X, Y)], backend=counting_backend)
    assert counting_backend.count == 1
    assert sorted(str(e["backend"]) != "eager" for e in entries(pointwise)) == [False, True]


def _have_cxx():
    return shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_cxx(), reason="Inductor on CPU needs a C++ compiler")
def test_inductor_backend():
    # one function and one module: Inductor compiles take seconds each on 2 cores
    run_both(pointwise, [(X, Y), (X, Y)], backend="inductor")
    torch.manual_seed(0)
    run_both(Mlp(), [(X,)], backend="inductor")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


@cuda
def test_cuda_eager_backend():
    x, y = X.cuda(), Y.cuda()
    run_both(pointwise, [(x, y), (x, y), (X, Y)])
    torch.manual_seed(0)
    run_both(Mlp().cuda(), [(x,)])


@cuda
def test_cuda_device_change_recompiles(counting_backend):
    x, y = X.cpu(), Y.cpu()
    c = run_both(pointwise, [(x, y), (x.cuda(), y.cuda()), (x, y)], backend=counting_backend)
    assert counting_backend.count == 2
    assert len(entries(c)) == 2


@cuda
def test_cuda_mixed_devices_raise_like_eager():
    run_both(pointwise, [(X.cuda(), Y)])


@cuda
@pytest.mark.slow
def test_cuda_inductor():
    pytest.importorskip("triton")
    run_both(pointwise, [(X.cuda(), Y.cuda())], backend="inductor")
