"""Cost of ember's PEP 523 frame hook (csrc/hook/em_hook.c) on ordinary Python calls.

While any frame evaluation function is installed, CPython stops inlining Python-to-Python calls
(CALL requires interp->eval_frame == NULL; the specialised calls deoptimise), so every call goes
through _PyEval_Vector and the hook (shared/reference/cpython_internals.md, section 1). ember keeps
the hook installed only while a compiled call runs original bytecode. This script measures, in one
process, per call of a small Python function called from a Python loop:

  plain        no hook installed (the normal state)
  passthrough  hook installed (ember._C._hook_force_install(True)) but this thread is in no
               compiled call: every frame goes straight to the previous eval function
  skip         inside a compiled call that fell back; the callee is excluded by the skip rules
               (copy._copy_immutable, a one-line standard-library function; its plain cost is the
               'stdlib plain' line)
  disabled     inside a compiled call, within ember.disable(): the hook passes frames through
  answered     inside a compiled call; the callee's frame is looked up in its cache and answered by
               its entry (whatever kind the tracer made of it: printed below)
  tensor       like answered, for a function of a tensor that compiles to a graph, against the
               same function called eagerly (the 'tensor eager' line)

usage: python bench/hook_passthrough.py [--calls N] [--rounds N]
Prints ns per call and the ratio to 'plain'; asserts nothing (timings are never asserted).
"""
import argparse
import copy
import statistics
import time

import torch

import ember
from ember import _C


def inc(a):
    return a + 1


_copy_immutable = copy._copy_immutable  # def _copy_immutable(x): return x  (Lib/copy.py)


def tensor_fn(x):
    return x * 2.0 + 1.0


def loop_plain(n):
    f = inc
    for _ in range(n):
        f(7)


def loop_stdlib(n):
    f = _copy_immutable
    for _ in range(n):
        f(7)


def loop_tensor(n, x):
    f = tensor_fn
    for _ in range(n):
        f(x)


def make_in_region(loop):
    """A compiled driver that falls back (a branch on a tensor value) and runs `loop` as original
    bytecode with the hook active for this thread."""
    def driver(flag, n, *args):
        if flag.sum() > 0:
            loop(n, *args)
        return flag
    return ember.compile(driver)


def timed(fn, calls, rounds):
    """ns per inner call: the minimum over rounds of the median of 3 runs of `calls` calls."""
    fn(200)  # warm up: compiles, fills caches, specialises bytecode
    best = float("inf")
    for _ in range(rounds):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(calls)
            ts.append((time.perf_counter() - t0) / calls * 1e9)
        best = min(best, statistics.median(ts))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    calls, rounds = args.calls, args.rounds
    flag = torch.ones(1)
    x = torch.randn(8)
    results = {}

    results["plain"] = timed(loop_plain, calls, rounds)

    _C._hook_force_install(True)
    try:
        results["passthrough"] = timed(loop_plain, calls, rounds)
    finally:
        _C._hook_force_install(False)

    results["stdlib plain"] = timed(loop_stdlib, calls, rounds)
    skip_driver = make_in_region(loop_stdlib)
    results["skip"] = timed(lambda n: skip_driver(flag, n), calls, rounds)

    # ember.disable around a compiled call makes it run eagerly with no hook installed; to measure
    # the disabled path inside a hook region, the region's own code enters ember.disable.
    def loop_disabled_inside(n):
        with ember.disable():
            loop_plain(n)
    inside_driver = make_in_region(lambda n: loop_disabled_inside(n))
    results["disabled"] = timed(lambda n: inside_driver(flag, n), calls, rounds)

    answered_driver = make_in_region(loop_plain)
    results["answered"] = timed(lambda n: answered_driver(flag, n), calls, rounds)
    answered_kinds = [e["kind"] for e in ember.cache_info(inc)]

    tensor_calls = max(calls // 10, 1000)
    results["tensor eager"] = timed(lambda n: loop_tensor(n, x), tensor_calls, rounds)
    tensor_driver = make_in_region(loop_tensor)
    results["tensor"] = timed(lambda n: tensor_driver(flag, n, x), tensor_calls, rounds)
    tensor_kinds = [e["kind"] for e in ember.cache_info(tensor_fn)]

    print(f"ember frame hook cost, ns per call of a small Python function ({calls} calls, best of {rounds})")
    base = results["plain"]
    for name, ns in results.items():
        ratio = ns / (results["tensor eager"] if name == "tensor" else base)
        vs = "tensor eager" if name == "tensor" else "plain"
        print(f"  {name:13s} {ns:9.1f} ns   x{ratio:5.2f} vs {vs}")
    print(f"  cache entries: inc {answered_kinds}, tensor_fn {tensor_kinds}")
    print(f"  hook installed at exit: {_C._hook_installed()}")


if __name__ == "__main__":
    main()
