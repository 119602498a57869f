"""No reference or memory leaks on the call path: 10,000 calls of a compiled function leave the
reference counts of its inputs and of the compiled object unchanged, free their outputs, and
grow neither Python-tracked memory (tracemalloc) nor the process RSS beyond small bounds.
Checked for a graph entry, a fallback entry, a module, and calls that raise."""
import gc
import os
import sys
import tracemalloc
import weakref

import pytest
import torch

import ember
from conftest import kinds

N = 10_000
LIMIT = 1 << 20  # 1 MB: a leaked 8-element tensor per call would be several MB; a tuple 0.5 MB+


def graph_fn(x, y):
    return x * y + 1.0


def fallback_fn(x, y):
    if x.sum() > -1e9:  # data-dependent: a graph break (a fallback with config.graph_breaks = 0)
        return x * y + 1.0
    return x


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


def _rss():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def _check_no_leak(call, objects):
    """Calls call() N times after a warm-up; asserts refcounts of objects flat and memory bounded."""
    for _ in range(200):
        call()
    gc.collect()
    refs = [sys.getrefcount(o) for o in objects]
    rss0 = _rss()
    tracemalloc.start()
    try:
        snap0 = tracemalloc.take_snapshot()
        for _ in range(N):
            call()
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    assert grown < LIMIT, f"tracemalloc: {grown} bytes more after {N} calls"
    rss1 = _rss()
    if rss0 is not None and rss1 is not None:
        # measured again without tracemalloc's own bookkeeping
        for _ in range(N):
            call()
        gc.collect()
        rss2 = _rss()
        assert rss2 - rss1 < LIMIT, f"RSS grew by {rss2 - rss1} bytes over {N} calls"
    assert [sys.getrefcount(o) for o in objects] == refs


@pytest.mark.parametrize("fn,kind,breaks", [(graph_fn, "graph", 1), (fallback_fn, "break", 1), (fallback_fn, "fallback", 0)],
                         ids=["graph", "graph_break", "fallback"])
def test_function_call_does_not_leak(fn, kind, breaks):
    old = ember.config.graph_breaks
    ember.config.graph_breaks = breaks
    try:
        _function_call_does_not_leak(fn, kind)
    finally:
        ember.config.graph_breaks = old


def _function_call_does_not_leak(fn, kind):
    c = ember.compile(fn)
    x, y = torch.randn(8), torch.randn(8)
    c(x, y)
    assert kinds(c) == [kind]
    _check_no_leak(lambda: c(x, y), [x, y, c])


@pytest.mark.parametrize("fn", [graph_fn, fallback_fn], ids=["graph", "fallback"])
def test_outputs_are_freed(fn):
    c = ember.compile(fn)
    x, y = torch.randn(8), torch.randn(8)
    c(x, y)
    out = c(x, y)
    r = weakref.ref(out)
    del out
    gc.collect()
    assert r() is None, "the compiled call keeps its output alive"


def test_keyword_call_does_not_leak():
    c = ember.compile(graph_fn)
    x, y = torch.randn(8), torch.randn(8)
    c(x, y=y)
    _check_no_leak(lambda: c(x, y=y), [x, y, c])


def test_module_call_does_not_leak():
    m = Small()
    c = ember.compile(m)
    x = torch.randn(2, 8)
    c(x)
    _check_no_leak(lambda: c(x), [x, c, m, m.lin.weight])


def test_bound_method_does_not_leak():
    m = Small()
    c = ember.compile(m.forward)
    x = torch.randn(2, 8)
    c(x)
    _check_no_leak(lambda: c(x), [x, c, m])


def test_raising_call_does_not_leak():
    def bad(a, b):
        return a @ b
    c = ember.compile(bad)
    a, b = torch.randn(2, 3), torch.randn(4, 5)

    def call():
        try:
            c(a, b)
        except RuntimeError:
            pass
        else:
            raise AssertionError("expected a shape error")
    _check_no_leak(call, [a, b, c])


def test_guard_miss_path_does_not_leak():
    """Calls alternating between two cached entries walk past a failing guard each time."""
    c = ember.compile(graph_fn)
    x4, y4, x5, y5 = torch.randn(4), torch.randn(4), torch.randn(5), torch.randn(5)
    c(x4, y4)
    c(x5, y5)

    def call():
        c(x4, y4)
        c(x5, y5)
    _check_no_leak(call, [x4, y4, x5, y5, c])


def test_compiled_object_is_collectable():
    def f(x):
        return x + 1.0
    c = ember.compile(f)
    c(torch.randn(3))
    r = weakref.ref(c)
    del c
    gc.collect()
    assert r() is None


def test_cache_entries_are_freed_with_their_code_object():
    """The cache lives in the code object's co_extra: when the code object dies, its entries and
    everything their guards hold (here an ID-matched module) are released."""
    import gc
    import weakref

    namespace = {}
    exec(compile("def f(x, mod):\n    return mod(x) + 1\n", "<ember-leak-test>", "exec"), namespace)
    f = namespace.pop("f")
    mod = torch.nn.Linear(3, 3)
    alive = weakref.ref(mod)
    code = weakref.ref(f.__code__)
    c = ember.compile(f)
    x = torch.randn(2, 3)
    torch.testing.assert_close(c(x, mod), f(x, mod))
    assert [e["kind"] for e in ember.cache_info(c)] == ["graph"]
    del c, f, mod
    gc.collect()
    assert code() is None, "the code object outlived its function"
    assert alive() is None, "a cache entry kept the module alive after its code object died"
