"""Recompilation: a changed shape, dtype, module attribute or global makes a new cache entry (and
the result equals eager); an unchanged call hits the existing entry; past config.cache_size_limit
ember warns once, naming the failed guard, and runs the function eagerly."""
import warnings

import pytest
import torch

import ember
from conftest import CountingBackend, assert_same, entries, kinds


def scaled_exp(x):
    return torch.exp(x) * 0.5


def _compiled(fn, **kw):
    backend = CountingBackend()
    return ember.compile(fn, backend=backend, **kw), backend


def test_same_input_hits():
    c, b = _compiled(scaled_exp)
    x = torch.randn(4)
    for _ in range(5):
        assert_same(c(x), scaled_exp(x))
    assert b.count == 1 and kinds(c) == ["graph"]
    assert entries(c)[0]["hits"] >= 4
    # another tensor with the same metadata also hits
    y = torch.randn(4)
    assert_same(c(y), scaled_exp(y))
    assert b.count == 1


def test_shape_change_recompiles():
    c, b = _compiled(scaled_exp, dynamic=False)  # static sizes (automatic dynamic: tests/py/test_dynamic.py)
    xs = [torch.randn(4), torch.randn(5), torch.randn(2, 3), torch.randn(4)]
    for x in xs:
        assert_same(c(x), scaled_exp(x))
    assert b.count == 3 and len(entries(c)) == 3
    gm, ex = b.calls[1]
    assert tuple(ex[0].shape) == (5,)
    # most recently used first: the (4,) entry was hit last
    assert any("4" in g for g in entries(c)[0]["guards"])


def test_stride_change_recompiles():
    c, b = _compiled(scaled_exp)
    base = torch.randn(3, 3)
    for x in (base, base.t(), base):
        assert_same(c(x), scaled_exp(x))
    assert b.count == 2


def test_dtype_change_recompiles():
    c, b = _compiled(scaled_exp)
    x = torch.randn(4)
    for t in (x, x.double(), x.half(), x.bfloat16(), x):
        assert_same(c(t), scaled_exp(t))
    assert b.count == 4


def test_requires_grad_change_recompiles():
    c, b = _compiled(scaled_exp)
    x = torch.randn(4)
    assert_same(c(x), scaled_exp(x))
    xr = x.clone().requires_grad_(True)
    assert_same(c(xr), scaled_exp(xr))
    assert b.count == 2


def test_int_argument_value_recompiles():
    def f(x, k):
        return x + k
    c, b = _compiled(f)
    x = torch.randn(3)
    for k in (1, 1, 2, 2.5, True, 1):
        assert_same(c(x, k), f(x, k))
    assert b.count == 4  # 1, 2, 2.5, True (type and value are guarded)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.i = 1

    def forward(self, x):
        return x * self.i


def test_module_attribute_change_recompiles():
    m = Counter()
    backend = CountingBackend()
    c = ember.compile(m, backend=backend)
    x = torch.randn(3)
    assert_same(c(x), x * 1)
    m.i = 5
    assert_same(c(x), x * 5)
    assert backend.count == 2
    m.i = 1                    # back to an earlier value: an old entry may answer, never a wrong one
    assert_same(c(x), x * 1)
    assert backend.count <= 3
    c.i = 7                    # set through the compiled module (shared __dict__)
    assert_same(c(x), x * 7)
    assert m.i == 7


def test_module_attribute_change_through_submodule():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Counter()

        def forward(self, x):
            return self.inner(x) + 1.0
    m = Outer()
    c = ember.compile(m, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), m.forward(x))
    m.inner.i = 5
    assert_same(c(x), m.forward(x))
    assert_same(c(x), x * 5 + 1.0)


SCALE = 2.0


def uses_global(x):
    return x * SCALE


def helper_a(x):
    return x + 1.0


HELPER = helper_a


def uses_global_function(x):
    return HELPER(x) * 2.0


def test_global_rebinding_recompiles():
    global SCALE
    c, b = _compiled(uses_global)
    x = torch.randn(3)
    try:
        assert_same(c(x), x * 2.0)
        SCALE = -4.0
        assert_same(c(x), x * -4.0)
        SCALE = 2.0
        assert_same(c(x), x * 2.0)
    finally:
        SCALE = 2.0


def test_global_function_rebinding_recompiles():
    global HELPER
    c, b = _compiled(uses_global_function)
    x = torch.randn(3)
    try:
        assert_same(c(x), (x + 1.0) * 2.0)
        HELPER = torch.sin
        assert_same(c(x), torch.sin(x) * 2.0)
    finally:
        HELPER = helper_a


def test_closure_variable_change_recompiles():
    k = 3.0

    def f(x):
        return x * k
    c = ember.compile(f, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), x * 3.0)
    k = -1.0  # noqa: F841 (read through the closure cell)
    assert_same(c(x), x * -1.0)


def test_grad_mode_change_recompiles():
    c, b = _compiled(scaled_exp)
    x = torch.randn(3, requires_grad=True)
    assert c(x).requires_grad
    with torch.no_grad():
        out = c(x)
        assert_same(out, scaled_exp(x))
        assert not out.requires_grad
    assert c(x).requires_grad


def test_default_dtype_change():
    def f(x):
        return x + torch.ones(3)
    c = ember.compile(f, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), f(x))
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert_same(c(x), f(x))
        assert c(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)


# ---- cache_size_limit ----

def _limit_warnings(record):
    return [w for w in record if "cache_size_limit" in str(w.message)]


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_cache_size_limit_warns_once_then_runs_eagerly(limit):
    ember.config.cache_size_limit = limit
    c, b = _compiled(scaled_exp, dynamic=False)  # each size its own entry (no automatic dynamic)
    sizes = list(range(1, limit + 6))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for n in sizes + sizes:
            x = torch.randn(n)
            assert_same(c(x), scaled_exp(x))
    assert b.count == limit
    assert len(entries(c)) == limit
    ws = _limit_warnings(rec)
    assert len(ws) == 1, [str(w.message) for w in rec]
    msg = str(ws[0].message)
    assert "scaled_exp" in msg and "L['x']" in msg, msg
    assert issubclass(ws[0].category, UserWarning)


class _Block(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return torch.sin(x) * self.k


def test_cache_size_limit_counts_entries_for_the_same_objects():
    """As Dynamo's (torch/_dynamo/cache_size.py): the limit counts a code object's entries made for
    the objects its locals hold by identity, so twelve blocks calling one forward each keep their
    entry (a model's layers; FSDP2's per-block compiled forwards); one object that recompiles past
    the limit still runs eagerly after it, and accumulated_cache_size_limit bounds all entries."""
    ember.config.cache_size_limit = 2
    blocks = [_Block(float(k)) for k in range(12)]
    run = lambda b, x: b(x)
    c, be = _compiled(run, dynamic=False)
    x = torch.randn(4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            for b in blocks:
                assert_same(c(b, x), run(b, x))
    assert not _limit_warnings(rec), [str(w.message) for w in rec]
    assert be.count == 12
    # a fresh object per call: the entries made for objects that died count (Dynamo's weakly held
    # ID_MATCH objects), so the limit still stops recompiling every call
    # (run's code two entries, then it falls back and the forward it calls compiles as a frame of its
    # own, for two fresh blocks too); then no call compiles again
    before = be.count
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for k in range(12):
            fresh = _Block(100.0 + k)
            assert_same(c(fresh, x), run(fresh, x))
            del fresh
            if k == 5:
                settled = be.count
    assert settled - before <= 4 and be.count == settled and _limit_warnings(rec), (be.count, [str(w.message) for w in rec])
    ember.reset()
    c, be = _compiled(run, dynamic=False)
    for b in blocks:
        c(b, x)
    # one block with new sizes: its third entry is past the limit for that object
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for n in (5, 6, 7):
            y = torch.randn(n)
            assert_same(c(blocks[0], y), run(blocks[0], y))
    ws = _limit_warnings(rec)
    assert len(ws) == 1 and "for the objects its locals hold" in str(ws[0].message), [str(w.message) for w in rec]
    # 13: run's entry for (5,); past the limit run falls back, and the forward it calls compiles as
    # a frame of its own for (6,) and (7,)
    assert be.count == 15
    # the accumulated limit
    ember.reset()
    ember.config.accumulated_cache_size_limit = 5
    c, be = _compiled(run, dynamic=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for b in blocks:
            assert_same(c(b, x), run(b, x))
    # run's five entries, then the forward frames of blocks 5-9 (run falls back), then none
    assert be.count == 10
    ws = [w for w in rec if "accumulated_cache_size_limit (5)" in str(w.message)]
    assert len(ws) == 2 and "<lambda>" in str(ws[0].message) and "forward" in str(ws[1].message), [str(w.message) for w in rec]


def test_cache_size_limit_warning_with_pytest_warns():
    ember.config.cache_size_limit = 2
    c, b = _compiled(scaled_exp, dynamic=False)
    c(torch.randn(1))
    c(torch.randn(2))
    x3 = torch.randn(3)
    with pytest.warns(UserWarning, match="cache_size_limit"):
        assert_same(c(x3), scaled_exp(x3))
    x = torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert_same(c(x), scaled_exp(x))
    assert b.count == 2


def test_cache_size_limit_fallback_still_compiles_callees():
    """Past the limit the frame runs eagerly; nothing is wrong, and results stay equal."""
    ember.config.cache_size_limit = 1

    def inner(x):
        return torch.cos(x) + 2.0

    def outer(x, k):
        return inner(x) * k
    c = ember.compile(outer, backend="eager")
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for k in (1.0, 2.0, 3.0, 1.0):
            assert_same(c(x, k), outer(x, k))
    assert len(_limit_warnings(rec)) == 1


def test_reset_clears_the_limit():
    ember.config.cache_size_limit = 1
    c, b = _compiled(scaled_exp)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        c(torch.randn(1))
        c(torch.randn(2))
        ember.reset()
        c(torch.randn(2))
        c(torch.randn(3))
    assert b.count == 2
    assert len(_limit_warnings(rec)) == 2  # once per code object per reset
