"""The PEP 523 frame hook (csrc/hook/em_hook.c): while a compiled call runs original bytecode (a
fallback entry), frames it starts are compiled and answered by their own cache entries; the hook is
installed only for the duration of such calls; generators, exceptions, recursion, threads and
ember.disable behave as in eager PyTorch, and answered frames leak nothing."""
import gc
import json
import sys
import threading

import pytest
import torch

import ember
from conftest import assert_same, assert_same_outcome, entries, kinds, outcome

_C = ember._C


# ---- functions the tests compile (module level: the hook compiles them by code object) ----

def helper(x, y):
    return torch.sin(x) * y + 1.0


def print_outer(x, y):
    print("ember test: a print breaks the graph")
    return helper(x, y) * 2.0


def branch_outer(x, y):
    if x.sum() > 0:  # depends on a tensor value: the frame falls back
        return helper(x, y) - 1.0
    return helper(y, x) + 1.0


installed_seen = []


def recording_outer(x):
    installed_seen.append(_C._hook_installed())  # side effect + unknown call: a fallback
    return helper(x, x)


def squares(x, n):
    for i in range(n):
        yield helper(x, x) * i


def gen_outer(x):
    if x.sum() > 0:
        return sum(squares(x, 3))
    return torch.stack(list(squares(x, 2)))


def raising_helper(x):
    raise ValueError(f"bad input of shape {tuple(x.shape)}")


def raise_outer(x):
    if x.sum() > 0:
        return raising_helper(x) + 1
    return x


def add_helper(x, y):
    return x + y


def shape_error_outer(x, y):
    if x.sum() > -1e30:
        return add_helper(x, y)  # raises for mismatched shapes
    return x


def stdlib_outer(x):
    if x.sum() > 0:
        return json.dumps({"n": x.numel()}), helper(x, x)
    return "", x


def rec_fallback(x, n):
    if x.sum() > 1e30:  # never true, but a tensor-value branch: every level falls back
        return x
    if n == 0:
        return helper(x, x)
    return rec_fallback(x * 0.5, n - 1) + 1.0


def rec_forever(x, n):
    if x.sum() > 1e30:
        return x
    return rec_forever(x, n + 1)


# ---- tests ----

def test_helper_of_a_fallback_frame_gets_its_own_graph_entry(capsys, no_graph_breaks):
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    c = ember.compile(print_outer, backend="eager")
    for _ in range(3):
        assert_same(c(x, y), print_outer(x, y))
    assert kinds(c) == ["fallback"]
    assert kinds(helper) == ["graph"]
    assert entries(helper)[0]["hits"] >= 2  # the second and third calls hit the hook's entry
    assert not _C._hook_installed()


def test_tensor_branch_fallback_compiles_both_helper_calls(no_graph_breaks):
    c = ember.compile(branch_outer, backend="eager")
    for x, y in [(torch.ones(3), torch.randn(3)), (-torch.ones(3), torch.randn(3)), (torch.ones(2, 2), torch.randn(2, 2))]:
        assert_same(c(x, y), branch_outer(x, y))
    assert set(kinds(c)) == {"fallback"}
    info = entries(helper)
    assert info and all(e["kind"] == "graph" for e in info)
    assert not _C._hook_installed()


def test_hook_installed_only_during_the_fallback_call():
    installed_seen.clear()
    assert not _C._hook_installed()
    c = ember.compile(recording_outer, backend="eager")
    x = torch.randn(3)
    assert_same(c(x), helper(x, x))
    assert_same(c(x), helper(x, x))
    assert installed_seen == [True, True]
    assert not _C._hook_installed()
    # a plain call installs nothing
    recording_outer(x)
    assert installed_seen[-1] is False and not _C._hook_installed()
    assert _C._hook_thread_state()["depth"] == 0


def test_hook_uninstalled_after_an_exception():
    c = ember.compile(raise_outer, backend="eager")
    with pytest.raises(ValueError):
        c(torch.ones(2))
    assert not _C._hook_installed()
    assert _C._hook_thread_state() == {"depth": 0, "disabled": 0, "busy": 0, "nthreads": 0}


def test_generators_called_from_a_fallback_frame(no_graph_breaks):
    c = ember.compile(gen_outer, backend="eager")
    for x in [torch.ones(3), -torch.ones(3), torch.randn(2, 2).abs()]:
        assert_same(c(x), gen_outer(x))
    assert entries(squares) == []  # generator code is never compiled
    assert _C._hook_skip_code(squares.__code__)
    assert kinds(helper) and set(kinds(helper)) == {"graph"}


def test_exceptions_in_nested_frames_propagate_unchanged(no_graph_breaks):
    c = ember.compile(raise_outer, backend="eager")
    for x in [torch.ones(2, 3), torch.ones(2, 3), -torch.ones(1)]:
        assert_same_outcome(outcome(c, x), outcome(raise_outer, x))
    c2 = ember.compile(shape_error_outer, backend="eager")
    calls = [(torch.ones(3), torch.ones(3)), (torch.ones(3), torch.ones(4)), (torch.ones(3), torch.ones(3)),
             (torch.ones(2), torch.ones(5))]
    for x, y in calls:
        assert_same_outcome(outcome(c2, x, y), outcome(shape_error_outer, x, y))
    assert not _C._hook_installed()


def test_stdlib_and_torch_frames_are_not_compiled():
    c = ember.compile(stdlib_outer, backend="eager")
    x = torch.ones(2, 2)
    assert_same(c(x), stdlib_outer(x))
    assert entries(json.dumps) == []
    assert entries(json.JSONEncoder.encode) == []
    assert _C._hook_skip_code(json.dumps.__code__)
    assert _C._hook_skip_code(torch.nn.functional.softmax.__code__)
    assert _C._hook_skip_code(ember.compile.__code__)
    assert not _C._hook_skip_code(helper.__code__)
    assert not _C._hook_skip_code((lambda t: t).__code__)
    module_code = compile("x = 1\nclass A:\n    y = 2\n", __file__, "exec")
    class_body = next(k for k in module_code.co_consts if hasattr(k, "co_name"))
    assert _C._hook_skip_code(module_code) and _C._hook_skip_code(class_body)


def test_disable_as_decorator_and_context_manager(no_graph_breaks):
    x, y = torch.randn(3), torch.randn(3)
    c = ember.compile(print_outer, backend="eager")
    with ember.disable():
        assert_same(c(x, y), print_outer(x, y))
        assert _C._hook_disabled()
    assert not _C._hook_disabled()
    assert entries(c) == [] and entries(helper) == []

    @ember.disable
    def disabled_helper(a, b):
        return helper(a, b) * 3.0

    def outer(a, b):
        print("ember test: break")
        return disabled_helper(a, b) + helper(b, a)

    co = ember.compile(outer, backend="eager")
    assert_same(co(x, y), outer(x, y))
    assert kinds(co) == ["fallback"]
    # helper(b, a) is compiled by the hook; helper(a, b) inside the disabled region is not:
    # one graph entry, hit at most by the later call
    info = entries(helper)
    assert [e["kind"] for e in info] == ["graph"] and info[0]["hits"] == 0
    assert entries(disabled_helper) == []
    assert not _C._hook_installed()


def test_two_threads_different_shapes_1000_calls_each(no_graph_breaks):
    ember.config.cache_size_limit = 16
    c = ember.compile(branch_outer, backend="eager")
    errors = []
    barrier = threading.Barrier(2)

    def work(shape):
        try:
            x, y = torch.randn(shape).abs(), torch.randn(shape)
            expected = branch_outer(x, y)
            barrier.wait()
            for _ in range(1000):
                assert_same(c(x, y), expected)
        except BaseException as e:  # reported below
            errors.append(e)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in [(2, 3), (5, 4)]]
        for t in threads:
            t.start()
        # the main thread is not in a compiled call: its calls must pass straight through
        z = torch.randn(7)
        for _ in range(2000):
            assert_same(helper(z, z), torch.sin(z) * z + 1.0)
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert len(entries(helper)) == 2 and set(kinds(helper)) == {"graph"}
    assert not _C._hook_installed()


def test_recursive_user_function():
    c = ember.compile(rec_fallback, backend="eager")
    x = torch.randn(3)
    for n in [0, 1, 5, 50]:
        assert_same(c(x, n), rec_fallback(x, n))
    assert not _C._hook_installed()


def test_infinite_recursion_raises_recursion_error():
    c = ember.compile(rec_forever, backend="eager")
    with pytest.raises(RecursionError):
        rec_forever(torch.ones(1), 0)
    with pytest.raises(RecursionError):
        c(torch.ones(1), 0)
    assert not _C._hook_installed()
    assert _C._hook_thread_state()["depth"] == 0
    x = torch.randn(2)  # the interpreter is still usable
    assert_same(ember.compile(print_outer, backend="eager")(x, x), print_outer(x, x))


def test_argument_refcounts_flat_over_10000_fallback_calls(capsys, no_graph_breaks):
    def fb(x, y):
        if x.sum() > 1e30:
            return x
        return helper(x, y)
    c = ember.compile(fb, backend="eager")
    x, y = torch.randn(3), torch.randn(3)
    for _ in range(20):
        c(x, y)
    gc.collect()
    before = (sys.getrefcount(x), sys.getrefcount(y), sys.getrefcount(helper.__code__), sys.getrefcount(helper))
    for _ in range(10000):
        c(x, y)
    gc.collect()
    after = (sys.getrefcount(x), sys.getrefcount(y), sys.getrefcount(helper.__code__), sys.getrefcount(helper))
    assert after == before
    assert kinds(helper) == ["graph"] and entries(helper)[0]["hits"] >= 10000


def test_innermost_config_wins(counting_backend, no_graph_breaks):
    x, y = torch.randn(3), torch.randn(3)
    c = ember.compile(print_outer, backend=counting_backend)
    assert_same(c(x, y), print_outer(x, y), exact=False)
    assert counting_backend.count == 1  # helper's graph went to the outer call's backend
    ce = ember.compile(print_outer, backend="eager")  # eager backend: a separate entry for helper
    assert_same(ce(x, y), print_outer(x, y))
    assert len(entries(helper)) == 2


def test_reset_drops_hook_entries(no_graph_breaks):
    x, y = torch.randn(3), torch.randn(3)
    c = ember.compile(print_outer, backend="eager")
    c(x, y)
    assert kinds(helper) == ["graph"]
    ember.reset()
    assert entries(helper) == []
    assert_same(c(x, y), print_outer(x, y))
    assert kinds(helper) == ["graph"]
