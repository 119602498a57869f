"""Several threads calling one compiled object at once: each thread's results equal eager (the
cache, its lookups and compiles must stay consistent, and the frame hook acts only on the thread
that installed it)."""
import threading

import torch

import ember
from conftest import assert_same, entries


def _run_threads(target, n=4):
    errors = []
    barrier = threading.Barrier(n)
    device = torch.get_default_device()  # thread-local in torch: carry the suite's device over

    def wrap(i):
        try:
            torch.set_default_device(device)
            barrier.wait()
            target(i)
        except BaseException as e:  # reported to the main thread below
            errors.append((i, e))
    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors


def poly(x, y):
    return torch.sin(x) * y + x * 0.5


def test_threads_different_shapes_graph():
    ember.config.cache_size_limit = 16
    c = ember.compile(poly, backend="eager")

    def work(i):
        x, y = torch.randn(i + 2, 3), torch.randn(i + 2, 3)
        expected = poly(x, y)
        for _ in range(200):
            assert_same(c(x, y), expected)
    _run_threads(work)
    info = entries(c)
    # automatic dynamic: a second size compiles a symbolic graph, which may serve the other threads
    # (how many threads trace before it exists depends on timing)
    assert 2 <= len(info) and all(e["kind"] == "graph" for e in info)
    assert sum(e["hits"] for e in info) >= 4 * 199


def branchy(x):
    if x.sum() > 0:
        return torch.cos(x) - 1.0
    return torch.sin(x) + 1.0


def test_threads_fallback_and_nested_compile():
    ember.config.cache_size_limit = 16

    def leaf(x):
        return torch.tanh(x) * 3.0

    def outer(x):
        print(end="")  # falls back: leaf is compiled by the frame hook on the calling thread
        return leaf(x) + branchy(x)
    c = ember.compile(outer, backend="eager")

    def work(i):
        x = torch.randn(i + 1, 2) * (1 if i % 2 else -1)
        expected = outer(x)
        for _ in range(100):
            assert_same(c(x), expected)
    _run_threads(work)


def test_threads_module_shared():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    c = ember.compile(m, backend="eager")

    def work(i):
        x = torch.randn(i + 1, 6)
        with torch.no_grad() if i % 2 else torch.enable_grad():
            expected = m.forward(x)
            for _ in range(100):
                assert_same(c(x), expected)
    _run_threads(work)


def test_thread_without_ember_is_untouched():
    """A plain function running in another thread while a compiled call runs original bytecode
    (hook installed on the main thread) is not compiled."""
    def plain(x):
        return x * 2.0 + 1.0

    started, stop = threading.Event(), threading.Event()
    results = []

    device = torch.get_default_device()

    def other():
        torch.set_default_device(device)
        x = torch.ones(3)
        started.set()
        while not stop.is_set():
            results.append(plain(x))

    def slow_fallback(x):
        print(end="")
        for _ in range(200):
            x = torch.sin(x)
        return x
    c = ember.compile(slow_fallback, backend="eager")
    t = threading.Thread(target=other)
    t.start()
    started.wait()
    try:
        for _ in range(20):
            assert_same(c(torch.ones(3)), slow_fallback(torch.ones(3)))
    finally:
        stop.set()
        t.join()
    assert entries(plain) == []
    assert all(torch.equal(r, torch.full((3,), 3.0)) for r in results)


def no_meta_kernel(x):
    a, tau = torch.geqrf(x)  # no meta kernel: the tracer's fake-tensor fallback (one mode per thread)
    return a * 2 + tau.sum()


def test_threads_trace_with_the_fake_tensor_fallback():
    ember.config.cache_size_limit = 16
    c = ember.compile(no_meta_kernel, backend="eager")

    def work(i):
        x = torch.randn(i + 3, 3, device="cpu")
        for _ in range(20):
            assert_same(c(x), no_meta_kernel(x))
    _run_threads(work)
    assert all(e["kind"] == "graph" for e in entries(c))
