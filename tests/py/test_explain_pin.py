"""ember.explain's object (both call forms, its fields) and the guard pin (ember.pin / unpin /
pinned: UNSAFE by design, calls skip guard evaluation and run the most recently used entry)."""
import pytest
import torch

import ember
from conftest import assert_same


def broken(x, n):
    y = torch.cos(x) * n
    if y.sum() > 0:  # BREAK-LINE
        return y.sin()
    return y


BREAK_LINE = broken.__code__.co_firstlineno + 2
X = torch.rand(6) * 0.5  # cos(X) > 0: the sin branch


def scale(x, n):
    return torch.cos(x) * n


# ---- explain ----

def test_explain_call_form_fields():
    rep = ember.explain(broken)(X, 2)
    assert isinstance(rep, ember.ExplainOutput) and isinstance(rep, str)
    assert rep.graph_count == 2 and rep.graph_break_count == 1
    (r,) = rep.break_reasons
    assert isinstance(r, ember.BreakReason) and r.reason == "DATA_DEPENDENT_BRANCH"
    assert r.filename == __file__ and r.lineno == BREAK_LINE and r.source_line.endswith("# BREAK-LINE")
    assert f"{__file__}:{BREAK_LINE}" in r and "DATA_DEPENDENT_BRANCH" in r
    assert rep.ops_per_graph == [["torch.cos", "operator.mul", "sum", "operator.gt"], ["sin"]]
    assert rep.op_count == 5
    assert "L['n'] == 2" in rep.guards and any(g.startswith("check_tensor(L['y']") for g in rep.guards)
    assert set(rep.compile_times) >= {"trace", "guards", "backend", "total"}
    assert rep.compile_times["total"] > 0
    text = str(rep)
    assert text.startswith("graphs: 2, graph breaks: 1") and "# BREAK-LINE" in text
    assert "graph 0: 4 op(s): torch.cos, operator.mul, sum, operator.gt" in text
    assert "compile time:" in text


def test_explain_old_form_same_report():
    old = ember.explain(broken, X, 2)
    assert old.graph_count == 2 and old.graph_break_count == 1
    assert old.break_reasons[0].lineno == BREAK_LINE


def test_explain_of_fallback_counts_no_break(monkeypatch):
    monkeypatch.setattr(ember.config, "graph_breaks", 0)
    rep = ember.explain(broken)(X, 2)
    assert rep.graph_count == 0 and rep.graph_break_count == 0 and rep.break_reasons == []
    (fb,) = rep.fallbacks
    assert fb.kind == "fallback" and fb.lineno == BREAK_LINE


def test_explain_of_a_compiled_function_keeps_its_backend():
    c = ember.compile(scale, backend="fx")
    rep = ember.explain(c)(X, 3)
    assert rep.graph_count == 1 and rep.graph_break_count == 0
    assert rep.entries[0]["backend"] == "fx" and rep.ops_per_graph == [["torch.cos", "operator.mul"]]


def test_explain_of_no_argument_function():
    def f():
        return torch.ones(2) * 2
    rep = ember.explain(f)()
    assert rep.graph_count == 1


# ---- pin ----

def test_pin_runs_pinned_entry_on_changed_input_unpin_restores_guards():
    c = ember.compile(scale, backend="eager")
    assert_same(c(X, 2), scale(X, 2))
    ember.pin(c)
    # UNSAFE by design: n=3 changes the guarded constant, the pinned entry (n=2) still answers
    assert_same(c(X, 3), scale(X, 2))
    assert len(ember.cache_info(c)) == 1 and ember.cache_info(c)[0]["hits"] == 1
    ember.unpin(c)
    assert_same(c(X, 3), scale(X, 3))  # guards again: a recompile
    assert len(ember.cache_info(c)) == 2


def test_pinned_context_takes_most_recent_entry_and_unpins_on_exit():
    c = ember.compile(scale, dynamic=False, backend="eager")  # n specialised per entry (automatic dynamic would make it a graph input)
    c(X, 2)
    c(X, 3)  # most recently used: n=3
    with ember.pinned(c):
        assert_same(c(X, 2), scale(X, 3))
        y = torch.rand(6)
        assert_same(c(y, 7), scale(y, 3))  # a new tensor of the same shape: the graph input is fetched
    assert_same(c(X, 2), scale(X, 2))
    with pytest.raises(KeyError):
        with ember.pinned(c):
            raise KeyError("x")
    assert_same(c(X, 5), scale(X, 5))  # unpinned after the exception
    assert len(ember.cache_info(c)) == 3


def test_pin_before_first_call_compiles_then_pins():
    c = ember.compile(scale, backend="eager")
    with ember.pinned(c):
        assert_same(c(X, 2), scale(X, 2))
        assert_same(c(X, 4), scale(X, 2))
    assert len(ember.cache_info(c)) == 1


def test_pin_covers_break_entries_and_resume_functions():
    c = ember.compile(broken, backend="eager")
    assert_same(c(X, 2), broken(X, 2))
    with ember.pinned(c):
        # n=-1 would take the other branch; pinned, both the frame's entry (n=2) and the resume
        # function's entry run as compiled: cos(x) * 2, then sin
        assert_same(c(X, -1), broken(X, 2))
    assert_same(c(X, -1), broken(X, -1))


def test_pin_of_module():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.k = 2

        def forward(self, x):
            return x * self.k

    m = M()
    cm = ember.compile(m, backend="eager")
    assert_same(cm(X), X * 2)
    ember.pin(cm)
    m.k = 5
    assert_same(cm(X), X * 2)  # the attribute change is not seen while pinned
    ember.unpin(cm)
    assert_same(cm(X), X * 5)


def test_hooks_while_pinned():
    """The compiled module's own hooks are checked on every call before any lookup (they route the
    call through Module.__call__), pinned or not; a hook on a submodule is guarded by its hook
    dict, which a pin does not evaluate: ignored while pinned, run again after unpin."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU())
    cm = ember.compile(net, backend="eager")
    with torch.no_grad():
        assert_same(cm(X), net(X))
        seen = []
        h = net[0].register_forward_hook(lambda mod, args, out: seen.append("sub"))
        h2 = None
        try:
            with ember.pinned(cm):
                cm(X)  # UNSAFE: the submodule's hook dict guard is not evaluated
                assert seen == []
                h2 = net.register_forward_hook(lambda mod, args, out: seen.append("own"))
                cm(X)
                assert "own" in seen
            seen.clear()
            h2.remove()
            assert_same(cm(X), net(X))  # unpinned: the hook dict guard fails, the hook runs
            assert seen == ["sub", "sub"]  # once from cm, once from the eager reference call
        finally:
            h.remove()
            if h2 is not None:
                h2.remove()
