"""The public API: ember.compile as a decorator and a function, on functions, bound methods and
modules; reset, disable, config, cache_info, explain, custom backends, fullgraph. Every compiled
result is compared with eager PyTorch on the same inputs (conftest.run_both / assert_same)."""
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import ember
from conftest import CountingBackend, assert_same, entries, kinds, run_both


def cos_cos(x, y):
    return torch.cos(torch.cos(x)) * y


def branchy(x):
    y = x * 2.0
    if x.sum() > 0:  # BRANCH-LINE
        y = y + 1.0
    return y


X, Y = torch.randn(4, 5), torch.randn(4, 5)


# ---- ember.compile forms ----

def test_decorator_without_arguments():
    @ember.compile
    def f(x, y):
        return torch.cos(torch.cos(x)) * y
    # the default backend, "ember": C kernels (libmvec's cosf: within assert_close's tolerance)
    assert_same(f(X, Y), torch.cos(torch.cos(X)) * Y, exact=False)
    assert kinds(f) == ["graph"] and entries(f)[0]["backend"] == "ember"
    assert ember.cache_info(f)[0]["ember"]["kernels"] == 1


def test_decorator_with_empty_arguments():
    @ember.compile()
    def f(x, y):
        return torch.sin(x) - y
    assert_same(f(X, Y), torch.sin(X) - Y, exact=False)
    assert kinds(f) == ["graph"]


def test_decorator_with_arguments():
    backend = CountingBackend()

    @ember.compile(backend=backend, fullgraph=True)
    def f(x, y):
        return torch.sin(x) - y
    assert_same(f(X, Y), torch.sin(X) - Y)
    assert backend.count == 1
    assert entries(f)[0]["kind"] == "graph"


def test_function_call_form_and_metadata():
    c = ember.compile(cos_cos)
    assert c is not cos_cos
    assert c.__name__ == "cos_cos" and c.__doc__ == cos_cos.__doc__
    run_both(cos_cos, [(X, Y), (X, Y)], compiled=c, exact=False)
    assert kinds(c) == ["graph"]
    # cache_info accepts the plain function too: the cache lives on the code object
    assert kinds(cos_cos) == ["graph"]
    assert entries(c)[0]["hits"] >= 1


def test_compiling_a_compiled_function_shares_its_cache():
    c1 = ember.compile(cos_cos)
    c1(X, Y)
    c2 = ember.compile(c1)
    assert_same(c2(X, Y), cos_cos(X, Y), exact=False)
    assert kinds(c2) == ["graph"]


def test_compile_rejects_non_callables():
    with pytest.raises(TypeError):
        ember.compile(42, backend="eager")
    with pytest.raises(TypeError):
        ember.compile("not a function", backend="eager")


# ---- bound methods ----

class Scaler:
    def __init__(self, k):
        self.k = k
        self.calls = 0

    def apply(self, x):
        return x * self.k + 1.0


def test_bound_method():
    s = Scaler(3.0)
    c = ember.compile(s.apply, backend="eager")
    assert_same(c(X), s.apply(X))
    assert_same(c(X), X * 3.0 + 1.0)
    # the method's object is read at call time: changing it changes the result like eager
    s.k = -2.0
    assert_same(c(X), X * -2.0 + 1.0)
    # another instance's bound method compiles the same code, separately guarded
    t = Scaler(0.5)
    ct = ember.compile(t.apply, backend="eager")
    assert_same(ct(X), X * 0.5 + 1.0)
    assert_same(c(X), X * -2.0 + 1.0)


def test_bound_method_of_module():
    lin = torch.nn.Linear(5, 3)
    c = ember.compile(lin.forward, backend="eager")
    assert_same(c(X), lin(X))


# ---- modules ----

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.lin = torch.nn.Linear(5, 5)
        self.register_buffer("offset", torch.full((5,), 0.25))

    def forward(self, x):
        y = F.relu(self.lin(x) * self.scale) + self.offset
        if self.training:
            return y * 2.0
        return y - 1.0


def test_module_shares_state_with_original():
    torch.manual_seed(0)
    m = Net()
    c = ember.compile(m, backend="eager")
    assert isinstance(c, Net) and isinstance(c, torch.nn.Module)
    assert c is not m
    assert c.scale is m.scale and c.lin.weight is m.lin.weight and c.offset is m.offset
    assert list(c.state_dict()) == list(m.state_dict())
    assert all(a is b for a, b in zip(c.parameters(), m.parameters()))
    assert [n for n, _ in c.named_buffers()] == [n for n, _ in m.named_buffers()]
    # an attribute set on one is seen by the other (shared __dict__)
    c.extra_attribute = 7
    assert m.extra_attribute == 7
    assert_same(c(X), m(X))


def test_module_results_equal_eager():
    torch.manual_seed(0)
    run_both(Net(), [(X,), (X,), (torch.randn(2, 5),)])


def test_module_train_eval_switch():
    torch.manual_seed(0)
    m = Net()
    c = ember.compile(m, backend="eager")
    assert_same(c(X), m.forward(X))
    c.eval()
    assert m.training is False
    assert_same(c(X), m.forward(X))
    assert_same(c(X), (F.relu(m.lin(X) * m.scale) + m.offset) - 1.0)
    m.train()  # switching the original switches the compiled one
    assert_same(c(X), (F.relu(m.lin(X) * m.scale) + m.offset) * 2.0)
    assert len(entries(c)) >= 2


def test_load_state_dict_through_compiled_module():
    torch.manual_seed(0)
    m = Net()
    c = ember.compile(m, backend="eager")
    c(X)
    torch.manual_seed(1)
    new = Net().state_dict()
    c.load_state_dict(new)
    for k, v in new.items():
        assert torch.equal(m.state_dict()[k], v), k
    assert_same(c(X), m.forward(X))
    # and the other way round
    m.load_state_dict({k: v + 1.0 for k, v in new.items()})
    assert_same(c(X), m.forward(X))


def test_module_with_forward_hook_runs_the_hook():
    torch.manual_seed(0)
    m = Net()
    c = ember.compile(m, backend="eager")
    seen = []
    h = m.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    assert_same(c(X), m.forward(X))
    assert seen == [X.shape]
    h.remove()
    assert_same(c(X), m.forward(X))
    assert seen == [X.shape]


# ---- reset ----

def test_reset_drops_entries():
    backend = CountingBackend()
    c = ember.compile(cos_cos, backend=backend)
    c(X, Y)
    c(X, Y)
    assert backend.count == 1 and len(entries(c)) == 1
    ember.reset()
    assert entries(c) == []
    assert_same(c(X, Y), cos_cos(X, Y))
    assert backend.count == 2


# ---- disable ----

def test_disable_context_manager_runs_eagerly():
    backend = CountingBackend()
    c = ember.compile(cos_cos, backend=backend)
    with ember.disable():
        assert_same(c(X, Y), cos_cos(X, Y))
    assert backend.count == 0 and entries(c) == []
    assert_same(c(X, Y), cos_cos(X, Y))
    assert backend.count == 1


@ember.disable
def _never_compiled(x):
    return torch.tanh(x) + 3.0


def test_disable_decorator():
    assert_same(_never_compiled(X), torch.tanh(X) + 3.0)

    def outer(x):
        return _never_compiled(x) * 2.0
    run_both(outer, [(X,), (X,)])
    # whatever outer does, the disabled function itself is never compiled
    assert entries(_never_compiled.__wrapped__) == []


def test_disable_nested_in_fallback_frame(no_graph_breaks):
    def inner(x):
        return torch.sin(x) + 1.0

    def outer(x):
        print("", end="")  # a fallback frame: the functions it calls are compiled by the hook
        return inner(x) * 2.0

    run_both(outer, [(X,)])
    assert kinds(inner) == ["graph"]
    ember.reset()
    c = ember.compile(outer, backend="eager")
    with ember.disable():
        assert_same(c(X), outer(X))
    assert entries(inner) == [] and entries(outer) == []


# ---- config ----

def test_config_defaults_and_attributes():
    assert ember.config.cache_size_limit == 8
    assert ember.config.max_inline_depth == 64
    assert ember.config.max_loop_iterations == 10000


def test_config_cache_size_limit():
    ember.config.cache_size_limit = 2
    backend = CountingBackend()

    def f(x):
        return x * 3.0 - 1.0
    c = ember.compile(f, backend=backend, dynamic=False)  # every size its own entry (no automatic dynamic)
    shapes = [(1,), (2,), (3,), (4,), (5,)]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for s in shapes + shapes:
            x = torch.randn(s)
            assert_same(c(x), f(x))
    assert len(entries(c)) <= 2
    assert backend.count == 2
    assert len([m for m in w if "cache_size_limit" in str(m.message)]) == 1


def test_config_max_loop_iterations_falls_back():
    ember.config.max_loop_iterations = 3

    def f(x):
        for _ in range(10):
            x = x + 1.0
        return x
    run_both(f, [(X,)])
    info = entries(f)
    assert info[0]["kind"] == "fallback" and info[0]["reason"] == "LOOP_LIMIT"


# ---- cache_info and explain ----

def test_cache_info_graph_entry():
    c = ember.compile(cos_cos)
    c(X, Y)
    (e,) = entries(c)
    assert e["kind"] == "graph" and e["backend"] == "ember"
    assert "cos" in e["graph"]
    assert any("L['x']" in g for g in e["guards"]) and any("L['y']" in g for g in e["guards"])
    assert e["reason"] is None and isinstance(e["output"], str)


def test_cache_info_fallback_entry(no_graph_breaks):
    c = ember.compile(branchy, backend="eager")
    assert_same(c(X), branchy(X))
    (e,) = entries(c)
    assert e["kind"] == "fallback" and e["reason"] == "DATA_DEPENDENT_BRANCH"
    assert e["reason_text"] == ember.FALLBACK_REASONS["DATA_DEPENDENT_BRANCH"]
    assert e["filename"] == __file__
    assert e["lineno"] == _line_of(branchy, "BRANCH-LINE")


def test_cache_info_of_module_and_unknown():
    torch.manual_seed(0)
    c = ember.compile(Net(), backend="eager")
    c(X)
    assert kinds(c) == ["graph"]
    with pytest.raises(TypeError):
        ember.cache_info(42)


def test_explain_returns_text(no_graph_breaks):
    text = ember.explain(branchy, X)
    assert isinstance(text, str) and "\n" in text
    assert "fallback" in text and "DATA_DEPENDENT_BRANCH" in text
    assert str(_line_of(branchy, "BRANCH-LINE")) in text
    text = ember.explain(cos_cos, X, Y)
    assert "graph" in text and "cos" in text


# ---- backends and fullgraph ----

def test_custom_backend_gets_graph_module_and_example_inputs():
    backend = CountingBackend()
    c = ember.compile(cos_cos, backend=backend)
    assert_same(c(X, Y), cos_cos(X, Y))
    assert backend.count == 1
    gm, ex = backend.calls[0]
    assert isinstance(gm, torch.fx.GraphModule)
    assert [n.op for n in gm.graph.nodes].count("placeholder") == len(ex) == 2
    assert all(isinstance(t, torch.Tensor) for t in ex)
    assert sorted(tuple(t.shape) for t in ex) == [(4, 5), (4, 5)]
    out = gm(*ex)
    assert isinstance(out, (tuple, list))
    assert_same(out[0], cos_cos(*ex))


def test_backend_returning_non_callable_raises():
    with pytest.raises(Exception):
        ember.compile(cos_cos, backend=lambda gm, ex: 42)(X, Y)


def test_fullgraph_raises_with_reason_and_line():
    c = ember.compile(branchy, fullgraph=True, backend="eager")
    with pytest.raises(ember.GraphBreakError) as ei:
        c(X)
    msg = str(ei.value)
    line = _line_of(branchy, "BRANCH-LINE")
    assert ember.FALLBACK_REASONS["DATA_DEPENDENT_BRANCH"] in msg or "DATA_DEPENDENT_BRANCH" in msg
    assert f":{line}" in msg and "test_api.py" in msg


def test_fullgraph_without_break_is_fine():
    run_both(cos_cos, [(X, Y)], compiled=ember.compile(cos_cos, fullgraph=True), exact=False)


def test_dynamic_and_options_arguments():
    # dynamic=None/False and options=None are accepted (torch.compile's signature)
    run_both(cos_cos, [(X, Y)], compiled=ember.compile(cos_cos, dynamic=False, options=None), exact=False)


def _line_of(fn, marker):
    src, start = inspect.getsourcelines(fn)
    for i, text in enumerate(src):
        if marker in text:
            return start + i
    raise AssertionError(marker)


def test_module_with_its_own_call_runs_that_call():
    """A class that overrides nn.Module.__call__ gets its __call__ compiled, not forward."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x)

        def __call__(self, x, scale=2.0):
            return super().__call__(x) * scale

    m = Scaled()
    c = ember.compile(m, backend="eager")
    x = torch.randn(2, 3)
    torch.testing.assert_close(c(x), m(x), rtol=0, atol=0)
    torch.testing.assert_close(c(x, scale=3.0), m(x, scale=3.0), rtol=0, atol=0)
    assert ember.cache_info(c), "the compiled __call__ has cache entries"


def test_decorated_forward_in_class_body():
    """`@ember.compile` on forward inside the class (the depyf tutorial's form): Module.__call__
    runs as usual and calls the compiled forward bound to each instance."""
    class Adder(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            self.i = i

        @ember.compile(backend="eager")
        def forward(self, x):
            return x + self.i

    a, b = Adder(1), Adder(2)
    x = torch.randn(4)
    for m, k in ((a, 1), (b, 2), (a, 1)):
        torch.testing.assert_close(m(x), x + k, rtol=0, atol=0)
    info = ember.cache_info(Adder.forward)
    assert [e["kind"] for e in info] == ["graph", "graph"], info
    assert sum(e["hits"] for e in info) >= 1


def test_many_graph_inputs():
    """An entry with more fetch slots than dispatch's stack buffer (64) takes the heap path."""
    def total(xs):
        s = xs[0]
        for x in xs[1:]:
            s = s + x
        return s

    c = ember.compile(total, backend="eager")
    xs = [torch.randn(2) for _ in range(80)]
    for _ in range(3):
        torch.testing.assert_close(c(xs), total(xs), rtol=0, atol=0)
    (entry,) = ember.cache_info(c)
    assert entry["kind"] == "graph" and entry["hits"] >= 2, entry


def test_a_torch_outside_the_tested_range_is_named():
    """Issue 43: torch 2.11 to 2.14 are tested (CI: 2.13; the whole suite: 2.14.1; the GPU machine:
    2.11); another release gets one RuntimeWarning at import naming the range, and ember still loads."""
    assert ember._untested_torch(torch.__version__) is None
    for v in ("2.11.0", "2.13.0+cpu", "2.14.1+cu130"):
        assert ember._untested_torch(v) is None
    for v in ("2.10.1", "2.15.0", "3.0.0a0+git1234"):
        msg = ember._untested_torch(v)
        assert msg and "tested with torch 2.11 to 2.14" in msg and v in msg
